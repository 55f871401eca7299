"""The order in which tasks arrive, inflated to 130% of the cluster's GPU capacity as the paper does.

The paper's runs (``experiments/run_scripts``: ``--shuffle-pod=true -tune 1.3 -tuneseed 42..51``):
the trace's tasks are shuffled with the seed, then ``TunePodsByNodeTotalResource`` either drops random
tasks until the GPU requests are at most 1.3x capacity, or appends copies of uniformly drawn trace tasks
(CPU-only ones included: they count and consume CPU) until the next copy would pass 1.3x. No departures.
``order="trace"`` keeps the file order instead of shuffling (appended copies stay random).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Sequence

import numpy as np

from extender.simulation.trace import TraceNode, TracePod

ORDERS = ("shuffle", "trace")


def gpu_capacity(nodes: Sequence[TraceNode], view: str) -> int:
    return sum(s.capacity for n in nodes for s in n.slots(view))


def arrivals(pods: Sequence[TracePod], nodes: Sequence[TraceNode], view: str, seed: int,
             ratio: float = 1.3, order: str = "shuffle") -> list[TracePod]:
    """The arrival sequence for one seed; the same for every policy compared under that seed."""
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    rng = np.random.default_rng(seed)
    seq = list(pods)
    if order == "shuffle":
        seq = [seq[i] for i in rng.permutation(len(seq))]
    target = ratio * gpu_capacity(nodes, view)
    total = sum(p.gpu_request(view) for p in seq)
    while total > target and seq:
        total -= seq.pop(int(rng.integers(len(seq)))).gpu_request(view)
    copies = 0
    while total < target and pods:
        pod = pods[int(rng.integers(len(pods)))]
        if total + pod.gpu_request(view) > target:
            break
        seq.append(replace(pod, name=f"{pod.name}-tuned-{copies}"))
        total += pod.gpu_request(view)
        copies += 1
    return seq
