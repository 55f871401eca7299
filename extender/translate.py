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

from dataclasses import dataclass, replace
from typing import Any, Mapping

from extender import cluster
from extender.slottable import MIG_FIT
from vramshare import contract, inventory, mig, mig_plan, podspec, quantity
from vramshare.contract import assignment
from vramshare.contract.assignment import AssignedGpu
from vramshare.contract import inventory as contract_inventory
from vramshare.contract import resident_models

__all__ = ["TranslateError", "ContainerAsk", "node_slots", "slots_from_inventory", "pod_asks",
           "demands_of", "node_inventory", "Assignment", "Rider", "Signature", "signature_of", "container_signature",
           "encode_assignment", "decode_assignment", "mig_kind", "node_host", "pod_host"]

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
        if gpu.mode is inventory.GpuMode.MIG and gpu.dynamic_mig is not None and gpu.dynamic_mig.table in mig.MODELS:
            slots.extend(placement_slots(gpu, gpu.dynamic_mig))
        elif gpu.mode is inventory.GpuMode.MIG:
            slots.extend(
                cluster.Slot(uuid=m.uuid, model=gpu.model, kind=mig_kind(m.profile), capacity=m.memory_mib,
                             healthy=gpu.healthy and m.healthy, index=gpu.index)
                for m in gpu.mig)
        elif gpu.mode is inventory.GpuMode.EXCLUSIVE:
            slots.append(cluster.Slot(uuid=gpu.uuid, model=gpu.model, kind=EXCLUSIVE, capacity=gpu.memory_mib,
                                      healthy=gpu.healthy, index=gpu.index))
        else:
            slots.append(cluster.Slot(uuid=gpu.uuid, model=gpu.model, kind=SHARED,
                                      capacity=inv.bookable_mib(gpu), healthy=gpu.healthy, index=gpu.index,
                                      credit=inv.credit_units(gpu) * inv.unit_mib,
                                      foreign=inv.booked_foreign_mib(gpu)))
    return slots


def placement_slots(gpu: inventory.Gpu, dyn: inventory.DynamicMig) -> list[cluster.Slot]:
    """Dynamic MIG (issue 24): one slot per profile per legal placement, named by the device plugin's
    device ID for it; :mod:`extender.mig_books` gives capacity only to those a plan may take."""
    table = mig.MODELS[dyn.table]
    existing = set(dyn.instances)
    sick = {(m.profile, m.start) for m in gpu.mig if not m.healthy}
    return [cluster.Slot(uuid=mig_plan.encode(mig_plan.MigPlacement(gpu.uuid, p.profile, p.start)), model=gpu.model,
                         kind=mig_kind(p.profile), capacity=table.profile(p.profile).memory_mib,
                         healthy=gpu.healthy and (p.profile, p.start) not in sick, index=gpu.index,
                         mig_table=table.name, mig_exists=(p.profile, p.start) in existing,
                         mig_isolation=dyn.isolation)
            for p in mig.all_placements(table)]


def node_inventory(node: Obj, names: contract.Names) -> inventory.NodeInventory | None:
    """The inventory a Node object publishes, ``None`` when it carries none (not a vramshare node)."""
    meta = node.get("metadata") or {}
    text = (meta.get("annotations") or {}).get(names.inventory)
    if text is None:
        return None
    try:
        return contract_inventory.parse(text)
    except inventory.InventoryError as exc:
        raise TranslateError(f"node {meta.get('name', '?')}: annotation {names.inventory}: {exc}") from None


def node_slots(node: Obj, names: contract.Names) -> list[cluster.Slot] | None:
    """The slots of a Node object, ``None`` when it carries no inventory (not a vramshare node)."""
    inv = node_inventory(node, names)
    return None if inv is None else slots_from_inventory(inv)


def model_reports(node: Obj, names: contract.Names) -> dict[str, str]:
    """The node's annotations that report resident models (issue 23), by key: the device plugin's
    inventory (its ``models``) and the DRA plugin's ``resident-models``; a node running both has both."""
    ann = (node.get("metadata") or {}).get("annotations") or {}
    return {k: ann[k] for k in (names.inventory, names.resident_models) if isinstance(ann.get(k), str)}


def reported_models(key: str, text: str, names: contract.Names) -> tuple[inventory.ResidentModel, ...]:
    """The models one of :func:`model_reports` says the node holds; raises :class:`contract.ContractError`
    when its annotation cannot be read (the caller keeps its last reading: a hint never blocks a node)."""
    if key == names.inventory:
        return contract_inventory.parse(text).models
    return resident_models.parse(text)


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
class Rider:
    """An ordinary init container steered onto the GPUs of the ask it rides on (see :func:`asks_of`).

    ``per_gpu`` is its MiB on each of the first ``count`` GPUs of that ask; ``None`` takes the ask's own
    (whole GPUs and MIG instances are taken whole)."""

    container: str
    count: int
    per_gpu: int | None


@dataclass(frozen=True)
class ContainerAsk:
    """One Demand of one container; a container asking for two kinds yields two asks."""

    container: str
    demand: cluster.Demand
    riders: tuple[Rider, ...] = ()
    own_per_gpu: int | None = None  # the container's own MiB per GPU when riders grew the demand


def pod_asks(pod: Obj, names: contract.Names, unit_mib: int) -> list[ContainerAsk]:
    """What a pod asks, per container, in the core's terms. Raises ``podspec.PodSpecError``.

    Memory units become MiB with the cluster's ``memoryUnitMiB``, the unit every device plugin slices
    in, so a request means the same memory on every node.
    """
    return asks_of(podspec.pod_demand(pod, names), unit_mib)


def _container_asks(c: podspec.ContainerDemand, models: tuple[str, ...], unit_mib: int,
                    isolated: bool = False) -> list[ContainerAsk]:
    """``isolated`` (``isolation: mig``, issue 24): the gpu-memory ask takes one dynamic-MIG placement of
    the smallest profile that holds it (kind :data:`extender.slottable.MIG_FIT`), never shared memory."""
    asks: list[ContainerAsk] = []
    if c.units:
        asks.append(ContainerAsk(c.container, cluster.Demand(
            per_gpu=c.units_per_gpu * unit_mib, count=c.gpu_count, kind=MIG_FIT if isolated else SHARED,
            models=models)))
    if c.whole_gpus:
        asks.append(ContainerAsk(c.container, cluster.Demand(
            per_gpu=0, count=c.whole_gpus, kind=EXCLUSIVE, models=models)))
    for profile, n in c.mig:
        if n:
            asks.append(ContainerAsk(c.container, cluster.Demand(
                per_gpu=0, count=n, kind=mig_kind(profile), models=models)))
    return asks


def asks_of(want: podspec.PodDemand, unit_mib: int) -> list[ContainerAsk]:
    """:func:`pod_asks` for a pod already read (callers that also need its policy read it once).

    Init containers, the way the kubelet runs and allocates them (``devicemanager`` reuses the devices
    of an init container for the containers that start after it, ``PodRequests`` takes the larger of
    the init peak and the running sum):

    * a sidecar (init container with ``restartPolicy: Always``) runs beside the app containers: it is
      one more ask, like an app container;
    * an ordinary init container runs alone and its devices are reused: it *rides* on an ask of the
      same kind with at least as many GPUs (the largest such), steered onto that ask's first GPUs. When
      it wants more per GPU than that ask, the ask grows to its size (the GPUs must hold the larger
      phase). An init container no ask can carry (more GPUs than any, or a kind no app container asks)
      becomes its own ask: the pod then holds the sum, more than the kubelet's max, never less.

    The books hold, per GPU, the kubelet's max rule over the assignment (:meth:`Assignment.allocations`),
    which never exceeds what these asks reserved.
    """
    models = want.models
    isolated = want.isolation == podspec.ISOLATION_MIG
    asks: list[ContainerAsk] = []
    for c in [*(i for i in want.init_containers if i.restartable), *want.containers]:
        asks.extend(_container_asks(c, models, unit_mib, isolated))
    for init in (i for i in want.init_containers if not i.restartable):
        for own in _container_asks(init, models, unit_mib, isolated):
            d = own.demand
            hosts = [i for i, a in enumerate(asks) if a.demand.kind == d.kind and a.demand.count >= d.count]
            if not hosts:
                asks.append(own)
                continue
            best = max(hosts, key=lambda i: (asks[i].demand.count, asks[i].demand.per_gpu, -i))
            host = asks[best]
            rider = Rider(init.container, d.count, d.per_gpu if d.kind == SHARED else None)
            own_size = host.own_per_gpu
            if d.per_gpu > host.demand.per_gpu and own_size is None:
                own_size = host.demand.per_gpu
            grown = replace(host.demand, per_gpu=max(host.demand.per_gpu, d.per_gpu))
            asks[best] = ContainerAsk(host.container, grown, host.riders + (rider,), own_size)
    return asks


def demands_of(asks: list[ContainerAsk]) -> list[cluster.Demand]:
    return [a.demand for a in asks]


Signature = frozenset[tuple[str, int]]


def signature_of(want: podspec.PodDemand, names: contract.Names) -> Signature:
    """The pod's size signature: the set of ``(resource name, devices)`` its containers ask, init
    containers and sidecars included. This is all the kubelet tells the device plugin when it asks
    for a preferred allocation (one container, one resource, a device count), so two pods that share
    an element cannot be told apart there: a ``gpu-count: 2`` container of 2 x 11 units and a
    22-unit container both read ``(gpu-memory, 22)``. The extender's hold (``extender.holds``) lets
    such pods be ``assumed`` on one node together only when planned on the same GPUs."""
    out: set[tuple[str, int]] = set()
    for c in (*want.init_containers, *want.containers):
        out.update(container_signature(c, names).values())
    return frozenset(out)


def container_signature(c: podspec.ContainerDemand, names: contract.Names) -> dict[str, tuple[str, int]]:
    """One container's ``(resource name, devices)`` per slot kind it asks (``shared``, ``exclusive``,
    ``mig:<profile>``): what the kubelet asks the device plugin for it, one GetPreferredAllocation each."""
    out: dict[str, tuple[str, int]] = {}
    if c.units:
        out[SHARED] = (names.gpu_memory, c.units)
    if c.whole_gpus:
        out[EXCLUSIVE] = (names.gpu, c.whole_gpus)
    for p, n in c.mig:
        if n:
            out[mig_kind(p)] = (names.mig(p), n)
    return out


# -- the assignment annotation ----------------------------------------------------------------
@dataclass(frozen=True)
class Assignment:
    """The binder's decision as the pod carries it: per container the GPUs and MiB on each."""

    containers: dict[str, list[tuple[str, int]]]
    assume_time_ns: int = 0
    state: str = ""

    def allocations(self, pod: Obj | None = None) -> list[tuple[str, int]]:
        """What the pod holds per slot, as (slot uuid, MiB) pairs for ClusterState.add_pod.

        With the pod, the kubelet's rule per GPU (:func:`podspec.effective_requests`): its ordinary
        init containers run alone and their devices are reused, so a GPU holds the larger of each init
        phase and the running sum. Containers the pod does not declare count as app containers (never
        less than the sum of what is written)."""
        per_container = {name: _summed(pairs) for name, pairs in self.containers.items()}
        if pod is None:
            return list(_summed(p for pairs in self.containers.values() for p in pairs).items())
        spec = pod.get("spec") or {}
        declared = {c.get("name") for c in (spec.get("initContainers") or [])}
        apps = list(spec.get("containers") or []) + [
            {"name": n} for n in per_container if n not in declared
            and n not in {c.get("name") for c in spec.get("containers") or []}]
        shaped = {"spec": {"containers": apps, "initContainers": spec.get("initContainers") or []}}
        total = podspec.effective_requests(shaped, lambda c: per_container.get(c.get("name"), {}))
        return [(u, m) for u, m in total.items() if m > 0]


def _summed(pairs: Any) -> dict[str, int]:
    total: dict[str, int] = {}
    for uuid, mib in pairs:
        total[uuid] = total.get(uuid, 0) + mib
    return total


def encode_assignment(asks: list[ContainerAsk], picks: list[list[tuple[str, int]]]) -> str:
    """``{container: [{"uuid", "mib"}, ...]}``; ``picks`` is placement.pick's answer, one per ask.

    A grown ask (one an init container rides on) writes its container's own size; riders get the
    ask's first GPUs with their own size. Written by the contract's codec
    (:func:`vramshare.contract.assignment.encode`), which raises ``AssignmentError`` for a plan the node
    would refuse (a GPU of 0 MiB, one named twice for a container)."""
    out: dict[str, list[AssignedGpu]] = {}
    for ask, pairs in zip(asks, picks):
        mine = ask.own_per_gpu
        out.setdefault(ask.container, []).extend(
            AssignedGpu(u, int(m if mine is None else mine)) for u, m in pairs)
        for r in ask.riders:
            out.setdefault(r.container, []).extend(
                AssignedGpu(u, int(m if r.per_gpu is None else r.per_gpu)) for u, m in pairs[:r.count])
    return assignment.encode(out)


def decode_assignment(pod: Obj, names: contract.Names) -> Assignment | None:
    """The pod's assignment, ``None`` when it has none. Raises :class:`TranslateError` if unreadable."""
    meta = pod.get("metadata") or {}
    ann = meta.get("annotations") or {}
    text = ann.get(names.assignment)
    if text is None:
        return None
    try:
        parsed = assignment.parse(text)
    except assignment.AssignmentError as exc:
        raise TranslateError(f"pod {meta.get('namespace', 'default')}/{meta.get('name', '?')}: "
                             f"annotation {names.assignment}: {exc}") from None
    containers = {c: [(g.uuid, g.mib) for g in gpus] for c, gpus in parsed.items()}
    raw_time = ann.get(names.assume_time, "0")
    try:
        assume = int(raw_time)
    except (TypeError, ValueError):
        raise TranslateError(f"pod {meta.get('name', '?')}: annotation {names.assume_time}: "
                             f"{raw_time!r} is not unix nanoseconds") from None
    return Assignment(containers, assume, str(ann.get(names.allocation_state, "")))
