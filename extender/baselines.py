"""The FGD paper's baseline policies, as its simulator defines them (hkust-adsl/kubernetes-scheduler-simulator).

Kept to the letter, integer truncations included, because they decide ties and ties decide results:
each plugin scores 0..100 as an int64 and kube-scheduler picks uniformly among the best. GPU choice
follows the experiment scripts: Random -> random GPU, FGD -> its own fragmentation score, all others
-> best fit. Only the simulator compares against them; the live extender offers ours.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from extender.cluster import SHARED
from extender.fit import Ask
from extender.policies import FragmentationGradient, Policy, best_fit_columns

MAX_SCORE = 100
MAX_SPEC_CPU = 128000  # milli-CPU the paper normalises by (gpushareutils.MaxSpecCpu)
MAX_GPUS = 8  # MaxSpecGpu = 8 GPUs


def _gpu_totals(ask: Ask) -> tuple[np.ndarray, np.ndarray]:
    """Idle shared GPU per node and the pod's total GPU request, in slot units."""
    req = sum(d.per_gpu * d.count for d in ask.demands if d.kind == SHARED)
    return ask.shared_free.sum(axis=1).astype(np.float64), np.full(len(ask.rows), float(req))


class RandomFit:
    """Random feasible node (kube's tie-break over equal scores is the random draw), random GPU."""

    name = "random"

    def scores(self, ask: Ask) -> np.ndarray:
        assert ask.rng is not None, "random needs an rng"
        return ask.rng.random(len(ask.rows))

    def choose(self, ask: Ask, i: int) -> list[np.ndarray]:
        return [c[i] for c in ask.place("random").columns]


class BestFit:
    """``100 * (1 - sum 0.5 * (free - req) / maxSpec)`` over CPU and GPU, then min-max normalised."""

    name = "bestfit"

    def scores(self, ask: Ask) -> np.ndarray:
        gpu_free, gpu_req = _gpu_totals(ask)
        cpu_free = np.where(ask.state.host_tracked[ask.rows], ask.cpu_free, ask.host.cpu_milli)
        left = (0.5 * (cpu_free - ask.host.cpu_milli) / MAX_SPEC_CPU
                + 0.5 * (gpu_free - gpu_req) / (MAX_GPUS * ask.scale))
        raw = np.trunc((1.0 - left) * MAX_SCORE).astype(np.int64)
        if len(raw) == 0 or raw.max() == raw.min():
            return np.zeros(len(raw))
        lo, hi = raw.min(), raw.max()
        return ((raw - lo) * MAX_SCORE // (hi - lo)).astype(np.float64)

    def choose(self, ask: Ask, i: int) -> list[np.ndarray]:
        return best_fit_columns(ask, i)


class GpuPacking:
    """Shared GPUs in use > idle GPUs on a used node > an idle node (fewest GPUs first)."""

    name = "gpupacking"

    def scores(self, ask: Ask) -> np.ndarray:
        n = len(ask.rows)
        if not any(d.kind == SHARED and d.per_gpu > 0 for d in ask.demands):
            return np.zeros(n)  # CPU-only pods: MinNodeScore everywhere
        free, cap, shared = ask.free, ask.capacity, ask.shared
        gpus = shared.sum(axis=1)
        fully_free = (shared & (free == cap)).sum(axis=1)
        cols = ask.best_fit.columns[0]
        rows = np.arange(n)[:, None]
        taken_free = free[rows, cols]
        to_use_full = (taken_free == cap[rows, cols]).sum(axis=1)
        ratio = (taken_free * 100 // cap[rows, cols].clip(min=1)).sum(axis=1)
        score = np.maximum(MAX_SCORE - ratio // 10, MAX_SCORE // 2)
        score = np.where(to_use_full > 0, np.maximum(MAX_SCORE // 2 - to_use_full, MAX_SCORE // 3), score)
        score = np.where(fully_free == gpus, np.maximum(MAX_SCORE // 3 - fully_free, fully_free), score)
        return score.astype(np.float64)

    def choose(self, ask: Ask, i: int) -> list[np.ndarray]:
        return best_fit_columns(ask, i)


class DotProduct:
    """Tetris: ``1 - <free, request> / 2`` with both normalised by the max spec (merge GPUs, best fit)."""

    name = "dotprod"

    def scores(self, ask: Ask) -> np.ndarray:
        gpu_free, gpu_req = _gpu_totals(ask)
        cpu_free = np.where(ask.state.host_tracked[ask.rows], ask.cpu_free, 0)
        gpu_spec = MAX_GPUS * ask.scale
        dot = (cpu_free / MAX_SPEC_CPU) * (ask.host.cpu_milli / MAX_SPEC_CPU) + (gpu_free / gpu_spec) * (gpu_req / gpu_spec)
        return np.trunc(MAX_SCORE * (1.0 - dot / 2)).astype(np.float64)

    def choose(self, ask: Ask, i: int) -> list[np.ndarray]:
        return best_fit_columns(ask, i)


class PaperFGD(FragmentationGradient):
    """The paper's FGD: ``int(sigmoid(dF / GPU) * 100)``, the first GPU with the best int score.

    The simulator pins its target workload to the trace's typical pods (95% popularity, CPU included).
    """

    name = "fgd-paper"

    def _ints(self, ask: Ask) -> tuple[np.ndarray, np.ndarray | None]:
        delta, per_slot = self.deltas(ask)
        if per_slot is None:
            return _sigmoid_score(delta / ask.scale), None
        ints = np.where(np.isfinite(per_slot), _sigmoid_score(np.where(np.isfinite(per_slot), per_slot, 0) / ask.scale), -1)
        return ints.max(axis=1), ints

    def scores(self, ask: Ask) -> np.ndarray:
        return self._ints(ask)[0].astype(np.float64)

    def choose(self, ask: Ask, i: int) -> list[np.ndarray]:
        if self._single_slot(ask):
            _, per_slot = self._ints(ask.subset(np.arange(len(ask.rows)) == i))
            assert per_slot is not None
            return [np.argmax(per_slot, axis=1)[:1]]  # first index among equal ints, as the plugin
        return best_fit_columns(ask, i)


def _sigmoid_score(x: np.ndarray) -> np.ndarray:
    return np.trunc(MAX_SCORE / (1.0 + np.exp(-x))).astype(np.int64)


BASELINES: dict[str, Callable[[], Policy]] = {
    cls.name: cls for cls in (RandomFit, BestFit, GpuPacking, DotProduct, PaperFGD)
}
