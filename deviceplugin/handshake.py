"""Which pod is this Allocate for? The annotation handshake with the extender, as pure functions.

The kubelet never tells Allocate which pod or container it serves. The extender writes, before the
Binding, ``<domain>/assignment`` (GPUs and MiB per container), ``<domain>/assume-time`` and
``allocation-state: assumed``. At Allocate the plugin takes, among pending pods bound to this node in
state ``assumed``, the oldest-assumed pod with a not-yet-served container whose request for this
resource equals the request size (DESIGN.md section 3). Unlike gpushare it matches per container, not
per pod total, so multi-container pods work; the caller serializes Allocate so two pods of the same
size are served in assume order.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import AbstractSet, Any, Iterable, Mapping

from vramshare import contract
from vramshare.podspec import ContainerDemand, PodSpecError, pod_demand


class AssignmentError(ValueError):
    """An assignment annotation that cannot be read; the pod is marked ``failed: <this message>``."""


@dataclass(frozen=True)
class PodRef:
    namespace: str
    name: str
    uid: str
    resource_version: str = ""

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True)
class AssignedGpu:
    uuid: str
    mib: int


#: A served (pod uid, container, resource): Allocate is once per container per resource.
Served = tuple[str, str, str]


@dataclass(frozen=True)
class Match:
    """The pod container an Allocate serves, what the extender assigned it, and if it completes the pod."""

    pod: PodRef
    container: str
    assignment_text: str | None  # raw annotation, parsed by the caller (a bad one fails the pod)
    assume_time: int
    completes_pod: bool


def requested(demand: ContainerDemand, resource: str, names: contract.Names) -> int:
    """How many devices of ``resource`` one container asks for."""
    if resource == names.gpu_memory:
        return demand.units
    if resource == names.gpu:
        return demand.whole_gpus
    if resource.startswith(names.mig_prefix):
        profile = resource[len(names.mig_prefix):]
        return sum(n for p, n in demand.mig if p.replace("+", ".") == profile)
    return 0


def _assume_time(raw: Any) -> int | None:
    try:
        return int(str(raw))
    except (TypeError, ValueError):
        return None


def find_match(pods: Iterable[Mapping[str, Any]], names: contract.Names, node: str, resource: str,
               size: int, served: AbstractSet[Served]) -> Match | None:
    """The container this Allocate serves, or ``None`` when no assumed pod on ``node`` asks for ``size``."""
    best: tuple[tuple[int, str, int], Match] | None = None
    for pod in pods:
        meta = pod.get("metadata") or {}
        ann = meta.get("annotations") or {}
        if ((pod.get("spec") or {}).get("nodeName") != node or meta.get("deletionTimestamp")
                or (pod.get("status") or {}).get("phase", "Pending") != "Pending"
                or ann.get(names.allocation_state) != contract.STATE_ASSUMED):
            continue
        assumed = _assume_time(ann.get(names.assume_time))
        if assumed is None:
            continue
        try:
            demand = pod_demand(pod, names)
        except PodSpecError:
            continue
        uid = demand.uid
        wanted = [(i, c) for i, c in enumerate(demand.containers)
                  if requested(c, resource, names) == size and (uid, c.container, resource) not in served]
        if not wanted:
            continue
        order, chosen = wanted[0]
        rank = (assumed, meta.get("creationTimestamp") or "", order)
        if best is not None and rank >= best[0]:
            continue
        todo = {(uid, c.container, r) for c in demand.containers for r in _resources_of(c, names)} - set(served)
        ref = PodRef(demand.namespace, demand.name, uid, str(meta.get("resourceVersion") or ""))
        best = (rank, Match(ref, chosen.container, ann.get(names.assignment), assumed,
                            completes_pod=todo == {(uid, chosen.container, resource)}))
    return best[1] if best else None


def _resources_of(demand: ContainerDemand, names: contract.Names) -> list[str]:
    out = []
    if demand.units:
        out.append(names.gpu_memory)
    if demand.whole_gpus:
        out.append(names.gpu)
    out += [names.mig(p) for p, n in demand.mig if n]
    return out


def parse_assignment(text: str | None, container: str) -> tuple[AssignedGpu, ...]:
    """One container's GPUs from ``{container: [{"uuid": .., "mib": ..}, ...]}``."""
    if text is None:
        raise AssignmentError("pod is assumed but has no assignment annotation")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise AssignmentError(f"assignment is not JSON: {exc.msg}") from None
    entries = data.get(container) if isinstance(data, dict) else None
    if not isinstance(entries, list) or not entries:
        raise AssignmentError(f"assignment has no GPUs for container {container!r}")
    out = []
    for i, e in enumerate(entries):
        if not (isinstance(e, dict) and isinstance(e.get("uuid"), str)
                and isinstance(e.get("mib"), int) and not isinstance(e.get("mib"), bool) and e["mib"] > 0):
            raise AssignmentError(f"assignment[{container!r}][{i}]: want {{\"uuid\": str, \"mib\": int > 0}}")
        out.append(AssignedGpu(e["uuid"], e["mib"]))
    if len({g.uuid for g in out}) != len(out):
        raise AssignmentError(f"assignment for container {container!r} names a GPU twice")
    return tuple(out)
