"""The warm tier's fast channel, node-agent side (issue 23): a unix socket per container quota dir.

The contract (:data:`vramshare.contract.WARM_SOCKET_NAME`, one JSON line per message) lets an engine that
is asleep ask for its memory back without waiting for a quota tick, and lets the loop tell an idle
engine to sleep. This adapter owns the sockets and nothing else: messages go to the
:class:`~deviceplugin.quota.warm.WarmBroker`; a wake request pokes the loop through the broker.

The socket lives in the directory the container sees read-only at ``/var/run/vramshare``: connecting to
a socket on a read-only mount works (only regular files, directories and links are refused writes).
It is made world-writable (0666) because the engine may run under any UID. Bad lines are dropped and
logged; a line longer than the limit closes that connection (an engine that does not speak the protocol).
"""
from __future__ import annotations

import os
import selectors
import socket
import threading
import time
from typing import Callable, Mapping

from deviceplugin.quota.model import TENANT_LABELS, TenantKey
from deviceplugin.quota.warm import WarmBroker
from vramshare import contract, logs

log = logs.get(__name__)

SEND_TIMEOUT_S = 1.0
SUN_PATH_MAX = 107  # bytes of a unix socket's path: sockaddr_un.sun_path is 108 with its NUL (unix(7))


class WarmChannels:
    def __init__(self, broker: WarmBroker, clock: Callable[[], float] = time.monotonic) -> None:
        self._broker, self._clock = broker, clock
        self._sel = selectors.DefaultSelector()
        self._lock = threading.Lock()
        self._listeners: dict[TenantKey, tuple[str, socket.socket]] = {}
        self._conns: dict[TenantKey, list[socket.socket]] = {}
        self._bufs: dict[socket.socket, bytes] = {}

    # -- which tenants have a socket -------------------------------------------------------------------
    def sync(self, dirs: Mapping[TenantKey, str]) -> None:
        """Listen in each tenant's quota dir; stop listening (and unlink) for tenants that are gone."""
        with self._lock:
            for key in [k for k in self._listeners if k not in dirs or self._listeners[k][0] != _path(dirs[k])]:
                path, sock = self._listeners.pop(key)
                self._close_listener(path, sock)
                for c in self._conns.pop(key, []):
                    self._drop(c)
            for key, d in dirs.items():
                if key in self._listeners or not os.path.isdir(d):
                    continue
                path = _path(d)
                try:
                    if os.path.exists(path) or os.path.islink(path):
                        os.unlink(path)  # a stale socket of an earlier agent
                    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    _bind(sock, path)
                    os.chmod(path, 0o666)
                    sock.listen(4)
                    sock.setblocking(False)
                except OSError as exc:
                    log.warning("warm channel: cannot listen", tenant=str(key), path=path, error=str(exc))
                    continue
                self._listeners[key] = (path, sock)
                self._sel.register(sock, selectors.EVENT_READ, ("listen", key))

    def send(self, key: TenantKey, msg: contract.WarmMessage) -> bool:
        """To every engine connected for ``key``; False when none is (or every send failed)."""
        data = contract.encode_warm(msg)
        ok = False
        with self._lock:
            conns = list(self._conns.get(key, []))
        for c in conns:
            try:
                c.settimeout(SEND_TIMEOUT_S)
                c.sendall(data)
                ok = True
            except OSError as exc:
                log.warning("warm channel: send failed", tenant=str(key), op=msg.op, error=str(exc))
            finally:
                try:
                    c.setblocking(False)
                except OSError:
                    pass
        return ok

    # -- the selector thread ---------------------------------------------------------------------------
    def serve(self, stop: threading.Event, dirs: Callable[[], Mapping[TenantKey, str]] | None = None,
              timeout: float = 0.2, sync_every_s: float = 1.0) -> None:
        """Until ``stop``: accept and read; every ``sync_every_s`` listen in ``dirs()`` (the loop's tenants)."""
        last = -sync_every_s
        while not stop.is_set():
            if dirs is not None and self._clock() - last >= sync_every_s:
                last = self._clock()
                try:
                    self.sync(dirs())
                except Exception as exc:  # noqa: BLE001 - the next round retries
                    log.warning("warm channel: sync failed", error=str(exc))
            self.poll(timeout)
        self.close()

    def poll(self, timeout: float = 0.0) -> None:
        """Accept and read what is ready (one round); the serve loop and the tests call it."""
        try:
            events = self._sel.select(timeout)  # epoll: registering from another thread meanwhile is safe
        except (OSError, ValueError, RuntimeError):  # closed
            return
        for sk, _ in events:
            kind, key = sk.data
            if kind == "listen":
                self._accept(sk.fileobj, key)  # type: ignore[arg-type]
            else:
                self._read(sk.fileobj, key)  # type: ignore[arg-type]

    def _accept(self, lsock: socket.socket, key: TenantKey) -> None:
        try:
            conn, _ = lsock.accept()
        except OSError:
            return
        conn.setblocking(False)
        with self._lock:
            self._conns.setdefault(key, []).append(conn)
            self._bufs[conn] = b""
            self._sel.register(conn, selectors.EVENT_READ, ("conn", key))

    def _read(self, conn: socket.socket, key: TenantKey) -> None:
        try:
            data = conn.recv(4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            with self._lock:
                self._drop(conn)
                conns = self._conns.get(key, [])
                if conn in conns:
                    conns.remove(conn)
                gone = not conns
            if gone:
                self._broker.disconnected(key)
            return
        buf = self._bufs.get(conn, b"") + data
        *lines, rest = buf.split(b"\n")
        if len(rest) > contract.WARM_MAX_LINE:
            log.warning("warm channel: line too long, closing", tenant=str(key))
            with self._lock:
                self._drop(conn)
            return
        self._bufs[conn] = rest
        for line in lines:
            if not line.strip():
                continue
            try:
                msg = contract.decode_warm(line)
            except contract.WarmMessageError as exc:
                log.warning("warm channel: message dropped", tenant=str(key), error=str(exc))
                continue
            self._broker.receive(key, msg, self._clock())

    def _drop(self, conn: socket.socket) -> None:
        try:
            self._sel.unregister(conn)
        except (KeyError, ValueError):
            pass
        self._bufs.pop(conn, None)
        conn.close()

    def _close_listener(self, path: str, sock: socket.socket) -> None:
        try:
            self._sel.unregister(sock)
        except (KeyError, ValueError):
            pass
        sock.close()
        try:
            os.unlink(path)
        except OSError:
            pass

    def close(self) -> None:
        self.sync({})
        self._sel.close()


def _bind(sock: socket.socket, path: str) -> None:
    """Bind ``path``, also past :data:`SUN_PATH_MAX`: the quota root, a pod UID and a 63-character
    container or claim name already make ~140 bytes (``AF_UNIX path too long``), so a long one is bound
    through its directory's descriptor (``/proc/self/fd/<fd>/warm.sock``, the same directory entry).
    The engine connects to the short path its container mounts (``/var/run/vramshare/warm.sock``)."""
    if len(os.fsencode(path)) <= SUN_PATH_MAX:
        sock.bind(path)
        return
    fd = os.open(os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY)
    try:
        sock.bind(f"/proc/self/fd/{fd}/{os.path.basename(path)}")
    finally:
        os.close(fd)


def _path(directory: str) -> str:
    return os.path.join(directory, contract.WARM_SOCKET_NAME)


class WarmCollector:
    """The broker's view on the node agent's ``/metrics`` (issue 23): per tenant, the engine's warm-tier
    state, the MiB it lends while asleep, its last wake latency and its sleeps and wakes."""

    def __init__(self, broker: WarmBroker) -> None:
        self._broker = broker

    def collect(self):  # noqa: ANN201 - prometheus_client's Collector protocol
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        labels = list(TENANT_LABELS)
        state = GaugeMetricFamily("vramshare_warm_engine_state", "1 for the engine's warm-tier state "
                                  "(awake, sleeping, waking); only engines that can sleep", labels=labels + ["state"])
        lent = GaugeMetricFamily("vramshare_warm_lent_bytes", "GPU memory a sleeping engine's tenant lends "
                                 "(its request minus its limit)", labels=labels)
        wake = GaugeMetricFamily("vramshare_warm_wake_seconds", "The engine's last wake: request to serving",
                                 labels=labels)
        sleeps = CounterMetricFamily("vramshare_warm_sleeps", "Sleeps the engine confirmed", labels=labels)
        wakes = CounterMetricFamily("vramshare_warm_wakes", "Wakes the engine confirmed", labels=labels)
        waited = CounterMetricFamily("vramshare_warm_wakes_waited", "Wakes that found no memory for a tick or "
                                     "more (beyond the wake reserve: issue 23 item 5)", labels=labels)
        displaced = CounterMetricFamily("vramshare_warm_displaced", "Sleeps asked of the engine to make room "
                                        "for a higher class's wake", labels=labels)
        prewakes = CounterMetricFamily("vramshare_warm_prewakes", "Wakes ahead of a forecast request (class "
                                       "wakeAhead): used (a request came), wasted (slept again with none), "
                                       "declined (the engine did not wake)", labels=labels + ["outcome"])
        credit = GaugeMetricFamily("vramshare_warm_sleep_credit_bytes", "GPU memory the sleeping pods of "
                                   "overcommit classes lend to the scheduler's books beyond the wake reserve",
                                   labels=["gpu"])
        for gpu, mib in sorted(self._broker.sleep_credits().items()):
            credit.add_metric([gpu], float(mib) * (1 << 20))
        for key, e in sorted(self._broker.views().items()):
            if not e.can_sleep:
                continue
            lv = [key.namespace, key.pod, key.container]
            for s in ("awake", "sleeping", "waking"):
                state.add_metric(lv + [s], 1.0 if e.state.value == s else 0.0)
            lent.add_metric(lv, float(e.lent_mib) * (1 << 20))
            if e.last_wake_s is not None:
                wake.add_metric(lv, e.last_wake_s)
            sleeps.add_metric(lv, float(e.sleeps))
            wakes.add_metric(lv, float(e.wakes))
            waited.add_metric(lv, float(e.waited))
            displaced.add_metric(lv, float(e.displaced))
            for outcome, n in (("used", e.prewakes_used), ("wasted", e.prewakes_wasted),
                               ("declined", e.prewakes_declined)):
                prewakes.add_metric(lv + [outcome], float(n))
        yield from (state, lent, wake, sleeps, wakes, waited, displaced, prewakes, credit)
