"""The ``<domain>/assignment`` annotation: ``{container: [{"uuid": str, "mib": int}, ...]}``.

Written by the extender at bind (its plan, ``allocation-state: assumed``) and rewritten by the device
plugin with what the kubelet handed out (``allocated``); read by the extender's books, the device
plugin's steering and reconciler and the quota loop (DESIGN.md section 3). One rule for all of them,
the node's: every container named holds at least one GPU, each GPU at most once, each with more than
0 MiB. The extender writes whole GPUs and MIG instances at their capacity and shared GPUs at the ask's
MiB, so it never needs a 0 or a repeat; a plan that would carry one is refused at encode, before it
reaches a pod, instead of being written and refused by the node.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from vramshare.contract._json import ContractError, dump, is_int, per_container

MAX_CHARS = 64 * 1024  # ~1,000 GPUs of UUIDs; an annotation value is at most 256 KiB with all others
MAX_CONTAINERS = 256
MAX_GPUS = 1024  # per container, as the inventory bounds a node
MAX_UUID = 128  # GPU-<36> and MIG-<36> UUIDs are 40; test and simulated UUIDs are shorter
MAX_NAME = 253
MAX_MIB = 1 << 24  # 16 TiB, as the inventory bounds memory


class AssignmentError(ContractError):
    """An assignment annotation that cannot be read (or written); the message says what is wrong."""


@dataclass(frozen=True)
class AssignedGpu:
    """One GPU (or MIG instance) of one container, and the MiB the container holds on it."""

    uuid: str
    mib: int


Containers = dict[str, tuple[AssignedGpu, ...]]


def parse(text: object) -> Containers:
    """Every container's GPUs, in the document's order; raises :class:`AssignmentError` saying why.

    ``{}`` is valid (a pod holding nothing). Unknown entry keys are ignored (additive)."""
    return per_container(text, MAX_CHARS, AssignmentError, "assignment", MAX_CONTAINERS, MAX_NAME, _gpus)


def _gpus(container: str, entries: object) -> tuple[AssignedGpu, ...]:
    where = f"assignment[{container!r}]"
    if not isinstance(entries, list) or not entries:
        raise AssignmentError(f"assignment: no GPUs for container {container!r} (want a non-empty list)")
    if len(entries) > MAX_GPUS:
        raise AssignmentError(f"{where}: {len(entries)} GPUs, more than {MAX_GPUS}")
    out = []
    for i, e in enumerate(entries):
        uuid, mib = (e.get("uuid"), e.get("mib")) if isinstance(e, dict) else (None, None)
        if not (isinstance(uuid, str) and 0 < len(uuid) <= MAX_UUID and is_int(mib, 1, MAX_MIB)):
            raise AssignmentError(f"{where}[{i}]: want {{\"uuid\": str (1 to {MAX_UUID} characters), "
                                  f"\"mib\": int 1..{MAX_MIB}}}, got {e!r:.200}")
        out.append(AssignedGpu(uuid, mib))
    if len({g.uuid for g in out}) != len(out):
        raise AssignmentError(f"{where}: names a GPU twice")
    return tuple(out)


def encode(containers: Mapping[str, Sequence[AssignedGpu]]) -> str:
    """The annotation text, containers and GPUs in the order given; raises :class:`AssignmentError`
    for what :func:`parse` refuses (one definition of valid)."""
    text = dump({c: [{"uuid": g.uuid, "mib": g.mib} for g in gpus] for c, gpus in containers.items()})
    parse(text)
    return text


def canonical(containers: Mapping[str, Sequence[AssignedGpu]]) -> str:
    """:func:`encode` with containers by name and GPUs by UUID: the same bytes for the same holdings."""
    return encode({c: sorted(gpus, key=lambda g: g.uuid) for c, gpus in sorted(containers.items())})


def same(a: Mapping[str, Sequence[AssignedGpu]], b: Mapping[str, Sequence[AssignedGpu]]) -> bool:
    """Equal holdings, whatever the order of GPUs within a container."""
    return ({c: sorted((g.uuid, g.mib) for g in gs) for c, gs in a.items()}
            == {c: sorted((g.uuid, g.mib) for g in gs) for c, gs in b.items()})
