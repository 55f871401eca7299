"""Steering GetPreferredAllocation by the extender's plan (pure): the assumed pods of this size signature on
this node steer when they are one pod or all share one plan; pods with different plans, or a plan that no
longer fits, mean best fit (no guess).
And reading/writing the assignment annotation."""
from __future__ import annotations

import json

import pytest

from deviceplugin import assignment as handshake
from deviceplugin.kubelet import steering
from vramshare import contract

NAMES = contract.Names()
MEM = NAMES.gpu_memory
FREE = {"GPU-a": 80, "GPU-b": 80, "MIG-1": 1, "MIG-2": 1}


def pod(name: str, containers: dict[str, int], gpus: tuple[str, ...] = ("GPU-a",), node: str = "gpu-1",
        state: str | None = "assumed", phase: str = "Pending", resource: str = MEM, **meta: object) -> dict:
    ann = {NAMES.assume_time: "100"}
    if state is not None:
        ann[NAMES.allocation_state] = state
    per = {c: [{"uuid": g, "mib": n * 1024 // len(gpus) if resource == MEM else 10240} for g in gpus]
           for c, n in containers.items()}
    ann[NAMES.assignment] = json.dumps(per)
    if len(gpus) > 1 and resource == MEM:
        ann[NAMES.gpu_count] = str(len(gpus))
    managed = [{"manager": contract.FIELD_MANAGER_EXTENDER, "operation": "Update", "apiVersion": "v1",
                "fieldsType": "FieldsV1", "fieldsV1": {"f:metadata": {"f:annotations": {f"f:{k}": {} for k in ann}}}}]
    return {
        "metadata": {"name": name, "namespace": "default", "uid": f"uid-{name}", "annotations": ann,
                     "resourceVersion": "7", "managedFields": managed, **meta},
        "spec": {"nodeName": node, "containers": [
            {"name": c, "resources": {"limits": {resource: str(n)}}} for c, n in containers.items()]},
        "status": {"phase": phase},
    }


def steer(pods: list[dict], size: int, resource: str = MEM, free: dict = FREE) -> steering.Steer:
    return steering.steer(pods, NAMES, "gpu-1", resource, size, 1024, free)


def test_the_single_assumed_pod_of_this_size_steers_to_its_gpu():
    s = steer([pod("p", {"c": 4}, gpus=("GPU-b",)), pod("other", {"c": 8})], 4)
    assert (s.targets, s.pod) == ({"GPU-b": 4}, "default/p")


def test_a_gpu_count_pod_steers_to_every_planned_gpu():
    assert steer([pod("tp2", {"c": 22}, gpus=("GPU-a", "GPU-b"))], 22).targets == {"GPU-a": 11, "GPU-b": 11}


def test_two_assumed_pods_of_one_size_with_different_plans_are_not_guessed_between():
    s = steer([pod("one", {"c": 22}, gpus=("GPU-a", "GPU-b")), pod("two", {"c": 22}, gpus=("GPU-b",))], 22)
    assert s.targets is None
    assert "2 assumed pods of this size with different plans: default/one, default/two" in s.reason
    s = steer([pod("one", {"c": 4}, gpus=("GPU-a",)), pod("two", {"c": 4}, gpus=("GPU-b",))], 4)
    assert s.targets is None and "different plans" in s.reason


def test_assumed_pods_of_one_size_that_share_the_plan_steer_to_it():
    """The narrower hold: the extender assumes same-size pods together only on the same GPUs, so
    whichever of them the kubelet admits, the answer is the same GPU set."""
    same = [pod(n, {"c": 22}, gpus=("GPU-a", "GPU-b")) for n in ("one", "two", "three")]
    s = steer(same, 22)
    assert s.targets == {"GPU-a": 11, "GPU-b": 11} and s.pod == "default/one, default/three, default/two"
    assert steer([pod(n, {"c": 4}, gpus=("GPU-b",)) for n in ("x", "y")], 4).targets == {"GPU-b": 4}


def test_a_shared_plan_still_respects_the_available_devices():
    same = [pod(n, {"c": 4}, gpus=("GPU-b",)) for n in ("x", "y")]
    s = steer(same, 4, free={"GPU-a": 80, "GPU-b": 3})
    assert s.targets is None and "no longer fits" in s.reason
    # and the caller still takes must_include first, then the shared plan's GPU
    from deviceplugin import allocation
    gpu_of = {f"GPU-{g}::{i}": f"GPU-{g}" for g in "ab" for i in range(8)}
    ids = allocation.preferred(sorted(gpu_of), ["GPU-a::0"], 4, gpu_of, steer(same, 4).targets)
    assert ids[0] == "GPU-a::0" and [gpu_of[i] for i in ids[1:]] == ["GPU-b"] * 3


def test_same_gpus_with_other_devices_per_gpu_is_a_different_plan():
    one = pod("one", {"c": 8}, gpus=("GPU-a", "GPU-b"))
    two = pod("two", {"c": 8}, gpus=("GPU-a", "GPU-b"))
    two["metadata"]["annotations"][NAMES.assignment] = json.dumps(
        {"c": [{"uuid": "GPU-a", "mib": 6144}, {"uuid": "GPU-b", "mib": 2048}]})
    assert steer([one, two], 8).targets is None


def test_one_pod_whose_containers_of_a_size_differ_still_makes_several_pods_ambiguous():
    p = pod("two", {"a": 4, "b": 4})
    p["metadata"]["annotations"][NAMES.assignment] = json.dumps(
        {"a": [{"uuid": "GPU-a", "mib": 4096}], "b": [{"uuid": "GPU-b", "mib": 4096}]})
    assert steer([p, pod("q", {"c": 4}, gpus=("GPU-a",))], 4).targets is None


def test_whole_gpu_and_mig_plans_of_two_pods_always_differ():
    m = [pod(n, {"c": 1}, gpus=(g,), resource="vramshare.io/mig-1g.10gb")
         for n, g in (("m1", "MIG-1"), ("m2", "MIG-2"))]
    assert steer(m, 1, resource="vramshare.io/mig-1g.10gb").targets is None


def test_init_containers_steer_too():
    p = pod("init", {"c": 4})
    p["spec"]["initContainers"] = [{"name": "i", "resources": {"limits": {MEM: "2"}}}]
    p["metadata"]["annotations"][NAMES.assignment] = json.dumps(
        {"c": [{"uuid": "GPU-a", "mib": 4096}], "i": [{"uuid": "GPU-a", "mib": 2048}]})
    assert steer([p], 2).targets == {"GPU-a": 2}


@pytest.mark.parametrize("other", [
    pod("p", {"c": 4}, node="gpu-2"),
    pod("p", {"c": 4}, state="allocated"),
    pod("p", {"c": 4}, state=None),
    pod("p", {"c": 4}, phase="Running"),
    pod("p", {"c": 4}, deletionTimestamp="2026-01-01T00:00:00Z"),
    pod("p", {"c": 5}),
    pod("p", {"c": 4}, resource="vramshare.io/gpu"),
], ids=["other-node", "allocated", "no-state", "running", "deleting", "other-size", "other-resource"])
def test_pods_that_do_not_steer(other):
    assert steer([other], 4).targets is None


def test_an_allocated_pod_does_not_make_an_assumed_one_ambiguous():
    assert steer([pod("done", {"c": 4}, state="allocated"), pod("p", {"c": 4}, gpus=("GPU-b",))], 4).targets == \
        {"GPU-b": 4}


def test_a_plan_that_no_longer_fits_the_available_devices_falls_back_to_best_fit():
    s = steer([pod("p", {"c": 4}, gpus=("GPU-b",))], 4, free={"GPU-a": 80, "GPU-b": 3})
    assert s.targets is None and "no longer fits" in s.reason


def test_within_one_pod_the_first_container_whose_plan_still_fits_is_the_one():
    p = pod("two", {"a": 4, "b": 4})
    ann = p["metadata"]["annotations"]
    ann[NAMES.assignment] = json.dumps({"a": [{"uuid": "GPU-a", "mib": 4096}], "b": [{"uuid": "GPU-b", "mib": 4096}]})
    assert steer([p], 4).targets == {"GPU-a": 4}
    assert steer([p], 4, free={"GPU-a": 2, "GPU-b": 80}).targets == {"GPU-b": 4}


def test_mig_plans_name_the_instance():
    p = pod("m", {"c": 1}, gpus=("MIG-2",), resource="vramshare.io/mig-1g.10gb")
    assert steer([p], 1, resource="vramshare.io/mig-1g.10gb").targets == {"MIG-2": 1}
    assert steer([p], 1, resource="vramshare.io/mig-2g.20gb").targets is None


def test_parse_and_encode_assignment_round_trip():
    text = json.dumps({"c": [{"uuid": "GPU-a", "mib": 4096}, {"uuid": "GPU-b", "mib": 4096}]})
    gpus = handshake.parse_assignment(text, "c")
    assert gpus == (handshake.AssignedGpu("GPU-a", 4096), handshake.AssignedGpu("GPU-b", 4096))
    assert handshake.parse_all(handshake.encode_assignment({"c": gpus})) == {"c": gpus}
    assert handshake.same_assignment({"c": gpus}, {"c": gpus[::-1]})


@pytest.mark.parametrize("text, message", [
    (None, "no assignment annotation"),
    ("{", "not JSON"),
    (json.dumps({"other": [{"uuid": "GPU-a", "mib": 1}]}), "no GPUs for container 'c'"),
    (json.dumps({"c": []}), "no GPUs for container 'c'"),
    (json.dumps({"c": [{"uuid": "GPU-a"}]}), "want"),
    (json.dumps({"c": [{"uuid": "GPU-a", "mib": True}]}), "want"),
    (json.dumps({"c": [{"uuid": "GPU-a", "mib": 1}, {"uuid": "GPU-a", "mib": 1}]}), "names a GPU twice"),
], ids=["missing", "not-json", "no-container", "empty-container", "no-mib", "bool-mib", "duplicate"])
def test_bad_assignments_say_what_is_wrong(text, message):
    with pytest.raises(handshake.AssignmentError, match=message):
        handshake.parse_assignment(text, "c")


def test_a_plan_someone_else_wrote_steers_nothing():
    """Issue 18: a user's forged ``assumed`` plan on their own pod must not pull another pod's devices."""
    forged = pod("mallory", {"c": 4}, gpus=("GPU-b",))
    forged["metadata"]["managedFields"][0]["manager"] = "kubectl-annotate"
    hint = steering.steer([forged], NAMES, "gpu-1", MEM, 4, 1024, FREE)
    assert hint.targets is None
