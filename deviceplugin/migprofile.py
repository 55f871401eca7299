"""MIG profile names (``3g.40gb``): parse the memory out of one, or build one from NVML numbers.

Both backends need this: the simulated one reads profile names from an inventory file, the NVML one
falls back to building a name when the driver's profile info has none. Pure functions, no I/O.
"""
from __future__ import annotations

import math
import re

_PROFILE = re.compile(r"^(?:(?P<c>\d+)c\.)?(?P<g>\d+)g\.(?P<gb>\d+)gb(?P<extra>(?:\+[a-z0-9]+)*)$")
_MIB_PER_GIB = 1024


def is_profile(name: str) -> bool:
    """True for names like ``1g.10gb``, ``1g.10gb+me``, ``1c.3g.40gb``."""
    return _PROFILE.match(name) is not None


def profile_memory_mib(name: str) -> int:
    """Memory of a MIG profile from its name, in MiB (``3g.40gb`` -> 40960); ``ValueError`` otherwise.

    The name's GB figure is NVIDIA's rounded label, not the exact size (a real A100 ``3g.40gb`` has
    40192 MiB usable); an inventory that needs the exact figure gives ``memoryMiB`` explicitly.
    """
    match = _PROFILE.match(name)
    if match is None:
        raise ValueError(f"{name!r} is not a MIG profile name like 1g.10gb")
    return int(match.group("gb")) * _MIB_PER_GIB


def profile_slices(name: str) -> int:
    """GPU slices of a profile (``3g.40gb`` -> 3)."""
    match = _PROFILE.match(name)
    if match is None:
        raise ValueError(f"{name!r} is not a MIG profile name like 1g.10gb")
    return int(match.group("g"))


def strip_prefix(nvml_name: str) -> str:
    """NVML profile info names read ``MIG 1g.10gb``; the resource name wants ``1g.10gb``."""
    return nvml_name.strip().removeprefix("MIG").strip()


def profile_name(slices: int, memory_mb: int, total_bytes: int) -> str:
    """Build NVIDIA's profile name from a GI's slice count and memory, as go-nvlib does.

    The GB label is the instance's fraction of the GPU rounded up to eighths, times the GPU's memory
    in whole GB; that is what makes a 40192 MiB instance of an 80 GB A100 read ``3g.40gb``.
    """
    one_mb, one_gb = 1024 * 1024, 1024 * 1024 * 1024
    if total_bytes <= 0:
        return f"{slices}g.{math.ceil(memory_mb / 1024)}gb"
    fraction = (memory_mb * one_mb) / total_bytes
    fraction = math.ceil(fraction * 8) / 8
    total_gb = (total_bytes + one_gb - 1) // one_gb
    return f"{slices}g.{round(fraction * total_gb)}gb"
