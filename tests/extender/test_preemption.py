"""The preempt verb keeps only nodes where evicting the proposed victims frees room on one GPU."""
from __future__ import annotations

import orjson
from hypothesis import given, settings, strategies as st

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


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 20), st.integers(0, 5)), max_size=12),
       st.integers(1, 22), st.integers(0, 6))
def test_victims_always_make_room_and_only_lower_priority_go(drawn: list[tuple[int, int, int]], gib: int,
                                                             mine: int) -> None:
    """Any node of 4 L4s, any pods and priorities: the answer frees room, names only pods of lower
    priority, is minimal (each victim is needed), changes nothing, and misses no node where evicting
    every lower-priority pod would make room."""
    acct = accounting.Accounting(Config(), clock=lambda: T)
    acct.apply_node("ADDED", b.gpu_node("n", b.l4(), b.l4(), b.l4(), b.l4()))
    pods: list[tuple[int, int, int]] = []
    for gpu, size, p in drawn:  # what fits: a node the books hold as it is
        if sum(s for g, s, _ in pods if g == gpu) + size <= 22:
            pods.append((gpu, size, p))
    for i, (gpu, size, p) in enumerate(pods):
        pod = prio(b.pod(f"v{i}", size, uid=f"uid-{i}"), p)
        acct.apply_pod("ADDED", b.assigned(pod, "n", [(b.uuid_of("n", gpu), size * 1024)], T))
    before = usage(acct)
    out = preemption.preempt_pod(acct, wire.PreemptionArgs(pod=prio(b.pod("big", gib), mine),
                                                           victims={"n": []}, pdb_violations={}))
    assert usage(acct) == before
    lower = [f"uid-{i}" for i, (_, _, p) in enumerate(pods) if p < mine]
    free_all = {b.uuid_of("n", g): 22528 - sum(s * 1024 for gg, s, p in pods if gg == g and p >= mine)
                for g in range(4)}
    possible = max(free_all.values()) >= gib * 1024
    fits_now = max(22528 - sum(s * 1024 for gg, s, _ in pods if gg == g) for g in range(4)) >= gib * 1024
    # a node where the pod already fits has no victim to name, and a node without victims is an
    # error to kube-scheduler (callExtenders): it is left out
    assert ("n" in out) == (possible and not fits_now)
    if "n" in out:
        victims = set(out["n"])
        assert victims <= set(lower)
        held = {b.uuid_of("n", g): sum(s * 1024 for i, (gg, s, _) in enumerate(pods)
                                        if gg == g and f"uid-{i}" not in victims) for g in range(4)}
        assert max(22528 - h for h in held.values()) >= gib * 1024
        for v in victims:  # minimal: putting any one victim back leaves no room
            i = int(v.split("-")[1])
            g = b.uuid_of("n", pods[i][0])
            assert 22528 - held[g] - pods[i][1] * 1024 < gib * 1024


def _host_node(name: str) -> dict:
    node = b.gpu_node(name, b.l4(), b.l4())
    node["status"]["allocatable"].update({"cpu": "16", "memory": "64Gi"})
    return node


def _host_pod(name: str, gib: int, priority: int = 0) -> dict:
    p = prio(b.pod(name, gib, uid=f"uid-{name}"), priority)
    p["spec"]["containers"][0]["resources"]["requests"] = {"cpu": "4", "memory": "16Gi"}
    return p


def test_a_what_if_puts_its_victims_back_with_their_cpu_and_memory() -> None:
    """Issue 17 item 9: _victims put candidates back with the default HostDemand(), so every preempt
    call erased the node's booked CPU and memory (12,000m / 48 GiB went to 0 / 0)."""
    acct = accounting.Accounting(Config(), clock=lambda: T)
    acct.apply_node("ADDED", _host_node("n1"))
    for name, gpu, gib in [("a", 0, 10), ("c", 0, 12), ("b", 1, 10)]:
        acct.apply_pod("ADDED", b.assigned(_host_pod(name, gib), "n1", [(b.uuid_of("n1", gpu), gib * 1024)], T))
    row = acct.state.row("n1")
    booked = (int(acct.state.cpu_used[row]), int(acct.state.mem_used[row]))
    assert booked == (12_000, 48 * 1024)
    gpus = usage(acct)
    for _ in range(3):
        out = preemption.preempt_pod(acct, wire.PreemptionArgs(pod=big(), victims={"n1": ["uid-a", "uid-b"]},
                                                               pdb_violations={}))
        assert out == {"n1": ["uid-b"]}
        assert (int(acct.state.cpu_used[row]), int(acct.state.mem_used[row])) == booked
        assert usage(acct) == gpus


def test_the_preemptors_cpu_counts_in_the_what_if() -> None:
    """A victim set that frees the GPU but leaves no CPU for the preemptor makes no room."""
    acct = accounting.Accounting(Config(), clock=lambda: T)
    acct.apply_node("ADDED", _host_node("n1"))
    acct.apply_pod("ADDED", b.assigned(_host_pod("a", 20), "n1", [(b.uuid_of("n1", 0), 20 * 1024)], T))
    hog = _host_pod("hog", 0, priority=1000)  # no GPU, 12 CPUs, never a victim
    hog["spec"]["containers"][0]["resources"]["requests"]["cpu"] = "12"
    acct.apply_pod("ADDED", dict(hog, spec={**hog["spec"], "nodeName": "n1"}))
    want = _host_pod("big", 20, priority=100)
    want["spec"]["containers"][0]["resources"]["requests"]["cpu"] = "4"  # 16 - 12 (hog) = 4 once a goes: fits
    assert preemption.preempt_pod(acct, wire.PreemptionArgs(pod=want, victims={"n1": []}, pdb_violations={})) \
        == {"n1": ["uid-a"]}
    want["spec"]["containers"][0]["resources"]["requests"]["cpu"] = "5"
    assert preemption.preempt_pod(acct, wire.PreemptionArgs(pod=want, victims={"n1": []}, pdb_violations={})) == {}


def test_no_node_is_answered_without_victims() -> None:
    """kube-scheduler's callExtenders: an empty victim list from a non-ignorable extender fails the
    preemption ("expected at least one victim pod on node")."""
    acct = cluster()
    small = prio(b.pod("small", 2), 100)  # fits n1's GPU 1 (12 GiB free) as it is
    out = preemption.preempt_pod(acct, wire.PreemptionArgs(pod=small, victims={"n1": [], "n2": ["uid-d"]},
                                                           pdb_violations={}))
    assert out == {"n2": ["uid-d"]}  # n1 fits already: nothing to evict; n2 fits too: kube-scheduler's reason stands
    plain = b.pod("plain")  # not a GPU pod: kube-scheduler's proposal passes, empty nodes do not
    assert preemption.preempt_pod(acct, wire.PreemptionArgs(pod=plain, victims={"n1": [], "n2": ["uid-d"]},
                                                            pdb_violations={})) == {"n2": ["uid-d"]}
