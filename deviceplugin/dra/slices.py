"""A node's GPU inventory as ``resource.k8s.io/v1`` ResourceSlices: the pure core of what DRA publishes.

One pool per node (pool name = node name), split into slices of at most 128 devices (64 when any
device carries taints, as the API requires). A shared GPU is one device with
``allowMultipleAllocations: true`` and a consumable ``capacity.memory`` whose ``requestPolicy``
rounds every share up to whole ``memoryUnitMiB`` units (default one unit, validRange min one unit,
max the GPU's schedulable memory, step one unit: KEP-5075; ``validValues`` of that one unit when the
GPU offers only one). An exclusive GPU is an ordinary device;
every MIG instance is a device of its profile. Unhealthy devices are withdrawn: removed, or tainted
``NoSchedule`` when the cluster has DRADeviceTaints (config ``dra.deviceTaints``).

Device names are DNS labels derived from the GPU index (``gpu-0``, ``gpu-0-mig-1-0``); the
``uuid`` attribute names the physical GPU. No I/O: dicts in the API's JSON shape come out.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from deviceplugin.dra import validation
from vramshare import contract
from vramshare.inventory import Gpu, GpuMode, MigInstance, NodeInventory

API_VERSION = "resource.k8s.io/v1"
#: the standard NUMA attribute (KEP-6072, stable in 1.37); the driver's own ``numaNode`` is kept too
STANDARD_NUMA_ATTRIBUTE = "resource.kubernetes.io/numaNode"
MAX_DEVICES_PER_SLICE = 128
MAX_DEVICES_PER_SLICE_WITH_TAINTS = 64
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")

Obj = dict[str, Any]


@dataclass(frozen=True)
class DeviceRef:
    """What a published device stands for: the GPU (and MIG instance) behind a device name."""

    name: str
    gpu: Gpu
    mig: MigInstance | None = None

    @property
    def uuid(self) -> str:
        """The UUID a container sees: the MIG instance's, else the GPU's."""
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


def device_refs(inventory: NodeInventory) -> tuple[DeviceRef, ...]:
    """Every device the inventory offers, healthy or not, in a stable order (GPU index, then MIG)."""
    out: list[DeviceRef] = []
    for g in inventory.gpus:
        if g.mode is GpuMode.MIG:
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
    if g.numa_node is not None:
        attrs["numaNode"] = {"int": g.numa_node}  # for clusters before 1.37
        attrs[STANDARD_NUMA_ATTRIBUTE] = {"int": g.numa_node}
    return attrs


def device_object(ref: DeviceRef, inventory: NodeInventory, node: str) -> Obj:
    """One ``spec.devices[]`` entry (without taints)."""
    dev: Obj = {"name": ref.name, "attributes": _attributes(ref, node)}
    if ref.mig is not None:
        dev["capacity"] = {"memory": {"value": mib(ref.mig.memory_mib)}}
    elif ref.shared:
        dev["allowMultipleAllocations"] = True
        dev["capacity"] = {"memory": {"value": mib(inventory.capacity_mib(ref.gpu)),
                                      "requestPolicy": request_policy(ref.gpu.units, inventory.unit_mib)}}
    else:
        dev["capacity"] = {"memory": {"value": mib(ref.gpu.memory_mib)}}
    return dev


def request_policy(units: int, unit_mib: int) -> Obj:
    """Shares of whole units: ``validRange`` {min one unit, max all, step one unit}; a GPU of exactly one
    unit gets ``validValues: [unit]`` instead, because the API server refuses a range whose
    ``min + step`` exceeds the capacity (validation.go ``validateRequestPolicyRange``), and that
    refusal would take every device of the slice with it."""
    unit = mib(unit_mib)
    if units <= 1:
        return {"default": unit, "validValues": [unit]}
    return {"default": unit, "validRange": {"min": unit, "max": mib(units * unit_mib), "step": unit}}


def publishable(devices: Sequence[Obj]) -> tuple[list[Obj], list[tuple[str, list[str]]]]:
    """Split ``devices`` into those the API server accepts and ``(name, reasons)`` of those it would
    refuse (:mod:`deviceplugin.dra.validation`): one bad device must not take the slice down."""
    ok, refused = [], []
    names: set[Any] = set()
    for dev in devices:
        errors = validation.device_errors(dev)
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


def desired_devices(inventory: NodeInventory, names: contract.Names, node: str, *, taints: bool,
                    refused: frozenset[str] = frozenset()) -> list[Obj]:
    """The devices to publish: healthy ones, plus unhealthy ones tainted when ``taints`` is on.

    ``refused`` holds GPU UUIDs another manager (the device plugin) already serves; never published.
    """
    out = []
    for ref in device_refs(inventory):
        if ref.gpu.uuid in refused:
            continue
        dev = device_object(ref, inventory, node)
        if not ref.healthy:
            if not taints:
                continue
            dev["taints"] = [unhealthy_taint(names)]
        out.append(dev)
    return out


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
                    names: contract.Names) -> list[Obj]:
    """The pool's slices (at least one, possibly empty: an empty pool says "no devices here").

    Owned by the Node (as the kubeletplugin helper does), so deleting the node garbage-collects them.
    """
    per = MAX_DEVICES_PER_SLICE_WITH_TAINTS if any("taints" in d for d in devices) else MAX_DEVICES_PER_SLICE
    chunks = [list(devices[i:i + per]) for i in range(0, len(devices), per)] or [[]]
    out = []
    for k, chunk in enumerate(chunks):
        meta: Obj = {"name": slice_name(node, names, k)}
        if node_uid:
            meta["ownerReferences"] = [{"apiVersion": "v1", "kind": "Node", "name": node, "uid": node_uid,
                                        "controller": True}]
        spec: Obj = {"driver": names.dra_driver, "nodeName": node,
                     "pool": {"name": node, "generation": generation, "resourceSliceCount": len(chunks)}}
        if chunk:
            spec["devices"] = chunk
        out.append({"apiVersion": API_VERSION, "kind": "ResourceSlice", "metadata": meta, "spec": spec})
    return out


def device_index(inventory: NodeInventory) -> Mapping[str, DeviceRef]:
    """Device name -> what it stands for; Prepare resolves allocation results through this."""
    return {r.name: r for r in device_refs(inventory)}
