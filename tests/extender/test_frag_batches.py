"""One node's fragmentation must not depend on which other nodes are computed with it.

The row memo recomputes whatever rows are stale, in batches of any size; the simulator and the live
extender go stale in different batches. With a BLAS matrix-vector product a row's value changed in the
last bits with the batch, and a node score on a step boundary flipped: 13 of 10,842 trace pods landed
elsewhere through the wire than in the simulator (bench/bench_replay.py).
"""
from __future__ import annotations

import numpy as np

from extender.fragmentation import node_frag
from extender.workload import Shape, TargetWorkload


def test_node_frag_of_a_row_is_the_same_in_any_batch() -> None:
    rng = np.random.default_rng(0)
    wl = TargetWorkload.from_counts({Shape(int(p), int(c)): float(w) for p, c, w in zip(
        rng.integers(50, 1000, 30), rng.integers(1, 3, 30), rng.random(30))})
    free = rng.integers(0, 1001, (3000, 8))
    elig = np.ones((3000, 8, 1), bool)
    cpu = np.full(3000, 10**9)
    full = node_frag(free, elig, cpu, wl)
    for n in (1, 2, 3, 7, 100, 999):
        idx = rng.choice(3000, n, replace=False)
        np.testing.assert_array_equal(node_frag(free[idx], elig[idx], cpu[idx], wl), full[idx])
