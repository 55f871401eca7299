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

from typing import Any, Mapping

ATTRIBUTE = "foreignMiB"
MAX_MIB = 1 << 40  # far beyond any GPU; a larger value is not ours to believe

__all__ = ["ATTRIBUTE", "decode", "encode"]


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
