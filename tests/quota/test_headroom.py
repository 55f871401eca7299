"""Forecast headroom (``quota.headroom: forecast``, deviceplugin/quota/headroom.py): the knapsack is
optimal, options are sound, and the policy keeps every invariant of issue 9 with it (capacity,
never granting unreleased memory, floors, requests when protected)."""
from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deviceplugin.quota import headroom
from deviceplugin.quota.headroom import Option
from deviceplugin.quota.model import GpuState, Phase, PolicyParams, TenantState
from deviceplugin.quota.policy import rebalance
from tests.quota.test_policy_invariant import KEYS, traces
from vramshare.config import ConfigError, parse_config

option_lists = st.lists(st.lists(st.builds(Option, st.integers(0, 9999), st.integers(0, 5000) .map(lambda c: c * 64),
                                           st.floats(0, 1)), min_size=1, max_size=5), min_size=1, max_size=4)


@settings(max_examples=300, deadline=None)
@given(option_lists, st.integers(0, 20000))
def test_choose_is_the_best_plan_within_budget(per_tenant, budget):
    """Brute force over every combination: same best value, within budget (costs are multiples of
    the quantum here, so banding loses nothing)."""
    plans = [(sum(o.cost_mib for o in c), sum(o.p for o in c)) for c in itertools.product(*per_tenant)]
    feasible = [v for c, v in plans if c <= budget]
    picks = headroom.choose(per_tenant, budget)
    if not feasible:
        assert picks is None
        return
    chosen = [opts[j] for opts, j in zip(per_tenant, picks)]
    assert sum(o.cost_mib for o in chosen) <= budget
    assert sum(o.p for o in chosen) == pytest.approx(max(feasible))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 80000), max_size=60), st.integers(0, 80000), st.integers(0, 40000),
       st.integers(0, 80000), st.integers(0, 80000), st.integers(0, 80000))
def test_options_are_sound(recent, now, floor, ceil, held, least):
    ceil = max(ceil, floor)
    sample = headroom.forecast(recent, now)
    assert sum(w for _, w in sample) == pytest.approx(1.0)
    opts = headroom.options(sample, floor, ceil, held, least, now)
    assert opts[0].limit_mib == min(ceil, max(floor, least))  # the least one is always offered
    for a, b in zip(opts, opts[1:]):
        assert a.limit_mib < b.limit_mib and a.p <= b.p + 1e-12  # a higher limit covers at least as much
    for o in opts:
        assert floor <= o.limit_mib <= ceil and o.cost_mib == max(0, o.limit_mib - held)


def test_a_new_tenant_is_forecast_to_stay_where_it_is():
    assert headroom.forecast([], 5000) == [(5000, 0.5), (5000, 0.5)]


def test_the_forecast_is_half_recent_levels_half_now_plus_each_recent_change():
    """A tenant climbing 1 GiB a tick: each level it held weighs 1/6, and now plus each one-tick
    change (+1 GiB twice) weighs 1/4, so a limit at today's use covers only half the sample."""
    sample = headroom.forecast([1024, 2048, 3072], 3072)
    assert [(v, round(w * 12)) for v, w in sample] == [(1024, 2), (2048, 2), (3072, 2), (4096, 3), (4096, 3)]
    opts = headroom.options(sample, 0, 8192, 3072, 3072, 3072)
    assert [(o.limit_mib, round(o.p, 3)) for o in opts] == [(3072, 0.5), (4096, 1.0)]


def test_a_limit_below_every_forecast_use_covers_nothing():
    """The least option (what it holds, 4,000 MiB) lies below every sampled use (8,000 and more): its
    chance is 0, not the weight of the lowest sample."""
    opts = headroom.options(headroom.forecast([8000, 9000], 9000), 0, 20000, 4000, 4000, 4000)
    assert opts[0] == Option(4000, 0, 0.0) and opts[1].p > 0
    # a limit at the lowest sampled use covers exactly that sample's weight (1/6), the next level 5/6
    low = headroom.options(headroom.forecast([1024, 2048, 3072], 1024), 0, 8192, 1024, 1024, 1024)
    assert [(o.limit_mib, round(o.p * 6, 6)) for o in low] == [(1024, 1), (2048, 5), (3072, 6)]


def test_choose_breaks_ties_toward_the_cheaper_plan():
    """Not every tenant's best fits (6,000 + 9,000 on 10,000), so the plans are searched: giving b its
    6,000 or c its 9,000 covers as much (1.5); the cheaper plan wins, the rest stays free."""
    a = [Option(0, 0, 0.5), Option(1, 5000, 0.5)]
    b = [Option(0, 0, 0.0), Option(1, 6000, 1.0)]
    c = [Option(0, 0, 0.0), Option(1, 9000, 1.0)]
    assert headroom.choose([a, b, c], 10000) == [0, 1, 0]


def test_forecast_returns_to_recent_levels():
    """A tenant that swung 10 <-> 30 GiB and sits at 10 now: the forecast keeps a real chance of 30."""
    sample = headroom.forecast([10240, 30720] * 10, 10240)
    opts = headroom.options(sample, 0, 81920, 10240, 10240, 10240)
    assert max(o.p for o in opts if o.limit_mib < 30720) < 0.8 and opts[-1].limit_mib >= 30720


P = PolicyParams(floor_fraction=0.1, ceiling_fraction=3.0, step_mib=1, margin_mib=1024, headroom="forecast", loans="any",
                 protect_requests=False)


def _state(i, req, cur, used, recent, demand=None):
    return TenantState(KEYS[i], req, cur, used, demand_mib=used if demand is None else demand,
                       recent_mib=tuple(recent))


def test_overload_covers_the_cheapest_whole_tenants():
    """Three tenants fenced at 25 GiB want 30, 30 and 35 GiB of a 92 GiB GPU: 17 GiB are free, so
    the two cheapest are covered whole and the costliest is the one cut, and its reason says why
    (a proportional split would leave all three short)."""
    gib = 1024
    uses = [30 * gib, 30 * gib, 35 * gib]
    states = tuple(_state(i, 30 * gib, 25 * gib, 25 * gib, [u] * 30, demand=u) for i, u in enumerate(uses))
    out = rebalance(GpuState("GPU-x", 92 * gib, states), P)
    short = [i for i, d in enumerate(out) if d.limit_mib < uses[i]]
    assert short == [2], [d.reason for d in out]
    assert "cheapest to satisfy" in out[2].reason


def test_protected_requests_are_never_cut_below_use_within_request():
    gib = 1024
    p = PolicyParams(floor_fraction=0.1, ceiling_fraction=3.0, step_mib=1, headroom="forecast", loans="any")
    uses = [20 * gib, 40 * gib, 40 * gib]
    states = tuple(_state(i, 27306, u, u, [u] * 30) for i, u in enumerate(uses))
    out = rebalance(GpuState("GPU-x", 80 * gib, states), p)
    assert all(d.limit_mib >= min(u, 27306) for d, u in zip(out, uses)), [d.reason for d in out]


@settings(max_examples=300, deadline=None)
@given(traces(), st.booleans(), st.booleans(), st.sampled_from([0.0, 0.25, 0.5]))
def test_forecast_keeps_the_capacity_invariant_and_floors(trace, protect, demand_known, floor):
    """The fenced world of test_policy_invariant with the forecast rule: for every tick the sum of
    max(limit, held) stays within the GPU, a cut frees nothing until released, floors hold (when
    they fit), and with protectRequests nobody's limit falls below its use within its request."""
    cap, reqs, wants, sig, ph, blind = trace
    n = len(reqs)
    p = PolicyParams(floor_fraction=floor, ceiling_fraction=3.0, step_mib=256, headroom="forecast", loans="any",
                     protect_requests=protect)
    limits: list[int | None] = [None] * n
    held = [0] * n
    hist: list[list[int]] = [[] for _ in range(n)]
    for tick, want in enumerate(wants):
        states = tuple(TenantState(KEYS[i], reqs[i], limits[i], None if blind[tick][i] else held[i], sig[tick][i],
                                   phase=ph[tick][i], demand_mib=want[i] if demand_known else None,
                                   recent_mib=tuple(hist[i][-60:]))
                       for i in range(n))
        out = rebalance(GpuState("GPU-x", cap, states), p)
        used = [held[i] if not blind[tick][i] else (limits[i] if limits[i] is not None else reqs[i]) for i in range(n)]
        assert sum(max(d.limit_mib, u) for d, u in zip(out, used)) <= max(cap, sum(used)), [d.reason for d in out]
        floors_fit = sum(p.floor_of(r) for r in reqs) <= cap - sum(u for u, b in zip(used, blind[tick]) if b)
        for i, d in enumerate(out):
            assert d.limit_mib <= d.ceiling_mib and d.reason
            if floors_fit and not blind[tick][i] and "not granted" not in d.reason:
                assert d.limit_mib >= d.floor_mib, d.reason
            if protect and not blind[tick][i] and ph[tick][i] is Phase.HOT and "not granted" not in d.reason \
                    and sum(min(r, max(u, h)) for r, u, h in zip(reqs, used, held)) <= cap:
                assert d.limit_mib >= min(used[i], p.ceiling_of(reqs[i]), max(reqs[i], p.floor_of(reqs[i]))), d.reason
            limits[i] = d.limit_mib
            held[i] = min(want[i], max(d.limit_mib, held[i]))
            hist[i].append(want[i] if demand_known else held[i])
        assert sum(held) <= max(cap, 0)


def test_headroom_key_is_validated():
    assert parse_config("version: v1\nquota:\n  headroom: forecast\n").quota.headroom == "forecast"
    with pytest.raises(ConfigError, match="quota.headroom"):
        parse_config("version: v1\nquota:\n  headroom: crystal-ball\n")
