"""Reading and writing the ``assignment`` annotation, and what a container asks of one resource.

The annotation is the contract with the extender (DESIGN.md section 3): ``{container: [{"uuid",
"mib"}, ...]}``. The extender writes it at bind as a *plan* (``allocation-state: assumed``); the
device plugin only reads that plan to steer GetPreferredAllocation (:mod:`deviceplugin.steering`)
and, after admission, overwrites it with what the kubelet actually handed out
(:mod:`deviceplugin.reconcile`, ``allocation-state: allocated``). Allocate itself never reads a pod:
the kubelet does not say which pod it serves, and the device IDs already name the GPU and the size.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from vramshare import contract
from vramshare.podspec import ContainerDemand


class AssignmentError(ValueError):
    """An assignment annotation that cannot be read; the message says what is wrong."""


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


def resources_of(demand: ContainerDemand, names: contract.Names) -> list[str]:
    """The extended resources of ours one container asks for (at least one device each)."""
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
        raise AssignmentError("pod has no assignment annotation")
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


def parse_all(text: str | None) -> dict[str, tuple[AssignedGpu, ...]]:
    """Every container's GPUs; raises :class:`AssignmentError` when any part is unreadable."""
    try:
        containers = json.loads(text or "null")
    except json.JSONDecodeError as exc:
        raise AssignmentError(f"assignment is not JSON: {exc.msg}") from None
    if not isinstance(containers, dict):
        raise AssignmentError("assignment is not an object of container name to GPU list")
    return {c: parse_assignment(text, c) for c in containers}


def encode_assignment(containers: Mapping[str, Sequence[AssignedGpu]]) -> str:
    """The annotation text, containers by name and GPUs by UUID (the same bytes for the same holdings)."""
    return json.dumps({c: [{"uuid": g.uuid, "mib": g.mib} for g in sorted(gpus, key=lambda g: g.uuid)]
                       for c, gpus in sorted(containers.items())}, separators=(",", ":"))


def same_assignment(a: Mapping[str, Iterable[AssignedGpu]], b: Mapping[str, Iterable[AssignedGpu]]) -> bool:
    """Equal holdings, whatever the order of GPUs within a container."""
    return ({c: sorted((g.uuid, g.mib) for g in gs) for c, gs in a.items()}
            == {c: sorted((g.uuid, g.mib) for g in gs) for c, gs in b.items()})
