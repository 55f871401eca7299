"""Property tests of class-aware lending and cutting (issue 14) over random tenant mixes.

Stated properties, each over many random GPUs, classes and traces in a fenced world (a tenant holds
min(want, max(limit, what it held)): a cut frees nothing until its use drops):

* a higher class is never cut below its use while a lower class keeps more than its floor (unless
  the memory it needs is still held by a tenant being cut, and its decision says "not granted":
  never grant what is not free);
* a higher class is never cut below its floor while a lower class is above its own (same proviso);
* the capacity invariant of issue 9: sum over tenants of max(limit, use) <= capacity;
* ranks only order classes: the same rank for everybody is the policy without classes.
"""
from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from deviceplugin.quota.model import Bounds, GpuState, Phase, PolicyParams, Signals, TenantKey, TenantState
from deviceplugin.quota.policy import rebalance

KEYS = [TenantKey("ns", f"t{i}", "c", pod_uid=f"u{i}") for i in range(5)]
params = st.builds(PolicyParams, floor_fraction=st.sampled_from([0.0, 0.25, 0.5]),
                   ceiling_fraction=st.sampled_from([1.0, 1.5, 3.0]), step_mib=st.sampled_from([1, 256, 512]),
                   margin_mib=st.sampled_from([0, 1024]), protect_requests=st.booleans(),
                   share_spare=st.booleans(), loans=st.just("any"))  # rank order of loans


@st.composite
def mixes(draw):
    """Tenants of one GPU, each with a class (rank, floor and ceiling fractions), and their wants per tick."""
    n = draw(st.integers(2, 5))
    cap = draw(st.integers(8, 80)) * 1024
    reqs = [draw(st.integers(1, cap // n // 256)) * 256 for _ in range(n)]
    classes = [draw(st.sampled_from([(100, 1.0, 1.5), (50, 0.5, 2.0), (0, 0.33, 3.0), (0, 0.0, 1.0)]))
               for _ in range(n)]
    bounds = [Bounds(int(f * r), max(int(f * r), int(c * r)), draw(st.sampled_from([0, 512, 1024])))
              for r, (_, f, c) in zip(reqs, classes)]
    ticks = draw(st.integers(1, 12))
    wants = [[draw(st.integers(0, cap)) for _ in range(n)] for _ in range(ticks)]
    sig = [[draw(st.sampled_from([Signals(), Signals(waiting=3), Signals(preemptions=2)])) for _ in range(n)]
           for _ in range(ticks)]
    ph = [[draw(st.sampled_from([Phase.HOT, Phase.HOT, Phase.HOT, Phase.WARM, Phase.WAKING])) for _ in range(n)]
          for _ in range(ticks)]
    blind = [[draw(st.integers(0, 11)) == 0 for _ in range(n)] for _ in range(ticks)]
    return cap, reqs, [c[0] for c in classes], bounds, wants, sig, ph, blind


def _seen(s: TenantState) -> int:
    """What the policy counts as the tenant's use (demand is always known here), within its bounds."""
    b = s.bounds
    use = s.used_mib if s.phase is Phase.WARM else max(s.used_mib, s.demand_mib or 0)
    return b.clamp(use)


@settings(max_examples=400, deadline=None)
@given(mixes(), params)
def test_classes_cut_and_lend_in_rank_order_and_keep_the_capacity_invariant(mix, p):
    cap, reqs, ranks, bounds, wants, sig, ph, blind = mix
    n = len(reqs)
    limits: list[int | None] = [None] * n
    held = [0] * n
    for tick, want in enumerate(wants):
        states = tuple(TenantState(KEYS[i], reqs[i], limits[i], None if blind[tick][i] else held[i], sig[tick][i],
                                   bounds=bounds[i], peak_mib=held[i], phase=ph[tick][i], demand_mib=want[i],
                                   rank=ranks[i], recent_mib=(held[i],))  # the loop's window: last use seen
                       for i in range(n))
        out = rebalance(GpuState("GPU-x", cap, states), p)
        used = [held[i] if not blind[tick][i] else (limits[i] if limits[i] is not None else reqs[i])
                for i in range(n)]
        # issue 9's invariant still holds with classes
        assert sum(max(d.limit_mib, u) for d, u in zip(out, used)) <= max(cap, sum(used))
        why = [(ranks[i], d.floor_mib, _seen(states[i]) if not blind[tick][i] else None, d.limit_mib, d.reason)
               for i, d in enumerate(out)]
        for hi in range(n):
            for lo in range(n):
                if ranks[hi] <= ranks[lo] or blind[tick][hi] or blind[tick][lo]:
                    continue
                lo_above_floor = out[lo].limit_mib > out[lo].floor_mib
                # its raise waits for memory others still hold, or for an owner of its class (or a higher
                # one) to get its request back first (a cut is not revoked before it lands): pending too
                pending = "not granted" in out[hi].reason or "while a co-tenant waits" in out[hi].reason
                # a higher class is not cut below its use while a lower class keeps more than its floor
                assert not (out[hi].limit_mib < _seen(states[hi]) and lo_above_floor) or pending, why
                # nor below its floor
                assert not (out[hi].limit_mib < min(out[hi].floor_mib, out[hi].previous_mib)
                            and lo_above_floor) or pending, why
        for i, d in enumerate(out):
            limits[i] = d.limit_mib
            held[i] = min(want[i], max(d.limit_mib, held[i]))
        assert sum(held) <= cap


@settings(max_examples=200, deadline=None)
@given(mixes(), params, st.integers(-5, 200))
def test_one_rank_for_everybody_is_the_policy_without_classes(mix, p, rank):
    cap, reqs, _, bounds, wants, sig, ph, blind = mix
    states = [TenantState(KEYS[i], reqs[i], None, None if blind[0][i] else wants[0][i] // 2, sig[0][i],
                          bounds=bounds[i], phase=ph[0][i], demand_mib=wants[0][i]) for i in range(len(reqs))]
    plain = rebalance(GpuState("GPU-x", cap, tuple(states)), p)
    ranked = rebalance(GpuState("GPU-x", cap, tuple(dataclasses.replace(s, rank=rank) for s in states)), p)
    assert ranked == plain


def test_the_lower_class_lends_first_under_pressure():
    """80 GiB, two tenants of 40 GiB: production (floor = request, rank 100) and batch (floor a third).
    Both want 50 GiB: production gets its 50, batch is cut, down to what is left (never below its floor)."""
    cap, req = 80 * 1024, 40 * 1024
    p = PolicyParams(step_mib=1, margin_mib=0, loans="any")
    prod = TenantState(KEYS[0], req, req, req, bounds=Bounds(req, int(1.5 * req), 0), demand_mib=50 * 1024, rank=100)
    batch = TenantState(KEYS[1], req, req, req, bounds=Bounds(req // 3, int(1.5 * req), 0), demand_mib=50 * 1024)
    out = {d.key: d for d in rebalance(GpuState("GPU-x", cap, (prod, batch)), p)}
    # nothing is free yet (both hold 40 GiB): production's raise waits for batch to release
    assert out[KEYS[1]].limit_mib == 30 * 1024 and "cut" in out[KEYS[1]].reason
    assert out[KEYS[0]].limit_mib == req and "not granted" in out[KEYS[0]].reason
    # a tick later batch holds 30 GiB: production gets its 50
    batch = dataclasses.replace(batch, current_mib=30 * 1024, used_mib=30 * 1024)
    out = {d.key: d for d in rebalance(GpuState("GPU-x", cap, (prod, batch)), p)}
    assert out[KEYS[0]].limit_mib == 50 * 1024 and out[KEYS[1]].limit_mib == 30 * 1024
    # the same two in one class: use within each request is protected (protectRequests), so nobody
    # borrows: both stay at their 40 GiB. Classes are what lets production borrow batch's request.
    same = (dataclasses.replace(prod, rank=0, bounds=batch.bounds), dataclasses.replace(batch, current_mib=req,
                                                                                         used_mib=req))
    out = {d.key: d for d in rebalance(GpuState("GPU-x", cap, same), p)}
    assert [out[k].limit_mib for k in KEYS[:2]] == [req, req]


def test_between_two_idle_lenders_the_lower_class_lends_whatever_their_names():
    """Two calm tenants of 10 GiB using 4 GiB each, and a pressured one that takes 2 GiB more of a 24 GiB
    GPU: the loan comes from the lower class's limit (``lendingPriority``), the higher class keeps its
    whole limit, and names only break ties within a class."""
    p = PolicyParams(share_spare=False, loans="any")
    hot = TenantState(KEYS[2], 4096, 4096, 4096, Signals(waiting=3, preemptions=2))
    for low, high in ((KEYS[0], KEYS[1]), (KEYS[1], KEYS[0])):
        idle = (TenantState(low, 10240, 10240, 4096, Signals(), rank=0),
                TenantState(high, 10240, 10240, 4096, Signals(), rank=100))
        out = {d.key: d for d in rebalance(GpuState("GPU-x", 24576, idle + (hot,)), p)}
        assert out[KEYS[2]].limit_mib == 6144
        assert (out[low].limit_mib, out[high].limit_mib) == (8192, 10240), (low, high)
