"""The quota policy as it was before issue 9 (bench baseline only; the daemon uses ``policy``): rebalance the memory limits of the tenants sharing one GPU. Pure, no I/O.

Rules, in the order they bind (each one explains a line of :func:`rebalance`):

1. Admin bounds are hard: every limit stays in [floor_fraction x request, ceiling_fraction x request].
2. A tenant is never cut below what it uses now plus ``margin_mib`` (its "need"); a tenant we have
   no telemetry for is never cut below its current limit. Together these give each tenant ``lo``.
3. The limits of one GPU never add up to more than its capacity. If the needs do not fit, the
   margins are given up first; if even the uses do not fit (tenants use more than the GPU has),
   reservations win: floors, then use up to the request, then use beyond it, shared in proportion.
   That is the one case where a tenant can be cut below its use, and the reason says so.
4. Spare memory goes to tenants under pressure first (preemptions, waiting requests, high KV
   usage, use within the margin of its limit), most pressured first: first up to their own request (taking back
   what they lent), then beyond it (borrowing). Then everybody keeps what it has, then tenants
   that lent memory get it back toward their request. Memory nobody asks for stays unassigned.
5. Hysteresis: pressure grows a limit by whole steps; a change smaller than ``step_mib`` that no
   rule forces is not made, so limits do not flap around a boundary.
"""
from __future__ import annotations

from dataclasses import dataclass

from deviceplugin.quota.model import Decision, GpuState, PolicyParams, TenantState

# pressure points: each point grows the limit by one step this tick
_P_PREEMPT, _P_WAITING, _P_KV, _P_NEAR = 4, 2, 1, 1


@dataclass
class _Plan:
    t: TenantState
    floor: int
    ceil: int
    cur: int
    lo: int  # hard minimum this tick (rule 2)
    want: int  # what it asks for (rule 4)
    score: int  # pressure points
    why: list[str]
    alloc: int = 0

    @property
    def reserve(self) -> int:
        """Its request, as far as its bounds allow: the part that rule 3 and tier 1 protect."""
        return min(max(self.t.request_mib, self.floor), self.ceil)


def _clamp(v: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, v))


def _plan(t: TenantState, p: PolicyParams) -> _Plan:
    floor, ceil = p.floor_of(t.request_mib), p.ceiling_of(t.request_mib)
    cur = _clamp(t.request_mib if t.current_mib is None else t.current_mib, floor, ceil)
    why: list[str] = []
    if t.used_mib is None:
        return _Plan(t, floor, ceil, cur, lo=cur, want=cur, score=0, why=["no telemetry"])
    need = t.used_mib + p.margin_mib
    lo = _clamp(need, floor, ceil)
    s, score = t.signals, 0
    if s.preemptions:
        score += _P_PREEMPT
        why.append(f"{s.preemptions} preemptions")
    if s.waiting:
        score += _P_WAITING
        why.append(f"{s.waiting} waiting")
    if s.kv_usage is not None and s.kv_usage >= p.kv_pressure:
        score += _P_KV
        why.append(f"kv {s.kv_usage:.2f}")
    if need > cur:  # the margin is eaten: use is within margin_mib of the limit (or above it)
        score += _P_NEAR
        why.append(f"used {t.used_mib} near limit {cur}")
    want = _clamp(max(cur, need) + score * p.step_mib, lo, ceil) if score else max(cur, lo)
    return _Plan(t, floor, ceil, cur, lo, want, score, why)


def _fill(plans: list[_Plan], target: dict[int, int], free: int) -> int:
    """Raise each plan (in the given order) toward its target while memory is left; returns the rest."""
    for pl in plans:
        give = min(max(0, target[id(pl)] - pl.alloc), free)
        pl.alloc += give
        free -= give
    return free


def _share(plans: list[_Plan], target: dict[int, int], free: int) -> int:
    """Raise all plans toward their targets in proportion to what each lacks (integer, deterministic)."""
    lack = {id(pl): max(0, target[id(pl)] - pl.alloc) for pl in plans}
    total = sum(lack.values())
    if total <= free:
        return _fill(plans, target, free)
    grants = {k: v * free // total for k, v in lack.items()}
    left = free - sum(grants.values())
    for pl in plans:  # the remainder, one MiB each, in key order
        if left and grants[id(pl)] < lack[id(pl)]:
            grants[id(pl)] += 1
            left -= 1
        pl.alloc += grants[id(pl)]
    return left


def _overcommitted(plans: list[_Plan], cap: int, margin: int) -> None:
    """Rule 3: the needs do not fit. Margins go first, then use beyond the request, then the rest.

    Filled bottom-up: floors; use within the request; use beyond it; the margins; each level shared
    in proportion when it does not fit whole. So while the uses alone fit, nobody is cut below use.
    """
    use = {id(pl): max(pl.floor, pl.lo - margin) if pl.t.used_mib is not None else pl.lo for pl in plans}
    free = _share(plans, {id(pl): pl.floor for pl in plans}, cap)
    free = _share(plans, {id(pl): min(use[id(pl)], pl.reserve) for pl in plans}, free)
    free = _share(plans, use, free)
    _share(plans, {id(pl): pl.lo for pl in plans}, free)


def _spare(plans: list[_Plan], cap: int) -> None:
    """Rule 4: everybody has its ``lo``; hand out the rest by tiers."""
    for pl in plans:
        pl.alloc = pl.lo
    free = cap - sum(pl.alloc for pl in plans)
    hot = sorted((pl for pl in plans if pl.score), key=lambda pl: (-pl.score, pl.t.key))
    calm = [pl for pl in plans if not pl.score]
    free = _fill(hot, {id(pl): min(pl.want, max(pl.reserve, pl.lo)) for pl in hot}, free)
    free = _fill(hot, {id(pl): pl.want for pl in hot}, free)
    free = _fill(calm, {id(pl): min(pl.cur, max(pl.reserve, pl.lo)) for pl in calm}, free)
    free = _fill(calm, {id(pl): pl.cur for pl in calm}, free)
    _fill(calm, {id(pl): max(pl.cur, pl.reserve) for pl in calm}, free)


def _hysteresis(plans: list[_Plan], cap: int, step: int) -> None:
    """Rule 5: undo changes smaller than a step unless a hard rule forces them."""
    for pl in plans:  # small raises that nothing forces give their memory back first
        if 0 < pl.alloc - pl.cur < step and pl.cur >= pl.lo:
            pl.alloc = pl.cur
    free = cap - sum(pl.alloc for pl in plans)
    for pl in plans:  # then small cuts are undone while that memory is free
        if 0 < pl.cur - pl.alloc < step and pl.cur - pl.alloc <= free:
            free -= pl.cur - pl.alloc
            pl.alloc = pl.cur


def _reason(pl: _Plan, over: bool) -> str:
    delta = pl.alloc - pl.cur
    because = ", ".join(pl.why)
    if over and pl.alloc < pl.lo:
        return (f"{'cut' if delta < 0 else 'set'} {delta:+d}: GPU over-committed, kept {pl.alloc} of "
                f"use+margin {pl.lo} (margins go first, then use beyond the request)")
    if delta > 0:
        if pl.score:
            return f"grow {delta:+d}: {because}"
        if pl.t.used_mib is not None and pl.lo > pl.cur:
            return f"grow {delta:+d}: used {pl.t.used_mib} + margin"
        return f"grow {delta:+d}: back toward request {pl.t.request_mib}"
    if delta < 0:
        return f"shrink {delta:+d}: lent to pressured co-tenants (kept use + margin)"
    if pl.why == ["no telemetry"]:
        return "hold: no telemetry, never cut blind"
    return "hold" + (f": {because}, no spare memory" if pl.score and pl.alloc < pl.want else "")


def rebalance(gpu: GpuState, params: PolicyParams) -> list[Decision]:
    """New limits for every tenant of ``gpu``, in key order, each with a one-line reason."""
    plans = [_plan(t, params) for t in sorted(gpu.tenants, key=lambda t: t.key)]
    cap = max(0, gpu.capacity_mib)
    over = sum(pl.lo for pl in plans) > cap
    if over:
        _overcommitted(plans, cap, params.margin_mib)
    else:
        _spare(plans, cap)
    _hysteresis(plans, cap, params.step_mib)
    return [Decision(key=pl.t.key, gpu_uuid=gpu.uuid, limit_mib=pl.alloc,
                     previous_mib=pl.t.request_mib if pl.t.current_mib is None else pl.t.current_mib,
                     floor_mib=pl.floor, ceiling_mib=pl.ceil, reason=_reason(pl, over))
            for pl in plans]
