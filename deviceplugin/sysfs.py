"""The host's sysfs, for the one thing NVML does not say well: a GPU's NUMA node.

``nvmlDeviceGetNumaNodeId`` only applies where the GPU *is* a NUMA node (Grace Hopper); the kubelet's
topology manager wants the host NUMA node of the PCI device, which is
``/sys/bus/pci/devices/<bus id>/numa_node``. That is what NVIDIA's plugin reads
(``internal/rm/nvml_devices.go`` getNumaNode). ``sysfs_root`` is injectable so tests use a temp tree.
"""
from __future__ import annotations

import os
import re

DEFAULT_ROOT = "/sys"

_BUS_ID = re.compile(r"^(?:(?P<domain>[0-9a-fA-F]{1,8}):)?(?P<bus>[0-9a-fA-F]{2}):"
                     r"(?P<dev>[0-9a-fA-F]{2})\.(?P<fn>[0-7])$")


class SysfsError(ValueError):
    """A sysfs value that is there but cannot be read as documented."""


def normalize_bus_id(bus_id: str) -> str:
    """NVML's ``00000000:3B:00.0`` (8-hex domain) -> sysfs's ``0000:3b:00.0`` (4-hex, lowercase).

    NVIDIA's plugin strips a leading ``0000`` from the string, which is right for NVML's 8-digit
    domain but would mangle the 4-digit legacy form; parsing the fields handles both.
    """
    match = _BUS_ID.match(bus_id.strip())
    if match is None:
        raise SysfsError(f"PCI bus id {bus_id!r} is not of the form [domain:]bus:device.function")
    domain = int(match.group("domain") or "0", 16)
    if domain > 0xFFFF:
        raise SysfsError(f"PCI bus id {bus_id!r}: domain does not fit sysfs's 4 hex digits")
    return f"{domain:04x}:{match.group('bus').lower()}:{match.group('dev').lower()}.{match.group('fn')}"


def numa_node_path(bus_id: str, sysfs_root: str = DEFAULT_ROOT) -> str:
    return os.path.join(sysfs_root, "bus", "pci", "devices", normalize_bus_id(bus_id), "numa_node")


def numa_node(bus_id: str, sysfs_root: str = DEFAULT_ROOT) -> int | None:
    """The GPU's host NUMA node, or ``None`` when unknown (no file, or the kernel says ``-1``).

    A missing file is normal (no NUMA, a VM, a test machine) and means "no preference" to the
    kubelet; a file with garbage in it is not, and raises :class:`SysfsError`.
    """
    path = numa_node_path(bus_id, sysfs_root)
    try:
        with open(path, encoding="ascii") as fh:
            text = fh.read().strip()
    except OSError:
        return None
    try:
        node = int(text)
    except ValueError:
        raise SysfsError(f"{path}: expected an integer, got {text!r}") from None
    return node if node >= 0 else None
