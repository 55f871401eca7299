"""Issue 21 (the quota tick without a round trip) and issue 19's leftover trust rule, on the whole node
agent: the API server double (real kubernetes client), the stand-in kubelet (real gRPC, PodResources)
and the simulated GPU backend with replayed use at the edges; the daemon's own reconciler, pod cache and quota loop inside.

* A quota tick makes no LIST call: its tenants are the reconciler's in-process view, the pods' metadata
  comes from the watch-fed pod cache. On d7ebb75 each tick LISTed the node's pods.
* A pod that departed (deleted from the API while the kubelet still lists its devices) leaves no state
  in the loop, from the next tick on.
* An ``allocated`` annotation the device plugin did not write makes no tenant, and does not hide the
  extender's reservation (the issue-18 rule the extender applies). On d7ebb75 a ``kubectl annotate``d
  pod was a tenant whose quota file the loop wrote, and its reservation was not counted.
Imports only what d7ebb75 has, so the file runs against it.
"""
from __future__ import annotations

import json

import pytest

from deviceplugin.simulated_backend import SimulatedBackend
from deviceplugin.simulated_usage import UsageReplay
from standins.apiserver import ApiServerDouble
from standins.apiserver.resources import PODS
from vramshare import contract
from vramshare.config import parse_config

from .conftest import MEM, NODE

NAMES = contract.Names()


@pytest.fixture
def node(api, http, kubelet, start_plugin, short_dir):
    """A running node agent on a simulated H100 whose use is replayed (so its quota loop runs), ticking
    only when the test says."""
    cfg = parse_config("quota: {intervalSeconds: 3600}").with_overrides(quota_host_dir=f"{short_dir}/quota")
    backend = SimulatedBackend.from_dict({"gpus": [{"model": "NVIDIA H100 80GB HBM3", "memoryMiB": 81559}]})
    backend.usage_replay = UsageReplay([[2000]])
    daemon = start_plugin(cfg=cfg, api=http, gpus=backend)
    loop = daemon._quota_loop  # noqa: SLF001 - the daemon's own loop, driven tick by tick
    assert loop is not None, "the quota loop runs on an NVML node with an API server"
    return daemon, loop, daemon.state.snapshot.inventory.gpus[0].uuid


def _pod(api: ApiServerDouble, name: str, gpu: str, units: int, state: str, manager: str) -> dict:
    return api.create_pod({
        "metadata": {"name": name, "namespace": "default", "annotations": {
            NAMES.assignment: json.dumps({"vllm": [{"uuid": gpu, "mib": units * 1024}]}),
            NAMES.assume_time: "100", NAMES.allocation_state: state}},
        "spec": {"nodeName": NODE, "containers": [
            {"name": "vllm", "image": "vllm", "resources": {"limits": {MEM: str(units)}}}]},
        "status": {"phase": "Running"}}, manager=manager)


def _cached(daemon, api: ApiServerDouble, name: str) -> None:
    """The plugin's pod cache has the API's current version of the pod (watch events are asynchronous)."""
    rv = api.get_pod("default", name)["metadata"]["resourceVersion"]
    assert api.wait_for(lambda _: any(p["metadata"]["name"] == name and p["metadata"]["resourceVersion"] == rv
                                      for p in daemon.pods.pods()))


def _gone(daemon, api: ApiServerDouble, name: str) -> None:
    assert api.wait_for(lambda _: all(p["metadata"]["name"] != name for p in daemon.pods.pods()))


def _admitted(daemon, api, kubelet, name: str) -> None:
    """The kubelet admits the pod (Allocate through the plugin) and a reconcile round records it."""
    _cached(daemon, api, name)
    kubelet.admit(api.get_pod("default", name))
    daemon.reconciler.run_once()
    _cached(daemon, api, name)


def _lists(api: ApiServerDouble) -> int:
    return sum(1 for r in api.requests("GET", r"/pods$") if "watch" not in r.query)


def test_a_tick_makes_no_list_call_and_a_departed_pod_leaves_no_state(api, kubelet, node):
    daemon, loop, gpu = node
    _pod(api, "chat", gpu, 8, contract.STATE_ASSUMED, contract.FIELD_MANAGER_EXTENDER)
    _admitted(daemon, api, kubelet, "chat")
    api.clear_requests()
    for _ in range(3):
        report = loop.run_once()
        assert report.skipped is None
    assert _lists(api) == 0, "a quota tick read the node's pods back from the API server"
    assert [k.pod for k, _gpu in loop.views()] == ["chat"]
    assert loop.limits()
    api.delete_pod("default", "chat")  # gone from the API; the kubelet still lists its devices a while
    _gone(daemon, api, "chat")
    report = loop.run_once()
    assert report.skipped is None, report.skipped
    assert loop.limits() == {} and loop.views() == {} and loop.phases() == {} and loop.classes() == {}
    tracked = getattr(loop, "tracked", None)
    assert tracked is None or tracked() == set()  # every per-tenant state, in one place
    assert _lists(api) == 0


def test_an_allocated_annotation_vramshare_did_not_write_is_not_believed(api, kubelet, node):
    daemon, loop, gpu = node
    # a user's script marks a pod the kubelet never admitted "allocated", with an assignment of its own
    _pod(api, "forged", gpu, 30, contract.STATE_ALLOCATED, "kubectl")
    # the extender bound this one (its reservation); a user then forged its state to "allocated"
    _pod(api, "bound", gpu, 8, contract.STATE_ASSUMED, contract.FIELD_MANAGER_EXTENDER)

    def forge(pod: dict) -> None:
        pod["metadata"]["annotations"][NAMES.allocation_state] = contract.STATE_ALLOCATED
    api.update(PODS, "default", "bound", forge, manager="kubectl")
    _cached(daemon, api, "forged")
    _cached(daemon, api, "bound")
    report = loop.run_once()
    assert {k.pod for k, _gpu in loop.views()} == set(), "a pod the plugin never reported became a tenant"
    assert report.reserved == {gpu: 8 * 1024}, "the extender's reservation was hidden by a forged state"
