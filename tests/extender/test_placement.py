"""filter_nodes / score_nodes / pick: the calls the HTTP extender and the simulator share."""
from __future__ import annotations

import pytest

from extender.cluster import ClusterState, Demand, NoFit, Slot
from extender.placement import filter_nodes, pick, score_nodes

GIB = 1024


def node(state: ClusterState, name: str, sizes_gib: list[int], model: str = "A100", kind: str = "shared",
         unhealthy: tuple[int, ...] = ()) -> None:
    state.set_node(name, [Slot(f"{name}-{i}", model, kind, s * GIB, i not in unhealthy, i)
                          for i, s in enumerate(sizes_gib)])


@pytest.fixture
def cluster() -> ClusterState:
    st = ClusterState()
    node(st, "big", [80, 80], "NVIDIA-A100-SXM4-80GB")
    node(st, "mixed", [16, 24], "NVIDIA-L4")
    node(st, "sick", [80], "NVIDIA-H100", unhealthy=(0,))
    return st


def test_filter_keeps_input_order_and_explains_each_failure(cluster: ClusterState) -> None:
    fitting, failed = filter_nodes(cluster, [Demand(20 * GIB)], ["sick", "mixed", "big", "ghost"])
    assert fitting == ["mixed", "big"]
    assert failed["sick"] == "all 1 matching GPUs are unhealthy"
    assert "no vramshare GPU inventory" in failed["ghost"]


def test_filter_says_the_most_free_and_where_alike_on_every_node_short_of_room(cluster: ClusterState) -> None:
    """kube-scheduler counts identical reasons ("0/N nodes are available: 2 no GPU has ..."): each node's
    own largest free amount would make one entry per node; the most free of them all, and where, is
    the same sentence on each."""
    cluster.add_pod("ns/x", "mixed", [("mixed-1", 12 * GIB)])
    _, failed = filter_nodes(cluster, [Demand(20 * GIB)], ["mixed"])
    assert failed["mixed"] == "no GPU has 20 GiB free; the most free: 16 GiB on mixed, GPU 0"
    cluster.add_pod("ns/y", "big", [("big-0", 70 * GIB), ("big-1", 62 * GIB)])
    _, failed = filter_nodes(cluster, [Demand(20 * GIB)], ["mixed", "big"])
    assert failed == {n: "no GPU has 20 GiB free; the most free: 18 GiB on big, GPU 1" for n in ("mixed", "big")}


def test_multi_gpu_demand_needs_distinct_gpus(cluster: ClusterState) -> None:
    fitting, failed = filter_nodes(cluster, [Demand(20 * GIB, count=2)], ["big", "mixed"])
    assert fitting == ["big"]
    assert failed["mixed"] == "needs 2 GPUs with 20 GiB free each; only 1 has"
    alloc = pick(cluster, [Demand(20 * GIB, count=2)], "big", "binpack")
    assert sorted(u for u, _ in alloc[0]) == ["big-0", "big-1"]


def test_model_constraint_is_a_substring_match(cluster: ClusterState) -> None:
    fitting, failed = filter_nodes(cluster, [Demand(GIB, models=("A100", "H100"))], ["big", "mixed"])
    assert fitting == ["big"] and failed["mixed"] == "no GPU matches models A100|H100"


def test_containers_fit_together_and_may_share_a_gpu() -> None:
    st = ClusterState()
    node(st, "n", [24, 16])
    pod = [Demand(10 * GIB), Demand(14 * GIB), Demand(16 * GIB)]
    assert filter_nodes(st, pod, ["n"])[0] == ["n"]
    alloc = pick(st, pod, "n", "binpack")
    per_gpu: dict[str, int] = {}
    for demand in alloc:
        for uuid, amount in demand:
            per_gpu[uuid] = per_gpu.get(uuid, 0) + amount
    assert per_gpu == {"n-0": 24 * GIB, "n-1": 16 * GIB}
    _, failed = filter_nodes(st, pod + [Demand(GIB)], ["n"])
    assert failed["n"].startswith("each container fits alone but not all 4 together")


def test_exclusive_and_mig_take_a_whole_free_slot() -> None:
    st = ClusterState()
    st.set_node("n", [Slot("gpu-0", "A100", "exclusive", 40 * GIB, index=0),
                      Slot("mig-a", "A100", "mig:1g.10gb", 9984, index=1),
                      Slot("mig-b", "A100", "mig:2g.20gb", 19968, index=1)])
    assert pick(st, [Demand(0, kind="mig:1g.10gb")], "n", "fgd") == [[("mig-a", 9984)]]
    st.add_pod("ns/m", "n", [("mig-a", 9984)])
    _, failed = filter_nodes(st, [Demand(0, kind="mig:1g.10gb")], ["n"])
    assert failed["n"] == "no free MIG instance of profile 1g.10gb"
    assert pick(st, [Demand(0, kind="exclusive")], "n", "spread") == [[("gpu-0", 40 * GIB)]]
    st.add_pod("ns/e", "n", [("gpu-0", 1)])  # any holder makes a whole GPU unavailable
    _, failed = filter_nodes(st, [Demand(0, kind="exclusive")], ["n"])
    assert failed["n"] == "needs 1 free whole GPU; 0 of 1 free"


def test_pick_raises_nofit_with_the_reason(cluster: ClusterState) -> None:
    with pytest.raises(NoFit, match=r"no GPU here holds 40 GiB \(the largest, GPU 1, holds 24 GiB\)"):
        pick(cluster, [Demand(40 * GIB)], "mixed", "fgd")
    with pytest.raises(NoFit, match="ghost"):
        pick(cluster, [Demand(GIB)], "ghost", "fgd")


@pytest.mark.parametrize("policy", ["fgd", "binpack", "spread"])
def test_scores_are_integers_0_to_10_and_zero_where_it_does_not_fit(cluster: ClusterState, policy: str) -> None:
    scores = dict(score_nodes(cluster, [Demand(20 * GIB)], ["big", "mixed", "sick", "ghost"], policy))
    assert set(scores) == {"big", "mixed", "sick", "ghost"}
    assert all(isinstance(s, int) and 0 <= s <= 10 for s in scores.values())
    assert scores["sick"] == scores["ghost"] == 0
    assert max(scores["big"], scores["mixed"]) == 10


def test_binpack_prefers_the_fullest_node_and_gpu_spread_the_emptiest() -> None:
    st = ClusterState()
    node(st, "a", [80, 80])
    node(st, "b", [80, 80])
    st.add_pod("ns/x", "a", [("a-1", 50 * GIB)])
    d = [Demand(20 * GIB)]
    assert dict(score_nodes(st, d, ["a", "b"], "binpack")) == {"a": 10, "b": 0}
    assert pick(st, d, "a", "binpack") == [[("a-1", 20 * GIB)]]
    assert dict(score_nodes(st, d, ["a", "b"], "spread")) == {"a": 0, "b": 10}
    assert pick(st, d, "a", "spread") == [[("a-0", 20 * GIB)]]


@pytest.mark.parametrize("policy", ["fgd", "binpack", "spread"])
def test_of_equally_good_nodes_the_first_in_the_stable_tie_order_alone_gets_10(policy: str) -> None:
    """Ties are broken by CRC-32 of the name (c, then b, then a), never by the order kube-scheduler
    sent the names in, whether two or three nodes tie."""
    st = ClusterState()
    for n in ("a", "b", "c"):
        node(st, n, [80, 80])
    d = [Demand(20 * GIB)]
    assert dict(score_nodes(st, d, ["a", "b"], policy)) == {"a": 9, "b": 10}
    assert dict(score_nodes(st, d, ["b", "a"], policy)) == {"a": 9, "b": 10}
    assert dict(score_nodes(st, d, ["a", "b", "c"], policy)) == {"a": 9, "b": 9, "c": 10}


def test_a_two_gpu_pod_goes_to_the_fullest_gpus_under_binpack_and_the_emptiest_under_spread() -> None:
    """The general placement path (several GPUs per pod, not the one-GPU shortcut): best fit takes the
    two fullest GPUs that fit, spread the two freest."""
    st = ClusterState()
    node(st, "n", [80, 80, 80, 80])
    st.add_pod("ns/x", "n", [("n-1", 50 * GIB), ("n-2", 30 * GIB)])
    d = [Demand(20 * GIB, count=2)]
    assert sorted(a for a, _ in pick(st, d, "n", "binpack")[0]) == ["n-1", "n-2"]
    assert sorted(a for a, _ in pick(st, d, "n", "spread")[0]) == ["n-0", "n-3"]


def test_different_gpu_sizes_on_one_node_best_fit_takes_the_smallest_that_fits() -> None:
    st = ClusterState()
    node(st, "n", [80, 24, 16])
    assert pick(st, [Demand(20 * GIB)], "n", "binpack") == [[("n-1", 20 * GIB)]]
    assert pick(st, [Demand(12 * GIB)], "n", "binpack") == [[("n-2", 12 * GIB)]]


def test_vectorised_reasons_say_the_same_as_the_one_node_explanation() -> None:
    import numpy as np

    from extender.cluster import HostDemand
    from extender.fit import Ask
    from extender.reasons import why_not, why_not_many

    st = ClusterState()
    node(st, "full", [16, 16])
    node(st, "h100", [80], "H100")
    node(st, "sick", [80], unhealthy=(0,))
    st.set_node("mig", [Slot("m", "A100", "mig:1g.10gb", 9984)])
    node(st, "small-cpu", [80])
    st.set_host("small-cpu", 1000, 10**6)
    st.add_pod("ns/a", "full", [("full-0", 10 * GIB), ("full-1", 15 * GIB)])
    rows = np.array([st.row(n) for n in ["full", "h100", "sick", "mig", "small-cpu"]])
    for demand in (Demand(20 * GIB, models=("A100",)), Demand(20 * GIB, count=2), Demand(100 * GIB)):
        ask = Ask(st, (demand,), rows, HostDemand(cpu_milli=2000))
        failing = np.flatnonzero(~ask.best_fit.ok)
        assert why_not_many(ask, failing) == [why_not(ask, int(j), detail=False) for j in failing]


@pytest.mark.parametrize("policy", ["fgd", "binpack"])
def test_equal_nodes_get_one_stable_ten_whatever_the_input_order(policy: str) -> None:
    st = ClusterState()
    names = [f"n{i}" for i in range(6)]
    for n in names:
        node(st, n, [80])
    first = dict(score_nodes(st, [Demand(GIB)], names, policy))
    again = dict(score_nodes(st, [Demand(GIB)], list(reversed(names)), policy))
    assert sorted(first.values()) == [9, 9, 9, 9, 9, 10] and first == again
