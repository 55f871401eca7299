"""Issue 24, ``isolation: mig`` in the extender: a memory ask maps to the smallest fitting profile.

The pod is read the one way every verb reads it (``translate.pod_asks``), placed by the policy, refined
by the fragmentation term and booked; any order of such binds and departures never books overlapping
partitions, each pod gets exactly the smallest profile of its GPU's table that holds its ask, and an ask
no profile holds fits nowhere, with the reason. On main the annotation was ignored: the ask was plain
shared memory and fit no dynamic-MIG GPU at all (or, on a shared GPU, landed there unisolated).
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extender import cluster, mig_books, placement, reasons, translate
from extender.fit import Ask
from vramshare import contract, mig, mig_plan, podspec

from vramshare.inventory import NodeInventory

from .test_extender_books import A, B, TABLE, inventory

NAMES = contract.Names()


def state_with(existing: tuple[tuple[str, int], ...] = (), isolation: bool = True) -> cluster.ClusterState:
    """Two dynamic-MIG A100s whose device plugin serves isolation: mig (inventory ``dynamicMig.isolation``)."""
    inv = inventory(existing)
    inv = dataclasses.replace(inv, gpus=tuple(dataclasses.replace(
        g, dynamic_mig=dataclasses.replace(g.dynamic_mig, isolation=isolation)) for g in inv.gpus))
    state = cluster.ClusterState()
    state.set_node("n", translate.slots_from_inventory(NodeInventory.from_json(inv.to_json())))
    return state


def iso_pod(units: int, isolation: str | None = "mig", **ann: str) -> dict:
    annotations = {NAMES.isolation: isolation, **ann} if isolation is not None else dict(ann)
    return {"metadata": {"name": "p", "namespace": "default", "annotations": annotations},
            "spec": {"containers": [{"name": "c", "resources": {"limits": {NAMES.gpu_memory: str(units)}}}]}}


def bind(state: cluster.ClusterState, key: str, units: int) -> list[tuple[str, int]] | None:
    demands = translate.demands_of(translate.pod_asks(iso_pod(units), NAMES, 1024))
    try:
        picks = placement.pick(state, demands, "n", "binpack")
        picks = mig_books.refine(state, "n", [d.kind for d in demands], picks)
    except (cluster.NoFit, ValueError):
        return None
    pairs = [pair for ps in picks for pair in ps]
    state.add_pod(key, "n", pairs)
    return pairs


def test_the_annotation_turns_the_memory_ask_into_a_partition_ask():
    [d] = translate.demands_of(translate.pod_asks(iso_pod(15), NAMES, 1024))
    assert (d.kind, d.per_gpu, d.count) == (cluster.MIG_FIT, 15 * 1024, 1)
    [plain] = translate.demands_of(translate.pod_asks(iso_pod(15, None), NAMES, 1024))
    assert plain.kind == cluster.SHARED


@pytest.mark.parametrize("ann, why", [
    ({NAMES.isolation: "gpu"}, "is not an isolation vramshare serves"),
    ({NAMES.isolation: "mig", NAMES.gpu_count: "2"}, "one MIG partition on one GPU")])
def test_a_bad_isolation_is_refused_with_the_reason(ann, why):
    pod = iso_pod(16, None, **ann)
    with pytest.raises(podspec.PodSpecError, match=why):
        podspec.pod_demand(pod, NAMES)


def test_the_smallest_fitting_profile_is_booked_and_a_plain_memory_ask_never_lands_on_the_mig_gpu():
    state = state_with()
    pairs = bind(state, "p1", 15)
    assert pairs is not None and len(pairs) == 1
    plan = mig_plan.parse(pairs[0][0])
    assert plan.profile == "1g.20gb" and pairs[0][1] == 20480  # 15 GiB: 1g.20gb, not 2g.20gb or 3g.40gb
    plain = translate.demands_of(translate.pod_asks(iso_pod(4, None), NAMES, 1024))
    with pytest.raises(cluster.NoFit):
        placement.pick(state, plain, "n", "binpack")  # only MIG GPUs here: shared memory fits nowhere


def test_an_ask_no_profile_holds_fits_nowhere_and_says_why():
    state = state_with()
    assert bind(state, "big", 81) is None
    demands = tuple(translate.demands_of(translate.pod_asks(iso_pod(81), NAMES, 1024)))
    why = reasons.why_not(Ask(state, demands, np.array([0])), 0)
    assert why == "no MIG profile holds 81 GiB (isolation: mig); the largest on this node is 80 GiB"


def test_a_node_whose_plugin_does_not_serve_isolation_gets_no_isolated_pod():
    """An older device plugin (or one without the pod cache) would grant shared units of another GPU."""
    state = state_with(isolation=False)
    assert bind(state, "p", 8) is None
    demands = tuple(translate.demands_of(translate.pod_asks(iso_pod(8), NAMES, 1024)))
    assert reasons.why_not(Ask(state, demands, np.array([0])), 0).startswith(
        "the node's device plugin does not serve isolation: mig")
    assert bind(state_with(isolation=True), "p", 8) is not None


def test_a_node_without_dynamic_mig_says_so():
    state = cluster.ClusterState()
    state.set_node("n", [cluster.Slot(uuid="GPU-s", model="H100", kind=cluster.SHARED, capacity=81920)])
    demands = tuple(translate.demands_of(translate.pod_asks(iso_pod(8), NAMES, 1024)))
    assert reasons.why_not(Ask(state, demands, np.array([0])), 0).startswith("node has no GPU with dynamic MIG")


@settings(max_examples=60, deadline=None)
@given(existing=st.sampled_from([(), (("3g.40gb", 0),), (("1g.10gb", 6), ("2g.20gb", 0))]),
       ops=st.lists(st.one_of(st.integers(1, 90), st.just(-1)), min_size=1, max_size=14),
       data=st.data())
def test_isolated_memory_asks_never_overlap_partitions_in_any_order(existing, ops, data):
    state = state_with(existing)
    live: dict[str, tuple[int, str]] = {}
    for n, op in enumerate(ops):
        if op == -1:
            if live:
                gone = data.draw(st.sampled_from(sorted(live)))
                state.remove_pod(gone)
                live.pop(gone)
            continue
        pairs = bind(state, f"p{n}", op)
        want = mig.smallest_fitting(TABLE, op * 1024)
        if want is None:
            assert pairs is None  # no profile holds it: refused, never something smaller
            continue
        if pairs is not None:
            [(uuid, mib)] = pairs
            plan = mig_plan.parse(uuid)
            assert plan.profile == want.name and mib == want.memory_mib and mib >= op * 1024
            live[f"p{n}"] = (op, uuid)
        # the booked plans and the instances NVML shows always form a layout NVIDIA accepts
        for gpu in (A, B):
            planned = [mig_plan.parse(u).placed for _, u in live.values() if mig_plan.parse(u).gpu_uuid == gpu]
            shown = [mig.Placed(s, p) for p, s in existing] if gpu == A else []
            assert mig.check_layout(TABLE, list(dict.fromkeys([*shown, *planned]))) == [], (gpu, planned, shown)
            assert len(set(planned)) == len(planned)  # never two pods on one partition


def test_the_inventory_flag_round_trips_and_a_bad_one_is_refused_by_name():
    inv = inventory()
    flagged = dataclasses.replace(inv, gpus=(dataclasses.replace(
        inv.gpus[0], dynamic_mig=dataclasses.replace(inv.gpus[0].dynamic_mig, isolation=True)), inv.gpus[1]))
    back = NodeInventory.from_json(flagged.to_json())
    assert back == flagged and back.gpus[1].dynamic_mig.isolation is False
    assert '"isolation"' not in inv.to_json()  # absent when false: older readers see what they saw
    bad = flagged.to_json().replace('"isolation":true', '"isolation":"yes"')
    with pytest.raises(ValueError, match=r"gpus\[0\]\.dynamicMig\.isolation: expected true or false"):
        NodeInventory.from_json(bad)


@pytest.mark.parametrize("policy", ["binpack", "spread", "fgd"])
def test_filter_and_prioritize_score_isolated_asks_on_a_mixed_cluster(policy):
    """A shared-GPU node and a dynamic-MIG node: the isolated pod fits only the MIG node (the shared one
    says why), and every policy scores it there; a plain ask is the reverse."""
    from extender import placement as pl
    state = state_with()
    state.set_node("s", [cluster.Slot(uuid="GPU-s", model="NVIDIA H100 80GB HBM3", kind=cluster.SHARED,
                                      capacity=81920)])
    iso = translate.demands_of(translate.pod_asks(iso_pod(15), NAMES, 1024))
    fitting, failed = pl.filter_nodes(state, iso, ["n", "s"])
    assert fitting == ["n"] and failed["s"].startswith("node has no GPU with dynamic MIG")
    scores = dict(pl.score_nodes(state, iso, ["n", "s"], policy))
    assert scores["n"] == 10 and scores["s"] == 0
    plain = translate.demands_of(translate.pod_asks(iso_pod(15, None), NAMES, 1024))
    assert pl.filter_nodes(state, plain, ["n", "s"])[0] == ["s"]
