"""The quota policy: rebalance the memory limits of the tenants sharing one GPU. Pure, no I/O.

Two layers, each explaining part of :func:`rebalance`:

**Targets** (where the limits should go; they add up to at most the GPU's capacity):

1. Each tenant's bounds (floor, ceiling, margin) are its own input (:class:`model.Bounds`; the
   defaults come from ``PolicyParams``), so a quota class can supply different ones. Limits stay in
   [floor, ceiling].
2. A tenant's *need* is its use (or its reported demand, when higher; a tenant at its limit with no
   reported demand counts one margin more, since a fence hides what it wants, and at least its
   window's peak when it shows the fence bites: preemptions or waiting requests; bench_quota,
   held-back k = 3 without exported demand: see README) plus headroom: at least its
   margin, and up to the peak of its use over the recent window (the loop keeps the window), since
   a tenant that fell from 30 GiB to 10 GiB a few minutes ago rises back by more than one margin.
   A tenant without telemetry holds its limit (never cut blind). A ``warm`` (idle) tenant needs only
   use + margin.
3. When the needs fit, everybody gets its need; then waking tenants are restored to their request
   ahead of anyone, pressured tenants grow (most pressured first), calm ones keep what they had, and
   lenders get memory back toward their request. What is left is split evenly as headroom
   (``share_spare``; off, it stays unassigned): under a hard limit unassigned memory helps nobody.
4. When the needs do not fit (overload), whole tenants are filled, in order of how little they ask
   beyond their request: limits cover use within the request first, then tenants get their whole
   use one by one, so the one asking most beyond its request is the one cut (and its reason says
   so); margins, then the rest of the headroom, come after every use. With ``protect_requests``
   (the default) use within each request is covered before anybody's use beyond it, so a tenant
   is never cut below its reservation to let another borrow; off, whole uses are filled in order
   alone, which puts fewer tenants over their limit (bench_quota: 7.5% vs 8.9% at k=3) at the cost
   of that guarantee.
   Splitting the shortfall in proportion would put every tenant a little over its limit.
   Quota classes (issue 14) rank tenants (``TenantState.rank``, the class's ``lendingPriority``):
   floors are covered first for everybody, then the use passes above run one rank at a time, the
   highest first, so a higher class is never cut below its use while a lower class keeps more than
   its floor; within a rank the rule above holds unchanged. With one class this is rule 4 as it was.
   Without overload, raises go to higher ranks first, so lower ranks are the ones left lending.
5. Hysteresis: a change smaller than ``step_mib`` that no rule forces is not made.

With ``headroom: forecast`` (:mod:`deviceplugin.quota.headroom`), rules 2-4 for serving tenants are
replaced by one choice: limits that maximise the expected number of tenants within their limit next
tick, from each tenant's window of uses, paying only for memory nobody holds (bench_quota, k=3:
6.61% vs 7.49% without protected requests, 8.21% vs 8.89% with them).

**Grants** (what may be handed out now): memory is counted as held by a tenant at max(limit,
measured use). A shrink the tenant has not yet honoured (its use is still above its new limit:
capping vLLM's KV pool frees no GPU memory by itself) is not free, so it is not granted to anyone
until measured use shows it released (or, for an engine that reports the generation it applied,
until it acknowledges the cut); a raise into such a not-yet-released limit must also fit the GPU as
it will be once the cuts are acknowledged. A starting engine that has reported no generation yet is
counted at the highest file it may have read (``unreported_mib``): nobody is raised into it and a
newcomer's file is fitted around it, but its own limit comes out of free memory, since a container not
started yet reads the newest file when it starts. Raises beyond use are granted from truly free memory only,
waking tenants first, then by the targets' order. A cut not yet applied stands: while a tenant of the
same class or a higher one waits for its request, nobody is raised beyond max(its limit in force, its
request), not even into memory it still holds (else a borrower cut for an owner is raised back every
tick before its engine applies the cut, and the owner waits as long as the borrower's demand lasts).
So for every GPU and tick, the sum over tenants of max(limit, use) never exceeds the capacity (or
the sum of uses, when the tenants already hold more than the capacity: then nobody is raised above
its use).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

from deviceplugin.quota import headroom, learned
from deviceplugin.quota.model import Bounds, Decision, GpuState, Phase, PolicyParams, Release, TenantState

# pressure points: each point grows the limit by one step this tick
_P_PREEMPT, _P_WAITING, _P_KV, _P_NEAR = 4, 2, 1, 1


@dataclass
class _Plan:
    t: TenantState
    b: Bounds
    cur: int
    held: int  # memory it holds now: its measured use, or its limit when use is unknown
    seen: int  # use, or reported demand when higher, within bounds
    need: int  # use + headroom within bounds (rule 2)
    want: int  # need + pressure steps (rule 3)
    score: int  # pressure points
    why: list[str]
    blind: bool  # no telemetry: the limit is held
    target: int = 0
    alloc: int = 0
    spare: int = 0  # part of the target that is shared spare memory (rule 3's last line)
    cut_note: str = ""  # why the forecast rule left it below its use (quota/headroom.py)
    ceiling: int = 0  # its class's ceiling, as the file states it (``b`` may hold loans back below it)
    settled: int = 0  # what it holds once its engine acknowledged every file (``held`` less unacked limits)
    waits: bool = False  # held at its request or limit in force because an owner waits for its request
    paper: int = 0  # what a starting engine that reported nothing may hold: counted for others, not its own

    @property
    def reserve(self) -> int:
        """Its request as far as its bounds allow: what rule 4 covers first."""
        return self.b.clamp(self.t.request_mib)

    @property
    def beyond(self) -> int:
        """How far its need goes beyond its request; the overload order (least first)."""
        return self.need - self.reserve

    def commit(self, limit: int) -> int:
        return max(limit, self.held, self.paper)


def _as_seen(t: TenantState) -> TenantState:
    """A starting container (issue 19) is planned as a waking one: restored to its request ahead of
    lenders, granted only what is free; with no sample yet its engine holds nothing."""
    if not t.starting:
        return t
    return dataclasses.replace(t, used_mib=0 if t.used_mib is None else t.used_mib, phase=Phase.WAKING)


def _bounds(t: TenantState, p: PolicyParams) -> Bounds:
    """Its bounds; with ``loans: releasing`` an engine that does not give memory back on a cut is
    never raised beyond its request: that memory is another's reservation or the extender's to
    promise, and a loan to it could not be called back when they need it."""
    b = t.bounds or p.bounds_of(t.request_mib)
    if p.loans == "releasing" and t.signals.release is not Release.RELEASE:
        b = Bounds(b.floor_mib, max(b.floor_mib, min(b.ceiling_mib, t.request_mib)), b.margin_mib)
    return b


def _held(t: TenantState, cur: int) -> int:
    """What it holds for the grant layer: its use; a releasing engine that acknowledged the file
    carrying its limit gives back what is above it at once (down to what it cannot release: its
    use beyond the KV memory it holds); a throttling one holds at least its KV memory."""
    used = t.used_mib or 0
    s = t.signals
    if s.release is Release.RELEASE and t.shrink_acked and used > cur:
        fixed = used - s.kv_held_mib if s.kv_held_mib is not None else 0
        held = max(cur, min(used, fixed))
    elif s.release is not Release.RELEASE and s.kv_held_mib is not None:
        held = max(used, s.kv_held_mib)
    else:
        held = used
    return held


def _unacked(t: TenantState, held: int) -> int:
    return max(held, t.unacked_mib or 0)  # it may still grow to a limit it has not let go of


def _plan(t: TenantState, p: PolicyParams) -> _Plan:
    pl = _plan_of(t, p)
    pl.settled, pl.held = pl.held, _unacked(t, pl.held)
    pl.paper = t.unreported_mib or 0
    pl.ceiling = max(pl.b.ceiling_mib, (t.bounds or p.bounds_of(t.request_mib)).ceiling_mib)
    return pl


def _plan_of(t: TenantState, p: PolicyParams) -> _Plan:
    t = _as_seen(t)
    b = _bounds(t, p)
    cur = b.clamp(t.request_mib if t.current_mib is None else t.current_mib)
    if t.used_mib is None:  # it holds its limit, or what it last held if a cut was not honoured yet
        last = t.recent_mib[-1] if t.recent_mib else 0
        return _Plan(t, b, cur, held=max(cur, last), seen=cur, need=cur, want=cur, score=0,
                     why=["no telemetry"], blind=True)
    held = _held(t, cur)
    seen = max(t.used_mib, t.demand_mib or 0)
    fence = cur if t.engine_mib is None else min(cur, b.clamp(t.engine_mib))
    if t.demand_mib is None and t.used_mib >= fence:  # at its (hard) limit: what it wants beyond is unseen,
        seen = t.used_mib + b.margin_mib  # so count one margin more as use, not as headroom
        if (t.signals.preemptions or t.signals.waiting) and t.peak_mib:  # fenced and showing it: it wants
            seen = max(seen, t.peak_mib)  # at least the level it held within the window (bench_quota @held)
        if not t.starting and t.phase is not Phase.WARM:  # an owner pressing on a fence below its request
            seen = max(seen, b.clamp(t.request_mib))  # takes its reservation back at once (issue 19)
    why: list[str] = []
    if t.phase is Phase.WARM:
        need = b.clamp(t.used_mib + b.margin_mib)
        return _Plan(t, b, cur, held, b.clamp(t.used_mib), need, need, 0, ["idle"], blind=False)
    need = b.clamp(max(seen + b.margin_mib, t.peak_mib or 0))
    if t.starting:  # counts at its request until its engine has shown what it uses
        seen = max(seen, b.clamp(t.request_mib))
        need = b.clamp(max(t.used_mib + b.margin_mib, seen))
        why.append("starting: counted at its request")
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
    if seen + b.margin_mib > cur:  # the margin is eaten: use is within margin of the limit (or above)
        score += _P_NEAR
        why.append(f"used {t.used_mib} near limit {cur}" if seen <= t.used_mib + b.margin_mib and
                   t.demand_mib is None else f"wants {seen}, limit {cur}")
    if need > b.clamp(seen + b.margin_mib):
        why.append(f"headroom to recent peak {t.peak_mib}")
    want = b.clamp(max(cur, need) + score * p.step_mib) if score else max(cur, need)
    return _Plan(t, b, cur, held, b.clamp(seen), need, max(want, need), score, why, blind=False)


def _raise(plans: list[_Plan], level: dict[int, int], free: int) -> int:
    """Raise each target (in the given order, whole tenants) toward ``level``; returns what is left."""
    for pl in plans:
        give = min(max(0, level[id(pl)] - pl.target), max(0, free))
        pl.target += give
        free -= give
    return free


def _targets_spare(plans: list[_Plan], cap: int, share_spare: bool) -> None:
    """Rule 3: every need fits."""
    for pl in plans:
        pl.target = pl.need
    free = cap - sum(pl.target for pl in plans)
    waking = [pl for pl in plans if pl.t.phase is Phase.WAKING and not pl.blind]
    hot = sorted((pl for pl in plans if pl.score), key=lambda pl: (-pl.t.rank, -pl.score, pl.t.key))
    calm = sorted((pl for pl in plans if not pl.score and pl.t.phase is not Phase.WARM),
                  key=lambda pl: (-pl.t.rank, pl.t.key))
    free = _raise(waking, {id(pl): max(pl.need, pl.reserve) for pl in waking}, free)
    free = _raise(hot, {id(pl): min(pl.want, max(pl.reserve, pl.need)) for pl in hot}, free)
    free = _raise(hot, {id(pl): pl.want for pl in hot}, free)
    free = _raise(calm, {id(pl): min(pl.cur, max(pl.reserve, pl.need)) for pl in calm}, free)
    free = _raise(calm, {id(pl): pl.cur for pl in calm}, free)
    free = _raise(calm, {id(pl): max(pl.cur, pl.reserve) for pl in calm}, free)
    if share_spare:
        _even(plans, free)


def _even(plans: list[_Plan], free: int) -> int:
    """What nobody asked for becomes headroom, split evenly up to each ceiling (warm and blind
    excluded); returns what is left."""
    open_ = sorted((pl for pl in plans if not pl.blind and pl.t.phase is not Phase.WARM), key=lambda pl: pl.t.key)
    while free > 0 and open_:
        share = max(1, free // len(open_))
        for pl in list(open_):
            give = min(share, pl.b.ceiling_mib - pl.target, free)
            pl.target += give
            pl.spare += give
            free -= give
            if pl.target >= pl.b.ceiling_mib:
                open_.remove(pl)
            if free <= 0:
                break
    return free


def _overload_order(plans: list[_Plan]) -> list[_Plan]:
    """Blind tenants keep their limit first; then by class rank (highest first), and within a rank
    waking ones first, then the least beyond its request."""
    return sorted(plans, key=lambda pl: (not pl.blind, -pl.t.rank, pl.t.phase is not Phase.WAKING, pl.beyond,
                                         pl.t.key))


def _bands(order: list[_Plan]) -> list[list[_Plan]]:
    """``order`` cut into runs of one class rank (blind tenants, first, ride with the top rank)."""
    out: list[list[_Plan]] = []
    for pl in order:
        if out and (pl.blind or out[-1][-1].blind or out[-1][-1].t.rank == pl.t.rank):
            out[-1].append(pl)
        else:
            out.append([pl])
    return out


def _targets_overload(plans: list[_Plan], cap: int, protect_requests: bool) -> None:
    """Rule 4: floors, then use within requests, then whole uses in order (the last ones are cut),
    then the margins, then the rest of the headroom: headroom goes before anybody's use does."""
    order = _overload_order(plans)
    for pl in plans:
        pl.target = 0
    free = _raise(order, {id(pl): pl.b.floor_mib for pl in order}, cap)
    for band in _bands(order):  # one class rank at a time, the highest first (one band without classes)
        if protect_requests:
            free = _raise(band, {id(pl): min(pl.seen, pl.reserve) for pl in band}, free)
        free = _raise(band, {id(pl): pl.seen for pl in band}, free)
    free = _raise(order, {id(pl): min(pl.need, pl.b.clamp(pl.seen + pl.b.margin_mib)) for pl in order}, free)
    _raise(order, {id(pl): pl.need for pl in order}, free)


def _targets_forecast(plans: list[_Plan], cap: int, p: PolicyParams) -> bool | None:
    """``headroom: forecast``: limits chosen by :mod:`quota.headroom` to minimise the expected number
    of tenants over their limit next tick, paying only for memory above what each holds (held memory
    is not free). Blind, warm and waking tenants keep rule 2/3's target first. Returns whether
    someone is left below its use, or None (rules 3/4 decide) while a serving tenant has no window
    of two uses yet (nothing to forecast from) or when even the least options do not fit."""
    if any(not pl.blind and pl.t.phase is Phase.HOT and len(pl.t.recent_mib or ()) < 2 for pl in plans):
        return None
    fixed = [pl for pl in plans if pl.blind or pl.t.phase is not Phase.HOT]
    for pl in fixed:
        pl.target = max(pl.need, pl.reserve) if pl.t.phase is Phase.WAKING and not pl.blind else pl.need
    free = cap - sum(max(pl.target, pl.held) for pl in fixed)
    free_plans = [pl for pl in plans if pl not in fixed]
    free -= sum(pl.held for pl in free_plans)
    opts = []
    for pl in free_plans:
        least = min(pl.held, pl.seen)
        if p.protect_requests:
            least = max(least, min(pl.seen, pl.reserve))
        if p.headroom == "learned":
            sample = learned.forecast(pl.t.recent_mib or (), pl.seen)
        else:
            sample = headroom.forecast(pl.t.recent_mib or (), pl.seen)
        o = headroom.options(sample, pl.b.floor_mib, pl.b.ceiling_mib, pl.held, least, pl.seen)
        opts.append(o)
    weighed = opts
    if len({pl.t.rank for pl in free_plans}) > 1:  # class-aware: a higher class's coverage counts more
        weighed = [[dataclasses.replace(x, p=x.p * _class_weight(pl.t.rank)) for x in o]
                   for pl, o in zip(free_plans, opts)]
    picks = headroom.choose(weighed, free) if free >= 0 else None
    if picks is None:
        return None
    for pl, o, j in zip(free_plans, opts, picks):
        pl.target = pl.need = o[j].limit_mib
        pl.why.append(f"forecast covers {o[j].p:.0%} of next use")
        if pl.target < pl.seen:
            cheaper = min((x.cost_mib for x in o if x.limit_mib >= pl.seen), default=0)
            pl.cut_note = (f"GPU over-committed, the tenants cheapest to satisfy are covered whole; covering "
                           f"its use {pl.seen} would take {cheaper} MiB more than is free")
    if p.share_spare:
        free = cap - sum(max(pl.target, pl.held) for pl in plans)
        _even(plans, free)
    return any(pl.target < pl.seen for pl in plans)


def _class_weight(rank: int) -> float:
    """How much covering a tenant of this class rank counts in the forecast's choice: doubling every
    100 ranks of lendingPriority (with one class every tenant counts the same)."""
    return 2.0 ** (max(-1000, min(1000, rank)) / 100)


def _hysteresis(plans: list[_Plan], cap: int, step: int) -> None:
    """Rule 5: undo changes smaller than a step unless a hard rule forces them."""
    for pl in plans:  # small raises that nothing forces give their memory back first
        if 0 < pl.target - pl.cur < step and pl.cur >= pl.need:
            pl.target = pl.cur
    free = cap - sum(pl.target for pl in plans)
    for pl in plans:  # then small cuts are undone while that memory is free
        if 0 < pl.cur - pl.target < step and pl.cur - pl.target <= free and pl.t.phase is not Phase.WARM:
            free -= pl.cur - pl.target
            pl.target = pl.cur


def _grant(plans: list[_Plan], cap: int) -> None:
    """The grant layer: raises beyond held memory come only out of memory nobody holds."""
    grow = sorted(plans, key=lambda pl: (-pl.t.rank, pl.t.phase is not Phase.WAKING, -pl.score, pl.beyond,
                                         pl.t.key))
    for pl in plans:  # a cut it has not applied yet stands here (see ``keep`` below)
        pl.alloc = min(pl.target, pl.held, max(pl.cur, pl.reserve))
    # a limit it has not let go of yet is held now but not for long: a raise into it is no new
    # promise today, but it is once the engine acknowledges; so every raise must also fit the GPU
    # as it will be then (``settled``), else a loan made before a claim came is never returned
    after = cap - sum(max(pl.alloc, pl.settled) for pl in plans)
    for pl in reversed(grow):  # the last to grow give such raises back first
        if after >= 0:
            break
        back = min(pl.alloc - min(pl.alloc, max(pl.cur, pl.settled)), -after)
        pl.alloc -= back
        after += back
    free = cap - sum(pl.commit(pl.alloc) for pl in plans)
    keep = sorted(plans, key=lambda pl: pl.t.key)
    for pl in keep:  # what it already had is not a new promise: served first; memory it still holds
        # above a cut its engine has not applied yet is its own only up to its request (a borrower's
        # pending cut is not revoked ahead of the owners it was cut for)
        free, after = _give(pl, min(pl.target, max(pl.cur, min(pl.held, pl.reserve))), free, after)
    for pl in grow:  # reservations come back before anybody borrows more (issue 19)
        free, after = _give(pl, min(pl.target, pl.reserve), free, after)
    owed = max((pl.t.rank for pl in plans if not pl.blind and pl.alloc < min(pl.target, pl.reserve)), default=None)
    for pl in grow:  # while an owner of its class or a higher one still waits for its request, nobody is
        # raised beyond its own request and its limit in force: else a borrower cut for that owner is
        # raised back into the memory it has not released yet, every tick before its engine applies
        # the cut, and the owner waits as long as the borrower's demand lasts (node property under
        # ``learned``). A higher class still borrows from a lower one (issue 14).
        waits = owed is not None and pl.t.rank <= owed
        free, after = _give(pl, min(pl.target, max(pl.cur, pl.reserve)) if waits else pl.target, free, after)
        pl.waits = waits and pl.alloc < pl.target and pl.alloc >= max(pl.cur, pl.reserve)


def _give(pl: _Plan, level: int, free: int, after: int) -> tuple[int, int]:
    if level <= pl.alloc:
        return free, after
    own = max(pl.alloc, pl.held)
    # every MiB above what it holds costs one free MiB (what it may hold on paper is counted in ``free``)
    reach = own + max(0, free + pl.commit(pl.alloc) - own)
    reach = min(reach, max(pl.alloc, pl.settled) + max(0, after))  # and one once its acknowledgements are in
    new = max(pl.alloc, min(level, reach))
    free -= pl.commit(new) - pl.commit(pl.alloc)
    after -= max(new, pl.settled) - max(pl.alloc, pl.settled)
    pl.alloc = new
    return free, after


def _phase(pl: _Plan) -> Phase:
    return Phase.COLD if pl.blind else pl.t.phase


def _reason(pl: _Plan, over: bool) -> str:  # noqa: C901 (one line per case, in the order they bind)
    delta = pl.alloc - pl.cur
    because = ", ".join(w for w in pl.why if w != "idle")
    verb = "grow" if delta > 0 else "shrink" if delta < 0 else "hold"
    if pl.blind:
        return "hold: no telemetry, never cut blind"
    if pl.waits:
        return (f"{verb} {delta:+d}: target {pl.target}, held at {pl.alloc} while a co-tenant waits for its "
                f"request (a cut is not revoked before it lands)")
    if pl.alloc < pl.target:
        return (f"{verb} {delta:+d}: target {pl.target}, {pl.target - pl.alloc} MiB not granted until "
                f"co-tenants release memory they were cut from")
    if over and pl.alloc < pl.seen and pl.cut_note:
        return f"{'cut' if delta < 0 else verb} {delta:+d}: {pl.cut_note}"
    if over and pl.alloc < pl.seen:
        return (f"{'cut' if delta < 0 else verb} {delta:+d}: GPU over-committed, kept {pl.alloc} of its use "
                f"{pl.seen}: it asks the most beyond its request {pl.t.request_mib} (whole tenants filled first)")
    if over and pl.alloc < pl.need:
        return f"{verb} {delta:+d}: GPU over-committed, headroom trimmed to {pl.alloc - pl.seen} MiB"
    if pl.t.phase is Phase.WARM:
        return f"{verb} {delta:+d}: warm (idle), shrunk toward floor {pl.b.floor_mib}, kept use + margin"
    if pl.t.phase is Phase.WAKING and delta > 0:
        return f"grow {delta:+d}: waking (traffic again), restored ahead of co-tenants"
    if delta > 0:
        if pl.spare and delta <= pl.spare:
            return f"grow {delta:+d}: spare memory shared as headroom"
        if pl.score:
            return f"grow {delta:+d}: {because}"
        if pl.need > pl.cur:
            return f"grow {delta:+d}: used {pl.t.used_mib} + headroom {pl.need - (pl.t.used_mib or 0)}"
        return f"grow {delta:+d}: back toward request {pl.t.request_mib}"
    if delta < 0:
        return f"shrink {delta:+d}: lent to pressured co-tenants (kept use + headroom)"
    return "hold" + (f": {because}, no spare memory" if pl.score and pl.alloc < pl.want else "")


def rebalance(gpu: GpuState, params: PolicyParams) -> list[Decision]:
    """New limits for every tenant of ``gpu``, in key order, each with a one-line reason."""
    plans = [_plan(t, params) for t in sorted(gpu.tenants, key=lambda t: t.key)]
    cap = max(0, gpu.capacity_mib - gpu.reserved_mib)  # reservations are never lent
    over = sum(pl.need for pl in plans) > cap
    forecast = _targets_forecast(plans, cap, params) if params.headroom in ("forecast", "learned") else None
    if forecast is not None:
        over = forecast
    elif over:
        _targets_overload(plans, cap, params.protect_requests)
    else:
        _targets_spare(plans, cap, params.share_spare)
    _hysteresis(plans, cap, params.step_mib)
    _grant(plans, cap)
    return [Decision(key=pl.t.key, gpu_uuid=gpu.uuid, limit_mib=pl.alloc,
                     previous_mib=pl.t.request_mib if pl.t.current_mib is None else pl.t.current_mib,
                     floor_mib=pl.b.floor_mib, ceiling_mib=pl.ceiling, reason=_reason(pl, over),
                     phase=_phase(pl), held_mib=pl.commit(pl.alloc))
            for pl in plans]


def node_excess(out: Sequence[Decision], tenants: Sequence[TenantState], capacity_mib: int,
                reserved_mib: int) -> tuple[int, int]:
    """The node-level invariant of issue 19 on one GPU: (MiB committed beyond the capacity, MiB of that
    which the decisions added). Every container with a quota file counts at max(limit, held), every claim
    at its grant (``reserved_mib``). Memory tenants already hold beyond the capacity (a loan made before a
    claim came, a late engine's file) only shrinks, so only what goes past max(capacity, held now) is the
    decisions' fault."""
    committed = sum(d.held_mib for d in out) + reserved_mib
    held = sum(max(t.used_mib or 0, t.unacked_mib or 0, t.unreported_mib or 0) for t in tenants) + reserved_mib
    return max(0, committed - capacity_mib), max(0, committed - max(capacity_mib, held))
