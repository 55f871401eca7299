"""The kubelet-facing gRPC side of the DRA plugin: the DRA service (v1 and v1beta1) and registration.

Like k8s.io/dynamic-resource-allocation/kubeletplugin (``Start``): the DRA service listens on
``<plugin-dir>/dra.sock`` (``plugins/<driver>/``), the registration service on
``<registry-dir>/<driver>-reg.sock``; the kubelet's plugin watcher finds the registration socket,
calls ``GetInfo`` (type ``DRAPlugin``, the driver name, the DRA socket, ``v1.DRAPlugin`` and
``v1beta1.DRAPlugin``: kubelets 1.34+ speak v1, older ones v1beta1) and reports the outcome with
``NotifyRegistrationStatus``. Per-claim failures go in the response (the kubelet retries those
claims); nothing here answers with a success it did not achieve.
"""
from __future__ import annotations

import os
import threading
from concurrent import futures
from typing import Any, Callable

import grpc

from deviceplugin.dra.claims import ClaimRef, base_request
from deviceplugin.dra.preparer import ClaimPreparer
from protos.dra.v1 import api_pb2 as v1
from protos.dra.v1 import api_pb2_grpc as v1_grpc
from protos.dra.v1beta1 import api_pb2 as v1beta1
from protos.dra.v1beta1 import api_pb2_grpc as v1beta1_grpc
from protos.pluginregistration.v1 import api_pb2 as reg
from protos.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from vramshare import logs

log = logs.get(__name__)

PLUGIN_TYPE = "DRAPlugin"
SUPPORTED_VERSIONS = ("v1.DRAPlugin", "v1beta1.DRAPlugin")
DRA_SOCKET = "dra.sock"


def registration_socket(registry_dir: str, driver: str) -> str:
    return os.path.join(registry_dir, f"{driver}-reg.sock")


def _servicer(pb: Any, base: type) -> type:
    """One DRAPlugin servicer class per API version; the messages are field-for-field the same."""

    class Servicer(base):  # type: ignore[misc, valid-type]
        def __init__(self, preparer: ClaimPreparer) -> None:
            self._preparer = preparer

        def NodePrepareResources(self, request: Any, context: grpc.ServicerContext) -> Any:
            out = {}
            for c in request.claims:
                ref = ClaimRef(c.namespace, c.name, c.uid)
                try:
                    result = self._preparer.prepare(ref)
                except Exception as exc:  # noqa: BLE001 - one claim's I/O error must not void the others
                    log.error("prepare failed", claim=f"{c.namespace}/{c.name}", uid=c.uid, error=str(exc))
                    out[c.uid] = pb.NodePrepareResourceResponse(error=f"prepare failed: {exc}")
                    continue
                # request names without their subrequest, as kubeletplugin's NodePrepareResources
                # (stripSubrequestNames) answers: the kubelet matches them to containers exactly
                out[c.uid] = pb.NodePrepareResourceResponse(error=result.error, devices=[
                    pb.Device(request_names=[base_request(r) for r in d.request_names],
                              pool_name=d.pool, device_name=d.device,
                              cdi_device_ids=list(d.cdi_ids)) for d in result.devices])
            return pb.NodePrepareResourcesResponse(claims=out)

        def NodeUnprepareResources(self, request: Any, context: grpc.ServicerContext) -> Any:
            out = {}
            for c in request.claims:
                try:
                    error = self._preparer.unprepare(ClaimRef(c.namespace, c.name, c.uid))
                except Exception as exc:  # noqa: BLE001
                    log.error("unprepare failed", claim=f"{c.namespace}/{c.name}", uid=c.uid, error=str(exc))
                    error = f"unprepare failed: {exc}"
                out[c.uid] = pb.NodeUnprepareResourceResponse(error=error)
            return pb.NodeUnprepareResourcesResponse(claims=out)

    Servicer.__name__ = f"DRAPluginServicer_{pb.DESCRIPTOR.package.rsplit('.', 1)[-1]}"
    return Servicer


DRAPluginV1 = _servicer(v1, v1_grpc.DRAPluginServicer)
DRAPluginV1beta1 = _servicer(v1beta1, v1beta1_grpc.DRAPluginServicer)


class RegistrationServicer(reg_grpc.RegistrationServicer):
    """What the kubelet's plugin watcher asks; ``registered`` is set once it accepted us."""

    def __init__(self, driver: str, endpoint: str, on_registered: Callable[[], None] = lambda: None) -> None:
        self.info = reg.PluginInfo(type=PLUGIN_TYPE, name=driver, endpoint=endpoint,
                                   supported_versions=list(SUPPORTED_VERSIONS))
        self.registered = threading.Event()
        self.error = ""
        self._on_registered = on_registered

    def GetInfo(self, request: reg.InfoRequest, context: grpc.ServicerContext) -> reg.PluginInfo:
        return self.info

    def NotifyRegistrationStatus(self, request: reg.RegistrationStatus,
                                 context: grpc.ServicerContext) -> reg.RegistrationStatusResponse:
        if request.plugin_registered:
            self.error = ""
            self.registered.set()
            log.info("registered with the kubelet", driver=self.info.name, endpoint=self.info.endpoint)
            self._on_registered()  # a (re)started kubelet wiped our slices: publish again now
        else:
            self.error = request.error
            self.registered.clear()
            log.error("kubelet refused the registration", driver=self.info.name, error=request.error)
        return reg.RegistrationStatusResponse()


def _listen(path: str) -> grpc.Server:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    try:
        os.unlink(path)  # a socket left by an earlier instance; the kubelet re-probes the new one
    except FileNotFoundError:
        pass
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    if server.add_insecure_port(f"unix://{path}") == 0:
        raise OSError(f"cannot listen on {path}")
    return server


class KubeletPlugin:
    """Both sockets of one driver: the DRA service first, then registration (the kubelet dials back)."""

    def __init__(self, preparer: ClaimPreparer, driver: str, plugin_dir: str, registry_dir: str,
                 on_registered: Callable[[], None] = lambda: None) -> None:
        self.dra_socket = os.path.join(plugin_dir, DRA_SOCKET)
        self.registration_socket = registration_socket(registry_dir, driver)
        self.registration = RegistrationServicer(driver, self.dra_socket, on_registered)
        self._preparer = preparer
        self._servers: list[grpc.Server] = []

    def start(self) -> None:
        dra = _listen(self.dra_socket)
        v1_grpc.add_DRAPluginServicer_to_server(DRAPluginV1(self._preparer), dra)
        v1beta1_grpc.add_DRAPluginServicer_to_server(DRAPluginV1beta1(self._preparer), dra)
        dra.start()
        self._servers.append(dra)
        registrar = _listen(self.registration_socket)
        reg_grpc.add_RegistrationServicer_to_server(self.registration, registrar)
        registrar.start()
        self._servers.append(registrar)
        log.info("serving", dra_socket=self.dra_socket, registration_socket=self.registration_socket)

    def stop(self) -> None:
        for server in reversed(self._servers):
            server.stop(grace=1).wait()
        self._servers.clear()
        for path in (self.registration_socket, self.dra_socket):
            try:
                os.unlink(path)  # the kubelet sees the registration socket go and unregisters us
            except FileNotFoundError:
                pass
