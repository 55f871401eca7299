"""Forecast headroom (``quota.headroom: forecast``): where to put a GPU's free memory so that the
fewest tenants go over their limit next tick. Pure, no I/O, no dependencies beyond NumPy.

Why a forecast and a choice rather than "use + margin" and proportional cuts (bench_quota, GenAI
trace, 3 tenants per 80 GiB GPU): use rises by more than 1 GiB in 15% of minutes, but mostly back
to a level it held in the last hour (the window's peak covers 92% of those rises). So

1. :func:`forecast` predicts a tenant's next use as a weighted sample: half "now + one of its
   recent one-tick changes" (how fast it moves), half "one of its recent levels" (where it returns
   to). Both come from the loop's window of recent uses; nothing is fitted, nothing is learned
   across tenants, so a new tenant with one sample is predicted to stay where it is.
2. :func:`options` turns that into a few candidate limits (quantiles of the forecast), each with
   its chance to cover next tick's use and its cost: only memory above what the tenant holds now
   costs anything, because held memory is not free until it is released (issue 9 item 2).
3. :func:`choose` picks one option per tenant to maximise the expected number of tenants within
   their limit under the GPU's free memory: a multiple-choice knapsack, solved exactly on the
   Pareto frontier (cost, expected covered). In overload it covers the tenants cheapest to satisfy
   whole and leaves the costliest one cut, instead of cutting everybody a little.

Measured (bench_quota, k=3, 20 groupings): see README "Quota policy figures". A myopic rule cannot
reach the clairvoyant figure: memory one tenant holds at t-1 cannot go to another at t even
when its use falls at t (a clairvoyant policy with that rule alone is 1.2x the unconstrained one).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

# the forecast's quantiles turned into candidate limits, every 2%: use returns to exact levels (KV
# pools come in fixed sizes), so coarse quantiles miss them (11 levels: 7.00% at k=3 on 5 groupings,
# 50: 6.91%, 100: 6.92%)
QUANTILES = tuple(j / 50 for j in range(1, 51))
_Q = np.array(QUANTILES)
# share of the forecast that says "back to a recent level" (the rest: "now + a recent change");
# 0.3 and 0.7 measured worse (7.24%, 7.25% vs 7.00%). Tried and dropped: weighting recent minutes
# more (half-life 20 ticks: no change), smoothing the levels by +-256 MiB or +-1 GiB (7.25%, 8.42%:
# a limit just above a level beats one "near" it), a fixed margin over each level (worse)
_LEVEL_WEIGHT = 0.5
_QUANTUM_MIB = 64  # plans whose costs differ by less are not both kept (bounds the knapsack's work)


@dataclass(frozen=True)
class Option:
    """One candidate limit for one tenant: ``p`` = forecast chance that next tick's use fits in it."""

    limit_mib: int
    cost_mib: int  # free memory it takes: the part of the limit above what the tenant holds now
    p: float


def forecast(recent: Sequence[int], now: int) -> list[tuple[int, float]]:
    """Next tick's use as (value, weight) pairs, sorted by value; weights add up to 1.

    ``recent`` are the last uses (oldest first; ``now`` need not be in it). With fewer than two,
    no change is known, so the forecast is ``now`` itself."""
    levels = list(recent) or [now]
    changes = [b - a for a, b in zip(levels, levels[1:])] or [0]
    wl, wc = _LEVEL_WEIGHT / len(levels), (1 - _LEVEL_WEIGHT) / len(changes)
    return sorted([(v, wl) for v in levels] + [(now + c, wc) for c in changes])


def options(sample: list[tuple[int, float]], floor_mib: int, ceiling_mib: int, held_mib: int,
            least_mib: int, now_mib: int) -> list[Option]:
    """Candidate limits within [floor, ceiling]: ``least_mib`` (the least the caller may give: what
    it holds, or its use within its request when requests are protected), and the forecast's
    quantiles, never below ``now_mib`` (today's use: a limit between the two covers nothing more
    than the least one, so it is not worth its memory)."""
    lo = min(ceiling_mib, max(floor_mib, least_mib))
    keep = max(lo, min(ceiling_mib, now_mib))
    values = np.fromiter((v for v, _ in sample), dtype=np.int64, count=len(sample))
    cum = np.cumsum(np.fromiter((w for _, w in sample), dtype=np.float64, count=len(sample)))
    at = np.minimum(len(values) - 1, np.searchsorted(cum, _Q - 1e-9, side="left"))  # first cum >= q
    levels = np.unique(np.append(np.maximum(keep, np.minimum(ceiling_mib, values[at])), lo))
    j = np.searchsorted(values, levels, side="right")  # how many sampled values each level covers
    ps = np.where(j > 0, cum[np.maximum(j - 1, 0)], 0.0)
    return [Option(int(lim), max(0, int(lim) - held_mib), float(pj)) for lim, pj in zip(levels.tolist(), ps.tolist())]


def choose(per_tenant: list[list[Option]], budget_mib: int) -> list[int] | None:
    """Index of the chosen option per tenant, maximising the sum of ``p`` with the sum of costs
    within ``budget_mib``; ties go to the cheaper plan. ``None`` when even the cheapest options
    do not fit (the caller falls back to its overload rule).

    A dynamic programme over tenants that keeps only Pareto-optimal (cost, value) partial plans,
    at most one per ``_QUANTUM_MIB`` of cost (the best of that band, with its exact cost), so it
    stays small however many tenants share the GPU; exact whenever costs differ by a quantum."""
    best_each = []  # when every tenant's best option fits at once, that is the answer (no overload):
    for opts in per_tenant:  # the cheapest option with the highest chance, per tenant
        top = max(o.p for o in opts)
        best_each.append(next(j for j, o in enumerate(opts) if o.p >= top - 1e-12))
    if sum(o[j].cost_mib for o, j in zip(per_tenant, best_each)) <= budget_mib:
        return best_each
    frontier: list[tuple[int, float, tuple[int, ...]]] = [(0, 0.0, ())]
    for opts in per_tenant:
        grown = sorted(((c + o.cost_mib, v + o.p, picks + (j,)) for c, v, picks in frontier
                        for j, o in enumerate(opts) if c + o.cost_mib <= budget_mib),
                       key=lambda s: (s[0], -s[1]))
        frontier, best = [], -1.0
        for s in grown:  # cost ascending: keep a plan only when it beats every cheaper one
            if s[1] > best + 1e-12:
                if frontier and frontier[-1][0] // _QUANTUM_MIB == s[0] // _QUANTUM_MIB:
                    frontier[-1] = s  # same band, more value: it replaces the cheaper one
                else:
                    frontier.append(s)
                best = s[1]
        if not frontier:
            return None
    return list(frontier[-1][2])
