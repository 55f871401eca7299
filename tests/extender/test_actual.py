"""Actual over assigned, and the per-node, per-signature hold (no I/O, virtual clock).

The device plugin rewrites a pod's ``vramshare.io/assignment`` with the GPUs the kubelet really gave it
and sets ``allocation-state: allocated``; the books follow that report. While a pod is still ``assumed``
on a node, no pod sharing a container size with it is bound there.
"""
from __future__ import annotations

import random

import orjson
import pytest
from hypothesis import given, settings, strategies as st

from extender import accounting, translate, verbs, wire
from vramshare import contract, podspec
from vramshare.config import Config, ExtenderConfig, Policy
from tests.extender import builders as b

SEC = 1_000_000_000
T0 = 1_700_000_000 * SEC
N = b.NAMES


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> int:
        return self.now


def make(clock: Clock, hold_s: float = 30.0) -> accounting.Accounting:
    a = accounting.Accounting(Config(extender=ExtenderConfig(assume_timeout_seconds=60, hold_timeout_seconds=hold_s,
                                                             policy=Policy.BINPACK)), clock)
    a.apply_node("ADDED", b.gpu_node("n1", b.l4(), b.l4()))
    a.apply_node("ADDED", b.gpu_node("n2", b.l4()))
    return a


def used(acct: accounting.Accounting, node: str = "n1") -> list[int]:
    return [u.used for u in acct.state.node_usage(node)]


def allocated(p: dict, node: str, gpus: list[tuple[str, int]], assume_ns: int = 0) -> dict:
    return b.assigned(p, node, gpus, assume_ns, state=contract.STATE_ALLOCATED)


def test_the_actual_gpu_replaces_the_assumed_one_and_deletion_frees_it() -> None:
    clock = Clock()
    acct = make(clock)
    p = b.pod("p", 20)
    acct.apply_pod("ADDED", b.assigned(p, "n1", [("GPU-n1-0", 20480)], T0))
    assert used(acct) == [20480, 0]
    acct.apply_pod("MODIFIED", allocated(p, "n1", [("GPU-n1-1", 20480)], T0))  # the kubelet chose GPU 1
    assert used(acct) == [0, 20480]
    acct.apply_pod("MODIFIED", b.assigned(p, "n1", [("GPU-n1-0", 20480)], T0))  # a stale event: ignored
    assert used(acct) == [0, 20480]
    clock.now += 3600 * SEC
    acct.expire()
    assert used(acct) == [0, 20480]  # allocated never expires
    acct.apply_pod("DELETED", b.ended(allocated(p, "n1", [("GPU-n1-1", 20480)], T0)))  # its kubelet ended it
    assert used(acct) == [0, 0]


def test_a_pod_that_bypassed_the_extender_is_booked_from_reality_even_over_capacity() -> None:
    acct = make(Clock())
    acct.reserve("default/ours", "n2", [("GPU-n2-0", 20480)], T0)
    stray = b.pod("stray", 8)
    stray["spec"]["schedulerName"] = "default-scheduler"
    acct.apply_pod("ADDED", allocated(stray, "n2", [("GPU-n2-0", 8192)]))  # no assume-time at all
    assert used(acct, "n2") == [28672]  # over the 22 GiB: the books say what the GPU holds
    assert acct.unaccounted == {}


def test_allocated_on_an_unbound_pod_is_not_believed() -> None:
    clock = Clock()
    acct = make(clock)
    acct.apply_pod("ADDED", allocated(b.pod("p", 20), "", [("GPU-n1-0", 20480)], T0))
    clock.now += 61 * SEC
    acct.expire()
    assert used(acct) == [0, 0]


# -- holds -------------------------------------------------------------------------------------
def filter_names(acct: accounting.Accounting, pod: dict, nodes: list[str]) -> wire.FilterResult:
    return verbs.filter_pod(acct.view(Policy.BINPACK), wire.ExtenderArgs(pod=pod, node_names=nodes))


def test_filter_passes_a_held_node_only_where_the_pod_can_take_the_held_gpu() -> None:
    """The narrower hold: a same-size pod may join an assumed one on its very GPU, nowhere else."""
    clock = Clock()
    acct = make(clock)
    first = b.pod("first", 8)
    acct.apply_pod("ADDED", b.assigned(first, "n1", [("GPU-n1-0", 8192)], T0))
    assert filter_names(acct, b.pod("second", 8), ["n1", "n2"]).passed == ["n1", "n2"]  # GPU 0: 14 GiB free
    acct.apply_pod("ADDED", b.assigned(b.pod("second", 8), "n1", [("GPU-n1-0", 8192)], T0))
    out = filter_names(acct, b.pod("third", 8), ["n1", "n2"])  # GPU 0 has 6 GiB left, GPU 1 22: held
    assert out.passed == ["n2"] and "held for pod default/" in out.failed["n1"]
    assert "of the held plan has 6144 MiB free, needs 8192" in out.failed["n1"]
    assert "n1" not in out.unresolvable
    assert filter_names(acct, b.pod("other", 4), ["n1", "n2"]).passed == ["n1", "n2"]  # other sizes: no hold
    split = b.pod("split", 8, count=2)  # 2 x 4 units: the kubelet asks 8 devices, as for "first"
    assert filter_names(acct, split, ["n1"]).passed == []  # two GPUs can never be the held one
    acct.apply_pod("MODIFIED", allocated(first, "n1", [("GPU-n1-0", 8192)], T0))  # reconciled
    acct.apply_pod("MODIFIED", allocated(b.pod("second", 8), "n1", [("GPU-n1-0", 8192)], T0))
    assert filter_names(acct, b.pod("third", 8), ["n1", "n2"]).passed == ["n1", "n2"]
    assert filter_names(acct, split, ["n1"]).passed == ["n1"]


def test_same_size_pods_assumed_on_different_gpus_hold_every_other_one() -> None:
    """Two same-size pods on different GPUs (an older extender, a restart): steering is already
    ambiguous there, so no third pod of that size joins either plan."""
    acct = make(Clock())
    acct.apply_pod("ADDED", b.assigned(b.pod("a", 4), "n1", [("GPU-n1-0", 4096)], T0))
    acct.apply_pod("ADDED", b.assigned(b.pod("b", 4), "n1", [("GPU-n1-1", 4096)], T0))
    assert filter_names(acct, b.pod("c", 4), ["n1"]).passed == []


def test_whole_gpus_and_mig_instances_are_never_shared_so_the_hold_is_as_before() -> None:
    acct = make(Clock())
    acct.apply_node("ADDED", b.gpu_node("x", b.a100(mode="exclusive"), b.a100(mode="exclusive")))
    acct.apply_node("ADDED", b.gpu_node("m", b.a100(mig=(("1g.10gb", 9728), ("1g.10gb", 9728)))))
    acct.apply_pod("ADDED", b.assigned(b.pod("w1", whole=1), "x", [("GPU-x-0", 81920)], T0))
    assert filter_names(acct, b.pod("w2", whole=1), ["x"]).passed == []
    acct.apply_pod("ADDED", b.assigned(b.pod("m1", mig={"1g.10gb": 1}), "m", [("MIG-m-0-0", 9728)], T0))
    out = filter_names(acct, b.pod("m2", mig={"1g.10gb": 1}), ["m"])
    assert out.passed == [] and "held for pod default/m1" in out.failed["m"]


@pytest.mark.parametrize("end", ["deleted", "timeout", "succeeded"])
def test_a_hold_ends_on_deletion_finish_or_timeout(end: str) -> None:
    clock = Clock()
    acct = make(clock, hold_s=30)
    first = b.assigned(b.pod("first", 16), "n1", [("GPU-n1-0", 16384)], T0)
    acct.apply_pod("ADDED", first)
    assert filter_names(acct, b.pod("second", 16), ["n1"]).passed == []  # its GPU has no room for two
    if end == "deleted":
        acct.apply_pod("DELETED", b.ended(first))
    elif end == "succeeded":
        acct.apply_pod("MODIFIED", {**first, "status": {"phase": "Succeeded"}})
    else:  # the node's plugin reports (another pod), this pod's report never comes: the full timeout
        clock.now += SEC
        acct.apply_pod("ADDED", b.assigned(b.pod("other", 1), "n1", [("GPU-n1-1", 1024)], T0,
                                           state=contract.STATE_ALLOCATED))
        clock.now += 28 * SEC
        assert filter_names(acct, b.pod("second", 16), ["n1"]).passed == []
        clock.now += 2 * SEC
        acct.expire()
    assert filter_names(acct, b.pod("second", 16), ["n1"]).passed == ["n1"]


def test_hold_off_with_zero_timeout() -> None:
    acct = make(Clock(), hold_s=0)
    acct.apply_pod("ADDED", b.assigned(b.pod("first", 16), "n1", [("GPU-n1-0", 16384)], T0))
    assert filter_names(acct, b.pod("second", 16), ["n1"]).passed == ["n1"]


def test_the_signature_is_what_the_kubelet_asks_per_container() -> None:
    def sig(p: dict) -> translate.Signature:
        return translate.signature_of(podspec.pod_demand(p, N), N)

    assert sig(b.pod("a", 22)) == sig(b.pod("b", 22, count=2)) == frozenset({(N.gpu_memory, 22)})
    assert sig(b.pod("w", whole=1, mig={"3g.40gb": 2})) == frozenset({(N.gpu, 1), (N.mig("3g.40gb"), 2)})
    assert sig(b.pod("a", 22)) & sig(b.pod("c", 22, containers=2))
    assert not sig(b.pod("a", 22)) & sig(b.pod("d", 21))


# -- the property: books equal reality after every step -----------------------------------------
@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_books_follow_the_device_plugins_reports_in_any_order(seed: int) -> None:
    """Random binds (through reserve, same-size pods joining a held plan as the binder does), random
    admission order with the kubelet picking any GPU with room, reports in any order, deletions and
    relists: after every step no two plans of one size are held on a node, and once every report is
    in, the books equal what the pods really hold, and reality never exceeds a GPU."""
    rng = random.Random(seed)
    clock = Clock()
    acct = make(clock)
    cap = {s.uuid: s.capacity for ns in acct.slots.values() for s in ns}
    node_of = {s.uuid: n for n, ns in acct.slots.items() for s in ns}
    real: dict[str, tuple[str, int]] = {}  # pod -> (gpu, MiB) the kubelet really gave
    pods: dict[str, dict] = {}
    for step in range(40):
        clock.now += SEC
        action = rng.random()
        if action < 0.5:
            name, gib = f"p{step}", rng.choice([2, 4, 8, 10])
            key, node = f"default/{name}", rng.choice(["n1", "n2"])
            free = [u for u in acct.state.node_usage(node) if u.slot.capacity - u.used >= gib * 1024]
            sig = frozenset({(N.gpu_memory, gib)})
            need = acct.hold_required(key, node, sig)  # the narrower hold, as the binder applies it
            if need.blocker is not None:
                continue
            held = need.plans.get((N.gpu_memory, gib))
            if held is not None:  # same size assumed here: only its GPU, if it still has room
                free = [u for u in free if u.slot.uuid == held[0][0]]
            if not free:
                continue
            gpu = free[0].slot.uuid
            acct.reserve(key, node, [(gpu, gib * 1024)], clock.now, sig, {(N.gpu_memory, gib): ((gpu, gib * 1024),)})
            pod = b.assigned(b.pod(name, gib), node, [(gpu, gib * 1024)], clock.now)
            pods[key] = pod
            acct.apply_pod("ADDED", pod)
            room = [g for g in cap if node_of[g] == node and
                    cap[g] - sum(m for gg, m in real.values() if gg == g) >= gib * 1024]
            if room:  # the kubelet admits it on any GPU with room (the hold makes this the steered one
                real[key] = (rng.choice(room), gib * 1024)  # in production; here: worst case)
        elif action < 0.8 and real:
            key = rng.choice(sorted(real))
            gpu, mib = real[key]
            pods[key] = allocated(pods[key], node_of[gpu], [(gpu, mib)], clock.now)
            acct.apply_pod("MODIFIED", pods[key])
        elif action < 0.95 and pods:
            key = rng.choice(sorted(pods))
            acct.apply_pod("DELETED", b.ended(pods.pop(key)))  # its kubelet ended it (or never ran it)
            real.pop(key, None)
        else:
            acct.replace_pods(list(pods.values()), clock.now)
        for g in cap:
            assert sum(m for gg, m in real.values() if gg == g) <= cap[g]
        plans: dict[tuple[str, tuple[str, int]], set] = {}  # never two plans for one size on one node
        live = [h for h in acct.holds._by_pod.values()  # noqa: SLF001 - the invariant is about the holds
                if clock.now < acct.holds.until(h, clock.now)]
        for h in live:  # themselves (one that timed out, or shortened on a silent node, gives way on purpose)
            for e in h.signature:
                plans.setdefault((h.node, e), set()).add((h.plans or {}).get(e))
        assert all(len(v) == 1 and None not in v for v in plans.values()), plans
    for key, pod in list(pods.items()):  # settle: every admitted pod reported, the rest never admitted
        if key in real:
            gpu, mib = real[key]
            acct.apply_pod("MODIFIED", allocated(pod, node_of[gpu], [(gpu, mib)], clock.now))
        else:
            acct.apply_pod("DELETED", b.ended(pod))
    books = {u.slot.uuid: u.used for n in acct.slots for u in acct.state.node_usage(n)}
    reality = {g: sum(m for gg, m in real.values() if gg == g) for g in cap}
    assert books == reality, orjson.dumps({"books": books, "real": reality}).decode()


def test_prioritize_holds_its_best_node_until_the_bind_decides() -> None:
    """kube-scheduler binds asynchronously: the next same-size pod's filter may come before the bind."""
    from extender import app, metrics

    clock = Clock()
    acct = make(clock)
    ext = app.Extender(acct, None, None, metrics.ExtenderMetrics(acct), Policy.BINPACK)  # type: ignore[arg-type]
    first, second = b.pod("first", 8), b.pod("second", 8)
    scores = orjson.loads(ext.handle("POST", "/prioritize", orjson.dumps(
        {"Pod": first, "NodeNames": ["n1", "n2"]})).body)
    best = max(scores, key=lambda s: s["Score"])["Host"]
    out = filter_names(acct, second, ["n1", "n2"])
    assert best in out.failed and "being bound here" in out.failed[best]
    assert filter_names(acct, b.pod("other", 4), ["n1", "n2"]).passed == ["n1", "n2"]
    clock.now += 3 * SEC  # the bind never came
    assert filter_names(acct, second, ["n1", "n2"]).passed == ["n1", "n2"]
    ext.handle("POST", "/filter", orjson.dumps({"Pod": first, "NodeNames": ["n2"]}))  # one node left
    assert filter_names(acct, second, ["n2"]).passed == []
    acct.reserve("default/first", "n1", [("GPU-n1-0", 8192)], clock.now,
                 translate.signature_of(podspec.pod_demand(first, N), N))  # bound elsewhere after all
    assert filter_names(acct, second, ["n1", "n2"]).passed == ["n2"]
