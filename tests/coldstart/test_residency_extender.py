"""The residency term in the live extender (issue 23): a pod that names a model prefers, among nodes the
policy rates alike, the node that holds the model; it never lifts a node that does not fit, and a pod
without the annotation (or with a bad one) is scored as before."""
from __future__ import annotations

import dataclasses

from extender import accounting, verbs, wire
from tests.extender import builders as b
from vramshare.config import Config, Policy
from vramshare.inventory import EngineState, ResidentModel

NAMES = b.NAMES


def node_with(name: str, models=(), gib_gpus=1) -> dict:
    inv = dataclasses.replace(b.node_inventory(name, *[b.a100() for _ in range(gib_gpus)]), models=tuple(models))
    return b.gpu_node(name, b.a100(), annotation=inv.to_json())


def cluster(*nodes: dict) -> accounting.Accounting:
    acct = accounting.Accounting(Config())
    for n in nodes:
        acct.apply_node("ADDED", n)
    return acct


LLAMA = ResidentModel("meta-llama/Llama-3.1-8B", "abc", 16 << 30)


def scores(acct, pod, names, policy=Policy.FGD):
    return dict(verbs.prioritize_pod(acct.view(policy), wire.ExtenderArgs(pod=pod, node_names=names)))


def test_named_model_prefers_the_node_that_holds_it():
    names = ["n1", "n2"]
    plain = scores(cluster(node_with("n1"), node_with("n2")), b.pod("q", 20), names)
    second = min(plain, key=plain.get)  # equal nodes: the stable tie order puts this one second
    acct = cluster(*(node_with(n, [LLAMA] if n == second else []) for n in names))
    assert scores(acct, b.pod("q", 20), names) == plain  # a pod that names no model: as before
    got = scores(acct, b.pod("p", 20, annotations={NAMES.model: "meta-llama/Llama-3.1-8B"}), names)
    assert got[second] == 10 and min(got.values()) < 10
    bad = scores(acct, b.pod("r", 20, annotations={NAMES.model: "../nope"}), names)
    assert bad == plain


def test_revision_must_match_when_asked():
    names = ["n1", "n2"]
    plain = scores(cluster(node_with("n1"), node_with("n2")), b.pod("q", 20), names)
    second = min(plain, key=plain.get)
    acct = cluster(*(node_with(n, [LLAMA] if n == second else []) for n in names))
    pod = b.pod("p", 20, annotations={NAMES.model: "meta-llama/Llama-3.1-8B@other"})
    assert scores(acct, pod, names) == plain


def test_bonus_never_lifts_a_node_that_does_not_fit():
    acct = cluster(node_with("cold"), node_with("warm", [dataclasses.replace(
        LLAMA, engines=(("GPU-warm-0", EngineState.SLEEPING),))]))
    pod = b.pod("p", 90, annotations={NAMES.model: "meta-llama/Llama-3.1-8B"})  # 90 GiB fits no A100
    assert set(scores(acct, pod, ["cold", "warm"]).values()) == {0}


def test_bonus_below_one_step_does_not_beat_a_better_fragmentation_step():
    import numpy as np
    from extender.cluster import ClusterState, Demand, Slot
    from extender.placement import ask_for, rank_rows, score_nodes

    st = ClusterState(gpus_per_node=1)
    for n, used in (("a", 0), ("b", 60 * 1024), ("c", 30 * 1024)):
        st.set_node(n, [Slot(f"GPU-{n}", "A100", capacity=80 * 1024, index=0)])
        if used:
            st.add_pod(f"x/{n}", n, [(f"GPU-{n}", used)])
    for size in (20, 40, 20, 10, 60):
        st.observe([Demand(size * 1024)])
    demand = [Demand(20 * 1024)]
    names = ["a", "b", "c"]
    raw = rank_rows(ask_for(st, demand, np.array([st.row(n) for n in names])), "fgd")
    plain = dict(score_nodes(st, demand, names, "fgd"))
    best = max(plain, key=plain.get)
    for i, n in enumerate(names):
        bonus = np.zeros(3)
        bonus[i] = 0.9
        got = dict(score_nodes(st, demand, names, "fgd", bonus=bonus))
        winner = max(got, key=got.get)
        if raw[i] <= raw[names.index(best)] - 1:  # a whole step worse: the bonus cannot win it
            assert winner == best
        if raw[i] == raw.max():  # tied with the best: the bonus decides
            assert winner == n
