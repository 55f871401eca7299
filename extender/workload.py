"""FGD's target workload: which request shapes are expected next, and how often.

Fragmentation is only defined against a workload (a free 300 MiB sliver is a fragment for a 20 GiB
request but not for a 256 MiB one). The paper takes the most popular shapes of the whole trace; live we
only know the past, so the extender keeps a sliding window of recent requests. Pure, no I/O.
"""
from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass
from typing import Iterable

import numpy as np


@dataclass(frozen=True, order=True)
class Shape:
    """One request shape: ``count`` slots with ``per_gpu`` each (+ host CPU where it is known)."""

    per_gpu: int
    count: int = 1
    kind: str = "shared"
    models: tuple[str, ...] = ()
    cpu_milli: int = 0
    memory_mib: int = 0


@dataclass(frozen=True)
class TargetWorkload:
    """Shapes with their popularity as parallel arrays, ready for broadcasting against slots."""

    shapes: tuple[Shape, ...]
    per_gpu: np.ndarray  # [M] int64
    count: np.ndarray  # [M] int64
    cpu: np.ndarray  # [M] int64
    weight: np.ndarray  # [M] float64, sums to 1 over all shapes (GPU ones and CPU-only ones)
    cpu_only_weight: float = 0.0  # share of CPU-only tasks: for them every idle GPU is a fragment
    mem: np.ndarray | None = None  # [M] int64 host memory, None when no shape carries any

    @property
    def empty(self) -> bool:
        return len(self.shapes) == 0

    @classmethod
    def from_counts(cls, counts: dict[Shape, float], cpu_only: float = 0.0) -> "TargetWorkload":
        """Build from shape->count; CPU-only tasks (per_gpu 0) may be folded into ``cpu_only``."""
        shared = {s: c for s, c in counts.items() if s.kind == "shared" and s.per_gpu > 0 and s.count > 0}
        cpu_only += sum(c for s, c in counts.items() if s.per_gpu <= 0 or s.count <= 0)
        total = float(sum(shared.values()) + cpu_only)
        shapes = tuple(sorted(shared))
        if total <= 0:
            return cls((), *(np.zeros(0, np.int64) for _ in range(3)), np.zeros(0))
        mem = np.array([s.memory_mib for s in shapes], np.int64)
        return cls(
            shapes,
            np.array([s.per_gpu for s in shapes], np.int64),
            np.array([s.count for s in shapes], np.int64),
            np.array([s.cpu_milli for s in shapes], np.int64),
            np.array([shared[s] / total for s in shapes], np.float64),
            cpu_only / total,
            mem if mem.any() else None,
        )


class WorkloadWindow:
    """The last ``size`` observed shapes, with counts kept incrementally.

    The published workload only moves when the distribution has drifted by more than ``drift``
    (L1 distance of the weights): per-node fragmentation is memoised against the published object,
    so republishing on every request would throw that memo away for no change in the decision.
    Every window state is checked for drift exactly once (by :meth:`workload` or by the next
    :meth:`add`), so what is published depends only on the sequence of shapes observed, never on who
    asked when: the live extender (whose warmer asks at any moment) and the simulator publish alike.
    """

    def __init__(self, size: int = 1000, top: int = 32, drift: float = 0.1) -> None:
        self._recent: deque[Shape] = deque(maxlen=max(1, size))
        self._counts: Counter[Shape] = Counter()
        self._top, self._drift = top, drift
        self._published: TargetWorkload | None = None
        self._dirty = True

    def add(self, shape: Shape) -> None:
        self._check_drift()
        if len(self._recent) == self._recent.maxlen:
            old = self._recent[0]
            self._counts[old] -= 1
            if self._counts[old] <= 0:
                del self._counts[old]
        self._recent.append(shape)
        self._counts[shape] += 1
        self._dirty = True

    def __len__(self) -> int:
        return len(self._recent)

    def latest(self, n: int = 16) -> list[Shape]:
        """The last ``n`` distinct shapes observed, newest first: pods that may be scheduled next."""
        out: dict[Shape, None] = {}
        for shape in reversed(self._recent):
            if len(out) >= n:
                break
            out.setdefault(shape, None)
        return list(out)

    def workload(self) -> TargetWorkload:
        """The most popular ``top`` shapes (bounding per-request cost), weights over what is kept."""
        self._check_drift()
        assert self._published is not None
        return self._published

    def _check_drift(self) -> None:
        if self._dirty:
            self._dirty = False
            fresh = TargetWorkload.from_counts(dict(self._counts.most_common(self._top)))
            if self._published is None or _distance(self._published, fresh) > self._drift:
                self._published = fresh


def _distance(a: TargetWorkload, b: TargetWorkload) -> float:
    wa = dict(zip(a.shapes, a.weight))
    wb = dict(zip(b.shapes, b.weight))
    return sum(abs(wa.get(s, 0.0) - wb.get(s, 0.0)) for s in set(wa) | set(wb)) + abs(a.cpu_only_weight - b.cpu_only_weight)


def typical_workload(shapes: Iterable[Shape], popularity: float = 0.95) -> TargetWorkload:
    """The paper's ``GetTypicalPods``: the most frequent shapes covering ``popularity`` of all tasks.

    CPU-only tasks are counted (``isInvolvedCpuPods: true``); weights are renormalised over what is kept.
    """
    counts = Counter(shapes)
    total = sum(counts.values())
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], _reverse_key(kv[0])))
    kept: dict[Shape, float] = {}
    covered = 0
    for shape, n in ranked:
        if covered >= popularity * total:
            break
        kept[shape] = n
        covered += n
    return TargetWorkload.from_counts(kept)


def _reverse_key(s: Shape) -> tuple:
    """Ties in popularity break like the paper's sort.Reverse(Less): larger CPU, then GPU first."""
    return (-s.cpu_milli, -s.per_gpu, -s.count, tuple(s.models))
