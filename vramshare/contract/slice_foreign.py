"""Foreign memory in the DRA plugin's ResourceSlices: the ``foreignMiB`` device attribute.

The device plugin publishes a shared GPU's foreign memory (memory no pod of ours holds: a process that
outlived its pod, a host process; :mod:`vramshare.foreign`) as ``gpus[].foreignMiB`` in its inventory.
The DRA plugin has no inventory; kube-scheduler's allocator books a shared device against its
``capacity.memory`` alone, so the plugin publishes that capacity *less* the foreign memory (the
allocator then never hands out memory that is not there) and says how much it took off in the int
attribute ``foreignMiB`` (unqualified: the driver's domain). The extender's DRA view adds it back to
the slot's capacity and books it as used, as it does on the device plugin's GPUs, so claims allocated
before the memory appeared are still recorded. Absent: 0 (an older plugin, or none foreign). Pure.
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping

from vramshare.contract.slice_enforcement import newest_devices  # one reading of pools

ATTRIBUTE = "foreignMiB"
MAX_MIB = 1 << 40  # far beyond any GPU; a larger value is not ours to believe
#: the taint (``<driver>/<TAINT>``, NoSchedule) of a shared GPU that foreign memory fills, where device
#: taints are on: published whole, no capacity left to offer (without taints it is withheld)
TAINT = "memory-held-outside"

__all__ = ["ATTRIBUTE", "TAINT", "decode", "encode", "held_outside", "taint"]


def taint(driver: str) -> dict[str, str]:
    """The taint a shared device carries while foreign memory fills it: no new claims, its claims stay."""
    return {"key": f"{driver}/{TAINT}", "value": "true", "effect": "NoSchedule"}


def encode(mib: int) -> dict[str, int]:
    """The attribute's value in a device's ``attributes`` map."""
    return {"int": int(mib)}


def decode(device: Mapping[str, Any]) -> int:
    """The foreign MiB a published device carries; 0 when absent or not a sane whole number (a reader must
    not be steered by a value the plugin cannot have written: the allocator reads the capacity anyway)."""
    attr = (device.get("attributes") or {}).get(ATTRIBUTE)
    value = attr.get("int") if isinstance(attr, Mapping) else None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_MIB:
        return 0
    return value


def held_outside(slices: Iterable[Mapping[str, Any]], driver: str) -> dict[str, dict[str, int | None]]:
    """Node -> device -> the foreign MiB its newest pool names (None: it fills the device, which carries the
    taint), for devices that have any; for readers (``vramshare check``), not for the allocator."""
    out: dict[str, dict[str, int | None]] = {}
    key = taint(driver)["key"]
    for node, devices in newest_devices(slices, driver).items():
        for d in devices:
            full = any(t.get("key") == key for t in d.get("taints") or ())
            mib = decode(d)
            if full or mib:
                out.setdefault(node, {})[str(d.get("name", "?"))] = None if full else mib
    return out
