"""The learned forecaster (quota.headroom: learned): fitting recovers known quantiles, its sample is a
distribution the knapsack can read, the shipped model loads, and the policy keeps its invariant with it."""
from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deviceplugin.quota import learned
from deviceplugin.quota.model import GpuState, PolicyParams, Signals, TenantKey, TenantState
from deviceplugin.quota.policy import rebalance
from vramshare.config import ConfigError, parse_config


def test_fit_recovers_the_quantiles_of_the_change():
    rng = random.Random(7)
    wins, nows, nexts = [], [], []
    for _ in range(4000):  # next = now + U(-1, 3) GiB, whatever the window says
        now = rng.randint(4096, 60000)
        wins.append([now + rng.randint(-2048, 2048) for _ in range(rng.randint(1, 30))] + [now])
        nows.append(now)
        nexts.append(now + rng.uniform(-1024, 3072))
    m = learned.fit(wins, nows, nexts, taus=(0.1, 0.5, 0.9))
    for tau, row in zip(m.taus, m.coef):
        pred = float(np.mean([row @ learned.features(w, n) for w, n in zip(wins[:500], nows[:500])]))
        assert pred == pytest.approx(-1 + 4 * tau, abs=0.15)  # GiB


def test_the_sample_is_a_sorted_distribution_snapped_up_to_held_levels():
    m = learned.Model((0.25, 0.5, 0.75), np.array([[0.0] * 9, [0.0] * 9, [0.9] + [0.0] * 8]), snap_mib=512)
    sample = learned.forecast([10000, 20000, 10000, 11000], 11000, m)
    assert [v for v, _ in sample] == sorted(v for v, _ in sample)
    assert sum(w for _, w in sample) == pytest.approx(1.0)
    assert sample[-1][0] == 11000 + int(0.9 * 1024)  # 0.9 GiB above now: no level within 512 MiB above
    snapped = learned.forecast([10000, 12000, 11000], 11000, learned.Model((0.5,), np.array([[0.8] + [0.0] * 8]), 512))
    assert snapped == [(12000, 1.0)]  # 11819 is snapped up to the level 12000 it held


def test_the_shipped_model_loads_and_refuses_other_features():
    m = learned.default_model()
    assert m.coef.shape == (len(m.taus), len(learned.FEATURES))
    with pytest.raises(ValueError, match="features"):
        learned.Model.from_json({**m.to_json(), "features": ["1", "now"]})


def test_the_features_read_the_window_as_named():
    """Each feature by its name in ``FEATURES``, in GiB relative to now: the last change is now minus
    the use one tick before (the window's last entry is now itself), peaks and trough over the last 5,
    15 and all ticks, the mean of the last 15, and the mean absolute change."""
    g = 1024
    # 18 ticks, now = 4 GiB; 15 ticks back the 15-tick peak (9), 5 ticks back the 5-tick peak (7)
    window = [30, 2, 2, 9, 2, 2, 2, 2, 2, 2, 2, 1, 2, 7, 3, 5, 6, 4]
    got = dict(zip(learned.FEATURES, learned.features([v * g for v in window], 4 * g)))
    assert got == pytest.approx({"1": 1.0, "now": 4.0, "last_change": -2.0, "peak5": 3.0, "peak15": 5.0,
                                 "peak60": 26.0, "trough15": -3.0, "mean15": 51 / 15 - 4,
                                 "volatility": float(np.abs(np.diff(window)).mean())})
    trough = dict(zip(learned.FEATURES, learned.features([g // 2] + [3 * g] * 14, 3 * g)))  # 15 ticks back
    assert trough["trough15"] == pytest.approx(-2.5)
    two = dict(zip(learned.FEATURES, learned.features([3 * g, 4 * g], 4 * g)))  # one change is a change
    assert (two["last_change"], two["volatility"]) == pytest.approx((1.0, 1.0))
    alone = dict(zip(learned.FEATURES, learned.features([], 4 * g)))  # no window: no change, no spread
    assert alone == pytest.approx({"1": 1.0, "now": 4.0, **{f: 0.0 for f in learned.FEATURES[2:]}})


def test_a_forecast_below_zero_is_zero_and_a_quantile_snaps_to_a_level_exactly_the_snap_above():
    m = learned.Model((0.5,), np.array([[-2.0] + [0.0] * 8]), snap_mib=512)
    assert learned.forecast([0, 0, 0], 0, m) == [(0, 1.0)]
    up = learned.Model((0.5,), np.array([[0.5] + [0.0] * 8]), snap_mib=512)  # now + 512 MiB: a level 512 above
    assert learned.forecast([10000, 11024], 10000, up) == [(11024, 1.0)]


def test_a_model_file_whose_coefficients_do_not_match_its_quantiles_is_refused():
    doc = learned.default_model().to_json()
    with pytest.raises(ValueError, match="coef shape"):
        learned.Model.from_json({**doc, "taus": doc["taus"][:-1]})


KEYS = [TenantKey("ns", f"t{i}", "c", pod_uid=f"u{i}") for i in range(3)]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40000), st.integers(0, 40000), st.lists(st.integers(0, 40000), min_size=2,
                                                                                 max_size=20)),
                min_size=1, max_size=3), st.booleans())
def test_the_policy_keeps_the_capacity_invariant_with_the_learned_forecast(tenants, protect):
    cap = 60000
    p = PolicyParams(floor_fraction=0.1, ceiling_fraction=3.0, headroom="learned", protect_requests=protect)
    states = tuple(TenantState(KEYS[i], cap // len(tenants), cur, used, Signals(release_mode="unmap"),
                               recent_mib=tuple(win)) for i, (cur, used, win) in enumerate(tenants))
    out = rebalance(GpuState("GPU-x", cap, states), p)
    used = [s.used_mib for s in states]
    assert sum(max(d.limit_mib, u) for d, u in zip(out, used)) <= max(cap, sum(used))
    assert all(d.floor_mib <= d.limit_mib <= d.ceiling_mib or d.limit_mib < d.floor_mib for d in out)


def test_config_takes_the_new_keys_and_refuses_unknown_values():
    q = parse_config("version: v1\nquota:\n  headroom: learned\n  loans: any\n").quota
    assert (q.headroom, q.loans) == ("learned", "any")
    assert parse_config("").quota.headroom == "forecast" and parse_config("").quota.loans == "releasing"
    with pytest.raises(ConfigError, match="quota.loans"):
        parse_config("version: v1\nquota:\n  loans: sometimes\n")
