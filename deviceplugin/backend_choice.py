"""Which GPU backend a node program runs on: the one choice both plugins make from ``--backend`` and
``--inventory`` (``vramshare device-plugin`` and ``vramshare dra-plugin``; the quota loop reads the
chosen backend's NVML handle).

The backends are imported only once chosen, so a simulated node never loads ``pynvml``.
"""
from __future__ import annotations

from typing import Callable

from deviceplugin.backend import GpuBackend

KINDS = ("nvml", "simulated", "auto")


def open_backend(kind: str, inventory: str | None = None,
                 on_nvml_error: Callable[[str, str], None] | None = None) -> GpuBackend:
    """``auto`` is NVML unless an inventory file is given; ``simulated`` without a file is the demo
    node. ``on_nvml_error(function, kind)`` counts NVML errors (the plugin's metric)."""
    if kind == "auto":
        kind = "simulated" if inventory else "nvml"
    if kind == "simulated":
        from deviceplugin.simulated_backend import SimulatedBackend
        return SimulatedBackend.from_file(inventory) if inventory else SimulatedBackend.demo()
    if kind != "nvml":
        raise ValueError(f"backend {kind!r}: not one of {', '.join(KINDS)}")
    from deviceplugin.nvml_backend import NvmlBackend
    return NvmlBackend(on_nvml_error=on_nvml_error)
