"""The kubelet's DRA side as upstream has it, and our plugin against it.

Conformance of :mod:`standins.dra_kubelet` to pkg/kubelet/cm/dra (``Manager.GetResources``
with ``ClaimInfo.cdiDevicesAsList``), and the plugin's answers as kubeletplugin's
``NodePrepareResources`` gives them (``stripSubrequestNames``): a container naming the request of a
``firstAvailable`` claim must get the claim's GPU.
"""
from __future__ import annotations

import shutil
import tempfile

import pytest
from kubernetes import client

from deviceplugin.dra.main import DraPluginDaemon
from deviceplugin.simulated_backend import SimulatedBackend
from standins import cdi_registry
from standins.apiserver import ApiServerDouble
from standins.apiserver.resources import RESOURCESLICES
from standins.dra_kubelet import DraKubelet
from tests.dra.conftest import NODE, dra_config
from vramshare.kube import api_client_for

DRIVER = "gpu.vramshare.io"


def _pod(containers: list[dict]) -> dict:
    return {"metadata": {"name": "p", "namespace": "default", "uid": "pod-1"},
            "spec": {"resourceClaims": [{"name": "gpu", "resourceClaimName": "c1"},
                                        {"name": "extra", "resourceClaimName": "c2"}],
                     "containers": containers}}


def test_a_container_gets_only_the_cdi_devices_of_the_requests_it_names():
    """Manager.GetResources + ClaimInfo.cdiDevicesAsList: per pod claim (spec order), per reference of
    the container: every device when it names no request or the device names none, else only devices
    whose request_names contain the request name exactly ("small/x" is not "small")."""
    kubelet = DraKubelet(api=None, node=NODE, registry_dir="/nonexistent")  # type: ignore[arg-type]
    kubelet.prepared = {
        "u1": {"driver": DRIVER, "pods": {"pod-1"}, "ref": ("default", "c1"),
               "devices": [(("big",), ("k=big",)), (("small/x",), ("k=sub",)), ((), ("k=any",))]},
        "u2": {"driver": DRIVER, "pods": {"pod-1"}, "ref": ("default", "c2"), "devices": [(("r",), ("k=c2",))]},
    }
    pod = _pod([{"name": "all", "resources": {"claims": [{"name": "gpu"}]}},
                {"name": "big", "resources": {"claims": [{"name": "gpu", "request": "big"}]}},
                {"name": "small", "resources": {"claims": [{"name": "gpu", "request": "small"}]}},
                {"name": "both", "resources": {"claims": [{"name": "extra"}, {"name": "gpu", "request": "big"}]}},
                {"name": "none", "resources": {}}])
    got = {c["name"]: kubelet.container_cdi(pod, c) for c in pod["spec"]["containers"]}
    assert got == {"all": ["k=big", "k=sub", "k=any"], "big": ["k=big", "k=any"], "small": ["k=any"],
                   "both": ["k=big", "k=any", "k=c2"],  # pod claims in spec order, not the container's
                   "none": []}


@pytest.fixture
def env(tmp_path):
    sockets = tempfile.mkdtemp(prefix="dra", dir="/tmp")
    with ApiServerDouble() as api, api_client_for(api.url) as http:
        api.create_node({"metadata": {"name": NODE}})
        yield api, http, tmp_path, sockets
    shutil.rmtree(sockets, ignore_errors=True)


def _daemon(env) -> DraPluginDaemon:
    api, http, tmp, sockets = env
    return DraPluginDaemon(SimulatedBackend.demo(), dra_config(tmp), http, NODE,
                           plugin_dir=f"{sockets}/plugins/{DRIVER}", registry_dir=f"{sockets}/registry",
                           retry_seconds=0.05, resync_seconds=300)


def _allocated_claim(http, pod_uid: str, request: str) -> None:
    """A claim as kube-scheduler leaves a ``firstAvailable`` request: result named ``<request>/<sub>``."""
    resource = client.ResourceV1Api(http)
    made = resource.create_namespaced_resource_claim("default", {
        "metadata": {"name": "c1"}, "spec": {"devices": {"requests": [{"name": "gpu", "firstAvailable": [
            {"name": "h100", "deviceClassName": "gpu-memory.vramshare.io",
             "capacity": {"requests": {"memory": "20Gi"}}}]}]}}})
    body = resource.api_client.sanitize_for_serialization(made)
    body["status"] = {"allocation": {"devices": {"results": [
        {"request": request, "driver": DRIVER, "pool": NODE, "device": "gpu-0",
         "shareID": "7d3c2a6e-0000-4000-8000-000000000001", "consumedCapacity": {"memory": "20Gi"}}]}},
        "reservedFor": [{"resource": "pods", "name": "p", "uid": pod_uid}]}
    resource.replace_namespaced_resource_claim_status("c1", "default", body)


def test_a_container_naming_a_first_available_request_gets_its_gpu(env):
    """NodePrepareResources answers base request names (kubeletplugin/draplugin.go stripSubrequestNames),
    so the kubelet's cdiDevicesAsList(claim.Request) finds the device for the container naming "gpu"."""
    api, http, tmp, sockets = env
    with _daemon(env) as daemon:
        assert api.wait_for(lambda a: bool(a.objects(RESOURCESLICES)), timeout=20)
        kubelet = DraKubelet(http, NODE, f"{sockets}/registry")
        assert kubelet.sync_plugins() == [DRIVER] and daemon.plugin.registration.registered.wait(5)
        pod = api.create_pod({"metadata": {"name": "p", "namespace": "default"}, "spec": {
            "resourceClaims": [{"name": "gpu", "resourceClaimName": "c1"}],
            "containers": [{"name": "vllm", "image": "v", "resources": {"claims": [{"name": "gpu", "request": "gpu"}]}},
                           {"name": "side", "image": "s", "resources": {"claims": [{"name": "gpu", "request": "x"}]}}]}})
        _allocated_claim(http, pod["metadata"]["uid"], "gpu/h100")
        per_container = kubelet.prepare_pod(pod)
        [info] = kubelet.prepared.values()
        assert [names for names, _ in info["devices"]] == [("gpu",)]
        assert per_container["side"] == []
        env_vllm = cdi_registry.Registry([str(tmp / "cdi")]).inject(per_container["vllm"]).env
        assert env_vllm["VRAMSHARE_MEMORY_LIMIT_MIB"] == str(20 * 1024)


# -- ResourceSlice wiping (pkg/kubelet/cm/dra/plugin/dra_plugin_manager.go wipeResourceSlices) -------
def _slice(node: str, domain: str = "vramshare.io") -> dict:
    from deviceplugin.dra import slices
    from vramshare.contract import Names
    return slices.resource_slices(node, None, [], 1, Names(domain))[0]


def _slice_keys(api) -> set[tuple[str, str]]:
    return {(s["spec"]["nodeName"], s["spec"]["driver"]) for s in api.objects(RESOURCESLICES)}


def test_the_kubelet_stand_in_wipes_slices_as_upstream_does():
    """At start: every slice of the node, every driver (NewDRAPluginManager -> wipeResourceSlices(ctx, "")).
    After the last plugin of a driver goes: that driver's slices of the node, wipingDelay (30 s) later,
    unless it registers again first (DRAPluginManager.sync)."""
    from standins.dra_kubelet import WIPING_DELAY_SECONDS
    with ApiServerDouble() as api, api_client_for(api.url) as http:
        resource = client.ResourceV1Api(http)
        for node, domain in [(NODE, "vramshare.io"), (NODE, "other.io"), ("gpu-node-2", "vramshare.io")]:
            resource.create_resource_slice(_slice(node, domain))
        kubelet = DraKubelet(http, NODE, "/nonexistent")
        assert kubelet.start() == 2
        assert _slice_keys(api) == {("gpu-node-2", DRIVER)}
        assert api.count("DELETE", r"/resourceslices$") == 1  # one DeleteCollection, by field selector
        for node, domain in [(NODE, "vramshare.io"), (NODE, "other.io")]:
            resource.create_resource_slice(_slice(node, domain))
        kubelet.pending_wipes[DRIVER] = 100.0 + WIPING_DELAY_SECONDS  # as sync_plugins sets it on deregistration
        assert kubelet.run_pending_wipes(now=100.0 + WIPING_DELAY_SECONDS - 1) == []
        assert kubelet.run_pending_wipes(now=100.0 + WIPING_DELAY_SECONDS) == [DRIVER]
        assert _slice_keys(api) == {("gpu-node-2", DRIVER), (NODE, "gpu.other.io")}


def test_a_kubelet_restart_or_a_deregistration_wipe_is_republished_at_once(env):
    """Issue 17 item 5: the publisher re-applied only on its 300 s resync. It watches its slices (as
    upstream's resourceslice controller does) and publishes again on registration."""
    api, http, tmp, sockets = env
    with _daemon(env) as daemon:  # resync 300 s: only the watch can bring the slices back in time
        assert api.wait_for(lambda a: len(a.objects(RESOURCESLICES)) == 1, timeout=20)
        kubelet = DraKubelet(http, NODE, f"{sockets}/registry")
        for _ in range(3):  # a kubelet (re)start wipes, then registers the running plugin
            assert kubelet.start() == 1
            assert api.wait_for(lambda a: len(a.objects(RESOURCESLICES)) == 1, timeout=10)
        patches = api.count("PATCH", r"/resourceslices/")
        assert kubelet.sync_plugins() == [DRIVER] and daemon.plugin.registration.registered.wait(5)
        assert api.wait_for(lambda a: a.count("PATCH", r"/resourceslices/") > patches, timeout=10)
        assert daemon.slice_watch.deletions >= 3
    # the plugin is gone: the kubelet's pending wipe fires 30 s later and nothing publishes
    assert kubelet.sync_plugins() == [] and DRIVER in kubelet.pending_wipes
    assert kubelet.run_pending_wipes(now=kubelet.pending_wipes[DRIVER]) == [DRIVER]
    assert api.objects(RESOURCESLICES) == []
    with _daemon(env):  # it comes back: published before any registration
        assert api.wait_for(lambda a: len(a.objects(RESOURCESLICES)) == 1, timeout=20)
        assert kubelet.sync_plugins() == [DRIVER] and DRIVER not in kubelet.pending_wipes
