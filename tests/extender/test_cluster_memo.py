"""Row memo: per-node results recomputed only for nodes that changed since the last identical ask."""
from __future__ import annotations

import numpy as np

from extender.cluster import ClusterState, Demand, Slot
from extender.memo import RowMemo
from extender.placement import score_nodes


def test_only_stale_rows_are_recomputed_and_a_new_pin_starts_over() -> None:
    memo, calls = RowMemo(), []
    versions = np.array([1, 1, 1])
    rows = np.array([0, 1, 2])

    def compute(stale: np.ndarray) -> np.ndarray:
        calls.append(rows[stale].tolist())
        return rows[stale] * 10.0

    pin = object()
    assert memo.get("k", pin, rows, versions, compute).tolist() == [0, 10, 20]
    memo.get("k", pin, rows, versions, compute)
    versions[1] = 2
    memo.get("k", pin, rows, versions, compute)
    memo.get("k", object(), rows, versions, compute)
    assert calls == [[0, 1, 2], [1], [0, 1, 2]]


def test_memoised_scores_follow_every_change_to_the_cluster() -> None:
    st = ClusterState()
    for n in ("a", "b"):
        st.set_node(n, [Slot(f"{n}/0", "G", capacity=1000), Slot(f"{n}/1", "G", capacity=1000, index=1)])
    st.observe([Demand(1000)] * 3 + [Demand(500)])
    before = dict(score_nodes(st, [Demand(500)], ["a", "b"], "fgd"))
    st.add_pod("x", "b", [("b/0", 500)])  # b now has a half GPU a 500 request fills exactly
    after = dict(score_nodes(st, [Demand(500)], ["a", "b"], "fgd"))
    assert sorted(before.values()) == [9, 10] and after == {"a": 0, "b": 10}  # a tie, then b is best
    st.remove_pod("x")
    assert dict(score_nodes(st, [Demand(500)], ["a", "b"], "fgd")) == before


def test_the_warmer_leaves_no_table_for_a_request_to_compute() -> None:
    """After the background warmer, a request of a workload shape finds every row's table current: no
    request pays for a shape's first appearance (the slow first request at 5,000 nodes)."""
    from extender import placement
    from extender.cluster import ClusterState, Demand, HostDemand, Slot
    from extender.policies import FragmentationGradient

    st = ClusterState(gpus_per_node=4)
    for n in range(300):
        st.set_node(f"n{n}", [Slot(f"g{n}-{g}", "m", capacity=1000, index=g) for g in range(4)])
    for size in (100, 250, 500, 250, 100, 700):
        st.observe([Demand(size)])
    st.observe([Demand(500, 2)])
    steps = 0
    while placement.warm(st, "fgd", max_rows=64):
        steps += 1
    assert steps > 1  # it works in short steps
    wl, rows = st.target_workload(), st.live_rows()
    for shape in wl.shapes:
        d = (Demand(shape.per_gpu, shape.count),)
        key = FragmentationGradient._keys(d, HostDemand())
        assert len(st.memo.stale(key, wl, rows, st.row_version)) == 0
        # and prioritize's scores of the shape (its first prioritize paid every row's host stranding)
        score = FragmentationGradient._score_key(d, HostDemand(), st.gpu_scale())
        assert len(st.memo.stale(score, wl, rows, st.row_version)) == 0
    st.add_pod("p", "n7", [("g7-0", 100)])  # one node changes: only its row is stale, and warmed again
    assert placement.warm(st, "fgd") is True
    while placement.warm(st, "fgd"):
        pass
    assert placement.warm(st, "fgd") is False


def test_the_published_workload_depends_only_on_what_was_observed() -> None:
    """The live extender's warmer asks for the workload at any moment, the simulator only per request:
    both must publish the same workloads for the same observed sequence (a different publication
    moment gave different fgd scores: 20 of 10,842 trace pods placed differently through the wire)."""
    import numpy as np

    from extender.workload import Shape, WorkloadWindow

    rng = np.random.default_rng(3)
    shapes = [Shape(int(p)) for p in rng.choice([100, 200, 500, 1000], 400, p=[0.1, 0.2, 0.3, 0.4])]
    shapes += [Shape(int(p)) for p in rng.choice([100, 200], 400)]  # the mix drifts
    eager, lazy = WorkloadWindow(size=100), WorkloadWindow(size=100)
    asked = rng.random(len(shapes)) < 0.2
    for shape, ask in zip(shapes, asked):
        eager.add(shape)
        eager.workload()  # asked after every pod (the warmer)
        lazy.add(shape)
        if ask:  # asked now and then (only pods that reach prioritize)
            assert lazy.workload() is not None
            assert lazy.workload().shapes == eager.workload().shapes
            np.testing.assert_array_equal(lazy.workload().weight, eager.workload().weight)


def test_the_warmer_prepares_a_new_pods_shape_before_it_is_asked_about() -> None:
    """A shape too rare to move the published workload is warmed as soon as it is observed."""
    from extender import placement
    from extender.cluster import ClusterState, Demand, HostDemand, Slot
    from extender.policies import FragmentationGradient

    st = ClusterState(gpus_per_node=4)
    for n in range(50):
        st.set_node(f"n{n}", [Slot(f"g{n}-{g}", "m", capacity=1000, index=g) for g in range(4)])
    for _ in range(200):
        st.observe([Demand(100)])
    while placement.warm(st, "fgd"):
        pass
    published = st.target_workload()
    st.observe([Demand(730)], HostDemand(3000, 0))  # one new pod: no drift, same published workload
    assert st.target_workload() is published
    while placement.warm(st, "fgd"):
        pass
    key = FragmentationGradient._keys((Demand(730),), HostDemand(3000, 0))
    assert len(st.memo.stale(key, published, st.live_rows(), st.row_version)) == 0


def test_the_fit_memo_follows_a_node_that_grows_wider_than_any_before() -> None:
    """A node's inventory grows to more GPUs than the books had columns for (its report now lists 4)
    between two filters of one pod shape: only its row is stale, but the memoised fit of the other rows
    cannot be patched with it (its arrays are narrower), so every row is placed again and the answer
    equals a fresh state's."""
    from extender.placement import filter_rows

    def build(wide: bool) -> ClusterState:
        st = ClusterState(gpus_per_node=2)
        for n, gpus in (("a", 2), ("b", 4 if wide else 2)):
            st.set_node(n, [Slot(f"{n}/{i}", "G", capacity=1000, index=i) for i in range(gpus)])
        st.add_pod("x", "a", [("a/0", 900)])
        return st

    st = build(False)
    assert filter_rows(st, [Demand(500, count=2)], ["a", "b"]).fitting == ["b"]
    st.set_node("b", [Slot(f"b/{i}", "G", capacity=1000, index=i) for i in range(4)])
    got = filter_rows(st, [Demand(500, count=2)], ["a", "b"]).fitting
    assert got == filter_rows(build(True), [Demand(500, count=2)], ["a", "b"]).fitting == ["b"]
    assert filter_rows(st, [Demand(500, count=3)], ["a", "b"]).fitting == ["b"]
