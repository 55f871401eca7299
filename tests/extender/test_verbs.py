"""filter and prioritize on literal clusters: what passes, what fails, and which failures are for good."""
from __future__ import annotations

import pytest

from extender import accounting, verbs, wire
from vramshare.config import Config, Policy
from tests.extender import builders as b


def cluster(*nodes: dict) -> accounting.Accounting:
    acct = accounting.Accounting(Config(), clock=lambda: 1_000_000_000_000)
    for node in nodes:
        acct.apply_node("ADDED", node)
    return acct


def run_filter(acct: accounting.Accounting, pod: dict, names: list[str]) -> wire.FilterResult:
    return verbs.filter_pod(acct.view(Policy.BINPACK), wire.ExtenderArgs(pod=pod, node_names=names))


def use(acct: accounting.Accounting, name: str, node: str, gpus: list[tuple[str, int]]) -> None:
    """A bound pod holding ``gpus`` (uuid, MiB), as the binder would have annotated it."""
    holder = b.pod(name, sum(m for _, m in gpus) // 1024)
    acct.apply_pod("MODIFIED", b.assigned(holder, node, gpus, 1_000_000_000_000))


def test_pod_without_our_resources_passes_untouched() -> None:
    acct = cluster(b.gpu_node("n1", b.l4()))
    plain = b.pod("web")
    assert run_filter(acct, plain, ["n1", "no-gpus", "n1"]) == wire.FilterResult(passed=["n1", "no-gpus", "n1"])


def test_fitting_nodes_in_input_order_and_reasons_for_the_rest() -> None:
    acct = cluster(b.gpu_node("small", b.l4()), b.gpu_node("big", b.a100()), b.gpu_node("busy", b.a100()))
    use(acct, "hog", "busy", [(b.uuid_of("busy", 0), 70 * 1024)])
    result = run_filter(acct, b.pod("p", 24), ["busy", "small", "plain", "big"])
    assert result.passed == ["big"]
    assert set(result.failed) == {"busy"}
    assert set(result.unresolvable) == {"small", "plain"}
    assert result.unresolvable["plain"] == verbs.NOT_A_GPU_NODE
    assert result.unresolvable["small"].startswith("no GPU here holds 24 GiB (the largest holds 22 GiB)")
    # the same sentence on every node short of room (kube-scheduler counts identical reasons): the most
    # free of them, and where
    assert result.failed["busy"] == "no GPU has 24 GiB free; the most free: 10 GiB on busy, GPU 0"
    assert result.error == ""


@pytest.mark.parametrize("node, pod, why", [
    (b.gpu_node("n", b.a100(healthy=False)), b.pod("p", 8), "unhealthy"),
    (b.gpu_node("n", b.l4(), b.l4()), b.pod("p", 8, models="A100"), "no GPU matches models A100"),
    (b.gpu_node("n", b.a100()), b.pod("p", 16, count=2), "needs 2 GPUs with 8 GiB free each"),
    (b.gpu_node("n", b.a100()), b.pod("p", whole=1), "no whole GPU (exclusive mode)"),
    (b.gpu_node("n", b.a100(mig=(("3g.40gb", 40192),))), b.pod("p", mig={"1g.10gb": 1}), "no MIG instance of profile 1g.10gb"),
], ids=["unhealthy", "wrong-model", "too-few-gpus", "no-exclusive-gpu", "no-such-mig"])
def test_unschedulable_for_good_is_unresolvable(node: dict, pod: dict, why: str) -> None:
    result = run_filter(cluster(node), pod, ["n"])
    assert result.passed == [] and result.failed == {}
    assert why in result.unresolvable["n"]


def test_kinds_exclusive_and_mig_fit_their_slots() -> None:
    acct = cluster(b.gpu_node("ex", b.a100(mode="exclusive")),
                   b.gpu_node("mig", b.a100(mig=(("3g.40gb", 40192), ("1g.10gb", 9856)))))
    assert run_filter(acct, b.pod("w", whole=1), ["ex", "mig"]).passed == ["ex"]
    assert run_filter(acct, b.pod("m", mig={"1g.10gb": 1}), ["ex", "mig"]).passed == ["mig"]
    assert run_filter(acct, b.pod("s", 8), ["ex", "mig"]).passed == []


def test_a_bad_request_spec_fails_every_node_for_good() -> None:
    acct = cluster(b.gpu_node("n1", b.a100(), b.a100()))
    bad = b.pod("p", 3, count=2)  # 3 units do not split over 2 GPUs
    result = run_filter(acct, bad, ["n1"])
    assert result.passed == [] and "split evenly" in result.unresolvable["n1"]


def test_multi_gpu_pod_needs_distinct_gpus_on_one_node() -> None:
    acct = cluster(b.gpu_node("one", b.a100()), b.gpu_node("two", b.l4(), b.l4()))
    assert run_filter(acct, b.pod("p", 16, count=2), ["one", "two"]).passed == ["two"]


def test_prioritize_scores_0_to_10_for_every_candidate() -> None:
    acct = cluster(b.gpu_node("empty", b.a100()), b.gpu_node("half", b.a100()), b.gpu_node("full", b.a100()))
    use(acct, "a", "half", [(b.uuid_of("half", 0), 40 * 1024)])
    use(acct, "c", "full", [(b.uuid_of("full", 0), 80 * 1024)])
    args = wire.ExtenderArgs(pod=b.pod("p", 20), node_names=["empty", "half", "full", "plain"])
    scores = dict(verbs.prioritize_pod(acct.view(Policy.BINPACK), args))
    assert list(scores) == ["empty", "half", "full", "plain"]
    assert all(0 <= s <= 10 for s in scores.values())
    assert scores["half"] > scores["empty"]  # binpack: the fuller GPU first
    assert scores["full"] == 0 and scores["plain"] == 0


def test_pod_policy_annotation_overrides_the_default() -> None:
    acct = cluster(b.gpu_node("empty", b.a100()), b.gpu_node("half", b.a100()))
    use(acct, "a", "half", [(b.uuid_of("half", 0), 40 * 1024)])
    spread = wire.ExtenderArgs(pod=b.pod("p", 20, policy="spread"), node_names=["empty", "half"])
    scores = dict(verbs.prioritize_pod(acct.view(Policy.BINPACK), spread))
    assert scores["empty"] > scores["half"]


def test_unknown_policy_annotation_falls_back() -> None:
    assert verbs.policy_for("nonsense", Policy.FGD) is Policy.FGD
    assert verbs.policy_for(" Spread ", Policy.FGD) is Policy.SPREAD


def test_prioritize_scores_pods_that_want_no_gpu_too() -> None:
    """kube-scheduler sends them when the profile manages cpu: they get one best node like GPU pods
    (the simulator places them with the policy too)."""
    acct = cluster(b.gpu_node("n1", b.a100()), b.gpu_node("n2", b.a100()))
    args = wire.ExtenderArgs(pod=b.pod("web"), node_names=["n1", "n2"])
    scores = dict(verbs.prioritize_pod(acct.view(Policy.FGD), args))
    assert sorted(scores.values()) == [9, 10]


def test_a_node_counting_in_another_unit_takes_no_gpu_memory_pod_until_the_units_agree() -> None:
    """memoryUnitMiB is read at start by both sides: a device plugin and an extender not both restarted
    after it changed disagree on what n units are, so the extender's plan (and its books) would be wrong
    there by that ratio. Such a node is refused for gpu-memory asks, unresolvably and saying why; whole
    GPUs and MIG ask no units and still pass; a node that agrees again passes again."""
    acct = cluster(b.gpu_node("old", b.a100(), unit_mib=2048), b.gpu_node("new", b.a100()),
                   b.gpu_node("whole", b.a100(mode="exclusive"), unit_mib=2048))
    result = run_filter(acct, b.pod("p", 20), ["old", "new"])
    assert result.passed == ["new"] and set(result.unresolvable) == {"old"}
    assert result.unresolvable["old"].startswith(
        "node counts vramshare.io/gpu-memory in units of 2048 MiB, the extender in 1024 MiB: restart")
    assert run_filter(acct, b.pod("w", whole=1), ["whole", "new"]).passed == ["whole"]
    acct.apply_node("MODIFIED", b.gpu_node("old", b.a100()))
    assert run_filter(acct, b.pod("p", 20), ["old", "new"]).passed == ["old", "new"]


def _zero(pod: dict) -> dict:
    pod["spec"]["containers"][0]["resources"] = {"limits": {b.NAMES.gpu_memory: "0"}}
    return pod


@pytest.mark.parametrize("pod, says", [
    # on main a pod asking 0 passed every node and was bound with no GPU: under the NVIDIA runtime an
    # image's NVIDIA_VISIBLE_DEVICES=all then sees every GPU of the node, unfenced
    (_zero(b.pod("p")), f"asks 0 {b.NAMES.gpu_memory}: ask at least 1"),
    # on main a typo'd policy was dropped silently (a log line without the pod's name)
    (b.pod("p", 8, policy="bnpack"), f"annotation {b.NAMES.policy}: 'bnpack' is not a placement policy (fgd, "
                                     "binpack, spread): correct it or remove the annotation"),
    # on main: 'no GPU has 150 GiB free; largest free is 80 GiB on GPU 0', as if waiting could help
    (b.pod("p", 150), "no GPU here holds 150 GiB (the largest holds 80 GiB): ask at most 80 GiB, or "
                      f"split the request over several GPUs with the annotation {b.NAMES.gpu_count}"),
    (b.pod("p", 200, count=2), "no GPU here holds 100 GiB each (the largest holds 80 GiB): ask at most 80 GiB "
                               f"per GPU, or split the request over more GPUs with the annotation {b.NAMES.gpu_count}"),
], ids=["zero", "policy-typo", "bigger-than-any-gpu", "bigger-than-any-gpu-per-gpu"])
def test_a_users_common_mistakes_get_a_reason_that_says_what_to_do(pod: dict, says: str) -> None:
    """What ``kubectl describe pod`` shows (kube-scheduler puts filter's reasons in the FailedScheduling
    event): the mistake and its fix, and unresolvable, since no eviction or wait can help."""
    result = run_filter(cluster(b.gpu_node("n", b.a100(), b.a100())), pod, ["n"])
    assert result.passed == [] and result.failed == {}
    assert says in result.unresolvable["n"], result.unresolvable["n"]
