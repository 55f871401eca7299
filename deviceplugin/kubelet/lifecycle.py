"""Sockets, registration and restarts: everything about *being* a device plugin, apart from serving.

The kubelet dials a plugin only after Register, wipes every socket in its directory when it
restarts, and never redials (device-plugin-anchors section 1). So each resource gets its own gRPC
server on ``<dir>/vramshare-<suffix>.sock``, which must serve (proven by dialing it) before Register;
and a watcher restarts every server and registers again when ``kubelet.sock`` is created anew, when
one of our sockets disappears, on SIGHUP, or when the set of resources changes (config reload).
The watcher stats the directory every ``poll_seconds`` (0.1 s by default: re-registration within a
second at negligible CPU, and no inotify dependency; bench/bench_deviceplugin.py measures it).
"""
from __future__ import annotations

import os
import threading
import time
from concurrent import futures
from typing import Callable, Sequence

import grpc

from deviceplugin import devices
from deviceplugin.kubelet import server
from deviceplugin.kubelet.manager import ResourceManager
from deviceplugin.metrics import PluginMetrics
from protos.deviceplugin.v1beta1 import api_pb2 as pb
from protos.deviceplugin.v1beta1 import api_pb2_grpc as pb_grpc
from vramshare import contract, logs
from vramshare.retry import Backoff

log = logs.get(__name__)

DIAL_TIMEOUT_S = 5.0
MAX_RETRY_S = 30.0


def _unix(path: str) -> str:
    return f"unix://{path}"


class PluginEndpoint:
    """One resource's gRPC server on its socket, and its Register call."""

    def __init__(self, rm: ResourceManager, plugin_dir: str) -> None:
        self.rm = rm
        self.socket = os.path.join(plugin_dir, devices.socket_name(rm.resource))
        self._kubelet_socket = os.path.join(plugin_dir, contract.KUBELET_SOCKET_NAME)
        self._stop = threading.Event()
        self._server: grpc.Server | None = None

    def serve(self) -> None:
        """Listen on the socket (replacing a stale one) and prove it answers by dialing it."""
        if os.path.exists(self.socket):
            os.unlink(self.socket)
        name = self.rm.resource.split("/", 1)[1]
        srv = grpc.server(futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix=f"grpc-{name}"))
        pb_grpc.add_DevicePluginServicer_to_server(server.DevicePluginServicer(self.rm, self._stop), srv)
        srv.add_insecure_port(_unix(self.socket))
        srv.start()
        self._server = srv
        with grpc.insecure_channel(_unix(self.socket)) as channel:  # a real call, not a connectivity poll
            pb_grpc.DevicePluginStub(channel).GetDevicePluginOptions(pb.Empty(), timeout=DIAL_TIMEOUT_S,
                                                                     wait_for_ready=True)

    def register(self) -> None:
        """Register with the kubelet; options are the same object GetDevicePluginOptions returns."""
        request = pb.RegisterRequest(version=contract.DEVICE_PLUGIN_API_VERSION,
                                     endpoint=os.path.basename(self.socket),
                                     resource_name=self.rm.resource, options=server.OPTIONS)
        with grpc.insecure_channel(_unix(self._kubelet_socket)) as channel:
            pb_grpc.RegistrationStub(channel).Register(request, timeout=DIAL_TIMEOUT_S, wait_for_ready=False)

    def stop(self) -> threading.Event:
        """Begin stopping (streams are cancelled); returns the event set once the server is down."""
        self._stop.set()
        done = self._server.stop(grace=0.1) if self._server is not None else _done()
        self._server = None
        try:
            os.unlink(self.socket)
        except FileNotFoundError:
            pass
        except OSError as exc:  # not ours to fix here; the next serve() reports it
            log.warning("cannot remove socket", socket=self.socket, error=exc.strerror)
        return done


def _done() -> threading.Event:
    event = threading.Event()
    event.set()
    return event


def _identity(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return (st.st_ino, st.st_mtime_ns)


class PluginLifecycle:
    """Keeps one registered endpoint per resource alive across kubelet restarts and reloads.

    ``managers`` is asked for the current resources at every (re)start. ``run`` is the body of the
    ``kubelet-watch`` thread, started by the composition root.
    """

    def __init__(self, plugin_dir: str, managers: Callable[[], Sequence[ResourceManager]],
                 metrics: PluginMetrics, open_streams: Callable[[str], int], poll_seconds: float = 0.1,
                 stream_grace_seconds: float = 1.0) -> None:
        self._dir = plugin_dir
        self._managers = managers
        self._metrics = metrics
        self._poll = poll_seconds
        self._open_streams = open_streams
        self._stream_grace = stream_grace_seconds
        self._registered_at = 0.0
        self._kubelet_socket = os.path.join(plugin_dir, contract.KUBELET_SOCKET_NAME)
        self._endpoints: list[PluginEndpoint] = []
        self._wake = threading.Event()
        self._restart_reason: str | None = None
        self._kubelet_seen: tuple[int, int] | None = None
        self._registered = False
        self._retry_at = 0.0  # next Register attempt after a failed one
        self._restart_at = 0.0  # next restart attempt after a failed one
        self._backoff = Backoff(1.0, MAX_RETRY_S)
        self.generation = 0  # completed (re)starts
        self._rounds = threading.Condition()
        self.registered_rounds = 0  # times every endpoint registered successfully
        self.failed_starts = 0  # restarts that failed and were retried

    @property
    def sockets(self) -> list[str]:
        return [e.socket for e in self._endpoints]

    def request_restart(self, reason: str) -> None:
        """Restart every server and Register again, from the watch thread (SIGHUP, resource change)."""
        self._restart_reason = reason
        self._wake.set()

    def run(self, stop: threading.Event) -> None:
        """Start, then watch the kubelet directory until ``stop`` is set; then close every endpoint."""
        self._restart_reason = "start"
        try:
            while not stop.is_set():
                reason = self._restart_reason or self._watch_reason()
                if reason and time.monotonic() >= self._restart_at:
                    self._restart_reason = None
                    self._try_restart(reason)
                elif not self._registered and time.monotonic() >= self._retry_at:
                    self._register_all()
                elif self._registered and self._stream_lost():
                    self._register_all()
                self._wake.wait(self._poll)
                self._wake.clear()
        finally:
            self._close()

    def _try_restart(self, reason: str) -> None:
        """A restart that fails (the directory vanished mid-way, a socket that will not bind) is retried
        with backoff instead of ending the plugin."""
        try:
            self._restart(reason)
        except Exception as exc:  # noqa: BLE001 - logged; the next attempt starts from scratch
            self._close()
            self._registered = False
            self._restart_reason = reason
            wait = self._backoff.next()
            self._restart_at = time.monotonic() + wait
            log.error("starting servers failed", reason=reason, error=f"{type(exc).__name__}: {exc}",
                      retry_in_s=round(wait, 2))
            with self._rounds:
                self.failed_starts += 1
                self._rounds.notify_all()

    def wake(self) -> None:
        self._wake.set()

    def _watch_reason(self) -> str | None:
        seen = _identity(self._kubelet_socket)
        if seen is not None and seen != self._kubelet_seen:
            return "kubelet.sock created"
        missing = [e.socket for e in self._endpoints if not os.path.exists(e.socket)]
        if missing:
            return f"socket {os.path.basename(missing[0])} removed"
        return None

    def _stream_lost(self) -> bool:
        """Registered a while ago but the kubelet holds no ListAndWatch stream: it broke, and the
        kubelet never redials, so only a new Register brings the resource back."""
        if time.monotonic() - self._registered_at < self._stream_grace:
            return False
        lost = [e.rm.resource for e in self._endpoints if self._open_streams(e.rm.resource) == 0]
        if lost:
            log.warning("kubelet stream lost, registering again", resource=lost[0])
        return bool(lost)

    def _restart(self, reason: str) -> None:
        log.info("starting device plugin servers", reason=reason, dir=self._dir)
        self._close()
        os.makedirs(self._dir, exist_ok=True)
        self._endpoints = [PluginEndpoint(rm, self._dir) for rm in self._managers()]
        for endpoint in self._endpoints:
            endpoint.serve()
            log.info("serving", resource=endpoint.rm.resource, socket=endpoint.socket,
                     devices=len(endpoint.rm.devices()))
        self._register_all()
        self.generation += 1

    def _register_all(self) -> None:
        self._kubelet_seen = _identity(self._kubelet_socket)
        if self._kubelet_seen is None:
            self._registered = False
            log.info("waiting for the kubelet", socket=self._kubelet_socket)
            self._retry_at = float("inf")  # the watch sees kubelet.sock appear
            return
        try:
            for endpoint in self._endpoints:
                endpoint.register()
                self._metrics.registration(endpoint.rm.resource, ok=True)
                log.info("registered", resource=endpoint.rm.resource, endpoint=os.path.basename(endpoint.socket))
        except grpc.RpcError as exc:
            self._metrics.registration(endpoint.rm.resource, ok=False)
            self._registered = False
            wait = self._backoff.next()
            self._retry_at = time.monotonic() + wait
            log.warning("register failed", resource=endpoint.rm.resource, code=str(exc.code()),
                        error=exc.details() or "", retry_in_s=round(wait, 2))
            return
        self._registered = True
        self._registered_at = time.monotonic()
        self._backoff.reset()
        with self._rounds:
            self.registered_rounds += 1
            self._rounds.notify_all()

    def wait_registered(self, rounds: int, timeout: float) -> bool:
        """Block until every endpoint has registered ``rounds`` times (tests, the bench, the demo)."""
        return self.wait_for(lambda: self.registered_rounds >= rounds, timeout)

    def wait_for(self, predicate: Callable[[], bool], timeout: float) -> bool:
        """Block until ``predicate`` holds, re-checked after every registration round or failed start."""
        with self._rounds:
            return self._rounds.wait_for(predicate, timeout)

    def _close(self) -> None:
        for stopped in [endpoint.stop() for endpoint in self._endpoints]:  # all at once, then wait
            stopped.wait()
        self._endpoints = []
