"""A stand-in for the kubelet's device side, for tests, the benchmark and ``vramshare demo``.

Never on a production path. It speaks the real protocol over real unix sockets, so the plugin under
test cannot tell it from a kubelet where it matters: a ``v1beta1.Registration`` server on
``<dir>/kubelet.sock`` that, on Register, dials the plugin's socket, calls GetDevicePluginOptions once
and keeps a ListAndWatch stream open (``pkg/kubelet/cm/devicemanager/plugin/v1beta1`` client/handler),
feeding each list to the device manager model (:mod:`standins.devicemanager`: the kubelet's
own per-resource accounting, GetPreferredAllocation with available/mustInclude, Allocate with one
container request per call, init-container reuse, checkpoint); all devices unhealthy once the stream
breaks; a restart that wipes every socket of the directory and keeps the checkpoint; and the
``v1.PodResourcesLister`` List on a second socket, which can be switched off to model a node
without it. Pods are admitted as ``HandlePodAdditions`` does: sorted by creation time
(``sort.Sort(sliceutils.PodsByCreationTime(pods))``, an unstable sort on one-second timestamps, so
ties come in random order), one at a time.
"""
from __future__ import annotations

import calendar
import glob
import os
import random
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

import grpc

from protos.deviceplugin.v1beta1 import api_pb2 as dp
from protos.deviceplugin.v1beta1 import api_pb2_grpc as dp_grpc
from protos.podresources.v1 import api_pb2 as pr
from protos.podresources.v1 import api_pb2_grpc as pr_grpc
from standins.devicemanager import AdmissionError, DeviceManager, FnEndpoint

API_VERSION = "v1beta1"


def creation_second(pod: Mapping[str, Any]) -> int:
    """``metadata.creationTimestamp`` in whole seconds (RFC 3339, one-second resolution)."""
    text = (pod.get("metadata") or {}).get("creationTimestamp") or "1970-01-01T00:00:00Z"
    return calendar.timegm(time.strptime(text[:19], "%Y-%m-%dT%H:%M:%S"))


def admission_order(pods: Iterable[Mapping[str, Any]], rng: random.Random) -> list[Mapping[str, Any]]:
    """``HandlePodAdditions``: ``sort.Sort(sliceutils.PodsByCreationTime(pods))``. Go's sort.Sort is
    not stable, so pods created in the same second come in an order nobody promises: random here."""
    shuffled = list(pods)
    rng.shuffle(shuffled)
    return sorted(shuffled, key=creation_second)


@dataclass
class PluginConnection:
    """What the fake kubelet knows of one registered resource."""

    resource: str
    endpoint: str
    options: dp.DevicePluginOptions
    channel: grpc.Channel
    stub: dp_grpc.DevicePluginStub
    devices: list[dp.Device] = field(default_factory=list)
    updates: int = 0  # ListAndWatch messages received
    stream: grpc.Future | None = None  # the open ListAndWatch call
    connected: bool = True


class FakeKubelet(dp_grpc.RegistrationServicer, pr_grpc.PodResourcesListerServicer):
    """Start with :meth:`start`, stop with :meth:`stop`; all waits are on a condition, never sleeps."""

    def __init__(self, plugin_dir: str, pod_resources_socket: str | None = None,
                 rng: random.Random | None = None) -> None:
        self.plugin_dir = plugin_dir
        self.rng = rng or random.Random(0)
        self.manager = DeviceManager(self.rng)
        self.socket = os.path.join(plugin_dir, "kubelet.sock")
        self.pod_resources_socket = pod_resources_socket
        self._cond = threading.Condition()
        self._plugins: dict[str, PluginConnection] = {}
        self.registrations: dict[str, int] = {}
        self.register_times: dict[str, float] = {}  # time.monotonic() of the last Register per resource
        self._server: grpc.Server | None = None
        self._pr_server: grpc.Server | None = None
        self._threads: list[threading.Thread] = []

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        os.makedirs(self.plugin_dir, exist_ok=True)
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="fake-kubelet"))
        dp_grpc.add_RegistrationServicer_to_server(self, self._server)
        self._server.add_insecure_port(f"unix://{self.socket}")
        self._server.start()
        if self.pod_resources_socket and self._pr_server is None:
            os.makedirs(os.path.dirname(self.pod_resources_socket), exist_ok=True)
            self._pr_server = grpc.server(futures.ThreadPoolExecutor(max_workers=2,
                                                                     thread_name_prefix="fake-podresources"))
            pr_grpc.add_PodResourcesListerServicer_to_server(self, self._pr_server)
            self._pr_server.add_insecure_port(f"unix://{self.pod_resources_socket}")
            self._pr_server.start()

    def stop(self, keep_pod_resources: bool = False) -> None:
        if self._server is not None:
            self._server.stop(grace=None).wait()
            self._server = None
        if self._pr_server is not None and not keep_pod_resources:
            self._pr_server.stop(grace=None).wait()
            self._pr_server = None
        with self._cond:
            plugins, self._plugins = list(self._plugins.values()), {}
            self.manager.restore(self.manager.checkpoint())  # readCheckpoint: podDevices survive
        for p in plugins:
            self._disconnect(p)
        for t in self._threads:
            t.join(timeout=5)
        self._threads = []

    def restart(self, timeout: float = 5.0) -> float:
        """Stop, wipe every socket in the directory, start again; wait until every resource that was
        registered has registered again and return how long that took (seconds)."""
        with self._cond:
            resources = list(self._plugins)
            before = {r: self.registrations.get(r, 0) for r in resources}
        self.stop(keep_pod_resources=True)
        for path in glob.glob(os.path.join(self.plugin_dir, "*.sock")):
            os.unlink(path)
        started = time.monotonic()
        self.start()
        self.wait_for(lambda: all(self.registrations.get(r, 0) > before[r] and r in self._plugins
                                  for r in resources), timeout, f"re-registration of {resources}")
        return max((self.register_times[r] for r in resources), default=started) - started

    def __enter__(self) -> "FakeKubelet":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- v1beta1.Registration ------------------------------------------------------------------
    def Register(self, request: dp.RegisterRequest, context: grpc.ServicerContext) -> dp.Empty:
        if request.version != API_VERSION:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unsupported version {request.version!r}")
        if "/" not in request.resource_name:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{request.resource_name!r} is not an extended resource")
        endpoint = os.path.join(self.plugin_dir, request.endpoint)
        channel = grpc.insecure_channel(f"unix://{endpoint}")
        stub = dp_grpc.DevicePluginStub(channel)
        try:
            options = stub.GetDevicePluginOptions(dp.Empty(), timeout=10, wait_for_ready=True)
        except grpc.RpcError as exc:
            channel.close()
            context.abort(grpc.StatusCode.UNAVAILABLE, f"cannot dial {endpoint}: {exc.details()}")
        conn = PluginConnection(request.resource_name, request.endpoint, options, channel, stub)
        conn.stream = stub.ListAndWatch(dp.Empty())
        with self._cond:
            old = self._plugins.get(request.resource_name)
            self._plugins[request.resource_name] = conn
            self.manager.register(request.resource_name, FnEndpoint(
                lambda available, must, size, c=conn: self._preferred_rpc(c, available, size, must),
                lambda ids, c=conn: self._allocate_rpc(c, ids),
                preferred_available=options.get_preferred_allocation_available))
        if old is not None:
            self._disconnect(old)
        thread = threading.Thread(target=self._watch, args=(conn,), daemon=True,
                                  name=f"fake-kubelet-watch-{request.resource_name}")
        self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()
        with self._cond:
            self.registrations[request.resource_name] = self.registrations.get(request.resource_name, 0) + 1
            self.register_times[request.resource_name] = time.monotonic()
            self._cond.notify_all()
        return dp.Empty()

    def _watch(self, conn: PluginConnection) -> None:
        try:
            for response in conn.stream:  # type: ignore[union-attr]
                with self._cond:
                    conn.devices = list(response.devices)
                    conn.updates += 1
                    if self._plugins.get(conn.resource) is conn:  # genericDeviceUpdateCallback
                        self.manager.update_devices(conn.resource, [
                            (d.ID, d.health == "Healthy", tuple(n.ID for n in d.topology.nodes))
                            for d in conn.devices])
                    self._cond.notify_all()
        except grpc.RpcError:
            pass
        with self._cond:  # like the kubelet: a broken stream makes every device unhealthy
            conn.connected = False
            conn.devices = [dp.Device(ID=d.ID, health="Unhealthy", topology=d.topology) for d in conn.devices]
            if self._plugins.get(conn.resource) is conn:
                self.manager.update_devices(conn.resource, [(d.ID, False, tuple(n.ID for n in d.topology.nodes))
                                                            for d in conn.devices])
            self._cond.notify_all()

    def _disconnect(self, conn: PluginConnection) -> None:
        if conn.stream is not None:
            conn.stream.cancel()
        conn.channel.close()

    # -- what tests ask --------------------------------------------------------------------------
    def wait_for(self, predicate: Callable[[], bool], timeout: float = 5.0, what: str = "condition") -> None:
        with self._cond:
            if not self._cond.wait_for(predicate, timeout):
                raise TimeoutError(f"fake kubelet: timed out after {timeout}s waiting for {what}")

    def wait_registered(self, resources: Iterable[str], timeout: float = 5.0) -> None:
        wanted = list(resources)
        self.wait_for(lambda: all(r in self._plugins and self._plugins[r].updates > 0 and self._plugins[r].connected
                                  for r in wanted),
                      timeout, f"registration of {wanted}")

    def plugin(self, resource: str) -> PluginConnection:
        with self._cond:
            return self._plugins[resource]

    @property
    def resources(self) -> list[str]:
        with self._cond:
            return sorted(self._plugins)

    def devices(self, resource: str) -> list[dp.Device]:
        with self._cond:
            return list(self._plugins[resource].devices)

    def healthy_ids(self, resource: str) -> list[str]:
        return [d.ID for d in self.devices(resource) if d.health == "Healthy"]

    def break_stream(self, resource: str) -> None:
        """Cancel the ListAndWatch call, as a kubelet that lost the plugin would."""
        self._disconnect(self.plugin(resource))
        self.wait_for(lambda: not self._plugins[resource].connected, 5, f"{resource} stream to end")

    def preferred(self, resource: str, available: Sequence[str], size: int,
                  must_include: Sequence[str] = ()) -> list[str]:
        return self._preferred_rpc(self.plugin(resource), available, size, must_include)

    @staticmethod
    def _preferred_rpc(conn: PluginConnection, available: Sequence[str], size: int,
                       must_include: Sequence[str]) -> list[str]:
        req = dp.PreferredAllocationRequest(container_requests=[dp.ContainerPreferredAllocationRequest(
            available_deviceIDs=list(available), must_include_deviceIDs=list(must_include), allocation_size=size)])
        resp = conn.stub.GetPreferredAllocation(req, timeout=10)
        return list(resp.container_responses[0].deviceIDs)

    @staticmethod
    def _allocate_rpc(conn: PluginConnection, device_ids: Sequence[str]) -> dp.ContainerAllocateResponse:
        if not conn.connected:  # the kubelet's endpoint is stopped once its stream broke
            raise AdmissionError(f"endpoint {conn.resource} is stopped")
        req = dp.AllocateRequest(container_requests=[dp.ContainerAllocateRequest(devices_ids=list(device_ids))])
        return conn.stub.Allocate(req, timeout=10).container_responses[0]

    def allocate(self, resource: str, device_ids: Sequence[str],
                 pod: tuple[str, str, str] | None = None) -> dp.ContainerAllocateResponse:
        """One raw Allocate with one container request, bypassing the device manager's choice (tests of
        the plugin's answers). ``pod`` = (namespace, name, container) records the grant as the kubelet
        would, so PodResources lists it."""
        resp = self._allocate_rpc(self.plugin(resource), device_ids)
        if pod is not None:
            ns, name, container = pod
            with self._cond:
                self.manager.record(ns, name, container, resource, device_ids, resp)
        return resp

    # -- pods, the kubelet's way --------------------------------------------------------------------
    def handle_pod_additions(self, pods: Iterable[Mapping[str, Any]]) -> dict[str, str | None]:
        """Admit a batch as ``HandlePodAdditions``: creation-time order, ties random; each pod's
        admission error (``UnexpectedAdmissionError``) or None, by namespace/name."""
        out: dict[str, str | None] = {}
        for pod in admission_order(pods, self.rng):
            meta = pod["metadata"]
            try:
                self.admit(pod)
                out[f"{meta.get('namespace', 'default')}/{meta['name']}"] = None
            except AdmissionError as exc:
                out[f"{meta.get('namespace', 'default')}/{meta['name']}"] = str(exc)
        return out

    def admit(self, pod: Mapping[str, Any]) -> list[tuple[str, dict[str, str]]]:
        """Admit one pod through the device manager; each container's environment, per resource.
        Raises :class:`~standins.devicemanager.AdmissionError`."""
        with self._cond:
            self.manager.admit(pod)
            entry = self.manager.pods[pod["metadata"]["uid"]]
            return [(c, dict(g.response.envs)) for c, grants in entry.containers.items()
                    for g in grants.values() if g.response is not None]

    def reallocate(self, uid: str, container: str) -> None:
        """A late re-Allocate: the container's cached devices are lost and allocated again."""
        with self._cond:
            self.manager.lose_container(uid, container)
            self.manager.reallocate(uid)

    def remove_pod(self, uid: str) -> None:
        with self._cond:
            self.manager.remove_pod(uid)

    def forget_pod(self, namespace: str, name: str) -> None:
        """The pod ended: its devices are free again (PodResources stops listing them)."""
        with self._cond:
            for uid, e in list(self.manager.pods.items()):
                if (e.namespace, e.name) == (namespace, name):
                    self.manager.remove_pod(uid)

    def stop_pod_resources(self) -> None:
        """A node without PodResources (the socket not mounted, or the server gone)."""
        if self._pr_server is not None:
            self._pr_server.stop(grace=None).wait()
            self._pr_server = None

    # -- v1.PodResourcesLister -------------------------------------------------------------------
    # The answers copy ``pkg/kubelet/apis/podresources/server_v1.go`` (List, Get) and
    # ``pkg/kubelet/cm/container_manager.go containerDevicesFromResourceDeviceInstances``: one
    # ContainerDevices per device ID (and per NUMA node of its topology), no pod UID, Go map order.
    def List(self, request: pr.ListPodResourcesRequest, context: grpc.ServicerContext) -> pr.ListPodResourcesResponse:
        with self._cond:
            listed = self.manager.pod_resources()
        return list_response(listed)

    def GetAllocatableResources(self, request: pr.AllocatableResourcesRequest,
                                context: grpc.ServicerContext) -> pr.AllocatableResourcesResponse:
        """``GetAllocatableDevices``: the healthy devices through the same per-device conversion."""
        with self._cond:
            devs = [container_device(r, d.ID, n) for r, p in self._plugins.items() for d in p.devices
                    if d.health == "Healthy" for n in ([x.ID for x in d.topology.nodes] or [None])]
        return pr.AllocatableResourcesResponse(devices=devs)

    def Get(self, request: pr.GetPodResourcesRequest, context: grpc.ServicerContext) -> pr.GetPodResourcesResponse:
        """``Get``: ``GetPodByName``; an unknown pod is a plain Go error (gRPC ``Unknown``) with
        upstream's message."""
        with self._cond:
            try:
                found = self.manager.get_pod_resources(request.pod_namespace, request.pod_name)
            except KeyError as exc:
                context.abort(grpc.StatusCode.UNKNOWN, str(exc.args[0]))
        return pr.GetPodResourcesResponse(pod_resources=pod_resources_message(found))


def container_device(resource: str, device_id: str, numa: int | None) -> pr.ContainerDevices:
    """One ``ContainerDevices``: one device ID, and its one NUMA node when it has a topology."""
    if numa is None:
        return pr.ContainerDevices(resource_name=resource, device_ids=[device_id])
    return pr.ContainerDevices(resource_name=resource, device_ids=[device_id],
                               topology=pr.TopologyInfo(nodes=[pr.NUMANode(ID=numa)]))


def pod_resources_message(listed: tuple[str, str, list[tuple[str, list[tuple[str, str, int | None]]]]]) -> pr.PodResources:
    ns, name, containers = listed
    return pr.PodResources(name=name, namespace=ns, containers=[
        pr.ContainerResources(name=c, devices=[container_device(*e) for e in entries]) for c, entries in containers])


def list_response(listed: Iterable[tuple[str, str, list[tuple[str, list[tuple[str, str, int | None]]]]]]
                  ) -> pr.ListPodResourcesResponse:
    """What ``List`` answers for :meth:`DeviceManager.pod_resources` (tests build it without a socket)."""
    return pr.ListPodResourcesResponse(pod_resources=[pod_resources_message(p) for p in listed])
