"""The kubelet-facing sockets: registration (as the kubelet's plugin watcher does it) and the DRA
service in both API versions, called by a client built from our .proto files over real unix sockets."""
from __future__ import annotations

import shutil
import tempfile

import grpc
import pytest

from deviceplugin.dra.grpc_service import KubeletPlugin, RegistrationServicer, registration_socket
from deviceplugin.dra.preparer import ClaimPreparer
from protos.dra.v1 import api_pb2 as v1
from protos.dra.v1 import api_pb2_grpc as v1_grpc
from protos.dra.v1beta1 import api_pb2 as v1beta1
from protos.dra.v1beta1 import api_pb2_grpc as v1beta1_grpc
from protos.pluginregistration.v1 import api_pb2 as reg
from protos.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from standins.dra_kubelet import DraKubelet
from tests.dra.test_preparer import Claims, claim, make, share

DRIVER = "gpu.vramshare.io"


@pytest.fixture
def sockets():
    root = tempfile.mkdtemp(prefix="dra", dir="/tmp")  # unix socket paths must stay under 108 bytes
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def served(tmp_path, sockets):
    claims = Claims()
    preparer: ClaimPreparer = make(tmp_path, claims)
    plugin = KubeletPlugin(preparer, DRIVER, f"{sockets}/plugins/{DRIVER}", f"{sockets}/registry")
    plugin.start()
    yield plugin, claims, tmp_path
    plugin.stop()


@pytest.mark.parametrize("pb, pb_grpc", [(v1, v1_grpc), (v1beta1, v1beta1_grpc)], ids=["v1", "v1beta1"])
def test_prepare_and_unprepare_over_the_socket(served, pb, pb_grpc):
    plugin, claims, tmp = served
    good = claims.add(claim("uid-g", [share("gpu-0", "10Gi")]))
    bad = claims.add(claim("uid-b", [share("gpu-7")]))
    with grpc.insecure_channel(f"unix://{plugin.dra_socket}") as channel:
        stub = pb_grpc.DRAPluginStub(channel)
        req = [pb.Claim(namespace="default", name=c["metadata"]["name"], uid=c["metadata"]["uid"])
               for c in (good, bad)]
        resp = stub.NodePrepareResources(pb.NodePrepareResourcesRequest(claims=req), timeout=10)
        assert set(resp.claims) == {"uid-g", "uid-b"}  # every claim answered, failures inside
        [dev] = resp.claims["uid-g"].devices
        assert (dev.pool_name, dev.device_name, list(dev.request_names), list(dev.cdi_device_ids)) == (
            "gpu-node-1", "gpu-0", ["gpu"], ["vramshare.io/gpu=uid-g-0"])
        assert resp.claims["uid-g"].error == "" and "gpu-7" in resp.claims["uid-b"].error
        again = stub.NodePrepareResources(pb.NodePrepareResourcesRequest(claims=req[:1]), timeout=10)
        assert again.claims["uid-g"] == resp.claims["uid-g"]
        un = stub.NodeUnprepareResources(pb.NodeUnprepareResourcesRequest(claims=req), timeout=10)
        assert set(un.claims) == {"uid-g", "uid-b"} and all(r.error == "" for r in un.claims.values())
    assert not list((tmp / "cdi").iterdir())


def test_registration_info_is_what_the_kubelet_validates(served):
    plugin, _, _ = served
    with grpc.insecure_channel(f"unix://{plugin.registration_socket}") as channel:
        stub = reg_grpc.RegistrationStub(channel)
        info = stub.GetInfo(reg.InfoRequest(), timeout=5)
        assert (info.type, info.name, info.endpoint) == ("DRAPlugin", DRIVER, plugin.dra_socket)
        assert list(info.supported_versions) == ["v1.DRAPlugin", "v1beta1.DRAPlugin"]
        stub.NotifyRegistrationStatus(reg.RegistrationStatus(plugin_registered=False, error="nope"), timeout=5)
        assert plugin.registration.error == "nope" and not plugin.registration.registered.is_set()
    assert plugin.registration_socket == registration_socket(plugin.registration_socket.rsplit("/", 1)[0], DRIVER)
    assert plugin.registration_socket.endswith(f"/registry/{DRIVER}-reg.sock")
    assert plugin.dra_socket.endswith(f"/plugins/{DRIVER}/dra.sock")


def test_the_kubelet_standin_registers_the_plugin_and_notices_it_leave(served, sockets):
    plugin, _, _ = served
    kubelet = DraKubelet(api=None, node="gpu-node-1", registry_dir=f"{sockets}/registry")  # type: ignore[arg-type]
    assert kubelet.sync_plugins() == [DRIVER]
    assert plugin.registration.registered.wait(5)
    assert kubelet.plugins[DRIVER].service == "v1.DRAPlugin" and kubelet.plugins[DRIVER].endpoint == plugin.dra_socket
    assert kubelet.sync_plugins() == []  # known socket: not registered twice
    plugin.stop()
    kubelet.sync_plugins()
    assert kubelet.plugins == {}


def test_a_plugin_speaking_no_known_version_is_refused(sockets):
    from concurrent import futures
    servicer = RegistrationServicer(DRIVER, "/nowhere/dra.sock")
    servicer.info.ClearField("supported_versions")
    servicer.info.supported_versions.append("v2.DRAPlugin")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    reg_grpc.add_RegistrationServicer_to_server(servicer, server)
    import os
    os.makedirs(f"{sockets}/registry")
    server.add_insecure_port(f"unix://{sockets}/registry/{DRIVER}-reg.sock")
    server.start()
    try:
        kubelet = DraKubelet(api=None, node="n", registry_dir=f"{sockets}/registry")  # type: ignore[arg-type]
        assert kubelet.sync_plugins() == []
        assert "none of the supported services" in servicer.error
    finally:
        server.stop(0)
