"""The preempt verb keeps only nodes where evicting the proposed victims frees room on one GPU."""
from __future__ import annotations

import orjson

from extender import accounting, app, metrics, preemption, wire
from vramshare.config import Config, Policy
from tests.extender import builders as b

T = 1_000_000_000


def prio(p: dict, value: int) -> dict:
    p["spec"]["priority"] = value
    return p


def cluster(priorities: dict[str, int] | None = None) -> accounting.Accounting:
    acct = accounting.Accounting(Config(), clock=lambda: T)
    acct.apply_node("ADDED", b.gpu_node("n1", b.l4(), b.l4()))  # 2 x 22 GiB
    acct.apply_node("ADDED", b.gpu_node("n2", b.l4()))
    for name, node, gpu, gib in [("a", "n1", 0, 10), ("c", "n1", 0, 12), ("b", "n1", 1, 10), ("d", "n2", 0, 20)]:
        p = prio(b.pod(name, gib, uid=f"uid-{name}"), (priorities or {}).get(name, 0))
        acct.apply_pod("ADDED", b.assigned(p, node, [(b.uuid_of(node, gpu), gib * 1024)], T))
    return acct


def big(priority: int = 100) -> dict:
    return prio(b.pod("big", 20), priority)


def usage(acct: accounting.Accounting) -> dict[str, int]:
    return {u.slot.uuid: u.used for n in acct.slots for u in acct.state.node_usage(n)}


def test_victims_are_the_fewest_lowest_priority_pods_that_free_one_gpu() -> None:
    acct = cluster()
    before = usage(acct)
    args = wire.PreemptionArgs(pod=big(), victims={
        "n1": ["uid-a", "uid-b"],  # kube-scheduler's pick spans both GPUs; b alone frees GPU 1
        "n2": ["uid-d"],  # the only GPU empties: fits
        "nowhere": ["uid-x"],  # not a GPU node
    }, pdb_violations={})
    assert preemption.preempt_pod(acct, args) == {"n1": ["uid-b"], "n2": ["uid-d"]}
    assert usage(acct) == before  # the what-if left nothing behind


def test_a_fragmented_node_yields_victims_even_when_kube_scheduler_proposes_none() -> None:
    acct = cluster()  # n1: 22 GiB free in total (no GPU has 20): the in-tree filter sees room, no victims
    args = wire.PreemptionArgs(pod=big(), victims={"n1": []}, pdb_violations={})
    assert preemption.preempt_pod(acct, args) == {"n1": ["uid-b"]}


def test_lower_priority_goes_first_and_higher_or_equal_priority_is_never_a_victim() -> None:
    acct = cluster({"a": 1, "c": 1, "b": 50, "d": 100})
    args = wire.PreemptionArgs(pod=big(100), victims={"n1": [], "n2": []}, pdb_violations={})
    out = preemption.preempt_pod(acct, args)  # two pods of priority 1 beat one of priority 50
    assert sorted(out["n1"]) == ["uid-a", "uid-c"] and "n2" not in out  # d is not lower than 100
    alone = preemption.preempt_pod(acct, wire.PreemptionArgs(pod=big(40), victims={"n1": []}, pdb_violations={}))
    assert sorted(alone["n1"]) == ["uid-a", "uid-c"]  # b (50) is above the preemptor (40): never a victim
    assert preemption.preempt_pod(acct, wire.PreemptionArgs(pod=big(1), victims={"n1": []},
                                                            pdb_violations={})) == {}


def test_preempt_over_the_wire_answers_the_meta_form() -> None:
    acct = cluster()
    ext = app.Extender(acct, None, None, metrics.ExtenderMetrics(acct), Policy.BINPACK)  # type: ignore[arg-type]
    body = orjson.dumps({"Pod": big(), "NodeNameToVictims": None, "NodeNameToMetaVictims": {
        "n1": {"Pods": [{"UID": "uid-a"}], "NumPDBViolations": 0},
        "n2": {"Pods": [{"UID": "uid-d"}], "NumPDBViolations": 1}}})
    resp = ext.handle("POST", "/preempt", body)
    assert (resp.status, resp.body) == (200, b'{"NodeNameToMetaVictims":{"n1":{"Pods":[{"UID":"uid-b"}],'
                                              b'"NumPDBViolations":0},"n2":{"Pods":[{"UID":"uid-d"}],'
                                              b'"NumPDBViolations":1}}}')
    bad = ext.handle("POST", "/preempt", b"{")
    assert (bad.status, bad.body) == (200, b'{"NodeNameToMetaVictims":{}}')
