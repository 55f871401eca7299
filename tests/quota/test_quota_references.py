"""bench/bench_quota.py's fair reference (issue 19): perfect foresight that keeps the property takes a
loan back from a borrower when an owner needs it; the round-17 reference never did. One hand-made GPU
of two tenants (request 40,960 MiB each): the borrower wants 60,000 MiB throughout, the owner 10,000,
then 30,000 from minute 2."""
from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from tests.fixtures import bench

_OWNER = [10000, 10000] + [30000] * 6
_BORROWER = [60000] * 8


@pytest.fixture(scope="module")
def bq():
    return bench.load("bench_quota")


def _run(bq, name):
    demand = np.array([_OWNER, _BORROWER], dtype=np.int64)
    limits, held = bq.REFERENCE[name](demand)
    return demand, limits, held, bq.score(demand, limits, held)


def test_the_reference_that_keeps_loans_leaves_the_owner_short_for_as_long_as_the_loan_lasts(bq):
    demand, limits, held, sc = _run(bq, "clairvoyant-fair")
    assert held[1, 1] == 60000  # the borrower took the free memory at minute 1
    assert (limits[0, 2:] < 30000).all()  # the owner never gets its request's worth back
    assert sc["owner_short_minutes"] == 6


def test_the_fair_reference_cuts_the_loan_at_once_and_the_owner_has_it_the_next_minute(bq):
    demand, limits, held, sc = _run(bq, "clairvoyant-reclaim")
    assert limits[0, 2] == 81920 - 60000  # the free memory, all it can have while the loan is held
    assert limits[1, 2] == 60000 - (30000 - 21920)  # the loan cut by what the owner lacks, no more
    assert held[1, 2] == limits[1, 2]  # the cut lands that minute
    assert (limits[0, 3:] == 30000).all() and (limits[1, 3:] == limits[1, 2]).all()
    assert sc["owner_short_minutes"] == 1  # the release rule makes one short minute the least
    assert (np.maximum(limits[:, 1:], held[:, :-1]).sum(axis=0) <= 81920).all()


def test_with_an_allowance_the_fair_reference_waits_that_many_short_minutes_before_the_cut(bq):
    demand = np.array([_OWNER, _BORROWER], dtype=np.int64)
    limits, held = bq.run_clairvoyant_reclaim(demand, allowance=2)
    assert (limits[1, 2:4] == 60000).all() and limits[1, 4] < 60000  # cut at the third short minute
    assert (limits[0, 5:] == 30000).all()
    assert bq.score(demand, limits, held)["owner_short_minutes"] == 3


def test_merge_takes_a_merged_file_and_gives_every_row_its_ratio_to_each_reference(bq, tmp_path):
    def row(pct, groupings=None):
        out = {"pct_container_minutes_over_limit": pct}
        return out if groupings is None else dict(out, groupings=groupings)
    merged = {"results": {"held_back": {"k3": {"clairvoyant": row(4.0, 20), "default@demand": row(8.0, 20),
                                               "default@held": row(9.0, 5)}}},
              "setup": {"runs": [{"command": "old"}], "groupings_per_part_and_k": "per row: see each row's groupings"}}
    new = {"results": {"held_back": {"k3": {"clairvoyant": row(4.0), "clairvoyant-reclaim": row(6.4)}}},
           "setup": {"groupings_per_part_and_k": 20, "command": "new", "wall_seconds": 1.0}}
    paths = []
    for name, doc in (("merged.json", merged), ("new.json", new)):
        paths.append(str(tmp_path / name))
        with open(paths[-1], "w", encoding="utf-8") as fh:
            json.dump(doc, fh)
    out = bq.merge(paths, str(tmp_path / "out.json"))
    rows = out["results"]["held_back"]["k3"]
    assert rows["default@demand"]["ratio_to_clairvoyant"] == 2.0
    assert rows["default@demand"]["ratio_to_clairvoyant_reclaim"] == 1.25
    assert rows["default@held"]["ratio_to_clairvoyant_reclaim"] is None  # no reference over its 5 groupings
    assert [r["command"] for r in out["setup"]["runs"]] == ["old", "new"]


@settings(max_examples=300, deadline=None)
@given(st.integers(2, 4).flatmap(lambda k: st.tuples(
    st.lists(st.integers(0, 81920), min_size=k, max_size=k),
    st.lists(st.integers(0, 81920), min_size=k, max_size=k))))
def test_after_a_step_in_demand_the_fair_reference_gives_every_owner_its_share_from_the_next_minute_on(bq, step):
    """Any GPU of 2-4 tenants whose demands step once, at minute 3, and then stay: the reference never
    commits more than the GPU (Σ max(limit, held before) <= capacity), and from minute 4 on nobody is
    below min(demand, request) while another holds more than its request."""
    before, after = step
    demand = np.array([[b] * 3 + [a] * 9 for b, a in zip(before, after)], dtype=np.int64)
    limits, held = bq.run_clairvoyant_reclaim(demand)
    assert (np.maximum(limits[:, 1:], held[:, :-1]).sum(axis=0) <= bq.GPU_MIB).all()
    assert bq.score(demand[:, 4:], limits[:, 4:], held[:, 4:])["owner_short_minutes"] == 0
