"""Slicing a node's GPUs into kubelet devices: the pure core of what the plugin advertises.

The backend says what GPUs exist; the config says how each is offered (memory units, whole, MIG).
From those two this module builds the :class:`~vramshare.inventory.NodeInventory` (published as the
node annotation) and, per extended resource, the device list handed to ListAndWatch. Device IDs
name the physical GPU (``<gpu-uuid>::<n>``, the GPU UUID, or the MIG UUID) so an ID alone says which
GPU it is, even after a restart. No I/O, no grpc: plain frozen values in, plain frozen values out.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import AbstractSet, Iterable, Mapping, Sequence

from deviceplugin.backend import DiscoveredGpu, DiscoveredMig
from vramshare import contract, mig, mig_plan
from vramshare.config import Config
from vramshare.inventory import DynamicMig, Gpu, GpuMode, MigInstance, NodeInventory, units_for


@dataclass(frozen=True)
class PluginDevice:
    """One kubelet device: its ID, the GPU it lives on, that GPU's NUMA node and its health."""

    id: str
    gpu_uuid: str
    numa_node: int | None
    healthy: bool
    mib: int  # memory this device stands for (a unit, a MIG instance, or a whole GPU)


class DeviceIdError(ValueError):
    """A device ID longer than the kubelet accepts (63 characters)."""


def build_inventory(discovered: Iterable[DiscoveredGpu], config: Config,
                    unhealthy: AbstractSet[str] = frozenset(), *, dra: bool = False,
                    isolation: bool = False) -> NodeInventory:
    """The node inventory: mode per GPU from the config, units per shared GPU, MIG instances.

    ``unhealthy`` holds GPU and MIG UUIDs the health watch reported; a MIG instance is also
    unhealthy when its parent GPU is. GPUs the config gives to the DRA plugin (``dra.gpus``) are in
    the DRA plugin's inventory (``dra=True``) and never in the device plugin's: one owner per GPU.
    """
    gpus = []
    for d in sorted(discovered, key=lambda g: g.index):
        if config.dra.manages(d.index, d.uuid) != dra:
            continue
        mode = config.mode_for(d.index, d.uuid, d.mig_enabled)
        gpu_ok = d.uuid not in unhealthy
        migs = tuple(
            MigInstance(uuid=m.uuid, profile=m.profile, memory_mib=m.memory_mib, gi=m.gi, ci=m.ci,
                        healthy=gpu_ok and m.uuid not in unhealthy, start=m.start)
            for m in d.mig
        ) if mode is GpuMode.MIG else ()
        dynamic = (dynamic_mig(d.model, d.memory_mib, d.mig)
                   if mode is GpuMode.MIG and config.dynamic_mig.allows(d.index, d.uuid) else None)
        if dynamic is not None and isolation:  # isolation: mig asks are served here (resource_devices)
            dynamic = dataclasses.replace(dynamic, isolation=True)
        units = (units_for(d.memory_mib - d.reserved_mib, config.reserved_mib_per_gpu, config.memory_unit_mib)
                 if mode is GpuMode.SHARED else 0)
        gpus.append(Gpu(index=d.index, uuid=d.uuid, model=d.model, memory_mib=d.memory_mib,
                        numa_node=d.numa_node, mode=mode, healthy=gpu_ok, mig=migs, units=units,
                        dynamic_mig=dynamic))
    return NodeInventory(unit_mib=config.memory_unit_mib, gpus=tuple(gpus), enforcement=config.enforcement.resolved)


def dynamic_mig(model: str, memory_mib: int, instances: Sequence[DiscoveredMig]) -> DynamicMig | None:
    """The dynamic-MIG view of a GPU the admin allows it on: its profile table, its instances with their
    placements, and what could still be created. ``None`` (the GPU stays as the admin cut it) when the
    model has no table here or the backend did not read where each instance sits."""
    table = mig.model_of_profiles(model, memory_mib)
    if table is None or any(m.start is None or m.profile not in table.names for m in instances):
        return None
    placed = [mig.Placed(m.start, m.profile) for m in instances if m.start is not None]
    if mig.check_layout(table, placed):
        return None
    return DynamicMig(table.name, tuple((p.profile, p.start) for p in sorted(placed)),
                      tuple((p.name, tuple(mig.free_starts(table, placed, p.name))) for p in table.profiles))


def placement_devices(g: Gpu) -> list[tuple[str, PluginDevice]]:
    """(profile, device) for a dynamic-MIG GPU: one device per placement where an instance of the profile
    could be created now or exists (ID: :func:`vramshare.mig_plan.encode`). An existing instance keeps its
    device while it lives, so what the kubelet granted never vanishes from its list."""
    assert g.dynamic_mig is not None
    table = mig.MODELS[g.dynamic_mig.table]
    free = dict(g.dynamic_mig.free)
    health = {(m.profile, m.start): m.healthy for m in g.mig}
    out = []
    for p in table.profiles:
        for s in p.starts:
            if s in free.get(p.name, ()) or (p.name, s) in health:
                device_id = mig_plan.encode(mig_plan.MigPlacement(g.uuid, p.name, s))
                ok = g.healthy and health.get((p.name, s), True)
                out.append((p.name, PluginDevice(device_id, g.uuid, g.numa_node, ok, p.memory_mib)))
    return out


def isolation_units(g: Gpu, unit_mib: int) -> int:
    """Memory units a dynamic-MIG GPU offers ``isolation: mig`` pods (issue 24): its largest plain profile's
    memory. Each such pod holds its ask in units and gets a partition at least that large, so the units
    run out no sooner than the partitions; the extender's books, not these units, keep partitions apart."""
    assert g.dynamic_mig is not None
    return max((p.memory_mib for p in mig.MODELS[g.dynamic_mig.table].profiles if not p.media), default=0) // unit_mib


def resource_devices(inventory: NodeInventory, names: contract.Names,
                     isolation: bool = False) -> dict[str, tuple[PluginDevice, ...]]:
    """Kubelet devices per extended resource; a resource appears only when it has a device.

    ``isolation``: the plugin serves ``isolation: mig`` pods (dynamic MIG on, and a pod cache to find
    each Allocate's plan in), so each dynamic-MIG GPU also offers gpu-memory units (:func:`isolation_units`),
    which Allocate grants only as the partition planned for such a pod (:mod:`deviceplugin.kubelet.allocator`)."""
    out: dict[str, list[PluginDevice]] = {}
    for g in inventory.gpus:
        if g.mode is GpuMode.SHARED:
            out.setdefault(names.gpu_memory, []).extend(
                PluginDevice(contract.unit_device_id(g.uuid, n), g.uuid, g.numa_node, g.healthy,
                             inventory.unit_mib)
                for n in range(g.units + inventory.credit_units(g)))  # + units of the sleep credit (issue 23)
        elif g.mode is GpuMode.EXCLUSIVE:
            out.setdefault(names.gpu, []).append(
                PluginDevice(g.uuid, g.uuid, g.numa_node, g.healthy, g.memory_mib))
        elif g.dynamic_mig is not None:  # every profile keeps its resource: no re-registration per change
            for p in mig.MODELS[g.dynamic_mig.table].profiles:
                out.setdefault(names.mig(p.name), [])
            for profile, dev in placement_devices(g):
                out.setdefault(names.mig(profile), []).append(dev)
            if isolation:
                out.setdefault(names.gpu_memory, []).extend(
                    PluginDevice(contract.unit_device_id(g.uuid, n), g.uuid, g.numa_node, g.healthy,
                                 inventory.unit_mib)
                    for n in range(isolation_units(g, inventory.unit_mib)))
        else:
            for m in g.mig:
                out.setdefault(names.mig(m.profile), []).append(
                    PluginDevice(m.uuid, g.uuid, g.numa_node, m.healthy, m.memory_mib))
    for devices in out.values():
        check_ids(d.id for d in devices)
    return {r: tuple(ds) for r, ds in sorted(out.items())}


def check_ids(ids: Iterable[str]) -> None:
    """Refuse IDs the kubelet would reject; better to fail at start than at every registration."""
    for device_id in ids:
        if len(device_id) > contract.MAX_DEVICE_ID_LEN:
            raise DeviceIdError(f"device ID {device_id!r} is {len(device_id)} characters, "
                                f"the kubelet accepts at most {contract.MAX_DEVICE_ID_LEN}")


def socket_name(resource: str) -> str:
    """``vramshare-<suffix>.sock`` for a resource ``<domain>/<suffix>``; one socket per resource."""
    return f"vramshare-{resource.split('/', 1)[1]}.sock"


def by_id(devices: Sequence[PluginDevice]) -> Mapping[str, PluginDevice]:
    return {d.id: d for d in devices}
