"""The three questions kube-scheduler asks, answered for the live extender and the simulator alike.

``filter_nodes``: which nodes can hold the pod (and why not the others, in words a person can act on);
``score_nodes``: how good each is, 0..10; ``pick``: which GPUs to take on the chosen node. The row-level
functions (``fit_rows``, ``rank_rows``, ``choose`` on one :class:`Ask` built by ``ask_for``) are what the
simulator calls in its inner loop; the name-level ones wrap them. A pod is a sequence of :class:`Demand` (one per container that asks).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from vramshare.contract import MAX_EXTENDER_PRIORITY, MIN_EXTENDER_PRIORITY

from extender import policy_catalog, residency
from extender.cluster import ClusterState, Demand, HostDemand, NoFit
from extender.fit import Ask, allocation_amounts
from extender.reasons import why_not, why_not_rows, with_best

UNKNOWN_NODE = "node has no vramshare GPU inventory"


def ask_for(state: ClusterState, demands: Sequence[Demand], rows: np.ndarray,
            host: HostDemand = HostDemand(), rng: np.random.Generator | None = None) -> Ask:
    """One pod against candidate rows; build it once and pass it to the three row-level calls."""
    return Ask(state, tuple(demands), np.asarray(rows, np.int64), host, rng)


def fit_rows(ask: Ask) -> np.ndarray:
    """``[n]`` bool: does the whole pod fit each row (greedy, all demands together)."""
    if len(ask.rows) == 0:
        return np.zeros(0, bool)
    return ask.best_fit.ok


def rank_rows(ask: Ask, policy: str) -> np.ndarray:
    """Raw policy scores (float, higher is better) for rows that all fit the pod."""
    if len(ask.rows) == 0:
        return np.zeros(0)
    return policy_catalog.get(policy).scores(ask)


def choose(ask: Ask, i: int, policy: str) -> list[list[tuple[str, int]]]:
    """Slots and amounts per demand on row ``ask.rows[i]``; raises :class:`NoFit` with the reason."""
    if not ask.best_fit.ok[i]:
        raise NoFit(why_not(ask, i))
    return allocation_amounts(ask, i, policy_catalog.get(policy).choose(ask, i))


def without(items: list[str], drop: list[int], keep: np.ndarray | None = None) -> list[str]:
    """``items`` but those at the ascending indices ``drop``, in order. Few dropped (filter's usual
    answer: most of 5,000 nodes fit): whole slices between them, a quarter of what walking every item
    costs; many: ``keep`` (the mask of the others) walked once."""
    if len(drop) * 4 > len(items):
        if keep is None:
            keep = np.ones(len(items), bool)
            keep[drop] = False
        return list(itertools.compress(items, keep.tolist()))
    out: list[str] = []
    start = 0
    for i in drop:
        out += items[start:i]
        start = i + 1
    out += items[start:]
    return out


@dataclass(frozen=True)
class Filtered:
    """:func:`filter_rows`' answer: the fitting names (input order) and their rows, and ``{failed name:
    reason}`` with each failed name's row in the same order (-1: an unknown name)."""

    fitting: list[str]
    fitting_rows: np.ndarray
    failed: dict[str, str]
    failed_rows: np.ndarray


def filter_nodes(state: ClusterState, demands: Sequence[Demand], node_names: Sequence[str],
                 host: HostDemand = HostDemand()) -> tuple[list[str], dict[str, str]]:
    """Fitting names (input order) and ``{failed name: reason}``."""
    out = filter_rows(state, demands, node_names, host)
    return out.fitting, out.failed


def filter_rows(state: ClusterState, demands: Sequence[Demand], node_names: Sequence[str],
                host: HostDemand = HostDemand()) -> Filtered:
    """:func:`filter_nodes` with the rows it found, so the caller never looks a name up again."""
    found = state.rows_of(node_names)
    known = found >= 0
    rows = found[known]
    ask = Ask(state, tuple(demands), rows, host)
    ok = ask.best_fit.ok if len(rows) else np.zeros(0, bool)
    failing = np.flatnonzero(~ok)
    reasons = with_best(ask, failing, why_not_rows(ask, failing))
    if known.all():
        names = node_names if isinstance(node_names, list) else list(node_names)
        fitting = without(names, failing.tolist(), ok)
        fitting_rows = rows[ok]
        state.remember_rows(fitting, fitting_rows)
        return Filtered(fitting, fitting_rows, dict(zip(map(names.__getitem__, failing.tolist()), reasons)),
                        rows[failing])
    fitting: list[str] = []
    failed: dict[str, str] = {}
    fits, why = iter(ok.tolist()), iter(reasons)
    for name, is_known in zip(node_names, known.tolist()):
        if not is_known:
            failed[name] = UNKNOWN_NODE
        elif next(fits):
            fitting.append(name)
        else:
            failed[name] = next(why)
    at = np.zeros(len(node_names), bool)
    at[np.flatnonzero(known)[ok]] = True
    return Filtered(fitting, found[at], failed, found[~at])


def score_nodes(state: ClusterState, demands: Sequence[Demand], node_names: Sequence[str], policy: str,
                host: HostDemand = HostDemand(), rng: np.random.Generator | None = None,
                bonus: np.ndarray | None = None) -> list[tuple[str, int]]:
    """``(name, score)`` per input name, as :func:`score_rows` scores them."""
    _, out = score_rows(state, demands, node_names, policy, host, rng, bonus)
    return list(zip(node_names, out.tolist()))


def score_rows(state: ClusterState, demands: Sequence[Demand], node_names: Sequence[str], policy: str,
               host: HostDemand = HostDemand(), rng: np.random.Generator | None = None,
               bonus: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Each input name's row (-1: unknown) and its integer score 0..10, as ``[n]`` int64 arrays (the
    extender encodes them without a Python object per node, :class:`extender.wire.HostFragments`).

    Integer 0..10 per input name: one best fitting node gets 10, names that do not fit get 0.

    Raw scores are min-max scaled over the fitting nodes, so the extender's weight decides how much
    VRAM placement counts against kube-scheduler's own plugins, whatever the policy's raw units.
    Exactly one node keeps 10: of the nodes with the highest raw score, the first in a stable per-node
    order (``tie_rank``, CRC-32 of the name); every other node that would scale to 10 gets 9. So with
    a weight that dominates the default plugins, kube-scheduler binds exactly the node the simulator
    picks (``rank_rows`` argmax, same tie order), not merely one within a twentieth of the range of it;
    and it never breaks a tie at random (in the simulator a random choice among equally good nodes
    costs FGD five points of allocation against always filling the same nodes first).

    ``bonus`` (per input name, in steps of the policy's score: the residency term of issue 23,
    :mod:`extender.residency`) is added to the raw scores of the nodes that fit, before scaling; a
    policy's step is its ``score_step`` (fgd: 1, its scores are whole steps), else a tenth of the raw
    range (one point of the 0..10 scale). It never reaches a node that does not fit.
    """
    found = state.rows_of(node_names)
    known = found >= 0
    every = bool(known.all())  # the usual case: no copies by mask
    rows = found if every else found[known]
    out = np.full(len(node_names), MIN_EXTENDER_PRIORITY, np.int64)
    if len(rows):
        ask = Ask(state, tuple(demands), rows, host, rng)
        ok = ask.best_fit.ok
        if ok.any():
            pol = policy_catalog.get(policy)
            fit = ask.subset(ok)
            raw = pol.scores(fit)
            if bonus is not None:
                add = np.asarray(bonus, np.float64)[known][ok]
                if add.any():
                    raw = residency.with_bonus(raw, add, residency.step_of(raw, getattr(pol, "score_step", None)))
            lo, hi = float(raw.min()), float(raw.max())
            scaled = np.full(len(raw), MAX_EXTENDER_PRIORITY, np.int64) if hi <= lo else \
                np.rint((raw - lo) / (hi - lo) * (MAX_EXTENDER_PRIORITY - MIN_EXTENDER_PRIORITY)).astype(np.int64)
            scaled += MIN_EXTENDER_PRIORITY
            best = np.flatnonzero(raw >= hi)
            keep = best[np.argmin(state.tie_rank[fit.rows[best]])] if len(best) > 1 else best[0]
            scaled[scaled == MAX_EXTENDER_PRIORITY] = MAX_EXTENDER_PRIORITY - 1
            scaled[keep] = MAX_EXTENDER_PRIORITY
            if every:
                out[ok] = scaled
            else:
                per_row = np.full(len(rows), MIN_EXTENDER_PRIORITY, np.int64)
                per_row[ok] = scaled
                out[known] = per_row
    return found, out


def warm(state: ClusterState, policy: str, max_rows: int = 512) -> bool:
    """Precompute some of ``policy``'s per-row tables for the target workload (see
    :meth:`extender.policies.FragmentationGradient.warm`); ``True`` while more remain. Policies without
    tables return ``False``."""
    step = getattr(policy_catalog.get(policy), "warm", None)
    return bool(step(state, max_rows)) if step is not None else False


def pick(state: ClusterState, demands: Sequence[Demand], node: str, policy: str,
         host: HostDemand = HostDemand(), rng: np.random.Generator | None = None) -> list[list[tuple[str, int]]]:
    """Per demand ``[(slot uuid, amount)]`` on ``node``; raises :class:`NoFit` saying why not."""
    row = state.row(node)
    if row is None:
        raise NoFit(f"{node}: {UNKNOWN_NODE}")
    return choose(ask_for(state, demands, np.array([row]), host, rng), 0, policy)
