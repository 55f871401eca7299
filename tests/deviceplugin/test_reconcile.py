"""The reconcile core (pure): PodResources holdings + this node's pods -> patches with each pod's actual
GPUs, quota-directory owners, and the pods that must wait. No I/O."""
from __future__ import annotations

import json

from deviceplugin.kubelet import reconcile
from deviceplugin.devices import PluginDevice
from deviceplugin.quota_files import allocation_key
from vramshare import contract

NAMES = contract.Names()
MEM, WHOLE, MIG = NAMES.gpu_memory, NAMES.gpu, NAMES.mig("1g.10gb")
DEVICES = {d.id: d for d in
           [PluginDevice(f"GPU-a::{i}", "GPU-a", 0, True, 1024) for i in range(8)]
           + [PluginDevice(f"GPU-b::{i}", "GPU-b", 1, True, 1024) for i in range(8)]
           + [PluginDevice("GPU-x", "GPU-x", 0, True, 81559), PluginDevice("MIG-1", "GPU-m", 1, True, 9984)]}


def pod(name: str, containers: dict[str, dict[str, int]], state: str | None = "assumed",
        assignment: dict | None = None, node: str = "n1", init: dict[str, dict[str, int]] | None = None,
        writer: str = contract.FIELD_MANAGER_DEVICE_PLUGIN) -> dict:
    ann = {}
    if state:
        ann[NAMES.allocation_state] = state
    if assignment is not None:
        ann[NAMES.assignment] = json.dumps(assignment)
    spec = {"nodeName": node, "containers": [{"name": c, "resources": {"limits": {r: str(n) for r, n in lim.items()}}}
                                             for c, lim in containers.items()]}
    if init:
        spec["initContainers"] = [{"name": c, "resources": {"limits": {r: str(n) for r, n in lim.items()}}}
                                  for c, lim in init.items()]
    managed = [{"manager": writer, "operation": "Apply", "apiVersion": "v1", "fieldsType": "FieldsV1",
                "fieldsV1": {"f:metadata": {"f:annotations": {f"f:{k}": {} for k in ann}}}}]
    return {"metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}", "resourceVersion": "9",
                         "annotations": ann, "managedFields": managed}, "spec": spec}


def held(name: str, container: str, resource: str, *ids: str) -> reconcile.Held:
    return reconcile.Held("ns", name, container, resource, ids)


def plan(hs: list[reconcile.Held], pods: list[dict]) -> reconcile.Plan:
    return reconcile.plan(hs, pods, DEVICES, NAMES, "n1", 1024)


def test_the_actual_gpus_replace_the_plan_and_the_state_becomes_allocated():
    out = plan([held("p", "c", MEM, "GPU-b::0", "GPU-b::1")],
               [pod("p", {"c": {MEM: 2}}, assignment={"c": [{"uuid": "GPU-a", "mib": 2048}]})])
    [patch] = out.patches
    assert (patch.pod.key, patch.pod.uid, patch.pod.resource_version, patch.state) == \
        ("ns/p", "uid-p", "9", contract.STATE_ALLOCATED)
    assert json.loads(patch.assignment) == {"c": [{"uuid": "GPU-b", "mib": 2048}]}


def test_a_pod_already_saying_what_it_holds_is_not_patched():
    p = pod("p", {"c": {MEM: 3}}, state="allocated",
            assignment={"c": [{"uuid": "GPU-b", "mib": 1024}, {"uuid": "GPU-a", "mib": 2048}]})
    out = plan([held("p", "c", MEM, "GPU-a::0", "GPU-a::1", "GPU-b::5")], [p])
    assert out.patches == [] and out.in_sync == 1


def test_a_report_someone_else_wrote_is_written_again_even_when_equal():
    """Issue 18: the extender believes ``allocated`` only from the device plugin's field manager. A user
    who writes the very report the plugin would write (same GPUs, ``allocated``) would leave it
    unbelieved, the pod uncounted and its GPU over-committed; the plugin applies it under its own name."""
    p = pod("p", {"c": {MEM: 3}}, state="allocated", writer="kubectl-annotate",
            assignment={"c": [{"uuid": "GPU-b", "mib": 1024}, {"uuid": "GPU-a", "mib": 2048}]})
    out = plan([held("p", "c", MEM, "GPU-a::0", "GPU-a::1", "GPU-b::5")], [p])
    [patch] = out.patches
    assert patch.state == contract.STATE_ALLOCATED and out.in_sync == 0


def test_mig_whole_gpus_and_units_on_two_gpus_in_one_pod():
    p = pod("p", {"c": {MEM: 4, WHOLE: 1}, "m": {MIG: 1}})
    out = plan([held("p", "c", MEM, "GPU-a::0", "GPU-a::1", "GPU-b::0", "GPU-b::1"), held("p", "c", WHOLE, "GPU-x"),
                held("p", "m", MIG, "MIG-1")], [p])
    assert json.loads(out.patches[0].assignment) == {
        "c": [{"uuid": "GPU-a", "mib": 2048}, {"uuid": "GPU-b", "mib": 2048}, {"uuid": "GPU-x", "mib": 81559}],
        "m": [{"uuid": "MIG-1", "mib": 9984}]}


def test_a_pod_that_bypassed_the_scheduler_gets_an_assignment():
    out = plan([held("rogue", "c", MEM, "GPU-a::3")], [pod("rogue", {"c": {MEM: 1}}, state=None)])
    assert json.loads(out.patches[0].assignment) == {"c": [{"uuid": "GPU-a", "mib": 1024}]}


def test_devices_reused_from_an_init_container_count_once_for_the_app_container():
    p = pod("p", {"c": {MEM: 3}}, init={"init": {MEM: 2}})
    out = plan([held("p", "init", MEM, "GPU-a::0", "GPU-a::1"),
                held("p", "c", MEM, "GPU-a::0", "GPU-a::1", "GPU-a::2")], [p])
    assert json.loads(out.patches[0].assignment) == {"c": [{"uuid": "GPU-a", "mib": 3072}]}
    assert out.unlisted == {}


def test_init_devices_nobody_reuses_are_reported_not_guessed():
    p = pod("p", {"c": {WHOLE: 1}}, init={"init": {MEM: 2}})
    out = plan([held("p", "c", WHOLE, "GPU-x")], [p])
    assert out.unlisted == {"ns/p": {MEM: 2}}
    assert json.loads(out.patches[0].assignment) == {"c": [{"uuid": "GPU-x", "mib": 81559}]}


def test_a_pod_mid_admission_waits():
    p = pod("p", {"a": {MEM: 2}, "b": {MEM: 2}})
    out = plan([held("p", "a", MEM, "GPU-a::0", "GPU-a::1")], [p])
    assert out.patches == [] and "container b holds 0 of 2" in out.waiting["ns/p"]


def test_a_pod_the_cache_has_not_seen_waits_and_one_on_another_node_is_not_ours():
    out = plan([held("p", "c", MEM, "GPU-a::0")], [pod("p", {"c": {MEM: 1}}, node="n2")])
    assert out.patches == [] and out.waiting == {"ns/p": reconcile.NOT_CACHED}


def test_an_unknown_mig_id_waits_but_a_unit_of_a_vanished_gpu_still_counts():
    out = plan([held("p", "c", MIG, "MIG-gone")], [pod("p", {"c": {MIG: 1}})])
    assert out.patches == [] and "MIG-gone" in out.waiting["ns/p"]
    out = plan([held("q", "c", MEM, "GPU-gone::4")], [pod("q", {"c": {MEM: 1}})])
    assert json.loads(out.patches[0].assignment) == {"c": [{"uuid": "GPU-gone", "mib": 1024}]}


def test_quota_directories_are_owned_by_the_container_holding_the_ids():
    out = plan([held("p", "c", MEM, "GPU-a::1", "GPU-a::0")], [pod("p", {"c": {MEM: 2}})])
    key = allocation_key(["GPU-a::0", "GPU-a::1"])
    assert out.owners == {key: reconcile.Owner("uid-p", "ns", "p", "c")}
    assert out.links == {("uid-p", "c"): key}


def test_other_resources_and_empty_holdings_are_ignored():
    out = plan([reconcile.Held("ns", "p", "c", "nvidia.com/gpu", ("GPU-0",)), held("p", "c", MEM)], [])
    assert out.patches == [] and out.waiting == {} and out.owners == {}


def test_upstream_entries_one_per_device_and_numa_node_are_grouped_per_container_and_resource():
    """container_manager.go containerDevicesFromResourceDeviceInstances lists each ID on its own (twice for a
    device on two NUMA nodes): the key and the assignment are those of the whole set, counted once."""
    ids = [f"GPU-a::{i}" for i in range(5)]
    hs = [held("p", "c", MEM, d) for d in ids] + [held("p", "c", MEM, "GPU-a::0")]  # GPU-a::0 on two nodes
    out = plan(hs, [pod("p", {"c": {MEM: 5}})])
    key = allocation_key(ids)
    assert out.links == {("uid-p", "c"): key} and out.held_keys == {key}
    assert json.loads(out.patches[0].assignment) == {"c": [{"uuid": "GPU-a", "mib": 5120}]}


def test_a_name_listed_twice_is_never_merged_into_one_pod():
    """server_v1.go List has no UID: two entries of one name (the old pod terminating) stay apart."""
    hs = [reconcile.Held("ns", "p", "c", MEM, ("GPU-a::0",), 0), reconcile.Held("ns", "p", "c", MEM, ("GPU-b::0",), 1)]
    out = plan(hs, [pod("p", {"c": {MEM: 1}})])
    assert out.patches == [] and out.links == {} and "2 times" in out.waiting["ns/p"]
    assert out.held_keys == {allocation_key(["GPU-a::0"]), allocation_key(["GPU-b::0"])}  # neither is pruned
