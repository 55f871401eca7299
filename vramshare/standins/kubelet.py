"""A stand-in for the kubelet's device manager, for tests, the benchmark and ``vramshare demo``.

Never on a production path. It speaks the real protocol over real unix sockets, so the plugin under
test cannot tell it from a kubelet where it matters: a ``v1beta1.Registration`` server on
``<dir>/kubelet.sock`` that, on Register, dials the plugin's socket, calls GetDevicePluginOptions and
keeps a ListAndWatch stream open, remembering the latest devices per resource (all unhealthy once the
stream breaks, as the kubelet does); GetPreferredAllocation and Allocate with one container request
per call; a restart that wipes every socket of the directory; and the ``v1.PodResourcesLister`` List
on a second socket, answering from what it allocated.
"""
from __future__ import annotations

import glob
import os
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import grpc

from protos.deviceplugin.v1beta1 import api_pb2 as dp
from protos.deviceplugin.v1beta1 import api_pb2_grpc as dp_grpc
from protos.podresources.v1 import api_pb2 as pr
from protos.podresources.v1 import api_pb2_grpc as pr_grpc

API_VERSION = "v1beta1"


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

    def __init__(self, plugin_dir: str, pod_resources_socket: str | None = None) -> None:
        self.plugin_dir = plugin_dir
        self.socket = os.path.join(plugin_dir, "kubelet.sock")
        self.pod_resources_socket = pod_resources_socket
        self._cond = threading.Condition()
        self._plugins: dict[str, PluginConnection] = {}
        self.registrations: dict[str, int] = {}
        self.register_times: dict[str, float] = {}  # time.monotonic() of the last Register per resource
        self._allocated: dict[tuple[str, str], dict[str, list[tuple[str, list[str]]]]] = {}
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
                    self._cond.notify_all()
        except grpc.RpcError:
            pass
        with self._cond:  # like the kubelet: a broken stream makes every device unhealthy
            conn.connected = False
            conn.devices = [dp.Device(ID=d.ID, health="Unhealthy", topology=d.topology) for d in conn.devices]
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
        req = dp.PreferredAllocationRequest(container_requests=[dp.ContainerPreferredAllocationRequest(
            available_deviceIDs=list(available), must_include_deviceIDs=list(must_include), allocation_size=size)])
        resp = self.plugin(resource).stub.GetPreferredAllocation(req, timeout=10)
        return list(resp.container_responses[0].deviceIDs)

    def allocate(self, resource: str, device_ids: Sequence[str],
                 pod: tuple[str, str, str] | None = None) -> dp.ContainerAllocateResponse:
        """One Allocate with one container request; ``pod`` = (namespace, name, container) to remember
        the grant for PodResources (the real kubelet knows it; the plugin is not told)."""
        req = dp.AllocateRequest(container_requests=[dp.ContainerAllocateRequest(devices_ids=list(device_ids))])
        resp = self.plugin(resource).stub.Allocate(req, timeout=10)
        if pod is not None:
            ns, name, container = pod
            with self._cond:
                self._allocated.setdefault((ns, name), {}).setdefault(container, []).append(
                    (resource, list(device_ids)))
        return resp.container_responses[0]

    def forget_pod(self, namespace: str, name: str) -> None:
        """The pod ended: its devices are free again (PodResources stops listing them)."""
        with self._cond:
            self._allocated.pop((namespace, name), None)

    # -- v1.PodResourcesLister -------------------------------------------------------------------
    def List(self, request: pr.ListPodResourcesRequest, context: grpc.ServicerContext) -> pr.ListPodResourcesResponse:
        with self._cond:
            pods = [pr.PodResources(name=name, namespace=ns, containers=[
                pr.ContainerResources(name=c, devices=[pr.ContainerDevices(resource_name=r, device_ids=ids)
                                                       for r, ids in grants])
                for c, grants in containers.items()]) for (ns, name), containers in self._allocated.items()]
        return pr.ListPodResourcesResponse(pod_resources=pods)

    def GetAllocatableResources(self, request: pr.AllocatableResourcesRequest,
                                context: grpc.ServicerContext) -> pr.AllocatableResourcesResponse:
        with self._cond:
            devs = [pr.ContainerDevices(resource_name=r, device_ids=[d.ID for d in p.devices if d.health == "Healthy"])
                    for r, p in self._plugins.items()]
        return pr.AllocatableResourcesResponse(devices=devs)

    def Get(self, request: pr.GetPodResourcesRequest, context: grpc.ServicerContext) -> pr.GetPodResourcesResponse:
        found = [p for p in self.List(pr.ListPodResourcesRequest(), context).pod_resources
                 if p.name == request.pod_name and p.namespace == request.pod_namespace]
        if not found:
            context.abort(grpc.StatusCode.NOT_FOUND, f"pod {request.pod_namespace}/{request.pod_name} not found")
        return pr.GetPodResourcesResponse(pod_resources=found[0])
