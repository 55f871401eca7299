"""The DRA plugin's enforcement mode in its ResourceSlices: the ``enforcement`` device attribute.

The device plugin publishes its node's pinned mode in the inventory annotation; the DRA plugin publishes
no inventory (its GPUs are in ResourceSlices), so it puts the mode on each *shared* device as the string
attribute ``enforcement`` (unqualified, so in the driver's domain: a claim selects on it with
``device.attributes["gpu.<domain>"].enforcement == "driver"``). Exclusive GPUs and MIG instances do not
carry it: a whole GPU or a MIG instance is its own fence, whatever the node's mode.

Readers (the extender's ``/inspect``, ``vramshare check``) take a node's mode from the newest generation
of its pool, as the allocator reads pools. A node whose shared devices lack the attribute runs an older
plugin ("mode not published"); one with no shared device has no mode to show. Pure: dicts in, values out.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from vramshare.inventory import EnforcementMode

ATTRIBUTE = "enforcement"
NOT_PUBLISHED = "mode not published (an older DRA plugin)"
NO_SHARED = "no shared GPU (the mode fences shared GPUs only)"

__all__ = ["ATTRIBUTE", "NOT_PUBLISHED", "NO_SHARED", "DraNodeMode", "encode", "newest_devices", "node_modes"]


def encode(mode: EnforcementMode) -> dict[str, str]:
    """The attribute's value in a device's ``attributes`` map."""
    return {"string": mode.value}


@dataclass(frozen=True)
class DraNodeMode:
    """What one node's DRA pool says of its mode."""

    node: str
    mode: EnforcementMode | None  # None: not published (or unreadable, see ``unknown``)
    devices: int = 0  # devices in the pool's newest generation
    shared: int = 0  # of them shared (the ones that carry the attribute)
    unknown: str | None = None  # a value this reader does not know (a newer plugin's mode)

    @property
    def text(self) -> str:
        """The mode, or why there is none to show."""
        if self.mode is not None:
            return self.mode.value
        if self.unknown is not None:
            return f"unknown mode {self.unknown!r} (a newer DRA plugin?)"
        return NOT_PUBLISHED if self.shared else NO_SHARED

    @property
    def published(self) -> bool:
        return self.mode is not None


def _value(device: Mapping[str, Any]) -> Any:
    attr = (device.get("attributes") or {}).get(ATTRIBUTE)
    return attr.get("string") if isinstance(attr, Mapping) else None


def newest_devices(slices: Iterable[Mapping[str, Any]], driver: str) -> dict[str, list[Mapping[str, Any]]]:
    """Node name -> the devices of ``driver``'s pool there (others are ignored), newest pool generation
    only, as the allocator reads pools: slices in name order, devices in published order."""
    pools: dict[str, list[Mapping[str, Any]]] = {}
    for s in slices:
        spec = s.get("spec") or {}
        if spec.get("driver") != driver or not spec.get("nodeName"):
            continue
        pools.setdefault(spec["nodeName"], []).append(s)
    out = {}
    for node, members in sorted(pools.items()):
        newest = max(int((m["spec"].get("pool") or {}).get("generation", 0)) for m in members)
        current = sorted((m for m in members if int((m["spec"].get("pool") or {}).get("generation", 0)) == newest),
                         key=lambda m: (m.get("metadata") or {}).get("name", ""))
        out[node] = [d for m in current for d in m["spec"].get("devices") or ()]
    return out


def node_modes(slices: Iterable[Mapping[str, Any]], driver: str) -> dict[str, DraNodeMode]:
    """Node name -> its DRA mode, from ``driver``'s ResourceSlices (others are ignored), newest pool
    generation only. Devices that disagree (a pool half rewritten) are read first-published-first."""
    out = {}
    for node, devices in newest_devices(slices, driver).items():
        shared = [d for d in devices if d.get("allowMultipleAllocations")]
        values = [v for v in map(_value, shared) if isinstance(v, str)]
        mode, unknown = None, None
        if values:
            try:
                mode = EnforcementMode(values[0])
            except ValueError:
                unknown = values[0][:64]
        out[node] = DraNodeMode(node, mode, len(devices), len(shared), unknown)
    return out
