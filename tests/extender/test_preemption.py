"""The preempt verb keeps only nodes where evicting the proposed victims frees room on one GPU."""
from __future__ import annotations

import orjson

from extender import accounting, app, metrics, preemption, wire
from vramshare.config import Config, Policy
from tests.extender import builders as b

T = 1_000_000_000


def cluster() -> accounting.Accounting:
    acct = accounting.Accounting(Config(), clock=lambda: T)
    acct.apply_node("ADDED", b.gpu_node("n1", b.l4(), b.l4()))  # 2 x 22 GiB
    acct.apply_node("ADDED", b.gpu_node("n2", b.l4()))
    for name, node, gpu, gib in [("a", "n1", 0, 10), ("c", "n1", 0, 12), ("b", "n1", 1, 10), ("d", "n2", 0, 20)]:
        acct.apply_pod("ADDED", b.assigned(b.pod(name, gib, uid=f"uid-{name}"), node,
                                           [(b.uuid_of(node, gpu), gib * 1024)], T))
    return acct


def usage(acct: accounting.Accounting) -> dict[str, int]:
    return {u.slot.uuid: u.used for n in acct.slots for u in acct.state.node_usage(n)}


def test_only_victim_sets_that_free_one_gpu_survive() -> None:
    acct = cluster()
    before = usage(acct)
    args = wire.PreemptionArgs(pod=b.pod("big", 20), victims={
        "n1": ["uid-a", "uid-b"],  # GPU 1 empties: fits
        "n2": ["uid-d"],  # the only GPU empties: fits
        "nowhere": ["uid-x"],  # not a GPU node
    }, pdb_violations={})
    assert preemption.preempt_pod(acct, args) == {"n1": ["uid-a", "uid-b"], "n2": ["uid-d"]}
    split = wire.PreemptionArgs(pod=b.pod("big", 20), victims={"n1": ["uid-a"]}, pdb_violations={})
    assert preemption.preempt_pod(acct, split) == {}  # 10 + 12 GiB free, but on two GPUs
    assert usage(acct) == before  # the what-if left nothing behind


def test_preempt_over_the_wire_answers_the_meta_form() -> None:
    acct = cluster()
    ext = app.Extender(acct, None, None, metrics.ExtenderMetrics(acct), Policy.BINPACK)  # type: ignore[arg-type]
    body = orjson.dumps({"Pod": b.pod("big", 20), "NodeNameToVictims": None, "NodeNameToMetaVictims": {
        "n1": {"Pods": [{"UID": "uid-a"}], "NumPDBViolations": 0},
        "n2": {"Pods": [{"UID": "uid-d"}], "NumPDBViolations": 1}}})
    resp = ext.handle("POST", "/preempt", body)
    assert (resp.status, resp.body) == (200, b'{"NodeNameToMetaVictims":{"n2":{"Pods":[{"UID":"uid-d"}],'
                                              b'"NumPDBViolations":1}}}')
    bad = ext.handle("POST", "/preempt", b"{")
    assert (bad.status, bad.body) == (200, b'{"NodeNameToMetaVictims":{}}')
