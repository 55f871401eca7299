"""Issue 21: the pod is read once (cached by UID and resourceVersion) and filter/prioritize change no state.

A verb given the same books and the same request answers the same and leaves the books, the holds
(silence and cuts included) and the cluster state as they were; the one state change a scheduling
cycle implies (the expected bind) goes through :meth:`Accounting.commit`, called by the app.
"""
from __future__ import annotations

import copy
import os
import random

import orjson
import pytest

from extender import accounting, app, metrics, parsed, verbs, wire
from vramshare.config import Config, ExtenderConfig, Policy
from tests.extender import builders as b

N = b.NAMES
SEC = 1_000_000_000
T0 = 1_700_000_000 * SEC
SEEDS = range(int(os.environ.get("VRAMSHARE_PROPERTY_SEEDS", "60")) // 3)


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> int:
        return self.now


def books(policy: Policy = Policy.BINPACK) -> tuple[accounting.Accounting, Clock]:
    clock = Clock()
    acct = accounting.Accounting(Config(extender=ExtenderConfig(hold_timeout_seconds=30, assume_timeout_seconds=60,
                                                                policy=policy)), clock)
    for name in ("n1", "n2", "n3"):
        acct.apply_node("ADDED", b.gpu_node(name, b.l4(), b.l4()))
    return acct, clock


def snapshot(acct: accounting.Accounting) -> tuple:
    """Everything a verb could change: the books, the holds (silence and cuts too), the GPU usage."""
    h = acct.holds
    return (copy.deepcopy(h._by_pod), sorted(h._by_node), dict(h.silent), dict(h._cut), dict(h._reported),  # noqa: SLF001
            acct.state.version, acct.state.used.tolist(), dict(acct._held), sorted(acct.pods),  # noqa: SLF001
            dict(acct.untrusted), dict(acct.unaccounted))


def assumed(name: str, node: str, gpu: int, gib: int, at: int) -> dict:
    """A pod the binder assumed on ``node`` (bound, not yet reported allocated): it holds its size there."""
    return b.assigned(b.pod(name, gib), node, [(b.uuid_of(node, gpu), gib * 1024)], at)


def test_filter_on_a_node_found_silent_records_nothing() -> None:
    """On today's main filter wrote the node's silence (and the hold's cut) into the holds: a read that
    changed what a later bind and the expiry loop decide. Now the expiry loop records it."""
    acct, clock = books()
    acct.apply_pod("ADDED", assumed("a", "n1", 0, 8, T0))
    clock.now += 6 * SEC  # the hold waited 5 s with no allocated report from n1: n1 is silent
    before = snapshot(acct)
    q = b.pod("q", 8)
    args = wire.ExtenderArgs(pod=q, node_names=["n1", "n2", "n3"])
    first = verbs.filter_pod(acct.view(Policy.BINPACK), args)
    assert snapshot(acct) == before
    assert "n1" in first.passed  # the hold is over all the same (cut on a silent node)
    acct.expire()  # the one place it is written down
    assert "n1" in acct.holds.silent
    assert verbs.filter_pod(acct.view(Policy.BINPACK), args) == first


@pytest.mark.parametrize("seed", SEEDS)
def test_verbs_answer_the_same_and_change_nothing(seed: int) -> None:
    """Property: random assumed/allocated pods, random time passed, random requests; each verb twice."""
    rng = random.Random(seed)
    acct, clock = books(rng.choice([Policy.BINPACK, Policy.FGD, Policy.SPREAD]))
    for i in range(rng.randint(0, 6)):
        node, gpu, gib = rng.choice(["n1", "n2", "n3"]), rng.randint(0, 1), rng.choice([2, 4, 8])
        pod = assumed(f"a{i}", node, gpu, gib, clock.now)
        if rng.random() < 0.3:
            pod = b.assigned(b.pod(f"a{i}", gib), node, [(b.uuid_of(node, gpu), gib * 1024)], clock.now, "allocated")
        acct.apply_pod("ADDED", pod)
        clock.now += rng.choice([0, 1, 3, 6]) * SEC
    if rng.random() < 0.5:
        acct.expect_bind("default/e", rng.choice(["n1", "n2"]), frozenset({(N.gpu_memory, 4)}))
    clock.now += rng.choice([0, 2, 6, 40]) * SEC
    for j in range(4):
        q = b.pod(f"q{j}", rng.choice([2, 4, 8, 24]), count=rng.choice([1, 1, 2]))
        q["metadata"]["resourceVersion"] = str(rng.randint(1, 5))
        if rng.random() < 0.5:
            acct.apply_pod("ADDED", q)  # the watch saw it first (as it does live)
        names = rng.sample(["n1", "n2", "n3", "ghost"], rng.randint(1, 4))
        args = wire.ExtenderArgs(pod=q, node_names=names)
        before = snapshot(acct)
        f1 = verbs.filter_pod(acct.view(Policy.BINPACK), args)
        p1 = verbs.prioritize_pod(acct.view(Policy.BINPACK), args)
        assert snapshot(acct) == before
        assert verbs.filter_pod(acct.view(Policy.BINPACK), args) == f1
        assert verbs.prioritize_pod(acct.view(Policy.BINPACK), args) == p1
        assert snapshot(acct) == before


def test_a_new_resource_version_is_read_again() -> None:
    reader = parsed.PodReader(N, 1024)
    pod = b.pod("p", 4, uid="u1")
    pod["metadata"]["resourceVersion"] = "7"
    first = reader.read(pod)
    assert reader.read(copy.deepcopy(pod)) is first  # same UID and resourceVersion: the same reading
    grown = copy.deepcopy(pod)
    grown["metadata"]["resourceVersion"] = "8"
    grown["spec"]["containers"][0]["resources"]["limits"][N.gpu_memory] = "6"
    second = reader.read(grown)
    assert second is not first and [d.per_gpu for d in second.demands] == [6 * 1024]
    assert [d.per_gpu for d in first.demands] == [4 * 1024]
    reader.forget(grown)
    assert len(reader) == 0


def test_a_pod_without_uid_or_resource_version_is_never_cached() -> None:
    reader = parsed.PodReader(N, 1024)
    pod = b.pod("p", 4)  # no resourceVersion
    assert reader.read(pod) is not reader.read(pod) and len(reader) == 0


def test_the_cache_is_bounded() -> None:
    reader = parsed.PodReader(N, 1024, max_pods=3)
    for i in range(10):
        pod = b.pod(f"p{i}", 1, uid=f"u{i}")
        pod["metadata"]["resourceVersion"] = "1"
        reader.read(pod)
    assert len(reader) == 3


def test_a_cycle_reads_the_pod_once() -> None:
    """The watch reads the pending pod; filter, prioritize and the expected bind reuse that reading."""
    acct, _ = books()
    ext = app.Extender(acct, None, None, metrics.ExtenderMetrics(acct), Policy.BINPACK)  # type: ignore[arg-type]
    q = b.pod("q", 4)
    q["metadata"]["resourceVersion"] = "3"
    acct.apply_pod("ADDED", q)
    misses = acct.pods_read.misses
    body = orjson.dumps({"Pod": q, "NodeNames": ["n1", "n2", "n3"]})
    passed = orjson.loads(ext.handle("POST", "/filter", body).body)["NodeNames"]
    ext.handle("POST", "/prioritize", orjson.dumps({"Pod": q, "NodeNames": passed}))
    assert acct.pods_read.misses == misses
    assert acct.holds.held_pods() == ["default/q"]  # the expected bind, committed by the app


def test_errors_read_once_answer_as_before() -> None:
    """A pod whose demand cannot be read: filter says why for every node, prioritize scores 0."""
    acct, _ = books()
    bad = b.pod("bad", 3, count=2)  # 3 units do not split over 2 GPUs
    bad["metadata"]["resourceVersion"] = "1"
    args = wire.ExtenderArgs(pod=bad, node_names=["n1", "n2"])
    result = verbs.filter_pod(acct.view(Policy.BINPACK), args)
    assert set(result.unresolvable) == {"n1", "n2"} and "split evenly" in result.unresolvable["n1"]
    assert verbs.prioritize_pod(acct.view(Policy.BINPACK), args) == [("n1", 0), ("n2", 0)]
    assert verbs.expectation(acct.view(Policy.BINPACK), args, "n1") is None


#: Edits of a pod at resourceVersion ``v`` (each writes a value of its own): what changes, and whether a
#: reading depends on it.
EDITS = [
    ("nodeName", lambda p, v: p["spec"].__setitem__("nodeName", f"n{v}"), False),
    ("assignment", lambda p, v: p["metadata"]["annotations"].__setitem__(N.assignment, f'{{"c0":[{{"uuid":"g","mib":{v}}}]}}'), False),
    ("state", lambda p, v: p["metadata"]["annotations"].__setitem__(N.allocation_state, f"s{v}"), False),
    ("status", lambda p, v: p.__setitem__("status", {"phase": "Running", "v": v}), False),
    ("label", lambda p, v: p["metadata"].setdefault("labels", {}).__setitem__("x", str(v)), False),
    ("size", lambda p, v: p["spec"]["containers"][0]["resources"]["limits"].__setitem__(N.gpu_memory, str(10 + v)), True),
    ("count", lambda p, v: p["metadata"]["annotations"].__setitem__(N.gpu_count, str(10 + v)), True),
    ("models", lambda p, v: p["metadata"]["annotations"].__setitem__(N.gpu_models, f"L{v}"), True),
    ("policy", lambda p, v: p["metadata"]["annotations"].__setitem__(N.policy, f"p{v}"), True),
    ("cpu", lambda p, v: p["spec"]["containers"][0]["resources"].setdefault("requests", {}).__setitem__("cpu", str(v)), True),
    ("init", lambda p, v: p["spec"].__setitem__("initContainers", [{"name": "i", "resources": {"limits": {N.gpu_memory: str(10 + v)}}}]), True),
    ("overhead", lambda p, v: p["spec"].__setitem__("overhead", {"cpu": str(v)}), True),
    ("any annotation", lambda p, v: p["metadata"]["annotations"].__setitem__("example.com/x", str(v)), True),
]


@pytest.mark.parametrize("seed", SEEDS)
def test_a_new_resource_version_reads_as_a_fresh_parse(seed: int) -> None:
    """A new resourceVersion that changed only what no reading depends on (the bind's nodeName and
    assignment, the status) keeps the reading without parsing again; any other change parses again.
    Either way the answer equals a fresh :func:`parsed.parse_pod` of the new object."""
    rng = random.Random(seed)
    reader = parsed.PodReader(N, 1024)
    pod = b.pod("p", 4, uid="u1", annotations={"team": "a"})
    pod["metadata"]["resourceVersion"] = "1"
    reader.read(pod)
    for rv in range(2, 8):
        pod = copy.deepcopy(pod)
        pod["metadata"]["resourceVersion"] = str(rv)
        edits = rng.sample(EDITS, rng.randint(1, 3))
        for _, edit, _ in edits:
            edit(pod, rv)
        misses, rereads = reader.misses, reader.rereads
        assert reader.read(pod) == parsed.parse_pod(pod, N, 1024), [e[0] for e in edits]
        relevant = any(r for *_, r in edits)
        assert (reader.misses - misses, reader.rereads - rereads) == ((1, 0) if relevant else (0, 1))
