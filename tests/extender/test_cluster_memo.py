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
