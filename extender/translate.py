"""From Kubernetes objects to the placement core's plain data: nodes to Slots, pods to Demands.

The placement core (``extender.cluster``/``extender.placement``) knows GPUs only as *slots* with a
capacity in MiB and a kind, and pods only as per-container demands. This module is the one place that
reads the node inventory annotation and the pod's resources and annotations and says what they mean:

* a GPU in ``shared`` mode is one slot of ``units x unitMiB`` (what the kubelet can actually hand out,
  not the raw memory: the reserved part and the rounding are not schedulable);
* a GPU in ``exclusive`` mode is one slot of kind ``exclusive`` taken whole by a ``vramshare.io/gpu`` ask;
* a GPU in MIG mode is one slot per MIG instance, of kind ``mig:<profile>`` (the profile as spelled in
  the resource name, so ``1g.10gb+me`` becomes ``1g.10gb.me`` on both sides).

It also reads back the assignment annotation the binder writes, so the cache can rebuild the GPU
usage of every pod after a restart from the API alone.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import orjson

from extender import cluster
from vramshare import contract, inventory, podspec, quantity

__all__ = ["TranslateError", "ContainerAsk", "node_slots", "slots_from_inventory", "pod_asks",
           "demands_of", "Assignment", "encode_assignment", "decode_assignment", "mig_kind", "node_host",
           "pod_host"]

Obj = Mapping[str, Any]
SHARED, EXCLUSIVE = "shared", "exclusive"


class TranslateError(ValueError):
    """An annotation we cannot read; the message names the object and the field."""


def mig_kind(profile: str) -> str:
    """Slot kind of a MIG profile, normalised as the resource name normalises it."""
    return "mig:" + profile.replace("+", ".")


def slots_from_inventory(inv: inventory.NodeInventory) -> list[cluster.Slot]:
    slots: list[cluster.Slot] = []
    for gpu in inv.gpus:
        if gpu.mode is inventory.GpuMode.MIG:
            slots.extend(
                cluster.Slot(uuid=m.uuid, model=gpu.model, kind=mig_kind(m.profile), capacity=m.memory_mib,
                             healthy=gpu.healthy and m.healthy, index=gpu.index)
                for m in gpu.mig)
        elif gpu.mode is inventory.GpuMode.EXCLUSIVE:
            slots.append(cluster.Slot(uuid=gpu.uuid, model=gpu.model, kind=EXCLUSIVE, capacity=gpu.memory_mib,
                                      healthy=gpu.healthy, index=gpu.index))
        else:
            slots.append(cluster.Slot(uuid=gpu.uuid, model=gpu.model, kind=SHARED,
                                      capacity=inv.capacity_mib(gpu), healthy=gpu.healthy, index=gpu.index))
    return slots


def node_slots(node: Obj, names: contract.Names) -> list[cluster.Slot] | None:
    """The slots of a Node object, ``None`` when it carries no inventory (not a vramshare node)."""
    meta = node.get("metadata") or {}
    text = (meta.get("annotations") or {}).get(names.inventory)
    if text is None:
        return None
    try:
        return slots_from_inventory(inventory.NodeInventory.from_json(text))
    except inventory.InventoryError as exc:
        raise TranslateError(f"node {meta.get('name', '?')}: annotation {names.inventory}: {exc}") from None


_MIB = 1 << 20


def node_host(node: Obj) -> tuple[int, int] | None:
    """``(CPU millicores, memory MiB)`` of ``status.allocatable``, what kube-scheduler's Fit compares
    against; ``None`` when either is missing (the node's host is then not tracked). Memory rounds down:
    never more than the node has. Raises :class:`TranslateError` for a quantity the API would refuse."""
    meta = node.get("metadata") or {}
    alloc = (node.get("status") or {}).get("allocatable") or {}
    if "cpu" not in alloc or "memory" not in alloc:
        return None
    where = f"node {meta.get('name', '?')}: status.allocatable"
    try:
        return quantity.cpu_millis(alloc["cpu"], f"{where}.cpu"), quantity.byte_count(alloc["memory"], f"{where}.memory") // _MIB
    except quantity.QuantityError as exc:
        raise TranslateError(str(exc)) from None


def _cpu_and_memory(container: Mapping[str, Any]) -> dict[str, int]:
    req = podspec.container_requests(container)
    where = f"container {container.get('name', '?')}"
    return {"cpu": quantity.cpu_millis(req.get("cpu", 0), f"{where}: cpu"),
            "memory": quantity.byte_count(req.get("memory", 0), f"{where}: memory")}


def pod_host(pod: Obj) -> cluster.HostDemand:
    """The pod's CPU and memory requests as the kubelet and kube-scheduler count them (init containers,
    sidecars and overhead: :func:`vramshare.podspec.effective_requests`). Memory rounds up to MiB: never
    less than the pod asked. Raises :class:`TranslateError` for a quantity the API would refuse."""
    try:
        total = podspec.effective_requests(pod, _cpu_and_memory)
    except quantity.QuantityError as exc:
        meta = pod.get("metadata") or {}
        raise TranslateError(f"pod {meta.get('namespace', 'default')}/{meta.get('name', '?')}: {exc}") from None
    return cluster.HostDemand(total.get("cpu", 0), -(-total.get("memory", 0) // _MIB))


# -- pods -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ContainerAsk:
    """One Demand of one container; a container asking for two kinds yields two asks."""

    container: str
    demand: cluster.Demand


def pod_asks(pod: Obj, names: contract.Names, unit_mib: int) -> list[ContainerAsk]:
    """What a pod asks, per container, in the core's terms. Raises ``podspec.PodSpecError``.

    Memory units become MiB with the cluster's ``memoryUnitMiB``, the unit every device plugin slices
    in, so a request means the same memory on every node.
    """
    return asks_of(podspec.pod_demand(pod, names), unit_mib)


def asks_of(want: podspec.PodDemand, unit_mib: int) -> list[ContainerAsk]:
    """:func:`pod_asks` for a pod already read (callers that also need its policy read it once)."""
    asks: list[ContainerAsk] = []
    for c in want.containers:
        if c.units:
            asks.append(ContainerAsk(c.container, cluster.Demand(
                per_gpu=c.units_per_gpu * unit_mib, count=c.gpu_count, kind=SHARED, models=want.models)))
        if c.whole_gpus:
            asks.append(ContainerAsk(c.container, cluster.Demand(
                per_gpu=0, count=c.whole_gpus, kind=EXCLUSIVE, models=want.models)))
        for profile, n in c.mig:
            if n:
                asks.append(ContainerAsk(c.container, cluster.Demand(
                    per_gpu=0, count=n, kind=mig_kind(profile), models=want.models)))
    return asks


def demands_of(asks: list[ContainerAsk]) -> list[cluster.Demand]:
    return [a.demand for a in asks]


# -- the assignment annotation ----------------------------------------------------------------
@dataclass(frozen=True)
class Assignment:
    """The binder's decision as the pod carries it: per container the GPUs and MiB on each."""

    containers: dict[str, list[tuple[str, int]]]
    assume_time_ns: int = 0
    state: str = ""

    def allocations(self) -> list[tuple[str, int]]:
        """All (slot uuid, MiB) pairs of the pod, summed per slot, as ClusterState.add_pod takes them."""
        total: dict[str, int] = {}
        for pairs in self.containers.values():
            for uuid, mib in pairs:
                total[uuid] = total.get(uuid, 0) + mib
        return list(total.items())


def encode_assignment(asks: list[ContainerAsk], picks: list[list[tuple[str, int]]]) -> str:
    """``{container: [{"uuid", "mib"}, ...]}``; ``picks`` is placement.pick's answer, one per ask."""
    out: dict[str, list[dict[str, Any]]] = {}
    for ask, pairs in zip(asks, picks):
        out.setdefault(ask.container, []).extend({"uuid": u, "mib": int(m)} for u, m in pairs)
    return orjson.dumps(out).decode()


def decode_assignment(pod: Obj, names: contract.Names) -> Assignment | None:
    """The pod's assignment, ``None`` when it has none. Raises :class:`TranslateError` if unreadable."""
    meta = pod.get("metadata") or {}
    ann = meta.get("annotations") or {}
    text = ann.get(names.assignment)
    if text is None:
        return None
    where = f"pod {meta.get('namespace', 'default')}/{meta.get('name', '?')}: annotation {names.assignment}"
    try:
        data = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise TranslateError(f"{where}: not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise TranslateError(f"{where}: expected an object of container name to GPU list")
    containers: dict[str, list[tuple[str, int]]] = {}
    for cname, entries in data.items():
        if not isinstance(entries, list):
            raise TranslateError(f"{where}: container {cname}: expected a list")
        pairs = []
        for e in entries:
            uuid, mib = (e.get("uuid"), e.get("mib")) if isinstance(e, dict) else (None, None)
            if not isinstance(uuid, str) or not isinstance(mib, int) or isinstance(mib, bool) or mib < 0:
                raise TranslateError(f"{where}: container {cname}: bad entry {e!r} (want uuid and mib)")
            pairs.append((uuid, mib))
        containers[cname] = pairs
    raw_time = ann.get(names.assume_time, "0")
    try:
        assume = int(raw_time)
    except (TypeError, ValueError):
        raise TranslateError(f"pod {meta.get('name', '?')}: annotation {names.assume_time}: "
                             f"{raw_time!r} is not unix nanoseconds") from None
    return Assignment(containers, assume, str(ann.get(names.allocation_state, "")))
