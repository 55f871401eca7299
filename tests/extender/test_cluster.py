"""ClusterState: per-GPU accounting that filter, prioritize, bind and /inspect all read."""
from __future__ import annotations

import pytest

from extender.cluster import ClusterState, Demand, HostDemand, OverCommit, Slot


def gpus(prefix: str, n: int, mib: int = 81920, model: str = "A100-SXM4-80GB") -> list[Slot]:
    return [Slot(f"{prefix}-{i}", model, capacity=mib, index=i) for i in range(n)]


def used(state: ClusterState, node: str) -> list[int]:
    return [u.used for u in state.node_usage(node)]


def test_add_pod_charges_each_slot_and_remove_frees_it() -> None:
    st = ClusterState()
    st.set_node("n1", gpus("g", 2))
    st.add_pod("ns/a", "n1", [("g-0", 20480), ("g-1", 20480)])
    st.add_pod("ns/b", "n1", [("g-0", 10240)])
    assert used(st, "n1") == [30720, 20480]
    assert st.node_usage("n1")[0].pods == {"ns/a": 20480, "ns/b": 10240}
    st.remove_pod("ns/a")
    assert used(st, "n1") == [10240, 0]
    assert not st.has_pod("ns/a") and st.has_pod("ns/b")


def test_add_pod_is_idempotent_and_remove_tolerates_unknown_keys() -> None:
    st = ClusterState()
    st.set_node("n1", gpus("g", 1))
    st.add_pod("ns/a", "n1", [("g-0", 1024)])
    st.add_pod("ns/a", "n1", [("g-0", 1024)])
    assert used(st, "n1") == [1024]
    st.remove_pod("ns/a")
    st.remove_pod("ns/a")
    st.remove_pod("never/seen")
    assert used(st, "n1") == [0]


def test_overcommit_is_atomic() -> None:
    st = ClusterState()
    st.set_node("n1", gpus("g", 2, mib=16384))
    with pytest.raises(OverCommit, match="GPU 1"):
        st.add_pod("ns/a", "n1", [("g-0", 8192), ("g-1", 20000)])
    assert used(st, "n1") == [0, 0] and not st.has_pod("ns/a")
    with pytest.raises(OverCommit, match="not on node"):
        st.add_pod("ns/a", "n1", [("other", 1)])


def test_same_key_with_new_holdings_replaces_the_old_ones() -> None:
    st = ClusterState()
    st.set_node("n1", gpus("g", 2))
    st.add_pod("ns/a", "n1", [("g-0", 1024)])
    st.add_pod("ns/a", "n1", [("g-1", 2048)])
    assert used(st, "n1") == [0, 2048]


def test_set_node_keeps_usage_on_remaining_slots_and_drops_removed_ones() -> None:
    st = ClusterState()
    st.set_node("n1", gpus("g", 3))
    st.add_pod("ns/a", "n1", [("g-0", 1000), ("g-2", 3000)])
    st.set_node("n1", [Slot("g-2", "A100", capacity=81920, healthy=False, index=2), Slot("g-9", "A100", capacity=100)])
    assert used(st, "n1") == [3000, 0]
    assert st.node_usage("n1")[0].slot.healthy is False
    st.remove_pod("ns/a")
    assert used(st, "n1") == [0, 0]


def test_remove_node_then_reuse_row() -> None:
    st = ClusterState()
    st.set_node("n1", gpus("a", 1))
    st.set_node("n2", gpus("b", 1))
    st.remove_node("n1")
    st.remove_node("n1")
    assert st.nodes() == ["n2"] and st.node_usage("n1") == []
    st.set_node("n3", gpus("c", 10, mib=1000))  # wider than the arrays were: they grow
    assert len(st.node_usage("n3")) == 10 and used(st, "n3") == [0] * 10
    assert len(st.node_usage("n2")) == 1


def test_host_resources_are_charged_only_where_tracked() -> None:
    st = ClusterState()
    st.set_node("n1", gpus("g", 1))
    st.set_host("n1", cpu_milli=4000, memory_mib=8192)
    st.add_pod("ns/a", "n1", [], HostDemand(3000, 1024))
    with pytest.raises(OverCommit, match="CPU"):
        st.add_pod("ns/b", "n1", [], HostDemand(2000, 1024))
    st.remove_pod("ns/a")
    st.add_pod("ns/b", "n1", [], HostDemand(2000, 1024))
    assert int(st.cpu_free()[st.row("n1")]) == 2000


def test_observe_builds_a_bounded_window_of_request_shapes() -> None:
    st = ClusterState(workload_window=3)
    st.observe([Demand(1024)])
    st.observe([Demand(2048), Demand(2048)])
    st.observe([Demand(4096, count=2)])
    wl = st.target_workload()
    assert {(s.per_gpu, s.count) for s in wl.shapes} == {(2048, 1), (4096, 2)}
    assert wl.weight.sum() == pytest.approx(1.0)
    assert wl.weight[list(wl.shapes).index(next(s for s in wl.shapes if s.per_gpu == 2048))] == pytest.approx(2 / 3)


def test_a_gpu_uuid_announced_by_a_second_node_is_refused_and_the_first_keeps_it() -> None:
    st = ClusterState()
    st.set_node("n1", gpus("g", 2))
    with pytest.raises(ValueError, match="node n2: GPU g-0 is already announced by node n1"):
        st.set_node("n2", gpus("g", 2))
    st.add_pod("ns/a", "n1", [("g-1", 1024)])
    assert used(st, "n1") == [0, 1024] and "n2" not in st.nodes()
    st.set_node("n1", gpus("g", 2))  # the owner may re-announce its own GPUs
    assert used(st, "n1") == [0, 1024]


def test_the_remembered_fit_and_rows_follow_every_change_of_the_state() -> None:
    from extender import placement
    st = ClusterState()
    st.set_node("n1", gpus("g", 1, mib=10240))
    st.set_node("n2", gpus("h", 1, mib=10240))
    ask = [Demand(per_gpu=8192)]
    assert placement.filter_nodes(st, ask, ["n1", "n2"])[0] == ["n1", "n2"]
    st.add_pod("ns/a", "n1", [("g-0", 4096)])  # same pod shape, new state: n1 no longer fits
    fitting, failed = placement.filter_nodes(st, ask, ["n1", "n2"])
    assert fitting == ["n2"] and "n1" in failed
    st.remove_node("n2")
    st.set_node("n3", gpus("k", 1, mib=10240))  # may reuse n2's row: the remembered rows must not
    assert placement.filter_nodes(st, ask, ["n1", "n2"]) == ([], {"n1": failed["n1"],
                                                                  "n2": placement.UNKNOWN_NODE})
