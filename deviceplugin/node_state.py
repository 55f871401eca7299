"""The node's current GPUs, health and config, and who to tell when they change.

One object owns the mutable facts (discovered GPUs, the unhealthy set, the config) and turns them,
through the pure :mod:`deviceplugin.devices`, into an immutable :class:`Snapshot`. Readers (the
servicers, the allocator, the inventory publisher, the metrics) take the current snapshot without
locking; writers (the health watch, the config reload) swap it and then call the listeners outside
the lock, so a slow listener never blocks a health event.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace
from typing import Callable, Mapping, Sequence

from deviceplugin import devices
from deviceplugin.devices import PluginDevice
from deviceplugin.backend import DiscoveredGpu, HealthEvent
from vramshare import logs
from vramshare.config import MAX_DEVICES_PER_MESSAGE, Config
from vramshare.inventory import GpuMode, NodeInventory

log = logs.get(__name__)


@dataclass(frozen=True)
class Snapshot:
    config: Config
    inventory: NodeInventory
    devices: Mapping[str, tuple[PluginDevice, ...]]  # per extended resource
    resource_of: Mapping[str, str] = field(default_factory=dict)  # device ID -> resource

    def device_map(self, resource: str) -> Mapping[str, PluginDevice]:
        return devices.by_id(self.devices.get(resource, ()))


Listener = Callable[[Snapshot, Snapshot], None]  # (old, new)


def _snapshot(discovered: Sequence[DiscoveredGpu], config: Config, unhealthy: frozenset[str],
              dra: bool = False, isolation: bool = False, credits: Mapping[str, int] | None = None) -> Snapshot:
    inventory = devices.build_inventory(discovered, config, unhealthy, dra=dra, isolation=isolation)
    if credits:
        inventory = with_credits(inventory, credits)
    per_resource = devices.resource_devices(inventory, config.names, isolation)
    owners = {d.id: r for r, ds in per_resource.items() for d in ds}
    return Snapshot(config, inventory, per_resource, owners)


def with_credits(inventory: NodeInventory, credits: Mapping[str, int]) -> NodeInventory:
    """Issue 23 item 5: the sleeping pods' credit on healthy shared GPUs, in whole units, at most the GPU's
    own units (a GPU is never booked past twice its memory) and, over the node, at most what keeps every
    device in one ListAndWatch message (:data:`vramshare.config.MAX_DEVICES_PER_MESSAGE`)."""
    unit = inventory.unit_mib
    budget = MAX_DEVICES_PER_MESSAGE - sum(g.units for g in inventory.gpus if g.mode is GpuMode.SHARED)
    gpus = []
    for g in inventory.gpus:
        extra = 0
        if g.mode is GpuMode.SHARED and g.healthy:
            extra = max(0, min(credits.get(g.uuid, 0) // unit, g.units, budget))
            budget -= extra
        gpus.append(replace(g, sleep_credit_mib=extra * unit) if extra else g)
    return replace(inventory, gpus=tuple(gpus))


class NodeState:
    """Thread-safe holder of the current :class:`Snapshot`."""

    def __init__(self, discovered: Sequence[DiscoveredGpu], config: Config, *, dra: bool = False) -> None:
        """``dra``: hold the GPUs the config gives the DRA plugin (``dra.gpus``) instead of the others."""
        self._dra = dra
        self._isolation = False  # dynamic-MIG GPUs offer gpu-memory units to isolation: mig pods (issue 24)
        self._discovered = tuple(discovered)
        self._unhealthy: frozenset[str] = frozenset()
        self._credits: dict[str, int] = {}  # GPU uuid -> sleep credit MiB (issue 23 item 5)
        self._lock = threading.Lock()
        self._listeners: list[Listener] = []
        self._snapshot = _snapshot(self._discovered, config, self._unhealthy, dra)

    @property
    def snapshot(self) -> Snapshot:
        return self._snapshot

    def add_listener(self, listener: Listener) -> None:
        with self._lock:
            self._listeners.append(listener)

    def on_health(self, event: HealthEvent) -> None:
        """Backend callback: a GPU (or one MIG instance) went unhealthy or came back."""
        target = event.mig_uuid or event.uuid
        with self._lock:
            unhealthy = self._unhealthy - {target} if event.healthy else self._unhealthy | {target}
            if unhealthy == self._unhealthy:
                return
            self._unhealthy = unhealthy
        log.warning("gpu health changed", gpu=event.uuid, mig=event.mig_uuid or "", healthy=event.healthy,
                    reason=event.reason)
        self._swap(lambda s: self._build(s.config))

    def on_credits(self, credits: Mapping[str, int]) -> None:
        """The quota loop's sleep credits changed (a pod of an overcommit class slept or woke): the
        inventory's ``sleepCreditMiB`` and the kubelet's units follow (a wake withdraws them at once)."""
        with self._lock:
            new = {g: int(c) for g, c in credits.items() if c > 0}
            if new == self._credits:
                return
            self._credits = new
        log.info("sleep credits changed", credits_mib=new or None)
        self._swap(lambda s: self._build(s.config))

    def on_discovered(self, discovered: Sequence[DiscoveredGpu]) -> None:
        """The GPUs were read again (a MIG instance was made or destroyed): lists follow what exists."""
        with self._lock:
            self._discovered = tuple(discovered)
        self._swap(lambda s: self._build(s.config))

    def serve_isolation(self) -> None:
        """Dynamic MIG is on and Allocate can find each pod's plan: offer ``isolation: mig`` units."""
        self._isolation = True
        self._swap(lambda s: self._build(s.config))

    def on_config(self, config: Config) -> None:
        """A new config (SIGHUP or file change); modes and unit size may change the device lists."""
        self._swap(lambda s: self._build(config))

    def _build(self, config: Config) -> Snapshot:
        return _snapshot(self._discovered, config, self._unhealthy, self._dra, self._isolation, self._credits)

    def _swap(self, build: Callable[[Snapshot], Snapshot]) -> None:
        with self._lock:
            old = self._snapshot
            new = build(old)
            self._snapshot = new
            listeners = list(self._listeners)
        if new == old:
            return
        for listener in listeners:
            listener(old, new)
