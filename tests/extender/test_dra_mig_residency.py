"""The residency term for DRA pods asking MIG profiles (issue 23 item 3 on the issue 24 path): on main
:meth:`extender.dra_scoring.DraCluster.score` added the bonus inside ``placement.score_nodes``, then
``mig_scores`` *replaced* the score of every node with dynamic-MIG GPUs, so a pod asking a MIG profile
on partitionable nodes never preferred the node that holds its weights.

Here: the MIG term gets the same bounded bonus (``extender.residency``'s one step rule: the policy's
step, a tenth of the raw range for a term without one), so it reorders only nodes whose MIG placement
loss is within that step, never lifts a node that cannot place the profile, and (as ``score_rows``) a
node below the best never rounds up to share the top score; the device plugin's path (MIG instances
and dynamic-MIG placements as slots of ``placement.score_rows``) already has it, pinned below.
"""
from __future__ import annotations

import dataclasses
import functools

from hypothesis import example, given, settings, strategies as st

from extender import accounting, dra_scoring, verbs, wire
from tests.extender import builders as b
from tests.extender.test_dra_mig_scoring import H100, mig_claim, mig_slices, pod
from tests.extender.test_dra_residency import ASLEEP, LLAMA, dra_node, live_dra_extender
from vramshare import contract, mig
from vramshare.config import Config, Policy
from vramshare.contract import resident_models
from vramshare.inventory import DynamicMig

NAMES = contract.Names()
MODEL = "meta-llama/Llama-3.1-8B"
PROFILES = [p.name for p in H100.profiles if not p.media]


@functools.lru_cache(maxsize=None)
def _slices(node: str) -> tuple[dict, ...]:
    return tuple(mig_slices(node))


@functools.lru_cache(maxsize=None)
def _device_of(node: str) -> dict[tuple[str, int], str]:
    """(profile, start) -> the partition device's name on ``node``'s one H100."""
    [gpu] = dra_scoring.partitions_of_slices(list(_slices(node)))
    return {(p, s): uuid.split("/", 1)[1] for uuid, p, s in gpu.devices}


def named(claim_name: str, model: str | None = MODEL) -> dict:
    out = pod(claim_name)
    if model is not None:
        out["metadata"]["annotations"] = {NAMES.model: model}
    return out


def mig_cluster(layouts: dict[str, list[mig.Placed]], asked: str) -> dra_scoring.DraCluster:
    """Nodes with one dynamic-MIG H100 each, ``layouts[node]`` held by allocated claims; the pod's own
    claim asks ``asked``."""
    dra = dra_scoring.DraCluster(NAMES, 1024)
    for node, layout in layouts.items():
        for s in _slices(node):
            dra.put("ResourceSlice", s)
        for i, pl in enumerate(layout):
            device = _device_of(node)[(pl.profile, pl.start)]
            dra.put("ResourceClaim", mig_claim(f"held-{node}-{i}", pl.profile, (node, device)))
    dra.put("ResourceClaim", mig_claim("mine", asked))
    return dra


def losses(dra: dra_scoring.DraCluster, layouts: dict[str, list[mig.Placed]], asked: str) -> dict[str, float | None]:
    """Each node's MIG placement loss (the term ``mig_scores`` scales; None: does not fit), the oracle."""
    held = dra.held_partitions()
    return {n: dra_scoring.partition_loss(dra_scoring.partitions_of_slices(list(_slices(n))), held, [asked])
            for n in layouts}


def test_tied_partitionable_nodes_prefer_the_one_holding_the_model():
    """Two empty dynamic-MIG nodes: the MIG loss ties (both score 10 without the model); the node that
    reports the pod's model must score higher, whichever of the two it is (on main both stayed 10)."""
    layouts: dict[str, list[mig.Placed]] = {"a": [], "b": []}
    dra = mig_cluster(layouts, "1g.10gb")
    plain = dict(dra.score(named("mine", None), ["a", "b"], "fgd"))
    assert plain == {"a": 10, "b": 10}
    for holder, other in (("a", "b"), ("b", "a")):
        got = dict(dra.score(named("mine"), ["a", "b"], "fgd", {holder: (LLAMA,)}))
        assert got[holder] == contract.MAX_EXTENDER_PRIORITY and got[other] < got[holder], (holder, got)
    assert dict(dra.score(named("mine", None), ["a", "b"], "fgd", {"a": (LLAMA,)})) == plain, "no model named"
    assert dict(dra.score(named("mine", f"{MODEL}@other"), ["a", "b"], "fgd", {"a": (LLAMA,)})) == plain
    assert dict(dra.score(named("mine"), ["a", "b"], "fgd", {"a": (LLAMA,)}, residency_max_steps=0)) == plain


def test_within_a_step_the_model_wins_beyond_it_the_mig_loss_does():
    """Four nodes, a 1g.10gb asked: ``best`` and ``twin`` lose alike (3/41 of the H100's potential, by
    different layouts), ``mid`` 7/41, ``far`` 15/41 (step: 1.2/41). The model on either of the tied two
    wins it the top; on ``mid`` or ``far`` (a whole step worse and more) it does not: the winner stays one
    of the least-loss nodes. (On one H100 the losses are whole 41sts, so below a step means tied.)"""
    layouts = {"best": [mig.Placed(4, "2g.20gb")], "twin": [mig.Placed(4, "1g.20gb")],
               "mid": [mig.Placed(0, "1g.10gb")], "far": []}
    dra = mig_cluster(layouts, "1g.10gb")
    loss = losses(dra, layouts, "1g.10gb")
    assert loss["best"] == loss["twin"] < loss["mid"] < loss["far"], loss  # type: ignore[operator]
    names = list(layouts)
    plain = dict(dra.score(named("mine", None), names, "fgd"))
    assert plain["best"] == plain["twin"] == 10 and plain["far"] < plain["mid"] < 10, plain
    for n in names:
        got = dict(dra.score(named("mine"), names, "fgd", {n: (ASLEEP,)}))
        top = [m for m in names if got[m] == max(got.values())]
        if n in ("best", "twin"):
            assert top == [n], (n, got)
        else:
            assert set(top) <= {"best", "twin"} and got[n] < 10, (n, got)


_layout = st.lists(st.tuples(st.sampled_from(PROFILES), st.integers(0, 7)), max_size=4)


def _valid(picks: list[tuple[str, int]]) -> list[mig.Placed]:
    """Random picks made a layout NVML allows: each pick at the nearest start still free, else dropped."""
    out: list[mig.Placed] = []
    for profile, want in picks:
        free = mig.free_starts(H100, out, profile)
        if free:
            out.append(mig.Placed(min(free, key=lambda s: (abs(s - want), s)), profile))
    return out


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(_layout, st.booleans()), min_size=2, max_size=5), st.sampled_from(PROFILES))
@example([([], False), ([], True)], "1g.10gb")  # a tie, the model on the second: main's shape of the fault
@example([([("3g.40gb", 4)], True), ([("1g.10gb", 6)], False), ([], True)], "1g.10gb")  # a step apart
@example([([], False), ([("1g.10gb", 0)], True), ([("1g.10gb", 6)], False)], "1g.20gb")  # 1.1 steps: rounds to 10
def test_the_bonus_never_flips_a_mig_order(nodes, asked):
    """The bound of test_dra_residency.py's test_the_bonus_never_flips_a_fit_order on the MIG term: a
    node whose MIG loss is a whole step (a tenth of the fitting nodes' loss range) worse never beats the
    better one by the bonus, one that cannot place the profile keeps 0, the winner is within a step of
    the least loss, and among the least-loss nodes one that holds the model wins."""
    layouts = {f"n{i}": _valid(picks) for i, (picks, _) in enumerate(nodes)}
    holders = {f"n{i}" for i, (_, h) in enumerate(nodes) if h}
    dra = mig_cluster(layouts, asked)
    names = list(layouts)
    models = {n: (ASLEEP,) for n in holders}
    plain = dict(dra.score(named("mine"), names, "fgd"))
    got = dict(dra.score(named("mine"), names, "fgd", models))
    loss = losses(dra, layouts, asked)
    fits = [n for n in names if loss[n] is not None]
    assert all(got[n] == plain[n] == 0 for n in names if n not in fits), "the bonus lifted a node that cannot fit"
    assert dict(dra.score(named("mine"), names, "fgd", models, residency_max_steps=0)) == plain, "max steps 0: off"
    if not fits:
        return
    fl = {n: loss[n] for n in fits}
    lo, hi = min(fl.values()), max(fl.values())  # type: ignore[type-var]
    step = (hi - lo) / 10  # type: ignore[operator]
    winner = max(got, key=got.get)  # type: ignore[arg-type]
    assert winner in fits and fl[winner] - lo <= 0.9 * step + 1e-12, (winner, fl, got)  # type: ignore[operator]
    if any(n in holders for n in fits if fl[n] == lo):
        top = [n for n in names if got[n] == max(got.values())]
        assert set(top) <= holders, f"among the least-loss nodes the one with the model wins: {top}, {got}"
    for a in fits:
        for c in fits:
            if fl[a] + step <= fl[c] and step > 0:  # type: ignore[operator]
                assert got[a] >= got[c], (a, c, fl, got)
    if not holders & set(fits):
        assert got == plain, "no fitting node holds the model: scores as before"


def test_through_the_live_extender():
    """Slices and claims by its DRA watch, the Nodes' resident-models by its node watch, prioritize's
    HTTP handler: the MIG pod naming its model goes to the partitionable node that holds it."""
    slices = [s for node in ("a", "b") for s in _slices(node)]
    with live_dra_extender(slices, [mig_claim("mine", "1g.10gb")], ["a", "b"]) as (api, ext, scores):
        assert scores(named("mine")) == {"a": 10, "b": 10}, "the MIG term ties"
        for n in ("a", "b"):
            api.create_node(dra_node(n, resident_models.encode([LLAMA] if n == "b" else [])))
        assert api.wait_for(lambda a: "b" in ext.app.acct.models, timeout=20)
        got = scores(named("mine"))
        assert got["b"] == 10 and got["a"] < 10, got
        assert scores(named("mine", None)) == {"a": 10, "b": 10}, "a pod that names no model: as before"


# The device plugin's path: MIG instances (static) and dynamic-MIG placements are slots that
# placement.score_rows scores, and its bonus reaches them; pinned so the two paths stay alike.

def _dp_node(name: str, kind: str, models=()) -> dict:
    """An H100 node of the device plugin: a static 1g.10gb instance, or dynamic MIG (``isolation``:
    its device plugin also serves ``isolation: mig`` memory asks)."""
    gpu = b.h100(mig=(("1g.10gb", 9856),))
    inv = b.node_inventory(name, gpu)
    if kind != "static":
        [g] = inv.gpus
        g = dataclasses.replace(g, mig=(), dynamic_mig=DynamicMig(
            table=H100.name, instances=(), free=tuple((p, tuple(mig.free_starts(H100, [], p))) for p in PROFILES),
            isolation=kind == "isolation"))
        inv = dataclasses.replace(inv, gpus=(g,))
    inv = dataclasses.replace(inv, models=tuple(models))
    return b.gpu_node(name, gpu, annotation=inv.to_json())


def test_the_device_plugin_path_gives_mig_pods_the_bonus_too():
    """No gap there (passes on main): MIG demands are slots of ``placement.score_rows``, which adds the
    bonus for every kind; a static instance, a dynamic placement, an ``isolation: mig`` memory ask."""
    pods = {"static": b.pod("p", mig={"1g.10gb": 1}, annotations={NAMES.model: MODEL}),
            "dynamic": b.pod("p", mig={"1g.10gb": 1}, annotations={NAMES.model: MODEL}),
            "isolation": b.pod("p", 15, annotations={NAMES.model: MODEL, NAMES.isolation: "mig"})}
    for kind, ask in pods.items():
        names = ["n1", "n2"]
        plain_acct = accounting.Accounting(Config())
        for n in names:
            plain_acct.apply_node("ADDED", _dp_node(n, kind))

        def scores(acct: accounting.Accounting) -> dict[str, int]:
            return dict(verbs.prioritize_pod(acct.view(Policy.FGD), wire.ExtenderArgs(pod=ask, node_names=names)))
        plain = scores(plain_acct)
        assert max(plain.values()) == 10, (kind, plain)
        second = min(plain, key=plain.get)  # type: ignore[arg-type]
        assert plain[second] < 10, (kind, plain)
        acct = accounting.Accounting(Config())
        for n in names:
            acct.apply_node("ADDED", _dp_node(n, kind, [LLAMA] if n == second else []))
        got = scores(acct)
        assert got[second] == 10 and min(got.values()) < 10, (kind, got)
