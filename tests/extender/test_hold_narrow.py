"""The narrower hold through the real binder and the API double: same-size pods are assumed together on a
node only on the same GPUs, the bind takes the held GPUs over the policy's choice, and with the device
plugin's real steering every pod lands on its own plan (books equal reality before any report).
"""
from __future__ import annotations

import json
import os
import random
from typing import Iterator

import pytest

from deviceplugin.kubelet import steering
from extender import accounting, apicalls, binder, holds, verbs, wire
from standins.apiserver import PODS, ApiServerDouble
from tests.extender import builders as b
from vramshare import contract, podspec
from vramshare.config import Config, ExtenderConfig, Policy
from vramshare.kube import api_client_for

N = b.NAMES
SEC = 1_000_000_000
T0 = 1_700_000_000 * SEC
UNIT = 1024
SEEDS = range(int(os.environ.get("VRAMSHARE_PROPERTY_SEEDS", "60")) // 4)


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> int:
        return self.now


class World:
    """The extender's accounting and binder against the API double; the watch is fed by hand."""

    def __init__(self, double: ApiServerDouble, api: object, policy: Policy = Policy.BINPACK) -> None:
        self.double, self.clock, self.policy = double, Clock(), policy
        self.acct = accounting.Accounting(Config(extender=ExtenderConfig(
            hold_timeout_seconds=30, assume_timeout_seconds=60, policy=policy)), self.clock)
        self.bind = binder.Binder(self.acct, apicalls.Kube(api), policy, clock=self.clock)
        for node in (b.gpu_node("n1", b.l4(), b.l4()), b.gpu_node("n2", b.l4())):
            self.acct.apply_node("ADDED", double.create_node(node))

    def create(self, pod: dict) -> dict:
        pod = self.double.create_pod(pod)
        self.acct.apply_pod("ADDED", pod)
        return pod

    def watch(self, name: str) -> dict:
        pod = self.double.get_pod("default", name)
        self.acct.apply_pod("MODIFIED", pod)
        return pod

    def bind_to(self, pod: dict, node: str) -> binder.BindOutcome:
        meta = pod["metadata"]
        out = self.bind.bind(wire.BindingArgs(meta["name"], "default", meta["uid"], node))
        self.watch(meta["name"])
        return out

    def filter(self, pod: dict, nodes: list[str]) -> wire.FilterResult:
        return verbs.filter_pod(self.acct.view(self.policy), wire.ExtenderArgs(pod=pod, node_names=nodes))

    def prioritize(self, pod: dict, nodes: list[str]) -> list[tuple[str, int]]:
        return verbs.prioritize_pod(self.acct.view(self.policy), wire.ExtenderArgs(pod=pod, node_names=nodes))


@pytest.fixture
def world(double: ApiServerDouble) -> Iterator[World]:
    with api_client_for(double.url) as api:
        yield World(double, api)


def plan(pod: dict) -> list[tuple[str, int]]:
    text = pod["metadata"]["annotations"][N.assignment]
    return sorted((e["uuid"], e["mib"]) for es in json.loads(text).values() for e in es)


def test_bind_takes_the_held_gpu_over_the_policys_choice_and_refuses_when_it_is_full(world: World) -> None:
    big = world.create(b.pod("big", 12))
    assert world.bind_to(big, "n1").error == ""
    assert plan(world.watch("big")) == [("GPU-n1-0", 12288)]  # binpack: the first GPU
    world.double.update(PODS, "default", "big", lambda p: p["metadata"]["annotations"].update(
        {N.allocation_state: contract.STATE_ALLOCATED}), manager=contract.FIELD_MANAGER_DEVICE_PLUGIN)
    world.watch("big")
    first = world.create(b.pod("first", 8))
    world.acct.apply_pod("MODIFIED", b.assigned(first, "n1", [("GPU-n1-1", 8192)], T0))  # planned on GPU 1
    second = world.create(b.pod("second", 8))
    out = world.bind_to(second, "n1")
    assert out.error == "", out.error
    assert plan(world.watch("second")) == [("GPU-n1-1", 8192)]  # binpack alone would take GPU 0 (10 GiB free)
    third = world.create(b.pod("third", 8))
    out = world.bind_to(third, "n1")  # GPU 1 has 6 GiB left: a third plan would make steering ambiguous
    assert out.result == "held" and "held for pod default/" in out.error and "6144 MiB free" in out.error
    assert N.assignment not in (world.double.get_pod("default", "third")["metadata"].get("annotations") or {})
    assert world.bind_to(world.create(b.pod("small", 4)), "n1").error == ""  # other sizes are never held


def test_a_pod_of_another_shape_of_the_same_size_waits(world: World) -> None:
    first = world.create(b.pod("first", 8))
    assert world.bind_to(first, "n1").error == ""
    split = world.create(b.pod("split", 8, count=2))  # 2 x 4 units on two GPUs: also (gpu-memory, 8)
    out = world.bind_to(split, "n1")
    assert out.result == "held" and "GPU(s) of kind shared where container c0 needs 2" in out.error
    assert world.bind_to(split, "n2").result == "no_fit"  # n2 has one GPU


def test_pods_expected_on_one_node_do_not_refuse_each_others_bind(world: World) -> None:
    """Both passed filter and were prioritized onto n1 before either bind (concurrent kube-scheduler
    cycles): expected holds route filter only, so the first bind takes a plan and the second follows."""
    a, c = world.create(b.pod("a", 8)), world.create(b.pod("c", 8))
    sig = frozenset({(N.gpu_memory, 8)})
    for p in (a, c):
        world.acct.expect_bind(f"default/{p['metadata']['name']}", "n1", sig)
    out = world.filter(b.pod("d", 8), ["n1", "n2"])
    assert out.passed == ["n2"] and "being bound here" in out.failed["n1"]
    assert world.bind_to(a, "n1").error == ""
    assert world.bind_to(c, "n1").error == ""
    assert plan(world.watch("a")) == plan(world.watch("c"))


# -- the rule, pure ----------------------------------------------------------------------------------
def demand(p: dict) -> podspec.PodDemand:
    return podspec.pod_demand(p, N)


def test_plans_of_names_one_plan_per_size_and_none_where_a_pods_own_containers_differ() -> None:
    two = b.pod("two", 4, containers=2)
    same = holds.plans_of(demand(two), N, {"c0": [("G0", 4096)], "c1": [("G0", 4096)]})
    assert same == {(N.gpu_memory, 4): (("G0", 4096),)}
    differ = holds.plans_of(demand(two), N, {"c0": [("G0", 4096)], "c1": [("G1", 4096)]})
    assert differ == {(N.gpu_memory, 4): None}
    assert holds.plans_of(demand(two), N, {"c0": [("G0", 4096)]}) == {(N.gpu_memory, 4): None}  # c1 unplanned
    init = b.pod("init", 8)
    init["spec"]["initContainers"] = [{"name": "i", "resources": {"limits": {N.gpu_memory: "2"}}}]
    assert holds.plans_of(demand(init), N, {"c0": [("G0", 8192)], "i": [("G0", 2048)]}) == {
        (N.gpu_memory, 8): (("G0", 8192),), (N.gpu_memory, 2): (("G0", 2048),)}
    tp2 = holds.plans_of(demand(b.pod("tp2", 8, count=2)), N, {"c0": [("G1", 4096), ("G0", 4096)]})
    assert tp2 == {(N.gpu_memory, 8): (("G0", 4096), ("G1", 4096))}  # order-free


def test_required_follows_real_holds_and_blocks_on_unknown_or_disagreeing_plans() -> None:
    h = holds.Holds(30 * SEC)
    e4, e8 = (N.gpu_memory, 4), (N.gpu_memory, 8)
    h.hold("a", "n1", frozenset({e4, e8}), T0, {e4: (("G0", 4096),), e8: (("G1", 8192),)})
    need = h.required("n1", "new", frozenset({e4}), T0)
    assert need.blocker is None and need.plans == {e4: (("G0", 4096),)} and need.holders[e4].pod == "a"
    assert h.required("n1", "new", frozenset({(N.gpu_memory, 2)}), T0) == holds.Required()  # other sizes
    assert h.required("n2", "new", frozenset({e4}), T0) == holds.Required()  # other nodes
    h.hold("b", "n1", frozenset({e4}), T0, {e4: (("G1", 4096),)})  # a second plan (a restart, a timeout)
    assert h.required("n1", "new", frozenset({e4}), T0).blocker is not None
    assert h.required("n1", "new", frozenset({e8}), T0).plans == {e8: (("G1", 8192),)}
    h.release("b")
    h.hold("self-ambiguous", "n1", frozenset({e8}), T0, {e8: None})
    assert h.required("n1", "new", frozenset({e8}), T0).blocker.pod == "self-ambiguous"
    h.release("self-ambiguous")
    h.expect("x", "n1", frozenset({e4}), T0)  # prioritized here, not bound yet: its plan is unknown
    assert h.required("n1", "new", frozenset({e4}), T0).blocker.pod == "x"  # filter goes elsewhere
    assert h.required("n1", "new", frozenset({e4}), T0, binding=True).plans == {e4: (("G0", 4096),)}
    assert h.required("n1", "new", frozenset({e4}), T0 + 31 * SEC, binding=True) == holds.Required()  # timed out


# -- the property ---------------------------------------------------------------------------------
SHAPES = [(4, 1), (8, 1), (8, 1), (6, 1), (8, 2)]  # (units, gpu-count)


def assumed_on(world: World, node: str) -> list[dict]:
    return [p for p in world.double.pods() if (p.get("spec") or {}).get("nodeName") == node
            and (p["metadata"].get("annotations") or {}).get(N.allocation_state) == contract.STATE_ASSUMED
            and (p.get("status") or {}).get("phase") == "Pending"]


def check_one_plan_per_size(world: World, where: str) -> int:
    """The regression: never two same-size pods assumed on one node with different plans. Returns how
    many (node, size) pairs have several assumed pods (the narrower hold at work)."""
    together = 0
    for node in ("n1", "n2"):
        by_element: dict[holds.Element, set] = {}
        for p in assumed_on(world, node):
            want = podspec.pod_demand(p, N)
            containers = {c: [(e["uuid"], e["mib"]) for e in es]
                          for c, es in json.loads(p["metadata"]["annotations"][N.assignment]).items()}
            for e, pl in holds.plans_of(want, N, containers).items():
                by_element.setdefault(e, set()).add(pl)
        for e, plans in by_element.items():
            assert len(plans) == 1 and None not in plans, f"{where}: {node} {e}: assumed with plans {plans}"
        together += sum(1 for e in by_element if sum(
            1 for p in assumed_on(world, node) if e in holds.plans_of(podspec.pod_demand(p, N), N, {})) > 1)
    return together


@pytest.mark.parametrize("seed", SEEDS)
def test_same_plan_pods_assumed_together_each_land_on_their_plan(double: ApiServerDouble, seed: int) -> None:
    """Bursts of same-size replicas through filter, prioritize and the real bind; a kubelet that admits
    assumed pods in random order, steered by the device plugin's real steering (free devices counted
    per GPU), reporting ``allocated``; deletions. After every step: no two same-size pods assumed on a
    node with different plans, every admitted pod got exactly its own plan, no GPU over capacity; at
    the end the books equal reality. Fails on the old hold (one assumed pod per size per node): the
    replicas of a burst are never assumed together there."""
    rng = random.Random(seed)
    with api_client_for(double.url) as api:
        world = World(double, api, rng.choice([Policy.BINPACK, Policy.FGD]))
        cap = {s.uuid: s.capacity // UNIT for ns in world.acct.slots.values() for s in ns}
        node_of = {s.uuid: n for n, ns in world.acct.slots.items() for s in ns}
        real: dict[str, dict[str, int]] = {}  # pod name -> GPU -> units the kubelet gave
        made, together = 0, 0
        for step in range(24):
            where = f"seed {seed} step {step}"
            world.clock.now += SEC // 10
            action = "burst" if step == 0 else rng.choice(["burst", "burst", "admit", "admit", "delete"])
            if action == "burst":
                units, count = rng.choice(SHAPES)
                for _ in range(rng.randint(2, 4)):
                    pod = world.create(b.pod(f"p{made}", units, count=count))
                    made += 1
                    passed = world.filter(pod, ["n1", "n2"]).passed
                    if not passed:
                        continue
                    scores = world.prioritize(pod, passed)
                    node = max(scores, key=lambda s: s[1])[0]
                    out = world.bind_to(pod, node)
                    assert out.error == "", f"{where}: filter passed {node}, bind said {out.error}"
            elif action == "admit":
                pending = [p for n in ("n1", "n2") for p in assumed_on(world, n) if p["metadata"]["name"] not in real]
                for p in rng.sample(pending, min(len(pending), rng.randint(1, 3))):
                    admit(world, p, real, cap, node_of, rng, where)
            elif world.double.pods():
                name = rng.choice(sorted(p["metadata"]["name"] for p in world.double.pods()))
                world.acct.apply_pod("DELETED", world.double.finish_pod_deletion("default", name))  # the kubelet ended it
                real.pop(name, None)
            together += check_one_plan_per_size(world, where)
            for g in cap:
                assert sum(r.get(g, 0) for r in real.values()) <= cap[g], f"{where}: {g} over capacity"
        for n in ("n1", "n2"):  # settle: the kubelet admits everything still assumed
            for p in assumed_on(world, n):
                if p["metadata"]["name"] not in real:
                    admit(world, p, real, cap, node_of, rng, f"seed {seed} settle")
        books = {u.slot.uuid: u.used for n in world.acct.slots for u in world.acct.state.node_usage(n)}
        reality = {g: sum(r.get(g, 0) for r in real.values()) * UNIT for g in cap}
        assert books == reality, f"seed {seed}: books {books} != reality {reality}"
        assert together > 0, f"seed {seed}: no burst was ever assumed together on one node"


def admit(world: World, pod: dict, real: dict[str, dict[str, int]], cap: dict[str, int],
          node_of: dict[str, str], rng: random.Random, where: str) -> None:
    """The kubelet admits ``pod``: the device plugin steers (deviceplugin.kubelet.steering), the kubelet takes
    the preferred devices if free, else any free ones; then the reconcile reports ``allocated``."""
    name, node = pod["metadata"]["name"], pod["spec"]["nodeName"]
    size = int(pod["spec"]["containers"][0]["resources"]["limits"][N.gpu_memory])
    free = {g: cap[g] - sum(r.get(g, 0) for r in real.values()) for g in cap if node_of[g] == node}
    hint = steering.steer(world.double.pods(), N, node, N.gpu_memory, size, UNIT, free)
    own = {u: m // UNIT for u, m in plan(pod)}
    got: dict[str, int] = {}
    if hint.targets is not None:
        got = dict(hint.targets)
    else:
        for g in rng.sample(sorted(free), len(free)):
            take = min(free[g], size - sum(got.values()))
            if take > 0:
                got[g] = take
    assert sum(got.values()) == size, f"{where}: {name} cannot be admitted on {node} ({free})"
    assert got == own, f"{where}: {name} planned {own} got {got} ({hint.reason or hint.pod})"
    real[name] = got
    text = json.dumps({"c0": [{"uuid": g, "mib": u * UNIT} for g, u in sorted(got.items())]})
    world.double.update(PODS, "default", name, lambda p: p["metadata"]["annotations"].update(
        {N.assignment: text, N.allocation_state: contract.STATE_ALLOCATED}), manager=contract.FIELD_MANAGER_DEVICE_PLUGIN)
    world.watch(name)


# -- issue 18 item 6: a node whose device plugin does not report -----------------------------------
def test_holds_on_a_node_whose_plugin_never_reports_shorten_and_recover_on_a_report() -> None:
    """On main every hold on such a node lasted the whole timeout: a burst of one size bound one
    replica per node per 30 s (160 replicas of 79 GiB took minutes). ``Required()``: nothing held."""
    e = (N.gpu_memory, 79)
    h = holds.Holds(30 * SEC)
    h.hold("a", "n1", frozenset({e}), T0, {e: (("G0", 79 * UNIT),)})
    size = frozenset({e})
    assert h.required("n1", "b", size, T0 + 4 * SEC) != holds.Required()  # a plugin may still report
    assert h.required("n1", "b", size, T0 + 6 * SEC) == holds.Required()  # silent: "a" waited 5 s unreported
    assert "n1" in h.silent
    h.hold("b", "n1", frozenset({e}), T0 + 6 * SEC, {e: (("G1", 79 * UNIT),)})
    assert h.required("n1", "c", size, T0 + 7 * SEC) != holds.Required()  # a short hold still steers
    assert h.required("n1", "c", size, T0 + 8 * SEC) == holds.Required()  # ... for 2 s
    h.reported("n1", T0 + 9 * SEC)  # the plugin is back
    assert "n1" not in h.silent
    assert len(h) == 0  # the holds that gave way stay ended: never two plans of one size come back
    h.hold("c", "n1", frozenset({e}), T0 + 10 * SEC, {e: (("G2", 79 * UNIT),)})
    assert h.required("n1", "d", size, T0 + 14 * SEC) != holds.Required()  # full holds again


def test_a_silent_node_is_learned_per_node(world: World) -> None:
    """Through the accounting: n1's plugin reports, n2's does not; only n2's holds shorten."""
    for name, node in (("p1", "n1"), ("p2", "n2")):
        pod = world.create(b.pod(name, 8))
        assert world.bind_to(pod, node).error == ""
    world.double.update(PODS, "default", "p1", lambda p: p["metadata"]["annotations"].update(
        {N.allocation_state: contract.STATE_ALLOCATED}), manager=contract.FIELD_MANAGER_DEVICE_PLUGIN)
    world.watch("p1")
    world.clock.now += 6 * SEC
    q1 = world.create(b.pod("q1", 8))
    assert world.bind_to(q1, "n1").error == ""
    world.clock.now += 3 * SEC
    world.acct.expire()
    assert "n2" in world.acct.holds.silent and "n1" not in world.acct.holds.silent
    q2 = world.create(b.pod("q2", 8))
    assert "n2" in world.filter(q2, ["n1", "n2"]).passed  # p2's hold on n2 is over


def test_a_hold_cut_on_a_silent_node_is_not_taken_again_by_a_later_event() -> None:
    """A relist re-applies every pod: the hold that gave way must not come back beside the newer plan."""
    e = (N.gpu_memory, 10)
    h = holds.Holds(30 * SEC)
    h.hold("a", "n1", frozenset({e}), T0, {e: (("G0", 10 * UNIT),)})
    assert h.required("n1", "b", frozenset({e}), T0 + 6 * SEC) == holds.Required()  # silent: cut
    h.hold("b", "n1", frozenset({e}), T0 + 6 * SEC, {e: (("G1", 10 * UNIT),)})
    h.reported("n1", T0 + 7 * SEC)
    h.hold("a", "n1", frozenset({e}), T0, {e: (("G0", 10 * UNIT),)})  # the relist's event for "a"
    assert h.held_pods() == ["b"]


def test_a_silent_node_is_scored_the_minimum(world: World) -> None:
    """Placement elsewhere first: n2's plugin does not report; binpack preferred it (its GPU is in use),
    now it scores the minimum, and filter still passes it (it is not full)."""
    p2 = world.create(b.pod("p2", 8))
    assert world.bind_to(p2, "n2").error == ""
    q = world.create(b.pod("q", 2))
    before = dict(world.prioritize(q, ["n1", "n2"]))
    assert before["n2"] > before["n1"]
    world.clock.now += 6 * SEC
    world.acct.expire()
    assert "n2" in world.acct.holds.silent
    after = dict(world.prioritize(q, ["n1", "n2"]))
    assert after == {"n1": before["n1"], "n2": contract.MIN_EXTENDER_PRIORITY}
    assert "n2" in world.filter(q, ["n1", "n2"]).passed


def test_where_every_candidate_is_silent_the_policy_scores_stand(world: World) -> None:
    p2 = world.create(b.pod("p2", 8))
    assert world.bind_to(p2, "n2").error == ""
    q = world.create(b.pod("q", 2))
    before = world.prioritize(q, ["n2"])
    world.clock.now += 6 * SEC
    world.acct.expire()
    assert "n2" in world.acct.holds.silent and world.prioritize(q, ["n2"]) == before


def test_a_restarted_extender_does_not_take_every_node_for_silent() -> None:
    """A new extender process (a kill, a rolling update, a failover) rebuilds holds from the assumed pods'
    assume times, all in its past, before any device plugin report could reach it. On 0fd81fb every node
    with a hold older than 5 s was found silent at once and its holds cut: the next same-size pod took
    another plan beside the one still written on the pending pod, and the device plugin could no longer
    steer.
    Silence is judged over what this process could have heard."""
    from extender import accounting
    from tests.extender.test_accounting import Clock
    from vramshare.config import Config, ExtenderConfig, Policy

    e = (N.gpu_memory, 8)
    clock = Clock()
    clock.now = T0 + 20 * SEC  # the new process starts 20 s after "a" was assumed
    acct = accounting.Accounting(Config(extender=ExtenderConfig(policy=Policy.SPREAD)), clock)
    acct.apply_node("ADDED", b.gpu_node("n1", b.a100(), b.a100()))
    acct.apply_pod("ADDED", b.assigned(b.pod("a", 8), "n1", [("GPU-n1-0", 8 * UNIT)], T0))
    need = acct.hold_required("default/b", "n1", frozenset({e}))
    assert "n1" not in acct.holds.silent
    assert need.blocker is None and need.plans == {e: (("GPU-n1-0", 8 * UNIT),)}  # "b" follows "a"'s plan
    clock.now += 6 * SEC  # then 6 s with no report from n1 since this process began: silent after all
    acct.expire()
    assert "n1" in acct.holds.silent


@pytest.mark.parametrize("ended", ["timeout", "silent"])
def test_after_a_hold_ends_a_same_size_pod_still_takes_the_pending_pod_s_gpus_when_they_have_room(
        double: ApiServerDouble, ended: str) -> None:
    """A hold ends without the pod reported (30 s, or 2 s on a silent node): the next same-size pod may bind
    there, but its own policy's GPU (spread: the empty one) beside the plan still written on the pending
    pod leaves the device plugin two plans for one size: it steers neither.
    Taking the pending pod's GPUs when they have room keeps one plan; when they do not, the policy's
    choice, never a wait (on 0fd81fb the policy's choice always)."""
    with api_client_for(double.url) as api:
        world = World(double, api, policy=Policy.SPREAD)
        a = world.create(b.pod("a", 8))
        assert world.bind_to(a, "n1").error == ""
        world.clock.now += (31 if ended == "timeout" else 6) * SEC
        world.acct.expire()
        assert world.acct.holds.held_pods() == [] and (ended == "timeout" or "n1" in world.acct.holds.silent)
        c = world.create(b.pod("c", 8))
        assert world.bind_to(c, "n1").error == ""
        assert plan(world.watch("c")) == plan(world.watch("a")), "another plan beside the pending pod's"
        world.clock.now += 31 * SEC
        world.acct.expire()
        e = world.create(b.pod("e", 8))  # a third 8 GiB does not fit that L4: the policy's GPU, no wait
        assert world.bind_to(e, "n1").error == ""
        assert plan(world.watch("e"))[0][0] != plan(world.watch("a"))[0][0]
