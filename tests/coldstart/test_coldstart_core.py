"""The cold-start replay core (vramshare/coldstart.py): behaviour on small hand-built deployments."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from vramshare import coldstart as cs

GIB = cs.GIB
COSTS = cs.Costs()


def dep(name: str, segments, slice_gib=40, weight_gib=27.5, overcommit=True) -> cs.Deployment:
    return cs.Deployment(name, weight_gib * GIB, slice_gib * GIB, np.array(segments, float).reshape(-1, 2), overcommit)


def test_busy_intervals_merge_below_the_idle_timer():
    seg = np.array([[0, 10], [100, 110], [1000, 1010]], float)
    iv = cs.busy_intervals(seg, 300)
    assert iv.tolist() == [[0, 410], [1000, 1310]]


def test_window_arrivals_keep_the_rate():
    rng = np.random.default_rng(0)
    n = sum(len(cs.window_arrivals(0.5, "Gamma", 0.3, rng)) for _ in range(200))
    assert abs(n / (200 * 600) - 0.5) < 0.05
    busy = cs.window_arrivals(100.0, "Weibull", 0.5, rng)
    assert len(busy) == 2 and 0 <= busy[0] <= busy[1] <= 600


def test_place_today_books_every_slice_and_keeps_the_reserve():
    """The live books' rule (vramshare.overcommit.books): awake whole + sleepers booked + the largest wake."""
    deps = [dep(f"d{i}", [[0, 1]]) for i in range(4)]
    assert cs.place(deps, 80 * GIB).gpus_used == 2
    over = cs.place(deps[:3], 80 * GIB, overcommit=2.0, residual_bytes=1.5 * GIB)
    assert over.gpus_used == 1  # 3 x 40 / 2 = 60 booked, plus one 20 GiB gap kept for a wake = 80
    assert cs.place(deps, 80 * GIB, overcommit=2.0, residual_bytes=1.5 * GIB).gpus_used == 2
    up = cs.place(deps[:3], 80 * GIB, overcommit=2.0, residual_bytes=1.5 * GIB, awake=frozenset({"d0"}))
    assert up.gpus_used == 2  # awake when placed: booked whole, as the live books count it
    firm = [dep(f"f{i}", [[0, 1]], overcommit=False) for i in range(2)]
    mixed = cs.place(firm + deps, 80 * GIB, overcommit=4.0, residual_bytes=1.5 * GIB)
    for g in set(mixed.gpu_of.values()):  # never two firm 40s plus a wake on one GPU
        on = [d for d in firm + deps if mixed.gpu_of[d.name] == g]
        firm_b = sum(d.slice_bytes for d in on if not d.overcommit)
        big = max((d.slice_bytes for d in on if d.overcommit), default=0)
        assert firm_b + big <= 80 * GIB + len(on) * 1.5 * GIB


def test_warm_tier_wakes_instead_of_loading_and_holds_only_the_residual():
    deps = [dep("a", [[0, 5], [2000, 2005], [5000, 5001]]), dep("b", [[100, 200], [4000, 4100]])]
    horizon = 8000.0
    pl = cs.place(deps, 80 * GIB)
    warm = cs.warm_tier(deps, cs.Cluster(pl.gpus_used, 80 * GIB), pl, 300, horizon, COSTS, count_from=0)
    keep = cs.keep_warm(deps, 300, horizon, COSTS, pl.gpus_used, count_from=0)
    zero = cs.scale_to_zero(deps, 300, horizon, COSTS, np.array([20.0]), np.random.default_rng(0), count_from=0)
    assert len(warm.ttft_s) == len(keep.ttft_s) == len(zero.ttft_s) == 5
    assert warm.full_loads == 0 and zero.full_loads == 5
    assert max(warm.ttft_s) < min(zero.ttft_s)
    assert warm.ttft_s[0] == pytest.approx(COSTS.wake_s(27.5 * GIB) + COSTS.base_ttft_s)
    assert warm.idle_bytes_s <= 0.05 * keep.idle_bytes_s
    assert warm.busy_bytes_s == pytest.approx(keep.busy_bytes_s, rel=0.01)


def test_a_wake_without_memory_waits_or_moves_never_fails():
    # three 39 GiB pods booked on one 80 GiB GPU (overcommit 3); a and b busy together, c wakes meanwhile
    deps = [dep(n, seg, slice_gib=39) for n, seg in (("a", [[0, 3000]]), ("b", [[0, 3000]]), ("c", [[1000, 1001]]))]
    pl = cs.place(deps, 80 * GIB, overcommit=3.0, residual_bytes=1.5 * GIB)
    assert pl.gpus_used == 1
    stuck = cs.warm_tier(deps, cs.Cluster(1, 80 * GIB), pl, 300, 10_000, COSTS, count_from=0, relocate=False)
    assert stuck.waited_for_memory == 1 and len(stuck.ttft_s) == 3
    assert max(stuck.wait_s) == pytest.approx(3300 - 1000)  # until a co-tenant's idle timer ran out
    spare = cs.Cluster(2, 80 * GIB)
    moved = cs.warm_tier(deps, spare, cs.Placement(pl.gpu_of, 2), 300, 10_000, COSTS, count_from=0)
    assert moved.relocations == 1 and moved.full_loads == 1 and len(moved.ttft_s) == 3
    assert max(moved.ttft_s) == pytest.approx(COSTS.restart_s(27.5 * GIB) + COSTS.base_ttft_s)


def test_idle_cotenants_are_sent_to_sleep_before_a_wake_waits():
    # a and b stop sending at 100 but their idle timers run to 400; c arrives at 200
    deps = [dep(n, seg, slice_gib=39) for n, seg in (("a", [[0, 100], [350, 351]]), ("b", [[0, 100]]), ("c", [[200, 201]]))]
    pl = cs.place(deps, 80 * GIB, overcommit=3.0, residual_bytes=1.5 * GIB)
    r = cs.warm_tier(deps, cs.Cluster(1, 80 * GIB), pl, 300, 5000, COSTS, count_from=0, relocate=False)
    assert r.waited_for_memory == 0 and r.displaced >= 1
    assert len(r.ttft_s) == 4  # a's request at 350 now wakes it: counted as a first request


def test_live_rule_displaces_only_lower_classes_and_never_relocates():
    segs = (("a", [[0, 100], [350, 351]]), ("b", [[0, 100]]), ("c", [[200, 201]]))
    same = [dep(n, seg, slice_gib=39) for n, seg in segs]
    pl = cs.place(same, 80 * GIB, overcommit=3.0, residual_bytes=1.5 * GIB)
    spare = cs.Cluster(2, 80 * GIB)  # room elsewhere: the live broker does not move a replica
    r = cs.warm_tier(same, spare, cs.Placement(pl.gpu_of, 2), 300, 5000, COSTS, count_from=0, live=True)
    assert r.displaced == 0 and r.relocations == 0 and r.waited_for_memory == 1
    assert max(r.wait_s) == pytest.approx(400 - 200)  # until a co-tenant's own idle timer ran out
    assert len(r.ttft_s) == len(r.wait_s) + 2 and max(r.ttft_s) > 200  # the wait is in its first-token time
    ranked = [dataclasses.replace(d, rank=10 if d.name == "c" else 0) for d in same]
    r = cs.warm_tier(ranked, spare, cs.Placement(pl.gpu_of, 2), 300, 5000, COSTS, count_from=0, live=True)
    assert r.waited_for_memory == 0 and r.displaced >= 1  # c's class is higher: the idle lower ones sleep


def test_host_ram_budget_drops_the_least_recently_slept():
    deps = [dep(f"d{i}", [[100 * i, 100 * i + 1]], slice_gib=24, weight_gib=15) for i in range(3)]
    pl = cs.place(deps, 80 * GIB)
    cl = cs.Cluster(1, 80 * GIB, host_bytes_per_node=30 * GIB)
    r = cs.warm_tier(deps, cl, pl, 300, 5000, COSTS, count_from=0)
    assert r.evictions >= 1 and r.full_loads >= 1


def test_a_long_wait_restarts_the_replica_where_there_is_room():
    # GPU 0: a and b busy, c wakes and finds no memory; GPU 1: three sleepers, so moving c there now
    # would leave none of them room to wake (the reserve): c waits max_wait_s, then restarts there
    busy = [dep(n, [[0, 3000]], slice_gib=39) for n in ("a", "b")]
    c = dep("c", [[1000, 1001]], slice_gib=39)
    sleepers = [dep(f"s{i}", [[5000 + 1000 * i, 5001 + 1000 * i]], slice_gib=39) for i in range(3)]
    gpu_of = {"a": 0, "b": 0, "c": 0, "s0": 1, "s1": 1, "s2": 1}
    r = cs.warm_tier(busy + [c] + sleepers, cs.Cluster(2, 80 * GIB), cs.Placement(gpu_of, 2), 300, 10_000,
                     COSTS, count_from=0)
    assert r.relocations == 1 and r.waited_for_memory == 1
    assert max(r.ttft_s) == pytest.approx(COSTS.max_wait_s + COSTS.restart_s(27.5 * GIB) + COSTS.base_ttft_s)


def test_quiet_before_and_the_reference_population_are_the_same_requests_under_any_idle_timer():
    """p99 ``ttft_ref_*`` is over requests after ``quiet_ref_s`` of quiet, whatever the warm tier's timer."""
    seg = np.array([[0, 10], [100, 110], [1000, 1010]], float)
    assert cs.quiet_before(seg, 0) == np.inf and cs.quiet_before(seg, 100) == 90 and cs.quiet_before(seg, 1000) == 890
    deps = [dep("a", seg)]
    pl = cs.place(deps, 80 * GIB)
    short = cs.warm_tier(deps, cs.Cluster(1, 80 * GIB), pl, 30, 5000, COSTS, count_from=0)
    long_ = cs.warm_tier(deps, cs.Cluster(1, 80 * GIB), pl, 300, 5000, COSTS, count_from=0)
    assert len(short.ttft_s) == 3 and len(long_.ttft_s) == 2  # 30 s: the request after 90 s quiet wakes it too
    s, l_ = short.summary(1.0, 1, quiet_ref_s=300), long_.summary(1.0, 1, quiet_ref_s=300)
    assert s["ttft_ref_n"] == l_["ttft_ref_n"] == 2 and s["ttft_ref_p99_s"] == l_["ttft_ref_p99_s"]
    assert s["wakes_per_hour"] == 3 and l_["wakes_per_hour"] == 2
    assert s["host_peak_gib_per_node"] == 27.5


def _regular(name="a", period=1000.0, n=10, **kw) -> cs.Deployment:
    return dep(name, [[k * period, k * period + 1] for k in range(n)], **kw)


def test_wake_ahead_serves_a_regular_client_without_a_wake_and_counts_the_wasted_one():
    deps = [_regular()]
    pl = cs.place(deps, 80 * GIB)
    plain = cs.warm_tier(deps, cs.Cluster(1, 80 * GIB), pl, 300, 12_000, COSTS, count_from=0)
    ahead = cs.warm_tier(deps, cs.Cluster(1, 80 * GIB), pl, 300, 12_000, COSTS, count_from=0, ahead=cs.WakeAhead())
    assert len(plain.ttft_s) == len(ahead.ttft_s) == 10 and plain.prewakes == 0
    # three quiet gaps of history, then every later request finds its engine already up
    assert ahead.prewake_hits == 6 and ahead.prewakes == 7 and ahead.prewake_wasted == 1  # after the last one
    assert sorted(ahead.ttft_s)[:6] == [pytest.approx(COSTS.base_ttft_s)] * 6
    assert min(plain.ttft_s) == pytest.approx(COSTS.wake_s(27.5 * GIB) + COSTS.base_ttft_s)
    assert ahead.wakes == 4  # the wakes left in a request's path
    # an engine woken ahead holds idle memory until its request comes (and the wasted one all along)
    assert ahead.idle_bytes_s > plain.idle_bytes_s + 300 * 40 * GIB


def test_wake_ahead_only_into_free_memory_and_a_real_wake_sends_it_back_to_sleep():
    # a woke ahead of 4000 (its history says so); b then c wake for real just before: c needs a's memory
    a = _regular(slice_gib=40, n=5)
    b = dep("b", [[3999.5, 3999.6]], slice_gib=38)
    c = dep("c", [[3999.7, 3999.8]], slice_gib=38)
    gpu_of = {"a": 0, "b": 0, "c": 0}
    r = cs.warm_tier([a, b, c], cs.Cluster(1, 80 * GIB), cs.Placement(gpu_of, 1), 300, 8000, COSTS, count_from=0,
                     relocate=False, ahead=cs.WakeAhead())
    # sent back to sleep for c; a second one after a's late request (nothing came at 5000): wasted too
    assert r.prewakes == 2 and r.prewake_wasted == 2 and r.prewake_hits == 0
    assert r.waited_for_memory == 1  # a's own request waits (the real wakes came first); c never did
    assert sorted(r.wait_s) == [pytest.approx(3999.6 + 300 - 4000)]  # until b slept on its idle timer
    # no room for the reserve beside it: no wake ahead at all
    big = dataclasses.replace(b, slice_bytes=40.5 * GIB)  # 40 + its 39 GiB gap + 1.5 held > 80
    r = cs.warm_tier([a, big], cs.Cluster(1, 80 * GIB), cs.Placement({"a": 0, "b": 0}, 1), 300, 8000, COSTS,
                     count_from=0, relocate=False, ahead=cs.WakeAhead())
    assert r.prewakes == 0
