"""Does a pod fit a node, and where would a greedy pass put it? Vectorised over candidate nodes.

A pod is a sequence of demands (one per container that asks); all must fit on one node at once.
Demands are placed largest first, each on distinct slots, choosing slots by a key (least free = best
fit by default); a later shared demand may land on a GPU an earlier one already uses. Greedy is exact
for one demand (the common case) and a sound heuristic for several. Pure numpy, no I/O.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Sequence

import numpy as np

from extender.cluster import SHARED, ClusterState, Demand, HostDemand

_BIG = np.iinfo(np.int64).max // 4


@dataclass(frozen=True)
class Placement:
    """Greedy result for every candidate row: fits, the columns each demand takes, free after."""

    ok: np.ndarray  # [n] bool
    columns: tuple[np.ndarray, ...]  # per demand (input order): [n, count] slot columns
    free_after: np.ndarray  # [n, G]


@dataclass
class Ask:
    """One pod's demands against a set of candidate rows; views are computed once and shared."""

    state: ClusterState
    demands: tuple[Demand, ...]
    rows: np.ndarray
    host: HostDemand = HostDemand()
    rng: np.random.Generator | None = None
    _masks: dict[int, np.ndarray] = field(default_factory=dict)

    @cached_property
    def free(self) -> np.ndarray:
        """``[n, G]`` free amount per slot (0 when unhealthy or absent)."""
        return self.state.free()[self.rows]

    @cached_property
    def capacity(self) -> np.ndarray:
        return self.state.capacity[self.rows]

    @cached_property
    def shared(self) -> np.ndarray:
        """``[n, G]`` healthy shared-mode GPUs: the only ones that fragment."""
        return self.state.shared_mask()[self.rows]

    @cached_property
    def shared_free(self) -> np.ndarray:
        return np.where(self.shared, self.free, 0)

    @cached_property
    def cpu_free(self) -> np.ndarray:
        return self.state.cpu_free()[self.rows]

    @cached_property
    def mem_free(self) -> np.ndarray:
        return self.state.mem_free()[self.rows]

    @cached_property
    def host_ok(self) -> np.ndarray:
        return (self.cpu_free >= self.host.cpu_milli) & (self.mem_free >= self.host.memory_mib)

    @property
    def scale(self) -> float:
        """Size of one GPU (1000 in the share view): the unit in which scores are compared."""
        return self.state.gpu_scale()

    def mask(self, i: int) -> np.ndarray:
        """``[n, G]`` slots demand i may use at all: its kind, an allowed model, healthy."""
        if i not in self._masks:
            d, st = self.demands[i], self.state
            m = st.kind_mask(d, self.rows) & st.healthy[self.rows]
            if d.models:
                m &= st.model_mask(d.models)[st.model[self.rows]]
            self._masks[i] = m
        return self._masks[i]

    def place(self, prefer: str = "least") -> Placement:
        """Greedy placement of all demands on every row; ``prefer``: least | most free, or random."""
        return greedy(self, prefer)

    @cached_property
    def best_fit(self) -> Placement:
        """Greedy best fit on these rows: computed once over every row per pod shape and state version
        (:meth:`ClusterState.memo_fit`), then sliced, since filter, prioritize and the policies all ask."""
        st = self.state

        def compute(previous: Placement | None, rows: np.ndarray) -> Placement:
            part = Ask(st, self.demands, rows, self.host).place("least")
            if previous is None or previous.free_after.shape[1] != part.free_after.shape[1]:
                return part if previous is None else Ask(st, self.demands, st.all_rows(), self.host).place("least")
            return _patched(previous, rows, part)

        return _Rows(st.memo_fit(self.demands, self.host, compute), self.rows)  # type: ignore[return-value]

    def subset(self, keep: np.ndarray) -> "Ask":
        return Ask(self.state, self.demands, self.rows[keep], self.host, self.rng)


class _Rows:
    """A :class:`Placement` over every row, read at ``rows``: each field is sliced on first use, so a
    filter that reads only ``ok`` never copies the ``[n, G]`` arrays (~0.1 ms a request at 5,000 nodes).
    The memo never changes a placement it handed out (:func:`_patched` writes new arrays)."""

    def __init__(self, full: Placement, rows: np.ndarray) -> None:
        self._full, self._rows = full, rows

    @cached_property
    def ok(self) -> np.ndarray:
        return self._full.ok[self._rows]

    @cached_property
    def columns(self) -> tuple[np.ndarray, ...]:
        return tuple(c[self._rows] for c in self._full.columns)

    @cached_property
    def free_after(self) -> np.ndarray:
        return self._full.free_after[self._rows]


def _patched(full: Placement, rows: np.ndarray, part: Placement) -> Placement:
    """``full`` with ``rows`` replaced by ``part`` (their fresh placement), in new arrays: a row's greedy
    fit depends on that row alone, so patching the rows that changed equals placing every row again."""
    ok, free_after = full.ok.copy(), full.free_after.copy()
    ok[rows], free_after[rows] = part.ok, part.free_after
    columns = []
    for old, new in zip(full.columns, part.columns):
        cols = old.copy()
        cols[rows] = new
        columns.append(cols)
    return Placement(ok, tuple(columns), free_after)


def order(demands: Sequence[Demand]) -> list[int]:
    """Whole-slot demands first (they cannot share), then shared ones, largest first."""
    return sorted(range(len(demands)), key=lambda i: (demands[i].kind == SHARED, -demands[i].per_gpu))


def greedy(ask: Ask, prefer: str = "least") -> Placement:
    d = ask.demands
    if len(d) == 1 and d[0].kind == SHARED and d[0].count == 1 and prefer != "random":
        return _one_gpu(ask, prefer)
    n = len(ask.rows)
    free = ask.free.copy()
    ok = ask.host_ok.copy()
    columns: list[np.ndarray | None] = [None] * len(ask.demands)
    arange = np.arange(n)[:, None]
    for i in order(ask.demands):
        d = ask.demands[i]
        k = max(1, d.count)
        if d.kind == SHARED:
            cand = ask.mask(i) & (free >= d.per_gpu)
        else:  # exclusive GPU or MIG instance: a whole slot nobody holds
            cand = ask.mask(i) & (free == ask.capacity) & (ask.capacity > 0)
        ok &= cand.sum(axis=1) >= k
        if prefer == "random" and ask.rng is not None:
            key = ask.rng.random(free.shape)
        elif prefer == "most":
            key = -free.astype(np.float64)
        elif d.kind == SHARED:
            key = free.astype(np.float64)
        else:
            key = np.zeros(free.shape)
        key = np.where(cand, key, np.inf)
        cols = np.argsort(key, axis=1, kind="stable")[:, :k]
        if cols.shape[1] < k:  # fewer columns than the count asks: fits nowhere
            ok &= False
            cols = np.zeros((n, k), np.int64)
        take = free[arange, cols]
        amount = d.per_gpu if d.kind == SHARED else take
        free[arange, cols] = np.where(ok[:, None], take - amount, take)
        columns[i] = cols
    return Placement(ok, tuple(c for c in columns if c is not None), free)


def _one_gpu(ask: Ask, prefer: str) -> Placement:
    """The common case, one shared GPU: argmin instead of a sort."""
    r = ask.demands[0].per_gpu
    cand = ask.mask(0) & (ask.free >= r)
    ok = ask.host_ok & cand.any(axis=1)
    key = np.where(cand, ask.free if prefer == "least" else -ask.free, _BIG)
    col = np.argmin(key, axis=1)
    free = ask.free.copy()
    rows = np.flatnonzero(ok)
    free[rows, col[rows]] -= r
    return Placement(ok, (col[:, None],), free)


def allocation_amounts(ask: Ask, row_index: int, cols_per_demand: Sequence[np.ndarray]) -> list[list[tuple[str, int]]]:
    """Turn chosen columns into ``[(slot uuid, amount)]`` per demand; whole slots take their capacity."""
    slots = ask.state.slots(int(ask.rows[row_index]))
    out = []
    for d, cols in zip(ask.demands, cols_per_demand):
        out.append([(slots[int(c)].uuid, d.per_gpu if d.kind == SHARED else slots[int(c)].capacity)
                    for c in cols])
    return out

