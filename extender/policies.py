"""Placement policies: how to rank the nodes a pod fits on, and which GPUs to take on the chosen one.

A policy turns an :class:`~extender.fit.Ask` (the pod against candidate rows that all fit) into raw
float scores, higher is better, and picks slot columns on one row. Raw scores keep full resolution so
the simulator can pick exactly what a lone scheduler would; the HTTP adapter gets them squeezed to
kube-scheduler's 0..10 by :func:`extender.placement.score_nodes`.

Ours: ``fgd`` (default), ``binpack``, ``spread``. The paper's baselines live in
:mod:`extender.baselines` and register here too, so the extender and the simulator share one table.
"""
from __future__ import annotations

from typing import Callable, Protocol

import numpy as np

from extender.cluster import SHARED, ClusterState, Demand, HostDemand
from extender.fit import Ask
from extender.fragmentation import frag_after_each_slot, host_stranded, node_frag
from extender.workload import TargetWorkload

# Differences in fragmentation below this fraction of one GPU are noise, not preference.
_RESOLUTION = 1e-7
# Node scores move in steps of 0.16 GPU of fragmentation removed. Exact float deltas lose three
# points of allocation on the openb trace: near-equal nodes then scatter pods, where a tie left to
# the scheduler's stable node order packs them. Steps of 1/25 GPU (the paper's int(100*sigmoid) slope)
# gave 94.9% allocated at 100% arrived, 0.16 gave 95.3%, 0.32 no better (3 seeds, bench/README notes).
NODE_STEP = 0.16


class Policy(Protocol):
    name: str

    def scores(self, ask: Ask) -> np.ndarray:
        """``[n]`` raw scores for ``ask.rows`` (every row fits), higher is better."""

    def choose(self, ask: Ask, i: int) -> list[np.ndarray]:
        """Slot columns per demand on row ``ask.rows[i]``."""


def _packing(ask: Ask, free_after: np.ndarray) -> np.ndarray:
    """In [-1, 0]: minus the node's idle shared GPU after placement, in GPUs per slot column."""
    idle = np.where(ask.shared, free_after, 0).sum(axis=1)
    return -idle / (ask.scale * free_after.shape[1])


def _host_packing(ask: Ask) -> np.ndarray:
    """In [-1, 0]: minus the share of the node's CPU left free (0 where the host is not tracked)."""
    st = ask.state
    cap = st.cpu_cap[ask.rows].astype(np.float64)
    left = (ask.cpu_free - ask.host.cpu_milli) / np.where(cap > 0, cap, 1.0)
    return np.where(st.host_tracked[ask.rows], -left, 0.0)


def best_fit_columns(ask: Ask, i: int) -> list[np.ndarray]:
    place = ask.best_fit
    return [c[i] for c in place.columns]


class BinPack:
    """Best fit: the node with the least free GPU memory after placement; best-fit GPU on it."""

    name = "binpack"

    def scores(self, ask: Ask) -> np.ndarray:
        return _packing(ask, ask.best_fit.free_after) + 1e-3 * _host_packing(ask)

    def choose(self, ask: Ask, i: int) -> list[np.ndarray]:
        return best_fit_columns(ask, i)


class Spread:
    """Most free after placement, on the GPU with the most free memory: fewer noisy neighbours."""

    name = "spread"

    def scores(self, ask: Ask) -> np.ndarray:
        return -_packing(ask, ask.place("most").free_after)

    def choose(self, ask: Ask, i: int) -> list[np.ndarray]:
        return [c[i] for c in ask.place("most").columns]


class FragmentationGradient:
    """FGD for memory: the placement that most reduces expected fragmentation.

    Differences from the paper's plugin (``fgd-paper``): the target workload is the recent window of
    requests (live, no oracle), weighted by count as the paper does, and a shape carries the host
    memory it asked besides CPU, so GPUs stranded behind exhausted RAM count as fragments; node scores
    are the delta in linear steps of :data:`NODE_STEP` GPUs instead of ``int(100*sigmoid)``; the GPU
    inside the node is chosen by the exact delta, ties to the fullest GPU (best fit), instead of the
    first GPU with the best rounded score. Equal nodes stay equal: the scheduler's node order decides.

    Node scores also count the idle GPU a placement strands behind the node's CPU and memory at the
    workload's average ratio (:func:`extender.fragmentation.host_stranded`): on openb, CPU runs out about
    as fast as GPU, and this alone adds half a point of allocation over the paper's FGD
    (bench/results/placement.md). Live, the accounting tracks each node's allocatable CPU and memory and
    the requests of every pod bound there, so the term is the same as in the simulator; a node that
    publishes no allocatable strands nothing.
    """

    name = "fgd"
    score_step = 1.0  # raw scores are whole steps of NODE_STEP GPU (a residency bonus is in these units)

    def _single_slot(self, ask: Ask) -> bool:
        d = ask.demands
        return len(d) == 1 and d[0].kind == SHARED and d[0].count == 1

    def _eligible(self, ask: Ask, wl: TargetWorkload) -> np.ndarray:
        """``[n, G, M]`` (or ``[n, G, 1]``): shared GPUs each shape may use (its model constraint)."""
        elig = ask.shared[:, :, None]
        if any(s.models for s in wl.shapes):
            masks = np.stack([ask.state.model_mask(s.models) for s in wl.shapes], axis=1)  # [C, M]
            elig = elig & masks[ask.state.model[ask.rows]]
        return elig

    @staticmethod
    def _keys(demands: tuple, host: HostDemand) -> tuple:
        if len(demands) == 1 and demands[0].kind == SHARED and demands[0].count == 1:
            return ("slot", demands[0].per_gpu, host.cpu_milli, host.memory_mib)
        return ("after", demands, host.cpu_milli, host.memory_mib)

    def warm(self, state: ClusterState, max_rows: int) -> bool:
        """Compute, ahead of any request, the per-row tables of up to ``max_rows`` stale rows for the first
        shape that has some, the shapes just observed first, then the target workload's; ``True`` while
        more remain. Run in the background (the accounting's warmer) so no request pays for a shape's
        first appearance or for the workload being republished: every pod is observed when the watch
        reports it, which is before kube-scheduler asks about it."""
        wl = state.target_workload()
        rows = state.live_rows()
        for shape in dict.fromkeys(state.window.latest() + list(wl.shapes)):  # just observed first
            if shape.kind != SHARED or shape.per_gpu <= 0 or shape.count <= 0:
                continue
            demands = (Demand(shape.per_gpu, shape.count, shape.kind, shape.models),)
            host = HostDemand(shape.cpu_milli, shape.memory_mib)
            stale = state.memo.stale(self._keys(demands, host), wl, rows, state.row_version)
            if not len(stale):
                stale = state.memo.stale(("f0",), wl, rows, state.row_version)
            if len(stale):
                self.deltas(Ask(state, demands, stale[:max_rows], host))
                return True
            # the shape's scores too (its fragmentation tables are current now): prioritize's first
            # sighting of a shape otherwise pays every row's host stranding (~2 ms at 5,000 nodes)
            key = self._score_key(demands, host, state.gpu_scale())
            stale = state.memo.stale(key, wl, rows, state.row_version)
            if len(stale):
                self.scores(Ask(state, demands, stale[:max_rows], host))
                return True
        return False

    def deltas(self, ask: Ask) -> tuple[np.ndarray, np.ndarray | None]:
        """Fragmentation reduction per node ``[n]`` and, for one-GPU shared pods, per slot ``[n, G]``.

        Memoised per row (:class:`extender.memo.RowMemo`): only rows changed since the same request
        was last scored are recomputed.
        """
        st, wl, host = ask.state, ask.state.target_workload(), ask.host

        def memo(key: tuple, compute: Callable[[Ask], np.ndarray]) -> np.ndarray:
            return st.memo.get(key, wl, ask.rows, st.row_version, lambda stale: compute(ask.subset(stale)))

        f0 = memo(("f0",), lambda a: node_frag(a.shared_free, self._eligible(a, wl), a.cpu_free, wl, a.mem_free))
        if self._single_slot(ask):
            d = ask.demands[0]
            after = memo(self._keys(ask.demands, host), lambda a: frag_after_each_slot(
                a.shared_free, self._eligible(a, wl), a.cpu_free, wl, d.per_gpu, host.cpu_milli,
                a.mem_free, host.memory_mib))
            per_slot = np.where(ask.mask(0) & (ask.free >= d.per_gpu), f0[:, None] - after, -np.inf)
            return per_slot.max(axis=1), per_slot
        f1 = memo(self._keys(ask.demands, host), lambda a: node_frag(
            np.where(a.shared, a.best_fit.free_after, 0), self._eligible(a, wl), a.cpu_free - host.cpu_milli, wl,
            a.mem_free - host.memory_mib))
        return f0 - f1, None

    def stranding_removed(self, ask: Ask) -> np.ndarray:
        """``[n]`` GPU freed from host stranding by placing the pod (usually negative: it takes CPU)."""
        wl, host = ask.state.target_workload(), ask.host
        if not ask.state.host_tracked[ask.rows].any():  # no host known (e.g. no allocatable published)
            return np.zeros(len(ask.rows))
        idle = ask.shared_free.sum(axis=1).astype(np.float64)
        req = float(sum(d.per_gpu * d.count for d in ask.demands if d.kind == SHARED))
        cpu, mem = ask.cpu_free.astype(np.float64), ask.mem_free.astype(np.float64)
        before = host_stranded(idle, cpu, mem, wl)
        after = host_stranded(idle - req, cpu - host.cpu_milli, mem - host.memory_mib, wl)
        return before - after

    def scores(self, ask: Ask) -> np.ndarray:
        """Memoised per row like :meth:`deltas` (a node's score depends on that node, the pod's shape, the
        target workload and the GPU scale alone): after a bind only the rows it touched are scored again."""
        st = ask.state
        return st.memo.get(self._score_key(ask.demands, ask.host, ask.scale), st.target_workload(), ask.rows,
                           st.row_version, lambda stale: self._scores(ask.subset(stale)))

    @staticmethod
    def _score_key(demands: tuple, host: HostDemand, scale: float) -> tuple:
        return ("score", demands, host.cpu_milli, host.memory_mib, scale)

    def _scores(self, ask: Ask) -> np.ndarray:
        delta, _ = self.deltas(ask)
        return np.floor((delta + self.stranding_removed(ask)) / ask.scale / NODE_STEP + 1e-9)

    def _best_columns(self, ask: Ask, per_slot: np.ndarray) -> np.ndarray:
        """Per row: the slot with the largest delta, ties to the least free (best fit), then index."""
        q = np.round(per_slot / ask.scale / _RESOLUTION)
        key = np.where(np.isfinite(q), -q + ask.free / (4 * ask.scale), np.inf)
        return np.argmin(key, axis=1)

    def choose(self, ask: Ask, i: int) -> list[np.ndarray]:
        if self._single_slot(ask):
            _, per_slot = self.deltas(ask.subset(np.arange(len(ask.rows)) == i))
            assert per_slot is not None
            return [self._best_columns(ask.subset(np.arange(len(ask.rows)) == i), per_slot)[:1]]
        return best_fit_columns(ask, i)


OURS: dict[str, Callable[[], Policy]] = {
    "fgd": FragmentationGradient,
    "binpack": BinPack,
    "spread": Spread,
}
