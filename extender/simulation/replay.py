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
from typing import Callable, Protocol, Sequence

import numpy as np

from vramshare.config import ExtenderConfig
from vramshare.contract import Names

from extender import residency
from extender.cluster import ClusterState
from extender.fragmentation import cluster_frag
from extender.placement import ask_for, choose, filter_nodes, fit_rows, pick, rank_rows, score_nodes
from extender.simulation.arrival import gpu_capacity
from extender.simulation.kube_model import KubeModel, PodRequest, Profile
from extender.simulation.trace import TraceNode, TracePod
from extender.workload import TargetWorkload

Progress = Callable[[str], None]


class Bonus(Protocol):
    """A term added to the policy's raw scores (the residency term, issue 23): steps per fitting row,
    and what was placed where (so it can learn, e.g. which node now holds a model's files)."""

    def steps(self, pod: TracePod, rows: np.ndarray) -> np.ndarray | None:
        """Steps of the policy's score for each of ``rows`` (the fitting rows); ``None``: no bonus."""

    def placed(self, pod: TracePod, row: int) -> None:
        """``pod`` was placed on ``row``."""


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


MIB = 1 << 20
GPU_MEMORY = Names().gpu_memory
#: Pods a node admits (the kubelet's default ``maxPods``), as the replay's nodes publish it.
MAX_PODS = 110


def kube_model_for(nodes: Sequence[TraceNode], profile: Profile, seed: int) -> KubeModel:
    """kube-scheduler's cache for the trace's nodes (allocatable as the replay's Node objects publish it)."""
    return KubeModel(profile, [n.cpu_milli for n in nodes], [n.memory_mib * MIB for n in nodes],
                     [MAX_PODS] * len(nodes), seed)


def pod_request(pod: TracePod) -> PodRequest:
    return PodRequest.of(pod.cpu_milli, pod.memory_mib * MIB)


def frag_rate(state: ClusterState, typical: TargetWorkload) -> float:
    """Fragmented share of idle GPU (%), measured against the trace's typical tasks (the paper's)."""
    shared = state.kind == state.kind_code("shared")
    free = np.where(shared, state.free(), 0)
    frag, idle = cluster_frag(free, shared[:, :, None], state.cpu_free(), typical)
    return 100.0 * frag / idle if idle > 0 else 0.0


def replay(nodes: Sequence[TraceNode], seq: Sequence[TracePod], policy: str, view: str, seed: int,
           typical: TargetWorkload, progress: Progress | None = None, bonus: Bonus | None = None) -> RunResult:
    """Place ``seq`` in order; ``typical`` pins fgd-paper's workload and measures fragmentation.
    ``bonus`` adds its steps to the raw scores (:func:`extender.residency.with_bonus`, fgd's unit)."""
    state = build_state(nodes, view)
    if policy == "fgd-paper":
        state.pinned = typical
    rng = np.random.default_rng(1_000_003 + seed)
    rows = np.array([state.row(n.name) for n in nodes], np.int64)
    rank = np.empty(len(rows), np.int64)
    rank[rows] = rng.permutation(len(rows))
    track = Tracker(float(gpu_capacity(nodes, view)), typical, len(seq))
    started = last_report = time.monotonic()
    for t, pod in enumerate(seq):
        demands, host = pod.demands(view), pod.host
        state.observe(demands, host)
        ask = ask_for(state, demands, rows, host, rng)
        ok = fit_rows(ask)
        got = None
        if ok.any():
            fitting = ask.subset(ok)
            raw = rank_rows(fitting, policy)
            steps = bonus.steps(pod, fitting.rows) if bonus is not None else None
            if steps is not None:
                raw = residency.with_bonus(raw, steps)
            best = np.flatnonzero(raw >= raw.max())
            i = int(best[np.argmin(rank[fitting.rows[best]])]) if len(best) > 1 else int(best[0])
            alloc = choose(fitting, i, policy)
            flat = [a for per_demand in alloc for a in per_demand]
            state.add_pod(pod.name, state.name(int(fitting.rows[i])), flat, host)
            got = sum(amount for _, amount in flat)
            if bonus is not None:
                bonus.placed(pod, int(fitting.rows[i]))
        track.record(t, state, pod.gpu_request(view), got)
        now = time.monotonic()
        if progress and (now - last_report > 5 or t == len(seq) - 1):
            last_report = now
            progress(f"{policy} seed {seed}: {t + 1}/{len(seq)} tasks, arrived {track.arrived_pct[t]:.1f}%, "
                     f"allocated {track.alloc_pct[t]:.1f}%, {now - started:.0f}s")
    return track.result(policy, seed, time.monotonic() - started)


@dataclass
class Tracker:
    """Arrived and allocated per task, and fragmentation at each whole arrived %, as :func:`replay` keeps."""

    capacity: float
    typical: TargetWorkload
    n: int
    arrived: float = 0.0
    allocated: float = 0.0
    failed: int = 0
    next_mark: int = 0

    def __post_init__(self) -> None:
        self.arrived_pct, self.alloc_pct = np.zeros(self.n), np.zeros(self.n)
        self.frag: list[tuple[float, float]] = []

    def record(self, t: int, state: ClusterState, asked: int, got: int | None) -> None:
        self.arrived += asked
        if got is None:
            self.failed += 1
        else:
            self.allocated += got
        self.arrived_pct[t], self.alloc_pct[t] = 100.0 * self.arrived / self.capacity, 100.0 * self.allocated / self.capacity
        if self.arrived_pct[t] >= self.next_mark:
            self.frag.append((self.arrived_pct[t], frag_rate(state, self.typical)))
            self.next_mark = int(self.arrived_pct[t]) + 1

    def result(self, policy: str, seed: int, seconds: float) -> RunResult:
        return RunResult(policy, seed, self.arrived_pct, self.alloc_pct, self.frag, self.failed, seconds)


def pod_resources(pod: TracePod, view: str) -> list[str]:
    """The resource names the replayed pod asks (what ``IsInterested`` reads)."""
    out = ["cpu"] + (["memory"] if pod.memory_mib else [])
    return out + ([GPU_MEMORY] if pod.demands(view) else [])


def replay_as_scheduler(nodes: Sequence[TraceNode], seq: Sequence[TracePod], policy: str, view: str, seed: int,
                        typical: TargetWorkload, profile: Profile,
                        placed: list[tuple[str, str]] | None = None) -> RunResult:
    """Place ``seq`` as kube-scheduler with the extender would: :class:`KubeModel` filters by CPU, memory
    and pod count; for pods the extender is interested in (its managedResources), the extender's
    ``filter_nodes`` and ``score_nodes`` (0..10, one 10 per cycle) answer as the verbs do, the model adds
    its default scores and the extender's weight and picks, and the binder's ``pick`` chooses the GPUs.
    Other pods are placed by the model alone. The stand-in driver (:class:`standins.scheduler.
    ProfileDriver`) does the same over HTTP; ``placed`` collects ``(pod, node)`` (``""``: unschedulable)."""
    state = build_state(nodes, view)
    if policy == "fgd-paper":
        state.pinned = typical
    kube = kube_model_for(nodes, profile, seed)
    rng = np.random.default_rng(1_000_003 + seed)  # only the baselines that choose at random use it
    names = [n.name for n in nodes]
    row_of = {n: i for i, n in enumerate(names)}
    name_arr = np.array(names, dtype=object)
    track = Tracker(float(gpu_capacity(nodes, view)), typical, len(seq))
    started = time.monotonic()
    for t, pod in enumerate(seq):
        demands, host, req = pod.demands(view), pod.host, pod_request(pod)
        state.observe(demands, host)
        feasible = np.flatnonzero(kube.fits(req))
        node, got = "", None
        if len(feasible) and profile.interested(pod_resources(pod, view)):
            candidates = name_arr[feasible].tolist()
            fitting = filter_nodes(state, demands, candidates, host)[0] if demands else candidates
            if fitting:
                rows = np.fromiter((row_of[n] for n in fitting), np.int64, len(fitting))
                ext = None
                if len(fitting) > 1:  # kube-scheduler skips prioritize with one feasible node
                    ext = np.array([sc for _, sc in score_nodes(state, demands, fitting, policy, host, rng)])
                node = names[int(rows[kube.select(rows, req, ext)])]
        elif len(feasible):
            node = names[int(feasible[kube.select(feasible, req)])]
        if node:
            flat = [a for per in pick(state, demands, node, policy, host, rng) for a in per] if demands else []
            state.add_pod(pod.name, node, flat, host)
            got = sum(amount for _, amount in flat)
            kube.bind(row_of[node], req)
        if placed is not None:
            placed.append((pod.name, node))
        track.record(t, state, pod.gpu_request(view), got if node else None)
    return track.result(policy, seed, time.monotonic() - started)
