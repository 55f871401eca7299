"""The DRA-path policies of the simulator: first-fit devices as kube-scheduler's allocator takes them."""
from __future__ import annotations

import numpy as np

from extender.cluster import ClusterState, Demand, Slot
from extender.placement import ask_for, choose, rank_rows


def state() -> ClusterState:
    st = ClusterState()
    st.set_node("n1", [Slot(f"g-{i}", "H100", capacity=81920, index=i) for i in range(3)])
    st.add_pod("ns/a", "n1", [("g-1", 61440)])  # g-1 has 20 GiB left: best fit for 16 GiB
    return st


def test_dra_policies_take_the_first_fitting_gpu_where_fgd_takes_the_best():
    st = state()
    ask = ask_for(st, [Demand(16384)], np.array([st.row("n1")]), rng=np.random.default_rng(0))
    assert choose(ask, 0, "dra-random") == [[("g-0", 16384)]]
    assert choose(ask, 0, "dra-fgd") == [[("g-0", 16384)]]
    assert choose(ask, 0, "bestfit") == [[("g-1", 16384)]]


def test_multi_gpu_demands_take_distinct_first_gpus():
    st = state()
    ask = ask_for(st, [Demand(30720, count=2)], np.array([st.row("n1")]), rng=np.random.default_rng(0))
    assert choose(ask, 0, "dra-random") == [[("g-0", 30720), ("g-2", 30720)]]


def test_dra_fgd_scores_the_gpu_the_allocator_will_take():
    """Two nodes; on n2 the first GPU is the fragmenting choice, so dra-fgd must not prefer n2 as fgd
    (which assumes its own best GPU) may."""
    st = ClusterState()
    st.set_node("n1", [Slot("a-0", "H100", capacity=81920, index=0)])
    st.set_node("n2", [Slot("b-0", "H100", capacity=81920, index=0), Slot("b-1", "H100", capacity=81920, index=1)])
    st.add_pod("ns/x", "n2", [("b-1", 65536)])
    for _ in range(50):
        st.observe([Demand(16384)])
    ask = ask_for(st, [Demand(16384)], np.array([st.row("n1"), st.row("n2")]), rng=np.random.default_rng(0))
    fgd, dra = rank_rows(ask, "fgd"), rank_rows(ask, "dra-fgd")
    assert dra[1] <= fgd[1]  # scoring the first-fit GPU can only lose against scoring the best one
    assert np.isfinite(dra).all()
