"""Dynamic MIG in the extender's books: placements as slots, geometry as capacity, fragmentation at bind.

A GPU whose inventory carries ``dynamicMig`` becomes one slot per profile per legal placement (the
device plugin's device IDs, :mod:`vramshare.mig_plan`), each of kind ``mig:<profile>`` and the profile's
memory. Placements overlap, so the slot table alone would over-commit: after every change on such a node
:func:`reblock` gives capacity only to the placements a new plan may still take beside the instances
NVML shows *and* the plans booked for pods (created or not: a plan is booked at bind, its instance is
made at Allocate), :func:`vramshare.mig.open_placements`; every other one gets capacity 0, so filter,
prioritize and bind never hand out two overlapping partitions. A booked placement keeps its capacity
(its pod holds it).

At bind, :func:`refine` replaces the policy's pick of placements by the ones the fragmentation term
prefers (:func:`vramshare.mig.placement_loss`: which placement keeps the largest profiles creatable), and
places a pod's several MIG asks one after another so they never overlap each other.

Pure: numpy arrays of the slot table in, capacities out; no I/O.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from vramshare import mig, mig_plan

ClusterState = Any  # extender.cluster.ClusterState, which imports this module (no cycle by annotation)
Slot = Any  # extender.cluster.Slot


@dataclass(frozen=True)
class Placement:
    """One placement slot of a dynamic-MIG GPU on a node."""

    col: int
    plan: mig_plan.MigPlacement
    capacity: int  # the profile's memory: the slot's capacity while it is open


@dataclass(frozen=True)
class GpuGeometry:
    table: mig.MigModel
    existing: tuple[mig.Placed, ...]  # instances the device plugin reports
    placements: tuple[Placement, ...]
    isolation: bool = False  # the node's plugin serves isolation: mig memory asks here (inventory)


def geometry(slots: Sequence[Slot]) -> dict[str, GpuGeometry]:
    """GPU UUID -> its geometry, for the dynamic-MIG slots among a node's slots (empty for most nodes)."""
    found: dict[str, tuple[str, list[mig.Placed], list[Placement]]] = {}
    isolation: set[str] = set()
    for col, s in enumerate(slots):
        if not s.mig_table:
            continue
        plan = mig_plan.try_parse(s.uuid)
        if plan is None or s.mig_table not in mig.MODELS:
            continue
        table, existing, placements = found.setdefault(plan.gpu_uuid, (s.mig_table, [], []))
        placements.append(Placement(col, plan, s.capacity))
        if s.mig_isolation:
            isolation.add(plan.gpu_uuid)
        if s.mig_exists:
            existing.append(plan.placed)
    return {g: GpuGeometry(mig.MODELS[t], tuple(e), tuple(p), g in isolation) for g, (t, e, p) in found.items()}


def fit_profile(geo: GpuGeometry, mib: int) -> str | None:
    """The profile an ``isolation: mig`` ask of ``mib`` takes on this GPU: the smallest that holds it
    (:func:`vramshare.mig.smallest_fitting`), None when none does."""
    p = mig.smallest_fitting(geo.table, mib)
    return p.name if p is not None else None


def fit_columns(geo: GpuGeometry, mib: int) -> list[int]:
    """The slot columns of every placement of :func:`fit_profile` on this GPU (open or not); none where
    the node's device plugin does not serve ``isolation: mig`` (an older one would grant shared memory)."""
    profile = fit_profile(geo, mib) if geo.isolation else None
    return [p.col for p in geo.placements if p.plan.profile == profile] if profile else []


def open_capacity(geo: GpuGeometry, used: Mapping[int, int]) -> dict[int, int]:
    """Column -> capacity for each placement: its memory where a plan may take it or a pod holds it, else 0."""
    planned = [p.plan.placed for p in geo.placements if used.get(p.col, 0) > 0]
    ok = mig.open_placements(geo.table, geo.existing, planned)
    return {p.col: p.capacity if (used.get(p.col, 0) > 0 or p.plan.placed in ok) else 0 for p in geo.placements}


def reblock(state: ClusterState, row: int, geo: Mapping[str, GpuGeometry]) -> None:
    """Set the capacities of a node's placement slots from what is booked on them now."""
    for g in geo.values():
        used = {p.col: int(state.used[row, p.col]) for p in g.placements}
        for col, cap in open_capacity(g, used).items():
            state.capacity[row, col] = cap


def default_weights(table: mig.MigModel) -> dict[str, float]:
    """Every profile a plain request may map to, equally likely (no ``+me``)."""
    return {p.name: 1.0 for p in table.profiles if not p.media}


def refine(state: ClusterState, node: str, kinds: Sequence[str], picks: list[list[tuple[str, int]]],
           weights: Mapping[str, float] | None = None) -> list[list[tuple[str, int]]]:
    """``picks`` with every dynamic-MIG placement re-chosen: per ask in order, the open placement of its
    profile (on any dynamic GPU of the node) whose :func:`vramshare.mig.placement_loss` is lowest, given
    what is booked and what this pod already took; ties go to the lower GPU index, then the lower start.
    Raises ``ValueError`` when the pod's asks cannot all be placed together."""
    row = state.row(node)
    geo = state.mig_geometry(node)
    if row is None or not geo:
        return picks
    by_uuid = {p.plan: (gpu, p) for gpu, g in geo.items() for p in g.placements}
    taken: dict[str, list[mig.Placed]] = {gpu: [p.plan.placed for p in g.placements
                                                 if int(state.used[row, p.col]) > 0] for gpu, g in geo.items()}
    index = {s.uuid: s.index for s in state.slots(row)}
    out: list[list[tuple[str, int]]] = []
    for kind, pairs in zip(kinds, picks):
        plans = [mig_plan.try_parse(u) for u, _ in pairs]
        if not pairs or any(p is None or p not in by_uuid for p in plans):
            out.append(pairs)
            continue
        profile = plans[0].profile  # type: ignore[union-attr]
        chosen: list[tuple[str, int]] = []
        for _ in pairs:
            best: tuple[tuple[float, int, int], str, Placement] | None = None
            for gpu, g in geo.items():
                ok = mig.open_placements(g.table, g.existing, taken[gpu])
                for p in g.placements:
                    if p.plan.profile != profile or p.plan.placed not in ok or p.plan.placed in taken[gpu]:
                        continue
                    if int(state.used[row, p.col]) > 0 or not state.healthy[row, p.col]:
                        continue
                    layout = list(dict.fromkeys([*g.existing, *taken[gpu]]))
                    loss = (0.0 if p.plan.placed in g.existing  # adopting what exists costs the GPU nothing
                            else mig.placement_loss(g.table, layout, profile, p.plan.start,
                                                    weights or default_weights(g.table)))
                    key = (loss, index.get(mig_plan.encode(p.plan), 0), p.plan.start)
                    if best is None or key < best[0]:
                        best = (key, gpu, p)
            if best is None:
                raise ValueError(f"no open {profile} placement left on {node} for this pod's MIG asks")
            _, gpu, p = best
            taken[gpu].append(p.plan.placed)
            chosen.append((mig_plan.encode(p.plan), p.capacity))
        out.append(chosen)
    return out
