"""Placement as it happens on the DRA path, for the simulator: who picks the node, who picks the GPU.

With DRA, kube-scheduler's allocator picks the devices itself: the first devices in pool and slice
order that satisfy the claim (k8s.io/dynamic-resource-allocation/structured ``allocateOne``, depth
first), i.e. first fit in GPU index order. The extender can only weigh nodes. Two policies measure
what that weighing is worth:

- ``dra-random``: DRA as shipped; no scorer for shared devices, so any feasible node (kube-scheduler's
  random tie-break among equal scores) and first-fit GPUs;
- ``dra-fgd``: vramshare's FGD node score, computed for the GPU the allocator will really take
  (first fit, not FGD's own best GPU), then first-fit GPUs.

Only the simulator uses these; the live extender's DRA scoring is not built yet.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from extender.cluster import SHARED
from extender.fit import Ask, order
from extender.policies import NODE_STEP, FragmentationGradient, Policy, best_fit_columns


def first_fit_columns(ask: Ask, i: int) -> list[np.ndarray]:
    """Per demand, the lowest-index slots that fit on row ``i`` (the DRA allocator's device order)."""
    free = ask.free[i].astype(np.int64).copy()
    cap = ask.capacity[i]
    out: list[np.ndarray | None] = [None] * len(ask.demands)
    for j in order(ask.demands):
        d = ask.demands[j]
        k = max(1, d.count)
        m = ask.mask(j)[i]
        cand = m & (free >= d.per_gpu) if d.kind == SHARED else m & (free == cap) & (cap > 0)
        cols = np.flatnonzero(cand)[:k]
        if len(cols) < k:  # first fit cannot seat this multi-demand pod where greedy best fit could
            return best_fit_columns(ask, i)
        free[cols] -= d.per_gpu if d.kind == SHARED else free[cols]
        out[j] = cols
    return [c for c in out if c is not None]


class DraRandom:
    """DRA today: a random feasible node, first-fit devices."""

    name = "dra-random"

    def scores(self, ask: Ask) -> np.ndarray:
        assert ask.rng is not None, "dra-random needs an rng"
        return ask.rng.random(len(ask.rows))

    def choose(self, ask: Ask, i: int) -> list[np.ndarray]:
        return first_fit_columns(ask, i)


class DraFgd(FragmentationGradient):
    """FGD's node score for the first-fit GPU of each node, then first-fit devices."""

    name = "dra-fgd"

    def scores(self, ask: Ask) -> np.ndarray:
        if not self._single_slot(ask):
            return super().scores(ask)
        _, per_slot = self.deltas(ask)
        assert per_slot is not None
        d = ask.demands[0]
        fits = ask.mask(0) & (ask.free >= d.per_gpu)
        first = np.argmax(fits, axis=1)  # the allocator's device: the lowest index that fits
        delta = per_slot[np.arange(len(ask.rows)), first]
        delta = np.where(fits.any(axis=1), delta, -np.inf)
        return np.floor((delta + self.stranding_removed(ask)) / ask.scale / NODE_STEP + 1e-9)

    def choose(self, ask: Ask, i: int) -> list[np.ndarray]:
        return first_fit_columns(ask, i)


DRA: dict[str, Callable[[], Policy]] = {"dra-random": DraRandom, "dra-fgd": DraFgd}
