"""Which GPUs GetPreferredAllocation should prefer: the extender's plan, when it is the same whichever pod is meant.

Pure functions over pod JSON from the plugin's watch-fed cache (no API call on the kubelet's path).
The kubelet does not say which pod it is admitting, so a plan is used only when it cannot be the wrong
one: among the pods bound to this node in ``allocation-state: assumed``, the ones with a container
asking for ``size`` devices of ``resource`` (an element of its *size signature*). The extender assumes
several such pods on one node only when they are all planned on the same GPUs for that size
(:mod:`extender.holds`, DESIGN.md section 3): then every plan names one GPU set, and whichever pod the
kubelet admits first gets it. When one pod matches, its containers of that size are tried in the
kubelet's order (the first whose plan still fits is the one being admitted). When several pods match
and their plans differ (a plugin newer than its extender, a hold that timed out), nothing is guessed:
the caller falls back to best fit. Either way it is only a hint: the container gets the IDs the kubelet
picks, and the reconciler records them afterwards.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from deviceplugin.assignment import AssignmentError, parse_assignment, requested
from vramshare import contract, managed, mig_plan
from vramshare.podspec import ISOLATION_MIG, PodSpecError, pod_demand


@dataclass(frozen=True)
class Steer:
    """``targets``: GPU (or MIG/whole-GPU device) UUID -> devices to prefer there; ``None``: best fit."""

    targets: dict[str, int] | None
    pod: str = ""  # namespace/name of the pod steered for (several, comma-separated, when they share the plan)
    reason: str = ""  # why there is no target (for logs and metrics)


def _assumed_here(pod: Mapping[str, Any], node: str, names: contract.Names) -> bool:
    """A pod the extender assumed on ``node``: its plan steers. A plan anyone else wrote (managedFields:
    not the extender's field manager) steers nothing, as the extender believes nothing of it (issue 18)."""
    meta = pod.get("metadata") or {}
    ann = meta.get("annotations") or {}
    return ((pod.get("spec") or {}).get("nodeName") == node and not meta.get("deletionTimestamp")
            and (pod.get("status") or {}).get("phase", "Pending") == "Pending"
            and ann.get(names.allocation_state) == contract.STATE_ASSUMED
            and contract.FIELD_MANAGER_EXTENDER in managed.annotation_owners(pod, (names.assignment,))[names.assignment])



def _targets(text: str | None, container: str, resource: str, names: contract.Names,
             unit_mib: int, size: int = 0, isolated: bool = False) -> dict[str, int]:
    gpus = parse_assignment(text, container)
    if resource == names.gpu_memory and isolated:  # isolation: mig: the placement is ``size`` units of its GPU
        return {p.gpu_uuid: size for p in map(mig_plan.try_parse, (g.uuid for g in gpus)) if p is not None}
    if resource == names.gpu_memory:
        return {g.uuid: g.mib // unit_mib for g in gpus if g.mib >= unit_mib}
    return {g.uuid: 1 for g in gpus}  # a MIG instance or a whole GPU is one device, its ID its UUID


def _of_this_resource(plan: dict[str, int], known: Mapping[str, int]) -> dict[str, int]:
    """A container asking two resources has one plan for both: keep the entries this resource can serve."""
    return {t: n for t, n in plan.items() if t in known}


def _candidates(pods: Iterable[Mapping[str, Any]], names: contract.Names, node: str, resource: str, size: int,
                unit_mib: int) -> list[tuple[str, list[dict[str, int]]]]:
    """(namespace/name, the plans of its containers asking ``size`` of ``resource``, kubelet order) of
    every pod assumed on ``node`` with such a container."""
    out: list[tuple[str, list[dict[str, int]]]] = []
    for pod in pods:
        if not _assumed_here(pod, node, names):
            continue
        try:
            demand = pod_demand(pod, names)
        except PodSpecError:
            continue
        ann = (pod.get("metadata") or {}).get("annotations") or {}
        text, isolated = ann.get(names.assignment), ann.get(names.isolation) == ISOLATION_MIG
        plans = []
        for c in (*demand.init_containers, *demand.containers):  # the kubelet's order
            if requested(c, resource, names) != size:
                continue
            try:
                plans.append(_targets(text, c.container, resource, names, unit_mib, size, isolated))
            except AssignmentError:
                continue
        if plans:
            out.append((f"{demand.namespace}/{demand.name}", plans))
    return out


def tie(pods: Iterable[Mapping[str, Any]], names: contract.Names, node: str, resource: str,
        got: Mapping[str, int], unit_mib: int) -> str | None:
    """``None`` when the devices an Allocate names (``got``: GPU UUID -> units, or MIG/whole-GPU UUID
    -> 1) are the plan of whichever assumed pod the kubelet is admitting, else why not.

    Used while PodResources is down (issue 17): then nobody can record where a pod really runs, so
    the books stay right only if the pod's own plan already says it. With one candidate pod, one of
    its containers of this size must plan exactly ``got``; with several, all their plans of this
    size must be one plan, and that plan ``got``."""
    size = sum(got.values())
    candidates = _candidates(pods, names, node, resource, size, unit_mib)
    want = dict(got)
    if not candidates:
        return f"no pod assumed on this node plans {size} {resource}"
    keys = ", ".join(sorted(k for k, _ in candidates))
    plans = [{t: n for t, n in p.items() if n} for _, ps in candidates for p in ps]
    if len(candidates) > 1 and len({frozenset(p.items()) for p in plans}) > 1:
        return f"{len(candidates)} assumed pods of this size with different plans ({keys})"
    if not any(p == want for p in plans):
        return f"the plan of {keys} is not these devices ({', '.join(f'{t}: {n}' for t, n in sorted(want.items()))})"
    return None


def steer(pods: Iterable[Mapping[str, Any]], names: contract.Names, node: str, resource: str, size: int,
          unit_mib: int, free_per_target: Mapping[str, int]) -> Steer:
    """The plan every assumed pod with a container of this size agrees on, else ``None``.

    With a single such pod, its containers are tried in the kubelet's order (init containers, then
    app containers); the first whose planned GPUs still have the devices free (``free_per_target``:
    available devices per GPU or per device UUID) is the one being admitted. With several, all their
    containers of this size must name the same GPUs and devices per GPU.
    """
    candidates = _candidates(pods, names, node, resource, size, unit_mib)
    if not candidates:
        return Steer(None, reason="no assumed pod of this size on the node")
    keys = ", ".join(sorted(k for k, _ in candidates))
    if len(candidates) > 1:
        if len({frozenset(p.items()) for _, plans in candidates for p in plans}) > 1:
            return Steer(None, reason=f"{len(candidates)} assumed pods of this size with different plans: {keys}")
        plans = candidates[0][1][:1]  # one GPU set, whichever pod the kubelet is admitting
    else:
        plans = candidates[0][1]
    for plan in (_of_this_resource(p, free_per_target) for p in plans):
        if sum(plan.values()) == size and all(free_per_target.get(t, 0) >= n for t, n in plan.items()):
            return Steer(plan, pod=keys)
    return Steer(None, pod=keys, reason=f"the plan of {keys} no longer fits the available devices")


def _isolation_plans(pods: Iterable[Mapping[str, Any]], names: contract.Names, node: str,
                     size: int) -> dict[str, set[str]]:
    """Placement ID -> the pods (namespace/name) assumed on ``node`` with ``isolation: mig`` whose
    container asking ``size`` gpu-memory units names it in the extender's plan."""
    found: dict[str, set[str]] = {}
    for pod in pods:
        ann = ((pod.get("metadata") or {}).get("annotations") or {})
        if ann.get(names.isolation) != ISOLATION_MIG or not _assumed_here(pod, node, names):
            continue
        try:
            demand = pod_demand(pod, names)
        except PodSpecError:
            continue
        for c in (*demand.init_containers, *demand.containers):
            if requested(c, names.gpu_memory, names) != size:
                continue
            try:
                gpus = parse_assignment(ann.get(names.assignment), c.container)
            except AssignmentError:
                continue
            for g in gpus:
                if mig_plan.try_parse(g.uuid) is not None:
                    found.setdefault(g.uuid, set()).add(f"{demand.namespace}/{demand.name}")
    return found


def isolation_plan(pods: Iterable[Mapping[str, Any]], names: contract.Names, node: str, gpu_uuid: str,
                   size: int, profile: str) -> tuple[str | None, str]:
    """The dynamic-MIG placement an Allocate of ``size`` gpu-memory units on ``gpu_uuid`` serves (issue 24),
    as ``(placement ID, "")``, else ``(None, why)``.

    Such units go only to a pod annotated ``isolation: mig``: the extender planned it a placement on that
    GPU and assumed it here (:func:`_assumed_here`). Its container asking ``size`` units names the
    placement in the assignment. Like :func:`tie`, a plan is used only when it cannot be the wrong one:
    every matching container of every matching pod must name the same placement (the extender's same-size
    hold keeps it so); otherwise nothing is guessed and the Allocate is refused with the reason. Only
    placements of ``profile`` count (the smallest that holds ``size`` units on this GPU, as the extender
    maps it), so a ``mig-<profile>`` device the same container also asks is never taken for it."""
    found = {pid: who for pid, who in _isolation_plans(pods, names, node, size).items()
             if (p := mig_plan.parse(pid)).gpu_uuid == gpu_uuid and p.profile == profile}
    if not found:
        return None, (f"no pod assumed on this node with {names.isolation}: {ISOLATION_MIG} plans a {profile} "
                      f"partition on GPU {gpu_uuid} for {size} units")
    if len(found) > 1:
        who = "; ".join(f"{pid} for {', '.join(sorted(ps))}" for pid, ps in sorted(found.items()))
        return None, f"several assumed pods of this size plan different partitions on GPU {gpu_uuid} ({who})"
    return next(iter(found)), ""


def isolated_here(pods: Iterable[Mapping[str, Any]], names: contract.Names, node: str, size: int) -> list[str]:
    """The ``isolation: mig`` pods assumed on ``node`` with a partition planned for ``size`` units: an
    Allocate of that many units of a *shared* GPU would be one of them misrouted (the same-size hold lets
    no other pod of that size be assumed beside them), so it is refused rather than run unisolated."""
    return sorted({p for ps in _isolation_plans(pods, names, node, size).values() for p in ps})
