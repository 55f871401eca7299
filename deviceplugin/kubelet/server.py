"""The kubelet-facing gRPC servicer for one resource: protobuf in, :class:`ResourceManager` calls, protobuf out.

No NVML, no Kubernetes, no sockets here (those live in :mod:`deviceplugin.kubelet.lifecycle`). A refusal
becomes a gRPC status with the refusal's message, because the kubelet shows it to the user as the
pod's admission error; nothing here ever answers a request it could not serve.
"""
from __future__ import annotations

import threading
from typing import Iterator

import grpc

from deviceplugin.allocation import ContainerSpec, Refusal, RefusalKind
from deviceplugin.devices import PluginDevice
from deviceplugin.kubelet.manager import ResourceManager
from protos.deviceplugin.v1beta1 import api_pb2 as pb
from protos.deviceplugin.v1beta1 import api_pb2_grpc as pb_grpc
from vramshare import contract

_STATUS = {
    RefusalKind.INVALID: grpc.StatusCode.INVALID_ARGUMENT,
    RefusalKind.PRECONDITION: grpc.StatusCode.FAILED_PRECONDITION,
    RefusalKind.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
}

#: Identical in GetDevicePluginOptions and in the RegisterRequest, as the kubelet caches either.
OPTIONS = pb.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True)


def device_message(d: PluginDevice) -> pb.Device:
    topology = (pb.TopologyInfo(nodes=[pb.NUMANode(ID=d.numa_node)]) if d.numa_node is not None
                else pb.TopologyInfo())
    return pb.Device(ID=d.id, health=contract.HEALTHY if d.healthy else contract.UNHEALTHY, topology=topology)


def list_response(devices: tuple[PluginDevice, ...]) -> pb.ListAndWatchResponse:
    return pb.ListAndWatchResponse(devices=[device_message(d) for d in devices])


def container_response(spec: ContainerSpec) -> pb.ContainerAllocateResponse:
    return pb.ContainerAllocateResponse(
        envs=dict(spec.envs), annotations=dict(spec.annotations),
        mounts=[pb.Mount(container_path=c, host_path=h, read_only=ro) for c, h, ro in spec.mounts],
        cdi_devices=[pb.CDIDevice(name=n) for n in spec.cdi_devices])


class DevicePluginServicer(pb_grpc.DevicePluginServicer):
    """``v1beta1.DevicePlugin`` for ``rm.resource``; ``stop`` ends every ListAndWatch stream."""

    def __init__(self, rm: ResourceManager, stop: threading.Event) -> None:
        self._rm = rm
        self._stop = stop

    def GetDevicePluginOptions(self, request: pb.Empty, context: grpc.ServicerContext) -> pb.DevicePluginOptions:
        return OPTIONS

    def ListAndWatch(self, request: pb.Empty, context: grpc.ServicerContext) -> Iterator[pb.ListAndWatchResponse]:
        watch = self._rm.watch()  # before the first list, so no change falls in between
        context.add_callback(watch.close)  # the kubelet hung up
        try:
            yield list_response(self._rm.devices())
            while not self._stop.is_set():
                devices = watch.next()
                if devices is None:
                    return
                yield list_response(devices)
        finally:
            watch.close()

    def GetPreferredAllocation(self, request: pb.PreferredAllocationRequest,
                               context: grpc.ServicerContext) -> pb.PreferredAllocationResponse:
        out = []
        for req in request.container_requests:
            try:
                ids = self._rm.preferred(list(req.available_deviceIDs), list(req.must_include_deviceIDs),
                                         req.allocation_size)
            except Refusal as refusal:
                context.abort(_STATUS[refusal.kind], str(refusal))
            out.append(pb.ContainerPreferredAllocationResponse(deviceIDs=ids))
        return pb.PreferredAllocationResponse(container_responses=out)

    def Allocate(self, request: pb.AllocateRequest, context: grpc.ServicerContext) -> pb.AllocateResponse:
        out = []
        for req in request.container_requests:
            try:
                spec = self._rm.allocate(list(req.devices_ids))
            except Refusal as refusal:
                context.abort(_STATUS[refusal.kind], f"{self._rm.resource}: {refusal}")
            out.append(container_response(spec))
        return pb.AllocateResponse(container_responses=out)

    def PreStartContainer(self, request: pb.PreStartContainerRequest,
                          context: grpc.ServicerContext) -> pb.PreStartContainerResponse:
        return pb.PreStartContainerResponse()
