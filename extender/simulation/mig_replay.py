"""The openb traces on MIG GPUs: static partitions against partitions made for the pods that ask.

Mapping (stated in README and the bench's JSON): every openb GPU becomes a MIG-capable card of similar
standing (:data:`GPU_MAP`); a task that shares one GPU (``num_gpu == 1``, ``gpu_milli < 1000``) asks for
``gpu_milli / 1000`` of that card's memory and gets the smallest profile holding it
(:func:`vramshare.mig.smallest_fitting`: fewest memory slots, then fewest compute slices); a task asking
whole GPUs gets one full-GPU instance (``7g``) on each of ``num_gpu`` GPUs of one node. CPU and host memory
are checked per node as in the paper's simulator; CPU-only tasks consume them too. Arrivals are the
FGD paper's (:func:`extender.simulation.arrival.arrivals`: shuffled, inflated to 1.3x the GPU capacity), no
departures; a task that fits nowhere is refused and never retries.

Policies:

* ``static``: every GPU pre-cut into a fixed layout, a task takes the smallest free instance that holds it
  (kinder than a real static cluster, where a pod asks one exact ``mig-<profile>`` resource);
* ``firstfit``: the instance is created for the task on the first GPU (per-seed node order) with a free
  legal placement, at its lowest free start;
* ``bestfit``: on the GPU with the fewest free memory slots that has a legal placement;
* ``frag``: at the (GPU, placement) that costs the least MIG potential for the expected workload
  (:func:`vramshare.mig.placement_loss`, weights = the profile mix of the tasks seen so far), then best fit;
* ``dra-random`` / ``dra-frag`` (the DRA path, partitionable devices): kube-scheduler's allocator picks
  the placement, first fit in the order the DRA plugin publishes (GPUs by index, each profile's
  placements from the highest start down), on the node kube-scheduler picks: any feasible node
  (``dra-random``, a fresh random order per task), or the one the extender's MIG term scores best
  (``dra-frag``: least :func:`vramshare.mig.placement_loss` of that first-fit placement, every non-media
  profile weighted alike, as :mod:`extender.dra_scoring` computes it).

GPUs in one (model, layout) state are interchangeable, so each decision looks at the distinct states,
not at every GPU: a cluster of 6,212 GPUs has a few hundred states.
"""
from __future__ import annotations

import time
from bisect import bisect_left, insort
from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np

from vramshare import mig
from extender import residency
from extender.simulation.replay import Bonus
from extender.simulation.trace import SHARE_UNITS, TraceNode, TracePod

#: openb model -> MIG card. 16 and 24 GiB cards -> A100 40GB, 32 GiB V100 -> A100 80GB; the undisclosed
#: G2 (4,392 of the 6,212 GPUs) -> H100 80GB and G3 -> H200 141GB, so every table is exercised.
GPU_MAP = {"P100": "A100-SXM4-40GB", "T4": "A100-SXM4-40GB", "V100M16": "A100-SXM4-40GB",
           "A10": "A100-SXM4-40GB", "G1": "A100-SXM4-40GB", "V100M32": "A100-SXM4-80GB",
           "G2": "H100-SXM5-80GB", "G3": "H200-SXM5-141GB"}
POLICIES = ("static", "firstfit", "bestfit", "frag", "dra-random", "dra-frag")
Layout = tuple[mig.Placed, ...]
Progress = Callable[[str], None]


def card_of(openb_model: str) -> mig.MigModel:
    """The MIG card an openb GPU model becomes (:data:`GPU_MAP`; an unknown model: A100 40GB)."""
    return mig.MODELS[GPU_MAP.get(openb_model, "A100-SXM4-40GB")]


def card(node: TraceNode) -> mig.MigModel:
    return card_of(node.model)


def ask(pod: TracePod, model: mig.MigModel) -> tuple[str, int] | None:
    """(profile, instances) a task needs on a node of ``model``; None for CPU-only tasks."""
    if pod.num_gpu <= 0 or pod.gpu_milli <= 0:
        return None
    full = model.profiles[-1]
    if pod.num_gpu > 1 or pod.gpu_milli >= SHARE_UNITS:
        return full.name, pod.num_gpu
    need = -(-pod.gpu_milli * model.memory_mib // SHARE_UNITS)
    profile = mig.smallest_fitting(model, need)
    return (profile or full).name, 1


def geometry(model: mig.MigModel, name: str) -> int:
    """A profile's position in its table: the same position is the same shape on every card."""
    return model.names.index(name)


def translate(layout: Layout, src: mig.MigModel, dst: mig.MigModel) -> Layout:
    return tuple(mig.Placed(p.start, dst.profiles[geometry(src, p.profile)].name) for p in layout)


@lru_cache(maxsize=None)
def _free_starts(model: str, layout: Layout, profile: str) -> tuple[int, ...]:
    return tuple(mig.free_starts(mig.MODELS[model], layout, profile))


@lru_cache(maxsize=None)
def _potential(model: str, layout: Layout, weights: tuple[tuple[str, float], ...]) -> float:
    return mig.potential(mig.MODELS[model], layout, dict(weights))


def _free_slots(model: mig.MigModel, layout: Layout) -> int:
    return mig.MEMORY_SLOTS - sum(model.profile(p.profile).memory_slots for p in layout)


State = tuple[str, Layout, frozenset[int]]  # (openb model, instances, indexes held by tasks)


@dataclass
class Cluster:
    """GPU layouts (instances) and host resources of every node. ``held[g]`` marks the instances of GPU
    ``g`` in use: static layouts exist before any task, dynamic ones are created for a task (and held).
    GPUs are grouped by state, each group kept in the per-seed node order, so a decision looks at the
    distinct states and the first GPU of each whose node still has CPU and memory."""

    nodes: Sequence[TraceNode]
    order: np.ndarray  # per-seed node order: ties go to the earliest node in it

    def __post_init__(self) -> None:
        rank = np.empty(len(self.nodes), dtype=np.int64)
        rank[self.order] = np.arange(len(self.nodes))
        self.gpu_node: list[int] = []
        self.gpu_rank: list[int] = []
        self.gpus_of: list[list[int]] = [[] for _ in self.nodes]
        for i, n in enumerate(self.nodes):
            for j in range(n.gpus):
                self.gpus_of[i].append(len(self.gpu_node))
                self.gpu_node.append(i)
                self.gpu_rank.append(int(rank[i]) * 64 + j)
        self.rank = rank
        self.layouts: list[Layout] = [()] * len(self.gpu_node)
        self.held: list[frozenset[int]] = [frozenset()] * len(self.gpu_node)
        self.members: dict[State, list[tuple[int, int]]] = {}
        for g in range(len(self.gpu_node)):
            self._join(g)
        self.cpu = np.array([n.cpu_milli for n in self.nodes], dtype=np.int64)
        self.mem = np.array([n.memory_mib for n in self.nodes], dtype=np.int64)

    def state(self, g: int) -> State:
        return self.nodes[self.gpu_node[g]].model, self.layouts[g], self.held[g]

    def _join(self, g: int) -> None:
        insort(self.members.setdefault(self.state(g), []), (self.gpu_rank[g], g))

    def _leave(self, g: int) -> None:
        group = self.members[self.state(g)]
        group.pop(bisect_left(group, (self.gpu_rank[g], g)))
        if not group:
            del self.members[self.state(g)]

    def set_gpu(self, g: int, layout: Layout, held: frozenset[int]) -> None:
        self._leave(g)
        self.layouts[g], self.held[g] = layout, held
        self._join(g)

    def model(self, g: int) -> mig.MigModel:
        return card(self.nodes[self.gpu_node[g]])

    def host_fits(self, i: int, pod: TracePod) -> bool:
        return self.cpu[i] >= pod.cpu_milli and self.mem[i] >= pod.memory_mib

    def allowed(self, i: int, pod: TracePod) -> bool:
        return not pod.gpu_spec or self.nodes[i].model in pod.gpu_spec

    def take_host(self, i: int, pod: TracePod) -> None:
        self.cpu[i] -= pod.cpu_milli
        self.mem[i] -= pod.memory_mib

    def first_fitting(self, state: State, pod: TracePod) -> int | None:
        """The first GPU of a state (node order) whose node has room for the task's CPU and memory."""
        for _rank, g in self.members.get(state, ()):
            if self.host_fits(self.gpu_node[g], pod):
                return g
        return None

    def used_slots(self) -> int:
        return sum(self.model(g).profile(self.layouts[g][k].profile).memory_slots
                   for g in range(len(self.layouts)) for k in self.held[g])


@dataclass
class MigRun:
    policy: str
    seed: int
    arrived: int = 0          # GPU tasks that arrived
    accepted: int = 0         # GPU tasks placed
    refused: int = 0
    cpu_only_refused: int = 0
    created: int = 0          # instances created for tasks (dynamic policies)
    slot_share: float = 0.0   # memory slots held by tasks / all slots, at the end (%)
    seconds: float = 0.0
    by_profile: dict[str, list[int]] = field(default_factory=dict)  # profile (reference card) -> [arrived, accepted]

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("policy", "seed", "arrived", "accepted", "refused",
                                              "cpu_only_refused", "created", "slot_share", "seconds",
                                              "by_profile")}


def _states_for(cluster: Cluster, pod: TracePod) -> Iterator[tuple[State, mig.MigModel]]:
    """The GPU states a single-GPU task may use (its model constraint), each with its card."""
    for state in list(cluster.members):
        if not pod.gpu_spec or state[0] in pod.gpu_spec:
            yield state, card_of(state[0])


def _weights_for(model: mig.MigModel, mix: Mapping[int, float]) -> tuple[tuple[str, float], ...]:
    return tuple(sorted((model.profiles[k].name, v) for k, v in mix.items()))


def _create(cluster: Cluster, g: int, start: int, profile: str) -> None:
    placed = mig.Placed(start, profile)
    layout = tuple(sorted((*cluster.layouts[g], placed)))
    k = layout.index(placed)
    held = {j + (j >= k) for j in cluster.held[g]}  # indexes past the new instance shift by one
    cluster.set_gpu(g, layout, frozenset(held | {k}))


def _dynamic_options(cluster: Cluster, layout: Layout, model: mig.MigModel, profile: str, policy: str,
                     mix: Mapping[int, float]) -> tuple[float, int] | None:
    """(loss, start) of the best placement of ``profile`` on a GPU in ``layout``; None if none is free."""
    starts = _free_starts(model.name, layout, profile)
    if not starts:
        return None
    if policy != "frag":
        return 0.0, starts[0]
    w = _weights_for(model, mix)
    before = _potential(model.name, layout, w)
    return min((before - _potential(model.name, tuple(sorted((*layout, mig.Placed(s, profile)))), w), s)
               for s in starts)


def _place_dynamic(cluster: Cluster, pod: TracePod, policy: str, mix: Mapping[int, float]) -> int:
    """Create the task's instances; the number created (0 when it fits nowhere)."""
    if pod.num_gpu > 1:
        return _place_dynamic_multi(cluster, pod, policy, mix)
    best: tuple | None = None
    for state, model in _states_for(cluster, pod):
        layout = state[1]
        profile = ask(pod, model)[0]  # type: ignore[index]
        option = _dynamic_options(cluster, layout, model, profile, policy, mix)
        if option is None:
            continue
        g = cluster.first_fitting(state, pod)
        if g is None:
            continue
        free = _free_slots(model, layout) if policy != "firstfit" else 0
        key = (option[0], free, cluster.gpu_rank[g], g, option[1], profile)
        if best is None or key < best:
            best = key
    if best is None:
        return 0
    *_, g, start, profile = best
    _create(cluster, g, start, profile)
    cluster.take_host(cluster.gpu_node[g], pod)
    return 1


@lru_cache(maxsize=None)
def _uniform(model: str) -> tuple[tuple[str, float], ...]:
    """The DRA scorer's weights (extender.dra_scoring.mig_weights): non-media profiles alike."""
    return tuple((p.name, 1.0) for p in mig.MODELS[model].profiles if not p.media)


@lru_cache(maxsize=None)
def _dra_first_fit_of(model: str, layouts: tuple[Layout, ...], profile: str,
                      count: int) -> tuple[float, tuple[tuple[int, int], ...]] | None:
    """What the allocator takes on a node whose GPUs hold ``layouts``: the first ``count`` GPUs (index
    order) with a free placement, each at its highest free start; with the MIG term's loss of those
    placements, each a share of its GPU's empty potential as the live scorer counts it
    (:func:`extender.dra_scoring.partition_loss`: cards of different sizes are ranked alike, pinned by
    ``tests/mig/test_replay.py``). Nodes in one state share the answer (pure, cached)."""
    w = _uniform(model)
    empty = max(_potential(model, (), w), 1e-9)
    loss, picks = 0.0, []
    for k, layout in enumerate(layouts):
        starts = _free_starts(model, layout, profile)
        if not starts:
            continue
        after = tuple(sorted((*layout, mig.Placed(starts[-1], profile))))
        loss += (_potential(model, layout, w) - _potential(model, after, w)) / empty
        picks.append((k, starts[-1]))
        if len(picks) == count:
            return loss, tuple(picks)
    return None


class DraNodes:
    """Nodes grouped by (openb model, GPU layouts), each group in node order: the allocator's first fit
    and the MIG term are one answer per group."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.key: list[tuple[str, tuple[Layout, ...]]] = []
        self.members: dict[tuple[str, tuple[Layout, ...]], list[tuple[int, int]]] = {}
        for i in range(len(cluster.nodes)):
            self.key.append(self._state(i))
            insort(self.members.setdefault(self.key[i], []), (int(cluster.rank[i]), i))

    def _state(self, i: int) -> tuple[str, tuple[Layout, ...]]:
        return self.cluster.nodes[i].model, tuple(self.cluster.layouts[g] for g in self.cluster.gpus_of[i])

    def changed(self, i: int) -> None:
        group = self.members[self.key[i]]
        group.pop(bisect_left(group, (int(self.cluster.rank[i]), i)))
        if not group:
            del self.members[self.key[i]]
        self.key[i] = self._state(i)
        insort(self.members.setdefault(self.key[i], []), (int(self.cluster.rank[i]), i))


def _place_dra(cluster: Cluster, nodes: DraNodes, pod: TracePod, policy: str, rng: np.random.Generator,
               bonus: Bonus | None = None) -> tuple[int, int]:
    """The DRA path: kube-scheduler's node (a random feasible one, or the MIG term's best, ties to the
    earliest in node order), the allocator's first-fit partitions there; the instances created and
    the node (-1: none). ``bonus`` (``dra-frag`` only): the residency term added to the MIG term as
    :meth:`extender.dra_scoring.DraCluster.mig_scores` adds it (:func:`extender.residency.step_of`)."""
    fits = (cluster.cpu >= pod.cpu_milli) & (cluster.mem >= pod.memory_mib)
    steps = bonus.steps(pod, np.arange(len(cluster.nodes))) if bonus is not None and policy == "dra-frag" else None
    if steps is not None and np.any(steps > 0):
        return _place_dra_bonus(cluster, nodes, pod, fits, steps)
    best: tuple | None = None
    feasible: list[tuple[tuple, int]] = []
    for (model, layouts), group in nodes.members.items():
        if pod.gpu_spec and model not in pod.gpu_spec:
            continue
        profile, count = ask(pod, card_of(model))  # type: ignore[misc]
        pick = _dra_first_fit_of(card_of(model).name, layouts, profile, count)
        if pick is None:
            continue
        if policy == "dra-random":
            feasible += [((pick, profile), i) for _r, i in group if fits[i]]
            continue
        if best is not None and pick[0] > best[0]:
            continue
        i = next((i for _r, i in group if fits[i]), None)
        if i is not None and (best is None or (pick[0], cluster.rank[i]) < (best[0], best[1])):
            best = (pick[0], int(cluster.rank[i]), i, pick, profile)
    if policy == "dra-random" and feasible:
        (pick, profile), i = feasible[int(rng.integers(len(feasible)))]
        best = (pick[0], 0, i, pick, profile)
    if best is None:
        return 0, -1
    *_, i, pick, profile = best
    for k, start in pick[1]:
        _create(cluster, cluster.gpus_of[i][k], start, profile)
    nodes.changed(i)
    cluster.take_host(i, pod)
    return len(pick[1]), i


def _place_dra_bonus(cluster: Cluster, nodes: DraNodes, pod: TracePod, fits: np.ndarray,
                     steps: np.ndarray) -> tuple[int, int]:
    """``dra-frag`` plus the residency term: each group's first fitting node (what the MIG term alone
    would weigh) and every fitting node with a bonus; raw = -loss + steps x one step of the fitting
    groups' losses; the best raw wins, ties to the earliest in node order."""
    picks: dict[tuple[str, tuple[Layout, ...]], tuple] = {}
    cands: list[tuple[float, int]] = []  # (loss, node)
    for key, group in nodes.members.items():
        model = key[0]
        if pod.gpu_spec and model not in pod.gpu_spec:
            continue
        profile, count = ask(pod, card_of(model))  # type: ignore[misc]
        pick = _dra_first_fit_of(card_of(model).name, key[1], profile, count)
        if pick is None:
            continue
        i = next((i for _r, i in group if fits[i]), None)
        if i is not None:
            picks[key] = (pick, profile)
            cands.append((pick[0], i))
    if not cands:
        return 0, -1
    step = residency.step_of(-np.array([loss for loss, _ in cands]))
    cands += [(picks[nodes.key[h]][0][0], h) for h in np.flatnonzero((steps > 0) & fits).tolist()
              if nodes.key[h] in picks]
    _raw, _rank, i = max((-loss + float(steps[i]) * step, -int(cluster.rank[i]), i) for loss, i in cands)
    pick, profile = picks[nodes.key[i]]
    for k, start in pick[1]:
        _create(cluster, cluster.gpus_of[i][k], start, profile)
    nodes.changed(i)
    cluster.take_host(i, pod)
    return len(pick[1]), i


def _place_dynamic_multi(cluster: Cluster, pod: TracePod, policy: str, mix: Mapping[int, float]) -> int:
    """Whole-GPU instances on ``num_gpu`` GPUs of one node: the node that loses least, then best fit."""
    best: tuple | None = None
    for i in cluster.order:
        if not cluster.allowed(i, pod) or not cluster.host_fits(i, pod):
            continue
        model = card(cluster.nodes[i])
        profile = ask(pod, model)[0]  # type: ignore[index]
        picks = []
        for g in cluster.gpus_of[i]:
            option = _dynamic_options(cluster, cluster.layouts[g], model, profile, policy, mix)
            if option is not None:
                picks.append((option[0], g, option[1]))
        if len(picks) < pod.num_gpu:
            continue
        picks.sort()
        chosen = picks[:pod.num_gpu]
        free = sum(_free_slots(model, cluster.layouts[g]) for g in cluster.gpus_of[i])
        key = (sum(c[0] for c in chosen), free if policy != "firstfit" else 0, int(cluster.rank[i]), i,
               [(g, s) for _, g, s in chosen], profile)
        if best is None or key[:3] < best[:3]:
            best = key
        if policy == "firstfit":
            break
    if best is None:
        return 0
    *_, i, chosen, profile = best
    for g, start in chosen:
        _create(cluster, g, start, profile)
    cluster.take_host(i, pod)
    return len(chosen)


def _fitting_instances(model: mig.MigModel, layout: Layout, held: frozenset[int],
                       need: mig.MigProfile) -> list[tuple[int, int, int]]:
    """Free instances of a static layout that hold ``need``: (memory slots, compute slices, index)."""
    out = []
    for k, inst in enumerate(layout):
        if k in held:
            continue
        p = model.profile(inst.profile)
        if p.memory_slots >= need.memory_slots and p.compute_slices >= need.compute_slices:
            out.append((p.memory_slots, p.compute_slices, k))
    return sorted(out)


def _place_static(cluster: Cluster, pod: TracePod) -> int:
    """Take the smallest free pre-made instance that holds the task (one per GPU it asks for)."""
    if pod.num_gpu > 1:
        best_multi: tuple | None = None
        for i in cluster.order:
            if not cluster.allowed(i, pod) or not cluster.host_fits(i, pod):
                continue
            model = card(cluster.nodes[i])
            need = model.profile(ask(pod, model)[0])  # type: ignore[index]
            chosen = []
            for g in cluster.gpus_of[i]:
                fits = _fitting_instances(model, cluster.layouts[g], cluster.held[g], need)
                if fits:
                    chosen.append((fits[0], g))
            if len(chosen) < pod.num_gpu:
                continue
            chosen.sort()
            chosen = chosen[:pod.num_gpu]
            key = (sum(c[0][0] for c in chosen), int(cluster.rank[i]), i, chosen)
            if best_multi is None or key[:2] < best_multi[:2]:
                best_multi = key
        if best_multi is None:
            return 0
        *_, i, chosen = best_multi
        for (_m, _c, k), g in chosen:
            cluster.set_gpu(g, cluster.layouts[g], cluster.held[g] | {k})
        cluster.take_host(i, pod)
        return len(chosen)
    best: tuple | None = None
    for state, model in _states_for(cluster, pod):
        _openb_model, layout, held = state
        need = model.profile(ask(pod, model)[0])  # type: ignore[index]
        fits = _fitting_instances(model, layout, held, need)
        if not fits:
            continue
        g = cluster.first_fitting(state, pod)
        if g is None:
            continue
        key = (fits[0][:2], cluster.gpu_rank[g], g, fits[0][2])
        if best is None or key < best:
            best = key
    if best is None:
        return 0
    _size, _rank, g, k = best
    cluster.set_gpu(g, cluster.layouts[g], cluster.held[g] | {k})
    cluster.take_host(cluster.gpu_node[g], pod)
    return 1


def replay(nodes: Sequence[TraceNode], seq: Sequence[TracePod], policy: str, seed: int,
           static_layouts: Sequence[Layout] | None = None, progress: Progress | None = None,
           observe: Callable[[Cluster], None] | None = None, bonus: Bonus | None = None) -> MigRun:
    """One policy over one arrival sequence; ``static`` needs ``static_layouts`` (one per GPU, in the
    order of ``nodes`` and their GPUs, each in its card's profile names). ``observe`` sees the final
    cluster (tests check its layouts). ``bonus`` (``dra-frag``): the residency term, rows = node indices
    (bench/bench_residency.py ``--policy dra-mig``)."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    started = time.perf_counter()
    cluster = Cluster(nodes, np.random.default_rng(seed).permutation(len(nodes)))
    if policy == "static":
        if static_layouts is None or len(static_layouts) != len(cluster.layouts):
            raise ValueError("static needs one layout per GPU")
        for g, layout in enumerate(static_layouts):
            problems = mig.check_layout(cluster.model(g), layout)
            if problems:
                raise ValueError(f"GPU {g}: {'; '.join(problems)}")
            cluster.set_gpu(g, tuple(sorted(layout)), frozenset())
    run = MigRun(policy, seed)
    rng = np.random.default_rng(seed + 1)  # dra-random's node choice per task
    dra_nodes = DraNodes(cluster) if policy.startswith("dra-") else None
    ref = mig.MODELS["A100-SXM4-40GB"]
    seen: Counter[int] = Counter()
    for n, pod in enumerate(seq):
        want = ask(pod, ref)
        if want is None:
            i = next((int(i) for i in cluster.order if cluster.host_fits(int(i), pod)), None)
            if i is None:
                run.cpu_only_refused += 1
            else:
                cluster.take_host(i, pod)
            continue
        key = geometry(ref, want[0])
        seen[key] += want[1]
        run.arrived += 1
        row = run.by_profile.setdefault(want[0], [0, 0])
        row[0] += 1
        if policy == "static":
            placed = _place_static(cluster, pod)
        elif policy.startswith("dra-"):
            assert dra_nodes is not None
            placed, node = _place_dra(cluster, dra_nodes, pod, policy, rng, bonus)
            run.created += placed
            if placed and bonus is not None:
                bonus.placed(pod, node)
        else:
            total = sum(seen.values())
            placed = _place_dynamic(cluster, pod, policy, {k: round(v / total, 2) for k, v in seen.items()})
            run.created += placed
        if placed:
            run.accepted += 1
            row[1] += 1
        else:
            run.refused += 1
        if progress and n % 2000 == 0:
            progress(f"{policy} seed {seed}: {n}/{len(seq)} tasks, {run.accepted} placed")
    if observe is not None:
        observe(cluster)
    run.slot_share = 100.0 * cluster.used_slots() / (mig.MEMORY_SLOTS * len(cluster.layouts))
    run.seconds = time.perf_counter() - started
    return run


def uniform_layouts(nodes: Sequence[TraceNode], layout: Layout, model: mig.MigModel) -> list[Layout]:
    """One layout (in ``model``'s names) on every GPU, translated to each card's names."""
    return [translate(layout, model, card(n)) for n in nodes for _ in range(n.gpus)]


def demand_mix(seq: Iterable[TracePod]) -> Counter[int]:
    """Instances asked per geometry key (on the reference card), whole-GPU tasks counted per GPU."""
    ref = mig.MODELS["A100-SXM4-40GB"]
    mix: Counter[int] = Counter()
    for pod in seq:
        want = ask(pod, ref)
        if want is not None:
            mix[geometry(ref, want[0])] += want[1]
    return mix


def mixed_layouts(nodes: Sequence[TraceNode], seq: Sequence[TracePod]) -> list[Layout]:
    """The admin's best guess with hindsight: cut each GPU, one after another, into the maximal layout
    that best covers what is still missing of the arrivals' instance mix (scaled to the cluster)."""
    ref = mig.MODELS["A100-SXM4-40GB"]
    candidates = mig.maximal_layouts(ref)
    gpus = [card(n) for n in nodes for _ in range(n.gpus)]
    mix = demand_mix(seq)
    slots = sum(ref.profiles[k].memory_slots * v for k, v in mix.items())
    scale = mig.MEMORY_SLOTS * len(gpus) / max(slots, 1)
    missing = {k: v * scale for k, v in mix.items()}
    out: list[Layout] = []
    for model in gpus:
        def gain(layout: Layout) -> float:
            have = Counter(geometry(ref, p.profile) for p in layout)
            return sum(min(missing.get(k, 0.0), c) * ref.profiles[k].memory_slots for k, c in have.items())
        layout = max(candidates, key=gain)
        for p in layout:
            k = geometry(ref, p.profile)
            missing[k] = missing.get(k, 0.0) - 1
        out.append(translate(layout, ref, model))
    return out
