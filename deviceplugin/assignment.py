"""Reading and writing the ``assignment`` annotation, and what a container asks of one resource.

The annotation is the contract with the extender (DESIGN.md section 3): ``{container: [{"uuid",
"mib"}, ...]}``, read and written by its one codec, :mod:`vramshare.contract.assignment`. The
extender writes it at bind as a *plan* (``allocation-state: assumed``); the device plugin only reads that plan to steer GetPreferredAllocation (:mod:`deviceplugin.kubelet.steering`)
and, after admission, overwrites it with what the kubelet actually handed out
(:mod:`deviceplugin.kubelet.reconcile`, ``allocation-state: allocated``). Allocate itself never reads a pod:
the kubelet does not say which pod it serves, and the device IDs already name the GPU and the size.
"""
from __future__ import annotations

from dataclasses import dataclass

from vramshare import contract
from vramshare.contract import assignment
from vramshare.contract.assignment import AssignedGpu, AssignmentError
from vramshare.podspec import ContainerDemand


@dataclass(frozen=True)
class PodRef:
    namespace: str
    name: str
    uid: str
    resource_version: str = ""

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


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
    """One container's GPUs, the whole annotation read by the contract's one codec
    (:func:`vramshare.contract.assignment.parse`); raises :class:`AssignmentError` saying why."""
    if text is None:
        raise AssignmentError("pod has no assignment annotation")
    gpus = assignment.parse(text).get(container)
    if gpus is None:
        raise AssignmentError(f"assignment: no GPUs for container {container!r}")
    return gpus


def parse_all(text: str | None) -> dict[str, tuple[AssignedGpu, ...]]:
    """Every container's GPUs; raises :class:`AssignmentError` when any part is unreadable."""
    return assignment.parse(text if text is not None else "null")


#: the annotation text, containers by name and GPUs by UUID (the same bytes for the same holdings)
encode_assignment = assignment.canonical
same_assignment = assignment.same
