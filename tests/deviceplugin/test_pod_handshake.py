"""Allocate finds its pod through the extender's annotations (DESIGN.md section 3), against the API
server double with the real kubernetes client: one pod, a two-container pod, two pods of the same size
(oldest assume-time first), a bad assignment, an API outage, the published node inventory, and
recovery after a plugin restart from the kubelet's PodResources."""
from __future__ import annotations

import json
import os
from typing import Iterator

import grpc
import pytest

from deviceplugin.inventory_file import load
from deviceplugin.main import DevicePluginDaemon
from deviceplugin.simulated_backend import SimulatedBackend
from vramshare import contract
from vramshare.standins.apiserver import PODS, ApiServerDouble
from vramshare.config import Config
from vramshare.inventory import NodeInventory
from vramshare.kube import api_client_for

from .conftest import MEM, MIXED

NAMES = contract.Names()
NODE = "gpu-1"
H100, A100 = load(MIXED)


@pytest.fixture
def api() -> Iterator[ApiServerDouble]:
    with ApiServerDouble() as double:
        double.create_node({"metadata": {"name": NODE}})
        yield double


@pytest.fixture
def http(api):
    with api_client_for(api.url) as client:
        yield client


def assumed_pod(api: ApiServerDouble, name: str, containers: dict[str, list[tuple[str, int]]],
                assume: int = 100, **ann: str) -> dict:
    """A pod the extender has bound to NODE: assignment, assume-time, allocation-state assumed."""
    annotations = {
        NAMES.assignment: json.dumps({c: [{"uuid": u, "mib": m} for u, m in gpus] for c, gpus in containers.items()}),
        NAMES.assume_time: str(assume),
        NAMES.allocation_state: contract.STATE_ASSUMED,
        **ann,
    }
    if any(len(g) > 1 for g in containers.values()):
        annotations[NAMES.gpu_count] = str(max(len(g) for g in containers.values()))
    return api.create_pod({
        "metadata": {"name": name, "namespace": "default", "annotations": annotations},
        "spec": {"nodeName": NODE, "containers": [
            {"name": c, "image": "vllm", "resources": {"limits": {MEM: str(sum(m for _, m in g) // 1024)}}}
            for c, g in containers.items()]},
        "status": {"phase": "Pending"},
    })


def state_of(api: ApiServerDouble, name: str) -> str | None:
    return api.get_pod("default", name)["metadata"]["annotations"].get(NAMES.allocation_state)


def test_allocate_serves_the_assumed_pod_and_marks_it_allocated(api, http, kubelet, start_plugin, config):
    pod = assumed_pod(api, "p", {"vllm": [(H100.uuid, 4096)]})
    start_plugin(api=http)
    ids = kubelet.preferred(MEM, kubelet.healthy_ids(MEM), 4)
    resp = kubelet.allocate(MEM, ids)
    assert resp.envs["NVIDIA_VISIBLE_DEVICES"] == H100.uuid
    assert resp.envs["VRAMSHARE_MEMORY_LIMIT_MIB"] == "4096"
    assert resp.mounts[0].host_path == os.path.join(config.quota_host_dir, pod["metadata"]["uid"], "vllm")
    assert os.path.exists(os.path.join(resp.mounts[0].host_path, "quota.json"))
    assert state_of(api, "p") == contract.STATE_ALLOCATED


def test_a_two_container_pod_is_allocated_when_both_containers_are(api, http, kubelet, start_plugin, config):
    pod = assumed_pod(api, "two", {"a": [(H100.uuid, 2048)], "b": [(H100.uuid, 2048)]})
    start_plugin(api=http)
    first = kubelet.allocate(MEM, kubelet.healthy_ids(MEM)[:2])
    assert state_of(api, "two") == contract.STATE_ASSUMED
    second = kubelet.allocate(MEM, kubelet.healthy_ids(MEM)[2:4])
    assert state_of(api, "two") == contract.STATE_ALLOCATED
    uid = pod["metadata"]["uid"]
    assert [first.mounts[0].host_path, second.mounts[0].host_path] == [
        os.path.join(config.quota_host_dir, uid, "a"), os.path.join(config.quota_host_dir, uid, "b")]


def test_two_pods_of_the_same_size_are_served_oldest_assume_time_first(api, http, kubelet, start_plugin):
    assumed_pod(api, "newer", {"c": [(H100.uuid, 3072)]}, assume=2_000)
    assumed_pod(api, "older", {"c": [(H100.uuid, 3072)]}, assume=1_000)
    start_plugin(api=http)
    kubelet.allocate(MEM, kubelet.healthy_ids(MEM)[:3])
    assert (state_of(api, "older"), state_of(api, "newer")) == (contract.STATE_ALLOCATED, contract.STATE_ASSUMED)
    kubelet.allocate(MEM, kubelet.healthy_ids(MEM)[3:6])
    assert state_of(api, "newer") == contract.STATE_ALLOCATED


def test_preferred_allocation_follows_the_assignment(api, http, kubelet, short_dir):
    two = SimulatedBackend.from_dict({"gpus": [
        {"model": "NVIDIA H100 80GB HBM3", "memoryMiB": 81559, "numaNode": 0, "uuid": "GPU-aaaa"},
        {"model": "NVIDIA H100 80GB HBM3", "memoryMiB": 81559, "numaNode": 1, "uuid": "GPU-bbbb"}]})
    assumed_pod(api, "p", {"c": [("GPU-bbbb", 8192)]})
    with DevicePluginDaemon(two, Config(quota_host_dir=os.path.join(short_dir, "q")), kubelet.plugin_dir,
                            node_name=NODE, api=http, poll_seconds=0.02):
        kubelet.wait_registered([MEM])
        ids = kubelet.preferred(MEM, kubelet.healthy_ids(MEM), 8)
        assert {i.split("::")[0] for i in ids} == {"GPU-bbbb"}  # best fit alone would take GPU-aaaa
        resp = kubelet.allocate(MEM, ids)
        assert resp.envs["NVIDIA_VISIBLE_DEVICES"] == "GPU-bbbb"


def test_a_bad_assignment_fails_the_pod_with_a_reason(api, http, kubelet, start_plugin):
    assumed_pod(api, "p", {"c": [(H100.uuid, 4096)]})
    api.update(PODS, "default", "p",
               lambda pod: pod["metadata"]["annotations"].update(
                   {NAMES.assignment: json.dumps({"c": [{"uuid": "GPU-elsewhere", "mib": 4096}]})}))
    start_plugin(api=http)
    with pytest.raises(grpc.RpcError) as err:
        kubelet.allocate(MEM, kubelet.healthy_ids(MEM)[:4])
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "GPU-elsewhere is not a shared GPU of this node" in err.value.details()
    assert state_of(api, "p").startswith("failed: assigned GPU GPU-elsewhere")


def test_an_api_outage_fails_allocate_instead_of_guessing(api, http, kubelet, start_plugin):
    assumed_pod(api, "p", {"c": [(H100.uuid, 4096)]})
    start_plugin(api=http)
    api.fail_next("PATCH", r"/pods/p$", code=503)
    with pytest.raises(grpc.RpcError) as err:
        kubelet.allocate(MEM, kubelet.healthy_ids(MEM)[:4])
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "cannot mark pod default/p 'allocated'" in err.value.details()
    assert state_of(api, "p") == contract.STATE_ASSUMED


def test_without_a_pod_cache_an_unreadable_pod_list_fails_allocate(api, http, kubelet, start_plugin):
    daemon = start_plugin(api=http)
    daemon.pods.synced.clear()  # as before the first list: every read goes to the API server
    api.fail_next("GET", r"/pods$", code=503)
    with pytest.raises(grpc.RpcError) as err:
        kubelet.allocate(MEM, kubelet.healthy_ids(MEM)[:4])
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "cannot read this node's pods" in err.value.details()


def test_no_matching_pod_falls_back_to_the_gpu_the_ids_name(api, http, kubelet, start_plugin):
    start_plugin(api=http)
    resp = kubelet.allocate(MEM, kubelet.healthy_ids(MEM)[:2])
    assert resp.envs["NVIDIA_VISIBLE_DEVICES"] == H100.uuid


def test_the_node_inventory_is_published_on_start_and_on_health_changes_only(api, http, kubelet, backend,
                                                                              start_plugin):
    start_plugin(api=http)

    def inventory(d: ApiServerDouble) -> NodeInventory | None:
        text = (d.get_node(NODE)["metadata"].get("annotations") or {}).get(NAMES.inventory)
        return NodeInventory.from_json(text) if text else None

    assert api.wait_for(lambda d: inventory(d) is not None)
    published = inventory(api)
    assert [(g.uuid, g.units, g.numa_node, g.healthy) for g in published.gpus] == [
        (H100.uuid, 79, 0, True), (A100.uuid, 0, 1, True)]
    assert [m.profile for m in published.gpus[1].mig] == ["3g.40gb", "2g.20gb", "1g.10gb"]
    backend.inject_xid(H100.uuid, 79)
    assert api.wait_for(lambda d: not inventory(d).gpus[0].healthy)
    backend.inject_xid(H100.uuid, 48)  # already unhealthy: no change, no patch
    backend.recover(H100.uuid)
    assert api.wait_for(lambda d: inventory(d).gpus[0].healthy)
    assert api.count("PATCH", rf"/nodes/{NODE}$") == 3


def test_after_a_plugin_restart_served_containers_are_recovered_from_pod_resources(api, http, kubelet,
                                                                                   start_plugin):
    assumed_pod(api, "two", {"a": [(H100.uuid, 2048)], "b": [(H100.uuid, 2048)]})
    first = start_plugin(api=http)
    kubelet.allocate(MEM, kubelet.healthy_ids(MEM)[:2], pod=("default", "two", "a"))
    first.close()
    kubelet.wait_for(lambda: not kubelet.plugin(MEM).connected, what="the old stream to end")
    # a new process knows nothing but what the kubelet and the API server say
    start_plugin(api=http, gpus=SimulatedBackend.from_file(MIXED))
    resp = kubelet.allocate(MEM, kubelet.healthy_ids(MEM)[2:4], pod=("default", "two", "b"))
    assert resp.mounts[0].host_path.endswith("/b")  # not "a" a second time
    assert state_of(api, "two") == contract.STATE_ALLOCATED
