"""A node's GPU inventory as ``resource.k8s.io/v1`` ResourceSlices: the pure core of what DRA publishes.

One pool per node (pool name = node name), split into slices of at most 128 devices (64 when any
device carries taints, as the API requires). A shared GPU is one device with
``allowMultipleAllocations: true`` and a consumable ``capacity.memory`` whose ``requestPolicy``
rounds every share up to whole ``memoryUnitMiB`` units (default one unit, validRange min one unit,
max the GPU's schedulable memory, step one unit: KEP-5075; ``validValues`` of that one unit when the
GPU offers only one). An exclusive GPU is an ordinary device;
every MIG instance is a device of its profile. A shared GPU also carries the node's pinned enforcement
mode (attribute ``enforcement``: :mod:`vramshare.contract.slice_enforcement`). Unhealthy devices are
withdrawn: removed, or tainted ``NoSchedule`` when the cluster has DRADeviceTaints (config
``dra.deviceTaints``).

Device names are DNS labels derived from the GPU index (``gpu-0``, ``gpu-0-mig-1-0``); the
``uuid`` attribute names the physical GPU. No I/O: dicts in the API's JSON shape come out.

Dynamic MIG (issue 24, KEP-4815 partitionable devices): a GPU in MIG mode whose admin allows it
(``dynamicMig.gpus``) is published as every profile at every legal placement (:mod:`vramshare.mig`),
each device consuming counters from the GPU's counter set ``gpu-<index>-counter-set``: one
``memory-slice-<n>`` per eighth of memory (value 1), ``compute-slices`` (7) and ``media-engines`` (1,
taken by ``+me`` profiles), so the scheduler's allocator never hands out two overlapping placements.
Names and counters follow NVIDIA's DRA driver (``cmd/gpu-kubelet-plugin/partitions.go``:
``gpu-<minor>-mig-<profile without dots>-<profile id>-<start>``, ``memory-slice-<n>``,
``<name>-counter-set``). Counter sets go in slices of their own, ahead of the device slices (1.35+:
a slice holds ``sharedCounters`` or ``devices``, never both). The allocator takes the first fitting
device in published order, so each profile's placements are published from the highest start down
(small instances fill a GPU from its end, keeping the 4g/7g placements at slot 0 possible longest).
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, replace
from typing import Any, Mapping, Sequence

from deviceplugin.dra import validation
from vramshare import contract, mig
from vramshare.contract import slice_enforcement, slice_foreign
from vramshare.inventory import Gpu, GpuMode, MigInstance, NodeInventory

API_VERSION = "resource.k8s.io/v1"
#: the standard NUMA attribute (KEP-6072, stable in 1.37); the driver's own ``numaNode`` is kept too
STANDARD_NUMA_ATTRIBUTE = "resource.kubernetes.io/numaNode"
MAX_DEVICES_PER_SLICE = 128
MAX_DEVICES_PER_SLICE_WITH_TAINTS = 64
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")

Obj = dict[str, Any]


@dataclass(frozen=True)
class Partition:
    """A MIG instance DRA makes when a claim gets it: a profile at a placement of a dynamic-MIG GPU."""

    model: mig.MigModel
    profile: mig.MigProfile
    start: int


@dataclass(frozen=True)
class DeviceRef:
    """What a published device stands for: the GPU (and MIG instance, or partition) behind a device name."""

    name: str
    gpu: Gpu
    mig: MigInstance | None = None
    partition: Partition | None = None

    @property
    def uuid(self) -> str:
        """The UUID a container sees: the MIG instance's, else the GPU's (a partition's MIG UUID exists
        only once Prepare made it)."""
        return self.mig.uuid if self.mig is not None else self.gpu.uuid

    @property
    def healthy(self) -> bool:
        return self.mig.healthy if self.mig is not None else self.gpu.healthy

    @property
    def shared(self) -> bool:
        return self.mig is None and self.gpu.mode is GpuMode.SHARED


def mib(n: int) -> str:
    """A MiB amount as a Kubernetes quantity (binary SI, exact)."""
    return f"{n}Mi"


COUNTER_COMPUTE = "compute-slices"
COUNTER_MEDIA = "media-engines"


def memory_slice_counter(n: int) -> str:
    """partitions.go memsliceCounterName."""
    return f"memory-slice-{n}"


def counter_set_name(gpu: Gpu) -> str:
    """partitions.go GetSharedCounterSetName: ``gpu-<minor>-counter-set`` (the index here)."""
    return f"gpu-{gpu.index}-counter-set"


def partition_name(gpu: Gpu, profile: mig.MigProfile, start: int) -> str:
    """mig.go ToCanonicalName: ``gpu-<index>-mig-<profile, dots dropped, RFC 1123>-<profile id>-<start>``."""
    pname = re.sub(r"[^a-z0-9-.]", "-", profile.name.replace(".", "").lower()).strip("-").removesuffix(".")
    return f"gpu-{gpu.index}-mig-{pname}-{profile.profile_id}-{start}"


def dynamic_models(inventory: NodeInventory, allowed: Any) -> dict[str, mig.MigModel]:
    """GPU UUID -> MIG table of every GPU in MIG mode that ``allowed(index, uuid)`` lets DRA partition
    (a model without a table stays static: we cannot say where its instances may go)."""
    out = {}
    for g in inventory.gpus:
        if g.mode is GpuMode.MIG and allowed(g.index, g.uuid):
            model = mig.model_for(g.model, g.memory_mib)
            if model is not None:
                out[g.uuid] = model
    return out


def _partitions(g: Gpu, model: mig.MigModel) -> list[DeviceRef]:
    """Every profile at every legal placement, largest profile first, each from its highest start."""
    out = []
    for p in sorted(model.profiles, key=lambda p: (-p.memory_slots, -p.compute_slices, p.media, p.profile_id)):
        for start in sorted(p.starts, reverse=True):
            out.append(DeviceRef(partition_name(g, p, start), g, partition=Partition(model, p, start)))
    return out


def counter_set(gpu: Gpu, model: mig.MigModel) -> Obj:
    """The GPU's ``sharedCounters`` entry: what every partition of it draws from."""
    counters = {memory_slice_counter(n): {"value": "1"} for n in range(mig.MEMORY_SLOTS)}
    counters[COUNTER_COMPUTE] = {"value": str(mig.COMPUTE_SLICES)}
    if any(p.media for p in model.profiles):
        counters[COUNTER_MEDIA] = {"value": "1"}
    return {"name": counter_set_name(gpu), "counters": counters}


def consumption(ref: DeviceRef) -> list[Obj]:
    """A partition's ``consumesCounters``: its memory slices, its compute slices, the media engines."""
    assert ref.partition is not None
    p, start = ref.partition.profile, ref.partition.start
    counters = {memory_slice_counter(n): {"value": "1"} for n in range(start, start + p.memory_slots)}
    counters[COUNTER_COMPUTE] = {"value": str(p.compute_slices)}
    if p.media:
        counters[COUNTER_MEDIA] = {"value": "1"}
    return [{"counterSet": counter_set_name(ref.gpu), "counters": counters}]


def device_refs(inventory: NodeInventory,
                dynamic: Mapping[str, mig.MigModel] | None = None) -> tuple[DeviceRef, ...]:
    """Every device the inventory offers, healthy or not, in a stable order (GPU index, then MIG).

    A GPU in ``dynamic`` offers its partitions instead of the instances that exist on it (those are
    either a prepared claim's partition, or someone else's, whose placements are withheld)."""
    out: list[DeviceRef] = []
    for g in inventory.gpus:
        if dynamic and g.uuid in dynamic:
            out += _partitions(g, dynamic[g.uuid])
        elif g.mode is GpuMode.MIG:
            for pos, m in enumerate(g.mig):
                suffix = f"{m.gi}-{m.ci}" if m.gi is not None and m.ci is not None else str(pos)
                out.append(DeviceRef(f"gpu-{g.index}-mig-{suffix}", g, m))
        elif g.mode is GpuMode.SHARED and g.units == 0:
            continue  # too small for one unit after the reserve: nothing to offer
        else:
            out.append(DeviceRef(f"gpu-{g.index}", g))
    for ref in out:
        if not _DNS_LABEL.match(ref.name):
            raise ValueError(f"device name {ref.name!r} is not a DNS label")
    return tuple(out)


def _bounded(text: str) -> str:
    """A string attribute value cut to the API's 64 bytes (on a character boundary)."""
    data = text.encode("utf-8")[:validation.DEVICE_ATTRIBUTE_MAX_VALUE_LENGTH]
    return data.decode("utf-8", errors="ignore")


def node_attribute(node: str) -> str:
    """The ``node`` attribute: the node name, or for a name over 64 bytes its first 51 characters and
    a digest of the whole (still one value per node, within the API's attribute limit)."""
    if len(node) <= validation.DEVICE_ATTRIBUTE_MAX_VALUE_LENGTH:
        return node
    return f"{node[:51]}-{hashlib.sha256(node.encode()).hexdigest()[:12]}"


def _attributes(ref: DeviceRef, node: str) -> Obj:
    g = ref.gpu
    attrs: Obj = {
        "node": {"string": node_attribute(node)},  # a claim's constraint "all on one node" (matchAttribute)
        # string attributes hold at most 64 bytes (validation.go validateDeviceAttributeStringValue);
        # NVML names may run to 96: keep the first 64 rather than lose the device
        "model": {"string": _bounded(g.model)},
        "uuid": {"string": ref.uuid},
        "mode": {"string": g.mode.value},
        "index": {"int": g.index},
    }
    if ref.mig is not None:
        attrs["profile"] = {"string": _bounded(ref.mig.profile)}
        attrs["parentUUID"] = {"string": g.uuid}
    if ref.partition is not None:  # no MIG UUID before Prepare makes it: "uuid" is left out
        del attrs["uuid"]
        attrs["profile"] = {"string": _bounded(ref.partition.profile.name)}
        attrs["parentUUID"] = {"string": g.uuid}
        attrs["placementStart"] = {"int": ref.partition.start}
        attrs["dynamic"] = {"bool": True}
    if g.numa_node is not None:
        attrs["numaNode"] = {"int": g.numa_node}  # for clusters before 1.37
        attrs[STANDARD_NUMA_ATTRIBUTE] = {"int": g.numa_node}
    return attrs


def device_object(ref: DeviceRef, inventory: NodeInventory, node: str) -> Obj:
    """One ``spec.devices[]`` entry (without taints)."""
    dev: Obj = {"name": ref.name, "attributes": _attributes(ref, node)}
    if ref.partition is not None:
        dev["capacity"] = {"memory": {"value": mib(ref.partition.profile.memory_mib)}}
        dev["consumesCounters"] = consumption(ref)
    elif ref.mig is not None:
        dev["capacity"] = {"memory": {"value": mib(ref.mig.memory_mib)}}
    elif ref.shared:
        dev["allowMultipleAllocations"] = True
        if inventory.enforcement is not None:  # the node's pinned fence: what a claim may select on (CEL)
            dev["attributes"][slice_enforcement.ATTRIBUTE] = slice_enforcement.encode(inventory.enforcement)
        # the GPU's units plus its sleep credit (issue 23 item 5), what the allocator books against, as the
        # extender does on the device plugin's GPUs, less the memory no pod of ours holds (the allocator
        # books capacity alone: slice_foreign); one share is never more than the GPU's own units
        offered, foreign = offered_mib(inventory, ref.gpu), inventory.booked_foreign_mib(ref.gpu)
        if foreign:
            dev["attributes"][slice_foreign.ATTRIBUTE] = slice_foreign.encode(foreign)
        dev["capacity"] = {"memory": {"value": mib(offered), "requestPolicy": request_policy(
            min(ref.gpu.units, offered // inventory.unit_mib), inventory.unit_mib)}}
    else:
        dev["capacity"] = {"memory": {"value": mib(ref.gpu.memory_mib)}}
    return dev


def offered_mib(inventory: NodeInventory, gpu: Gpu) -> int:
    """What the allocator may hand out of a shared GPU: its bookable memory less its booked foreign memory
    (whole units both, so the rest is whole units too)."""
    return inventory.bookable_mib(gpu) - inventory.booked_foreign_mib(gpu)


def request_policy(units: int, unit_mib: int) -> Obj:
    """Shares of whole units: ``validRange`` {min one unit, max all, step one unit}; a GPU of exactly one
    unit gets ``validValues: [unit]`` instead, because the API server refuses a range whose
    ``min + step`` exceeds the capacity (validation.go ``validateRequestPolicyRange``), and that
    refusal would take every device of the slice with it."""
    unit = mib(unit_mib)
    if units <= 1:
        return {"default": unit, "validValues": [unit]}
    return {"default": unit, "validRange": {"min": unit, "max": mib(units * unit_mib), "step": unit}}


def publishable(devices: Sequence[Obj], counter_sets: Sequence[Obj] = ()
                ) -> tuple[list[Obj], list[tuple[str, list[str]]]]:
    """Split ``devices`` into those the API server accepts and ``(name, reasons)`` of those it would
    refuse (:mod:`deviceplugin.dra.validation`): one bad device must not take the slice down, and one
    naming a counter the pool lacks must not make the whole pool unallocatable."""
    ok, refused = [], []
    names: set[Any] = set()
    pool_sets = [{"spec": {"sharedCounters": list(counter_sets)}}]
    for dev in devices:
        errors = validation.device_errors(dev)
        if dev.get("consumesCounters"):
            errors = errors + validation.pool_counter_errors(pool_sets + [{"spec": {"devices": [dev]}}])
        if dev.get("name") in names:  # a slice with two devices of one name is refused whole
            errors = errors + [validation.duplicate("device.name", dev.get("name"))]
        names.add(dev.get("name"))
        if errors:
            refused.append((str(dev.get("name")), errors))
        else:
            ok.append(dev)
    return ok, refused


def unhealthy_taint(names: contract.Names) -> Obj:
    """The taint an unhealthy device carries when taints are on: no new claims, running pods stay."""
    return {"key": f"{names.dra_driver}/unhealthy", "value": "true", "effect": "NoSchedule"}


def held_outside_taint(names: contract.Names) -> Obj:
    """The taint a shared GPU carries, when taints are on, while memory no pod of ours holds fills it (no
    capacity is left to publish): no new claims, its claims stay (:data:`slice_foreign.TAINT`)."""
    return slice_foreign.taint(names.dra_driver)


def desired_devices(inventory: NodeInventory, names: contract.Names, node: str, *, taints: bool,
                    refused: frozenset[str] = frozenset(), dynamic: Mapping[str, mig.MigModel] | None = None,
                    foreign: Mapping[str, Sequence[mig.Placed]] | None = None) -> list[Obj]:
    """The devices to publish: healthy ones, plus unhealthy ones tainted when ``taints`` is on (so is a
    shared GPU whose foreign memory leaves it no capacity: published whole with a taint, else withheld).

    ``refused`` holds GPU UUIDs another manager (the device plugin) already serves; never published.
    ``foreign`` holds, per dynamic GPU, the instances no claim of ours made (an admin's): a partition
    that could not be created beside them is withheld, so the scheduler never picks a taken placement.
    """
    out = []
    for ref in device_refs(inventory, dynamic):
        if ref.gpu.uuid in refused:
            continue
        if ref.partition is not None and foreign and foreign.get(ref.gpu.uuid):
            part = ref.partition
            if part.start not in mig.free_starts(part.model, list(foreign[ref.gpu.uuid]), part.profile.name):
                continue
        full = ref.shared and offered_mib(inventory, ref.gpu) <= 0  # foreign memory fills it
        if (full or not ref.healthy) and not taints:
            continue
        if full:  # published whole, tainted
            ref = replace(ref, gpu=replace(ref.gpu, foreign_mib=0))
        dev = device_object(ref, inventory, node)
        marks = ([] if ref.healthy else [unhealthy_taint(names)]) + ([held_outside_taint(names)] if full else [])
        if marks:
            dev["taints"] = marks
        out.append(dev)
    return out


def counter_sets(inventory: NodeInventory, dynamic: Mapping[str, mig.MigModel] | None,
                 refused: frozenset[str] = frozenset()) -> list[Obj]:
    """The pool's counter sets: one per dynamic-MIG GPU this plugin serves (partitions.go
    PartSharedCounterSets)."""
    return [counter_set(g, dynamic[g.uuid]) for g in inventory.gpus
            if dynamic and g.uuid in dynamic and g.uuid not in refused]


def next_generation(previous_generation: int, previous_devices: Sequence[Obj] | None,
                    devices: Sequence[Obj]) -> int:
    """The pool generation to publish: unchanged when the devices are, else one more (never back)."""
    if previous_devices is not None and list(previous_devices) == list(devices):
        return previous_generation
    return previous_generation + 1


def slice_name(node: str, names: contract.Names, k: int) -> str:
    """Deterministic slice names ``<node>-<driver>-<k>``, so a restart applies the same objects.

    An object name is a DNS subdomain of at most 253 characters; a node name near that limit is cut
    (at a label boundary's alphanumeric end) and a digest of the whole name keeps it unique."""
    name = f"{node}-{names.dra_driver}-{k}"
    if len(name) <= 253:
        return name
    digest = hashlib.sha256(node.encode()).hexdigest()[:12]
    tail = f"-{digest}-{names.dra_driver}-{k}"
    return node[:253 - len(tail)].rstrip(".-") + tail


def resource_slices(node: str, node_uid: str | None, devices: Sequence[Obj], generation: int,
                    names: contract.Names, counter_sets: Sequence[Obj] = (),
                    annotations: Mapping[str, str] | None = None) -> list[Obj]:
    """The pool's slices (at least one, possibly empty: an empty pool says "no devices here"), each with
    ``annotations`` (the config the plugin runs).

    Counter sets first, at most 8 per slice and in slices of their own (validation.go: "only one of
    `sharedCounters` or `devices` is allowed"), then the devices, 64 per slice when any device carries
    taints or consumes counters. Owned by the Node (as the kubeletplugin helper does), so deleting the
    node garbage-collects them.
    """
    per = validation.max_devices(list(devices))
    step = validation.RESOURCE_SLICE_MAX_COUNTER_SETS
    sets = [list(counter_sets[i:i + step]) for i in range(0, len(counter_sets), step)]
    chunks: list[tuple[str, list[Obj]]] = [("sharedCounters", c) for c in sets] + \
        [("devices", list(devices[i:i + per])) for i in range(0, len(devices), per)]
    chunks = chunks or [("devices", [])]
    out = []
    for k, (field, chunk) in enumerate(chunks):
        meta: Obj = {"name": slice_name(node, names, k)}
        if annotations:
            meta["annotations"] = dict(annotations)
        if node_uid:
            meta["ownerReferences"] = [{"apiVersion": "v1", "kind": "Node", "name": node, "uid": node_uid,
                                        "controller": True}]
        spec: Obj = {"driver": names.dra_driver, "nodeName": node,
                     "pool": {"name": node, "generation": generation, "resourceSliceCount": len(chunks)}}
        if chunk:
            spec[field] = chunk
        out.append({"apiVersion": API_VERSION, "kind": "ResourceSlice", "metadata": meta, "spec": spec})
    return out


def device_index(inventory: NodeInventory,
                 dynamic: Mapping[str, mig.MigModel] | None = None) -> Mapping[str, DeviceRef]:
    """Device name -> what it stands for; Prepare resolves allocation results through this."""
    return {r.name: r for r in device_refs(inventory, dynamic)}
