"""Property tests of the policy under random traces (issue 9 item 2): for every GPU and tick the sum
over tenants of max(limit, measured use) never exceeds the capacity; a shrink not yet honoured is not
granted to anyone; overload cuts whole tenants, the one asking most beyond its request first."""
from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from deviceplugin.quota.model import Bounds, GpuState, Phase, PolicyParams, Signals, TenantKey, TenantState
from deviceplugin.quota.policy import rebalance

KEYS = [TenantKey("ns", f"t{i}", "c", pod_uid=f"u{i}") for i in range(4)]
phases = st.sampled_from([Phase.HOT, Phase.HOT, Phase.WARM, Phase.WAKING])
params = st.builds(PolicyParams, floor_fraction=st.sampled_from([0.0, 0.25, 0.5]),
                   ceiling_fraction=st.sampled_from([1.0, 1.5, 3.0]), step_mib=st.sampled_from([1, 256, 512]),
                   margin_mib=st.sampled_from([0, 1024, 4096]), protect_requests=st.booleans(),
                   share_spare=st.booleans(), loans=st.sampled_from(["any", "releasing"]))


@st.composite
def traces(draw):
    """Tenants of one GPU (requests that fit it), and per tick what each *wants* to hold."""
    n = draw(st.integers(1, 4))
    cap = draw(st.integers(8, 80)) * 1024
    reqs = [draw(st.integers(1, cap // n // 256)) * 256 for _ in range(n)]
    ticks = draw(st.integers(1, 25))
    wants = [[draw(st.integers(0, cap)) for _ in range(n)] for _ in range(ticks)]
    sig = [[draw(st.sampled_from([Signals(), Signals(waiting=3), Signals(preemptions=2), Signals(kv_usage=0.95)]))
            for _ in range(n)] for _ in range(ticks)]
    ph = [[draw(phases) for _ in range(n)] for _ in range(ticks)]
    blind = [[draw(st.integers(0, 9)) == 0 for _ in range(n)] for _ in range(ticks)]
    return cap, reqs, wants, sig, ph, blind


@settings(max_examples=300, deadline=None)
@given(traces(), params, st.booleans())
def test_never_grants_memory_that_is_not_free(trace, p, demand_known):
    """A fenced world: a tenant holds min(want, max(limit, what it held)) (a cut frees nothing until
    its want drops), so held memory never exceeds the GPU as long as the policy keeps the invariant."""
    cap, reqs, wants, sig, ph, blind = trace
    n = len(reqs)
    limits: list[int | None] = [None] * n
    held = [0] * n
    for tick, want in enumerate(wants):
        states = tuple(TenantState(KEYS[i], reqs[i], limits[i], None if blind[tick][i] else held[i], sig[tick][i],
                                   peak_mib=held[i] + 512 * tick, phase=ph[tick][i],
                                   demand_mib=want[i] if demand_known else None)
                       for i in range(n))
        out = rebalance(GpuState("GPU-x", cap, states), p)
        assert out == rebalance(GpuState("GPU-x", cap, states), p)  # deterministic
        assert [d.key for d in out] == sorted(KEYS[:n])
        used = [held[i] if not blind[tick][i] else (limits[i] if limits[i] is not None else reqs[i]) for i in range(n)]
        committed = sum(max(d.limit_mib, u) for d, u in zip(out, used))
        assert committed <= max(cap, sum(used)), (committed, cap, used, [d.reason for d in out])
        assert sum(d.limit_mib for d in out) <= cap
        for i, d in enumerate(out):
            assert d.limit_mib >= 0 and d.reason and d.held_mib == max(d.limit_mib, used[i])
            if blind[tick][i]:  # never cut blind below its request (beyond it, co-tenants' use within
                reserve = max(p.floor_of(reqs[i]), min(p.ceiling_of(reqs[i]), reqs[i]))  # theirs comes first)
                assert d.limit_mib >= min(d.previous_mib, d.ceiling_mib, reserve) or "not granted" in d.reason \
                    or sum(p.floor_of(r) for r in reqs) > cap, d.reason
            limits[i] = d.limit_mib
            held[i] = min(want[i], max(d.limit_mib, held[i]))
        assert sum(held) <= max(cap, 0)


@settings(max_examples=300, deadline=None)
@given(st.integers(2, 4).flatmap(lambda n: st.tuples(
    st.lists(st.integers(0, 60000), min_size=n, max_size=n), st.integers(20000, 80000))))
def test_overload_cuts_whole_tenants_most_beyond_request_first(case):
    uses, cap = case
    n = len(uses)
    p = PolicyParams(floor_fraction=0.0, ceiling_fraction=12.0, step_mib=1, margin_mib=0, share_spare=False,
                     protect_requests=False, loans="any")
    req = cap // n
    # limits start at what each holds (an honest past), so every cut is for this tick's overload only
    states = tuple(TenantState(KEYS[i], req, uses[i], uses[i], demand_mib=uses[i]) for i in range(n))
    out = rebalance(GpuState("GPU-x", cap, states), p)
    short = [i for i, d in enumerate(out) if d.limit_mib < uses[i]]
    if sum(uses) <= cap:
        assert not short
        return
    # those cut are exactly the ones asking most (beyond an equal request = most use), and only
    # one of them is left partially served: whole tenants are filled, not shares of a shortfall
    served = sorted(range(n), key=lambda i: (uses[i], KEYS[i]))
    k = next(j for j, i in enumerate(served) if out[i].limit_mib < uses[i])
    assert set(short) == set(served[k:])
    assert all(out[i].limit_mib == 0 or i == served[k] for i in served[k + 1:])
    assert "asks the most beyond its request" in out[served[-1]].reason


def test_per_tenant_bounds_are_inputs_not_globals():
    p = PolicyParams(share_spare=False, loans="any")
    gold = TenantState(KEYS[0], 10000, 10000, 9800, bounds=Bounds(9000, 40000, 4096))
    bronze = TenantState(KEYS[1], 10000, 10000, 9800)
    out = rebalance(GpuState("GPU-x", 60000, (gold, bronze)), p)
    assert (out[0].floor_mib, out[0].ceiling_mib) == (9000, 40000) and out[0].limit_mib >= 9800 + 4096
    assert (out[1].floor_mib, out[1].ceiling_mib) == (5000, 15000) and out[1].limit_mib == 9800 + 1024 + 512  # its margin and one step of "near its limit"
    assert dataclasses.replace(bronze, bounds=None) == bronze


SIGNALS = [Signals(release_mode="unmap"), Signals(waiting=3, release_mode="unmap"),
           Signals(preemptions=2, release_mode="unmap"), Signals(kv_usage=0.95, release_mode="unmap")]


@st.composite
def pending_gpus(draw):
    """One GPU whose tenants hold their use and may still follow older, higher files (``unacked_mib``), or,
    starting, files they have not reported on (``unreported_mib``): every headroom rule, random pressure,
    classes, phases and a claim beside them."""
    n = draw(st.integers(1, 4))
    cap = draw(st.integers(8, 80)) * 1024
    ts = []
    for key in KEYS[:n]:
        req = draw(st.integers(1, max(1, cap // n // 512))) * 512
        used = draw(st.integers(0, 2 * req))
        cur = draw(st.one_of(st.none(), st.integers(req // 4, 2 * req)))
        w = tuple(draw(st.lists(st.integers(0, 2 * req), max_size=6)))
        starting = draw(st.booleans())
        kv = draw(st.one_of(st.none(), st.integers(0, used)))
        sig = dataclasses.replace(draw(st.sampled_from(SIGNALS)), kv_held_mib=kv)
        ts.append(TenantState(key, req, cur, used, sig, peak_mib=max(w + (used,)), shrink_acked=draw(st.booleans()),
                              phase=draw(phases), rank=draw(st.sampled_from([0, 0, 100])), recent_mib=w or None,
                              starting=starting, unacked_mib=draw(st.one_of(st.none(), st.integers(used, 3 * req))),
                              unreported_mib=draw(st.integers(req, 3 * req)) if starting and draw(st.booleans())
                              else None))
    headroom = draw(st.sampled_from(["peak", "forecast", "learned"]))
    return GpuState("GPU-x", cap, tuple(ts), reserved_mib=draw(st.sampled_from([0, 0, 2048]))), \
        dataclasses.replace(draw(params), headroom=headroom)


def _settled(t: TenantState, cur: int) -> int:
    """What it holds once its engine acknowledged every file: its use, less what a releasing engine that
    acknowledged its limit gives back at once: down to the limit, or to its use beyond the KV memory it
    says it holds when that is more (an engine that does not say fits its acknowledged limit)."""
    if t.shrink_acked and t.used_mib > cur:
        kv = t.signals.kv_held_mib
        return max(cur, min(t.used_mib, t.used_mib - kv if kv is not None else 0))
    return t.used_mib


@settings(max_examples=300, deadline=None)
@given(pending_gpus())
def test_every_raise_fits_the_gpu_now_and_once_every_file_is_acknowledged(case):
    """The grant layer's two sums (issue 19, policy docstring "Grants"): now, every tenant counts at the most
    it may hold (its use, a file it has not let go of, one it has not reported on) and the claim at its grant;
    once every engine has acknowledged its file, at max(new limit, what it then holds). Neither sum may grow
    past the capacity by a raise: each ends within the capacity, or no higher than it was before the tick."""
    gpu, p = case
    cap = gpu.capacity_mib - gpu.reserved_mib
    out = {d.key: d for d in rebalance(gpu, p)}
    cur = {t.key: p.bounds_of(t.request_mib).clamp(t.request_mib if t.current_mib is None else t.current_mib)
           for t in gpu.tenants}  # the limit in force as the policy reads it: within the tenant's bounds
    now_before = sum(max(cur[t.key], _settled(t, cur[t.key]), t.unacked_mib or 0, t.unreported_mib or 0)
                     for t in gpu.tenants)
    now_after = sum(out[t.key].held_mib for t in gpu.tenants)
    assert now_after <= max(cap, now_before), (now_after, now_before, cap)
    settled_before = sum(max(cur[t.key], _settled(t, cur[t.key])) for t in gpu.tenants)
    settled_after = sum(max(out[t.key].limit_mib, _settled(t, cur[t.key])) for t in gpu.tenants)
    assert settled_after <= max(cap, settled_before), (settled_after, settled_before, cap)
