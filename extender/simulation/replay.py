"""Replay one arrival sequence through the extender's own placement code under one policy.

Each task is filtered, scored and placed exactly as the live extender would (``fit_rows``,
``rank_rows``, ``choose`` from :mod:`extender.placement`); kube-scheduler's part is emulated: its
in-tree Fit (CPU and memory per node) through the host resources of :class:`ClusterState`, and its
choice among equal best scores as the paper's simulator makes it: the first such node in a per-seed
random node order (its scheduler fork plus randomly prefixed node names; a uniform coin toss per task
instead costs FGD five points of allocation, so this detail decides whether the baselines reproduce). Tasks that fit nowhere fail
and never retry; nothing departs.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from vramshare.config import ExtenderConfig

from extender.cluster import ClusterState
from extender.fragmentation import cluster_frag
from extender.placement import ask_for, choose, fit_rows, rank_rows
from extender.simulation.arrival import gpu_capacity
from extender.simulation.trace import TraceNode, TracePod
from extender.workload import TargetWorkload

Progress = Callable[[str], None]


@dataclass
class RunResult:
    """Per task: arrived and allocated GPU as % of capacity; fragmentation rate at each arrived %."""

    policy: str
    seed: int
    arrived: np.ndarray
    allocated: np.ndarray
    frag: list[tuple[float, float]] = field(default_factory=list)  # (arrived %, fragmented % of idle)
    failed: int = 0
    seconds: float = 0.0


def build_state(nodes: Sequence[TraceNode], view: str) -> ClusterState:
    gpus = max((n.gpus for n in nodes), default=1)
    state = ClusterState(workload_window=ExtenderConfig().workload_window, gpus_per_node=gpus)
    for n in nodes:
        state.set_node(n.name, n.slots(view))
        state.set_host(n.name, n.cpu_milli, n.memory_mib)
    return state


def frag_rate(state: ClusterState, typical: TargetWorkload) -> float:
    """Fragmented share of idle GPU (%), measured against the trace's typical tasks (the paper's)."""
    shared = state.kind == state.kind_code("shared")
    free = np.where(shared, state.free(), 0)
    frag, idle = cluster_frag(free, shared[:, :, None], state.cpu_free(), typical)
    return 100.0 * frag / idle if idle > 0 else 0.0


def replay(nodes: Sequence[TraceNode], seq: Sequence[TracePod], policy: str, view: str, seed: int,
           typical: TargetWorkload, progress: Progress | None = None) -> RunResult:
    """Place ``seq`` in order; ``typical`` pins fgd-paper's workload and measures fragmentation."""
    state = build_state(nodes, view)
    if policy == "fgd-paper":
        state.pinned = typical
    rng = np.random.default_rng(1_000_003 + seed)
    capacity = float(gpu_capacity(nodes, view))
    rows = np.array([state.row(n.name) for n in nodes], np.int64)
    rank = np.empty(len(rows), np.int64)
    rank[rows] = rng.permutation(len(rows))
    arrived_pct = np.zeros(len(seq))
    alloc_pct = np.zeros(len(seq))
    arrived = allocated = 0
    failed = 0
    frag: list[tuple[float, float]] = []
    next_mark = 0
    started = last_report = time.monotonic()
    for t, pod in enumerate(seq):
        demands, host = pod.demands(view), pod.host
        arrived += pod.gpu_request(view)
        state.observe(demands, host)
        ask = ask_for(state, demands, rows, host, rng)
        ok = fit_rows(ask)
        if ok.any():
            fitting = ask.subset(ok)
            raw = rank_rows(fitting, policy)
            best = np.flatnonzero(raw >= raw.max())
            i = int(best[np.argmin(rank[fitting.rows[best]])]) if len(best) > 1 else int(best[0])
            alloc = choose(fitting, i, policy)
            flat = [a for per_demand in alloc for a in per_demand]
            state.add_pod(pod.name, state.name(int(fitting.rows[i])), flat, host)
            allocated += sum(amount for _, amount in flat)
        else:
            failed += 1
        arrived_pct[t], alloc_pct[t] = 100.0 * arrived / capacity, 100.0 * allocated / capacity
        if arrived_pct[t] >= next_mark:
            frag.append((arrived_pct[t], frag_rate(state, typical)))
            next_mark = int(arrived_pct[t]) + 1
        now = time.monotonic()
        if progress and (now - last_report > 5 or t == len(seq) - 1):
            last_report = now
            progress(f"{policy} seed {seed}: {t + 1}/{len(seq)} tasks, arrived {arrived_pct[t]:.1f}%, "
                     f"allocated {alloc_pct[t]:.1f}%, {now - started:.0f}s")
    return RunResult(policy, seed, arrived_pct, alloc_pct, frag, failed, time.monotonic() - started)
