"""A learned forecast of next tick's use (``quota.headroom: learned``): linear quantile regression
over the loop's window of recent uses, pure NumPy, fitted offline on a trace (``bench/bench_quota.py
--fit``) and shipped as a small JSON file of coefficients (``learned_model.json``).

Why this shape: what the knapsack of :mod:`headroom` needs is a calibrated distribution of next
minute's use, not a point. Use mostly stays put, rises back to a level it held recently, or moves by
about its recent changes; a linear model per quantile of the *change* (next - now) over a few window
statistics (last change, distance to the recent peaks and troughs, recent volatility) learns how
those mix at each quantile across many containers, which the fixed 50/50 rule of
:func:`headroom.forecast` cannot. Each predicted quantile is then snapped up to a level the tenant
held within ``snap_mib`` above it (KV pools come in fixed sizes: a limit just above a level beats one
near it). Quantiles are sorted (rearrangement), so they never cross.

Fitting is IRLS for the pinball loss (iteratively reweighted least squares), exact enough for eight
features and tens of thousands of rows, in a second on one core.
"""
from __future__ import annotations

import bisect
import json
import os
from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

import numpy as np

GIB = 1024.0
MODEL_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "learned_model.json")
TAUS = tuple([0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.93, 0.95, 0.97, 0.98, 0.99, 0.995])
FEATURES = ("1", "now", "last_change", "peak5", "peak15", "peak60", "trough15", "mean15", "volatility")


def features(recent: Sequence[int], now: int) -> np.ndarray:
    """The window statistics, in GiB, relative to ``now`` (so one model fits every size)."""
    w = np.asarray(recent if len(recent) else [now], dtype=np.float64)
    last = w[-2] if len(w) >= 2 else w[-1]
    d = np.diff(w) if len(w) >= 2 else np.zeros(1)
    return np.array([1.0, now / GIB, (now - last) / GIB, (w[-5:].max() - now) / GIB, (w[-15:].max() - now) / GIB,
                     (w.max() - now) / GIB, (w[-15:].min() - now) / GIB, (w[-15:].mean() - now) / GIB,
                     float(np.abs(d).mean()) / GIB])


@dataclass(frozen=True)
class Model:
    taus: tuple[float, ...]
    coef: np.ndarray  # (len(taus), len(FEATURES))
    snap_mib: int = 512

    def to_json(self) -> dict[str, object]:
        return {"features": list(FEATURES), "taus": list(self.taus), "snap_mib": self.snap_mib,
                "coef": [[round(float(c), 6) for c in row] for row in self.coef]}

    @classmethod
    def from_json(cls, doc: dict[str, object]) -> "Model":
        if list(doc.get("features") or []) != list(FEATURES):  # type: ignore[call-overload]
            raise ValueError("learned model: features differ from this code's")
        coef = np.asarray(doc["coef"], dtype=np.float64)
        taus = tuple(float(t) for t in doc["taus"])  # type: ignore[union-attr]
        if coef.shape != (len(taus), len(FEATURES)):
            raise ValueError(f"learned model: coef shape {coef.shape}")
        return cls(taus, coef, int(doc.get("snap_mib", 512)))  # type: ignore[call-overload]


@lru_cache(maxsize=1)
def default_model() -> Model:
    """The shipped model (``MODEL_PATH``), read once."""
    with open(MODEL_PATH, encoding="utf-8") as fh:
        return Model.from_json(json.load(fh))


def forecast(recent: Sequence[int], now: int, model: Model | None = None) -> list[tuple[int, float]]:
    """Next tick's use as (value, weight) pairs, sorted, weights adding up to 1 (the shape
    :func:`headroom.options` reads): one value per quantile, each weighing the probability mass
    between its neighbours' midpoints."""
    m = model or default_model()
    x = features(recent, now)
    q = np.sort(now + GIB * (m.coef @ x))
    levels = sorted(set(int(v) for v in recent)) if m.snap_mib else []
    taus = m.taus
    edges = [0.0] + [(a + b) / 2 for a, b in zip(taus, taus[1:])] + [1.0]
    out = []
    for v, lo, hi in zip(q, edges, edges[1:]):
        v = max(0, int(v))
        i = bisect.bisect_left(levels, v)
        if i < len(levels) and levels[i] - v <= m.snap_mib:
            v = levels[i]
        out.append((v, hi - lo))
    return sorted(out)


def fit(windows: Sequence[Sequence[int]], nows: Sequence[int], nexts: Sequence[int],
        taus: Sequence[float] = TAUS, iters: int = 40, snap_mib: int = 512) -> Model:
    """Linear quantile regression of (next - now) on :func:`features`, one model per quantile."""
    X = np.array([features(w, n) for w, n in zip(windows, nows)])
    y = (np.asarray(nexts, dtype=np.float64) - np.asarray(nows, dtype=np.float64)) / GIB
    coef = np.zeros((len(taus), X.shape[1]))
    ridge = 1e-6 * np.eye(X.shape[1])
    for j, tau in enumerate(taus):
        beta = np.linalg.solve(X.T @ X + ridge, X.T @ y)
        for _ in range(iters):
            r = y - X @ beta
            w = np.where(r >= 0, tau, 1 - tau) / np.maximum(np.abs(r), 1e-3)
            beta = np.linalg.solve((X * w[:, None]).T @ X + ridge, (X * w[:, None]).T @ y)
        coef[j] = beta
    return Model(tuple(taus), coef, snap_mib)
