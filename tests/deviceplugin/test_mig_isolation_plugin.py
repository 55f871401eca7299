"""Issue 24, ``isolation: mig`` on the device-plugin path: a gpu-memory ask served as a partition made for it.

Through the real daemon over real gRPC (the stand-in kubelet) with the API server double (the real
kubernetes client in the pod cache and the reconciler). The extender planned the pod a placement of the
smallest fitting profile (written by its field manager, as bind does); the kubelet asks ``gpu-memory``
units, since it allocates by resource name. On main a dynamic-MIG GPU offered no gpu-memory unit at all,
so such a pod could never be admitted; and nothing stopped units of a MIG GPU from going to a plain pod.
"""
from __future__ import annotations

import json
import os

import grpc
import pytest

from deviceplugin.quota_files import MIG_PLAN_FILE, allocation_key
from deviceplugin.simulated_backend import SimulatedBackend
from standins.apiserver import ApiServerDouble
from tests.deviceplugin.mig_node import A100, H100, NODE, pid, with_dynamic_mig
from vramshare import contract
from vramshare.config import Config

NAMES = contract.Names()
MEM = NAMES.gpu_memory


@pytest.fixture
def backend() -> SimulatedBackend:
    return SimulatedBackend.from_dict(NODE)


@pytest.fixture
def dynamic(config: Config) -> Config:
    return with_dynamic_mig(config)


def pod(api: ApiServerDouble, name: str, units: int, plan: list[tuple[str, int]] | None,
        isolation: str | None = "mig") -> dict:
    """A pod bound to the node, ``units`` of gpu-memory; with ``plan`` the extender's assumed plan."""
    ann: dict[str, str] = {}
    if isolation is not None:
        ann[NAMES.isolation] = isolation
    if plan is not None:
        ann.update({NAMES.assignment: json.dumps({"c": [{"uuid": u, "mib": m} for u, m in plan]}),
                    NAMES.assume_time: "100", NAMES.allocation_state: contract.STATE_ASSUMED})
    return api.create_pod({
        "metadata": {"name": name, "namespace": "default", "annotations": ann},
        "spec": {"nodeName": "gpu-1", "containers": [
            {"name": "c", "image": "vllm", "resources": {"limits": {MEM: str(units)}}}]},
        "status": {"phase": "Pending"}}, manager=contract.FIELD_MANAGER_EXTENDER if plan else None)


def synced(daemon, api: ApiServerDouble, name: str) -> None:
    rv = api.get_pod("default", name)["metadata"]["resourceVersion"]
    assert api.wait_for(lambda _: any(p["metadata"]["name"] == name and p["metadata"]["resourceVersion"] == rv
                                      for p in daemon.pods.pods()))


def units_of(kubelet, gpu: str) -> list[str]:
    return [i for i in kubelet.healthy_ids(MEM) if i.startswith(gpu + "::")]


def test_without_a_pod_cache_a_dynamic_mig_gpu_offers_no_memory_units(start_plugin, kubelet, dynamic):
    daemon = start_plugin(dynamic)  # no API: Allocate could never find a plan, so nothing is offered
    assert units_of(kubelet, A100) == [] and len(units_of(kubelet, H100)) > 0
    assert daemon.state.snapshot.inventory.gpus[1].dynamic_mig.isolation is False  # and the extender is told


def test_an_isolated_memory_ask_gets_the_planned_partition_recorded_and_kept(
        api, http, kubelet, start_plugin, dynamic, backend, config):
    daemon = start_plugin(dynamic, api=http)
    assert len(units_of(kubelet, A100)) == 80  # the largest profile, 7g.80gb, in 1 GiB units
    p = pod(api, "iso", 15, [(pid("1g.20gb", 4), 20480)])
    synced(daemon, api, "iso")
    ids = kubelet.preferred(MEM, kubelet.healthy_ids(MEM), 15)
    assert {i.split("::")[0] for i in ids} == {A100}  # steered to the planned GPU
    resp = kubelet.allocate(MEM, ids, pod=("default", "iso", "c"))
    made = resp.envs[contract.ENV_VISIBLE_DEVICES]
    assert made.startswith("MIG-") and resp.envs[contract.ENV_MEMORY_LIMIT_MIB] == "20480"
    assert {(x.profile, x.start) for x in backend.mig_nvml.layout(A100)} == {("3g.40gb", 0), ("1g.20gb", 4)}
    alloc_dir = os.path.join(config.quota_host_dir, "_alloc", allocation_key(ids))
    with open(os.path.join(alloc_dir, MIG_PLAN_FILE), encoding="utf-8") as fh:
        assert fh.read() == f"{pid('1g.20gb', 4)} 20480"
    # idempotent: the kubelet retrying the same Allocate adopts the instance
    assert kubelet.allocate(MEM, ids).envs[contract.ENV_VISIBLE_DEVICES] == made
    assert len(backend.mig_nvml.layout(A100)) == 2
    # the reconciler records the placement (what the extender books), not shared memory of a MIG GPU
    assert daemon.reconciler.run_once().patched == ["default/iso"]
    ann = api.get_pod("default", "iso")["metadata"]["annotations"]
    assert ann[NAMES.allocation_state] == contract.STATE_ALLOCATED
    assert json.loads(ann[NAMES.assignment]) == {"c": [{"uuid": pid("1g.20gb", 4), "mib": 20480}]}
    # the reaper keeps it: the units hold the partition (their allocation dir says which)
    daemon.mig.fresh_seconds = daemon.mig.dynamic.grace_seconds = 0.0
    daemon.reconciler.run_once()
    assert {(x.profile, x.start) for x in backend.mig_nvml.layout(A100)} == {("1g.20gb", 4)}  # admin's 3g reaped
    kubelet.forget_pod("default", "iso")
    daemon.reconciler.run_once()
    assert backend.mig_nvml.layout(A100) == []
    assert p["metadata"]["uid"]


def test_memory_units_of_a_mig_gpu_never_go_to_a_pod_without_the_annotation(
        api, http, kubelet, start_plugin, dynamic, backend):
    daemon = start_plugin(dynamic, api=http)
    pod(api, "plain", 4, None, isolation=None)  # bypassed the scheduler: no plan, no annotation
    pod(api, "unplanned", 4, None)  # annotated, but no plan
    pod(api, "elsewhere", 6, [(H100, 6144)], isolation=None)  # a plain pod planned on the shared GPU
    synced(daemon, api, "elsewhere")
    # best fit never offers MIG-GPU units to anyone unplanned, even when they would fit tighter
    assert {i.split("::")[0] for i in kubelet.preferred(MEM, kubelet.healthy_ids(MEM), 4)} == {H100}
    for size in (4, 6):
        with pytest.raises(grpc.RpcError) as err:
            kubelet.allocate(MEM, units_of(kubelet, A100)[:size])
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "isolation: mig" in err.value.details() and A100 in err.value.details()
    assert [(x.profile, x.start) for x in backend.mig_nvml.layout(A100)] == [("3g.40gb", 0)]  # nothing made
    # units of both GPUs together: one partition cannot be combined with shared memory
    with pytest.raises(grpc.RpcError) as err:
        kubelet.allocate(MEM, units_of(kubelet, A100)[:2] + units_of(kubelet, H100)[:2])
    assert "cannot be combined" in err.value.details()


def test_two_assumed_pods_of_one_size_with_different_partitions_are_not_guessed_between(
        api, http, kubelet, start_plugin, dynamic, backend):
    daemon = start_plugin(dynamic, api=http)
    pod(api, "one", 8, [(pid("1g.10gb", 4), 10240)])
    pod(api, "two", 8, [(pid("1g.10gb", 5), 10240)])
    synced(daemon, api, "two")
    with pytest.raises(grpc.RpcError) as err:
        kubelet.allocate(MEM, units_of(kubelet, A100)[:8])
    assert "different partitions" in err.value.details()
    assert len(backend.mig_nvml.layout(A100)) == 1


def test_after_a_plugin_restart_the_partition_is_still_recorded_and_kept(
        api, http, kubelet, start_plugin, dynamic, backend):
    """Nothing of the tie lives only in memory: the allocation directory says which partition the units got."""
    first = start_plugin(dynamic, api=http)
    pod(api, "iso", 8, [(pid("1g.10gb", 5), 10240)])
    synced(first, api, "iso")
    ids = kubelet.preferred(MEM, kubelet.healthy_ids(MEM), 8)
    made = kubelet.allocate(MEM, ids, pod=("default", "iso", "c")).envs[contract.ENV_VISIBLE_DEVICES]
    first.close()
    second = start_plugin(dynamic, api=http, gpus=backend.restarted())
    synced(second, api, "iso")
    second.mig.fresh_seconds = second.mig.dynamic.grace_seconds = 0.0
    second.reconciler.run_once()  # (a restart reconciles before Register, so it may be patched already)
    ann = api.get_pod("default", "iso")["metadata"]["annotations"]
    assert ann[NAMES.allocation_state] == contract.STATE_ALLOCATED
    assert json.loads(ann[NAMES.assignment]) == {"c": [{"uuid": pid("1g.10gb", 5), "mib": 10240}]}
    assert [(x.profile, x.start) for x in backend.mig_nvml.layout(A100)] == [("1g.10gb", 5)]  # 3g@0 reaped
    assert [m.uuid for m in second.state.snapshot.inventory.gpus[1].mig] == [made]


def test_the_partition_of_the_memory_ask_is_told_from_a_mig_device_the_container_also_asks(
        api, http, kubelet, start_plugin, dynamic, backend):
    """A container asking 8 units with isolation and a mig-2g.20gb device has two placements in its plan:
    the memory units get the smallest profile holding 8 GiB (1g.10gb), never the 2g.20gb."""
    daemon = start_plugin(dynamic, api=http)
    p = pod(api, "both", 8, [(pid("2g.20gb", 4), 20480), (pid("1g.10gb", 6), 10240)])
    assert p["metadata"]["annotations"][NAMES.isolation] == "mig"
    synced(daemon, api, "both")
    resp = kubelet.allocate(MEM, units_of(kubelet, A100)[:8])
    assert resp.envs[contract.ENV_MEMORY_LIMIT_MIB] == "10240"
    assert [(x.profile, x.start) for x in backend.mig_nvml.layout(A100)] == [("3g.40gb", 0), ("1g.10gb", 6)]


def test_with_podresources_down_an_isolated_allocate_is_tied_to_its_plan():
    """Issue 17's rule holds for isolation: mig too: the units a kubelet asks are the pod's plan."""
    from deviceplugin.kubelet import steering
    meta = {"name": "iso", "namespace": "default", "uid": "u", "annotations": {
        NAMES.isolation: "mig", NAMES.allocation_state: contract.STATE_ASSUMED, NAMES.assume_time: "1",
        NAMES.assignment: json.dumps({"c": [{"uuid": pid("1g.10gb", 6), "mib": 10240}]})},
        "managedFields": [{"manager": contract.FIELD_MANAGER_EXTENDER, "operation": "Update", "apiVersion": "v1",
                           "fieldsType": "FieldsV1", "fieldsV1": {"f:metadata": {"f:annotations": {
                               f"f:{NAMES.assignment}": {}}}}}]}
    iso = {"metadata": meta, "status": {"phase": "Pending"}, "spec": {"nodeName": "gpu-1", "containers": [
        {"name": "c", "resources": {"limits": {MEM: "8"}}}]}}
    assert steering.tie([iso], NAMES, "gpu-1", MEM, {A100: 8}, 1024) is None
    assert "is not these devices" in steering.tie([iso], NAMES, "gpu-1", MEM, {H100: 8}, 1024)
    assert steering.steer([iso], NAMES, "gpu-1", MEM, 8, 1024, {A100: 80, H100: 79}).targets == {A100: 8}
    assert steering.isolation_plan([iso], NAMES, "gpu-1", A100, 8, "1g.10gb") == (pid("1g.10gb", 6), "")
    assert steering.isolation_plan([iso], NAMES, "gpu-1", A100, 8, "2g.20gb")[0] is None


def test_an_isolated_pod_misrouted_to_shared_memory_is_refused_not_run_unisolated(
        api, http, kubelet, start_plugin, dynamic, backend):
    daemon = start_plugin(dynamic, api=http)
    pod(api, "iso", 8, [(pid("1g.10gb", 6), 10240)])
    synced(daemon, api, "iso")
    with pytest.raises(grpc.RpcError) as err:
        kubelet.allocate(MEM, units_of(kubelet, H100)[:8])  # a kubelet that ignored the preferred answer
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "default/iso, annotated vramshare.io/isolation: mig" in err.value.details()
    assert kubelet.allocate(MEM, units_of(kubelet, H100)[:4]).envs[contract.ENV_VISIBLE_DEVICES] == H100  # other sizes


def test_the_inventory_says_whether_isolation_is_served(api, http, start_plugin, dynamic):
    from vramshare.inventory import NodeInventory
    served = NodeInventory.from_json(start_plugin(dynamic, api=http).state.snapshot.inventory.to_json())
    assert served.gpus[1].dynamic_mig.isolation is True and served.gpus[0].dynamic_mig is None


def test_a_plain_grant_of_the_same_ids_drops_an_earlier_partition_record(start_plugin, kubelet, config):
    start_plugin()
    ids = units_of(kubelet, H100)[:4]
    stale = os.path.join(config.quota_host_dir, "_alloc", allocation_key(ids))
    os.makedirs(stale)
    with open(os.path.join(stale, MIG_PLAN_FILE), "w", encoding="utf-8") as fh:
        fh.write(f"{pid('1g.10gb', 6)} 10240")
    assert kubelet.allocate(MEM, ids).envs[contract.ENV_VISIBLE_DEVICES] == H100
    assert not os.path.exists(os.path.join(stale, MIG_PLAN_FILE))  # never read back as a partition


def test_an_isolated_ask_the_pod_watch_has_not_shown_yet_reads_the_pods_once_more(
        api, http, kubelet, start_plugin, dynamic, backend):
    """The kubelet admits a pod as soon as its own watch shows it bound; ours can lag (a busy API server, a
    watch that broke and waits its backoff). Refusing then fails the pod for good (the kubelet never
    retries an admission): the CI run under load met exactly that in test_isolation_e2e. Here the pod
    cache is the real one whose watch has not delivered the pod yet (not started): the Allocate reads the
    node's pods once more and serves the plan; without the pod anywhere it still refuses with the reason."""
    from deviceplugin.kubelet.allocator import Allocator, Refusal
    from deviceplugin.metrics import PluginMetrics
    from deviceplugin.pod_cache import NodePodCache
    from deviceplugin.quota_files import QuotaFiles
    daemon = start_plugin(dynamic, api=http)
    behind = NodePodCache(http, "gpu-1", NAMES)  # its watch never ran: what a lagging one holds
    allocator = Allocator(daemon.state, QuotaFiles(dynamic.quota_host_dir, dynamic.quota), PluginMetrics(), "gpu-1",
                          behind, make_mig=daemon.allocator.make_mig)
    ids = sorted(units_of(kubelet, A100))[:15]
    with pytest.raises(Refusal, match="no pod assumed on this node with vramshare.io/isolation: mig plans"):
        allocator.allocate(MEM, ids)
    assert behind.refreshes == 1
    pod(api, "late", 15, [(pid("1g.20gb", 4), 20480)])
    spec = allocator.allocate(MEM, ids)
    assert spec.envs[contract.ENV_VISIBLE_DEVICES].startswith("MIG-") and behind.refreshes == 2
    assert ("1g.20gb", 4) in {(x.profile, x.start) for x in backend.mig_nvml.layout(A100)}
