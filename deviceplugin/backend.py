"""The one interface every GPU source implements: discover GPUs, report health changes.

The real one wraps NVML (``nvml_backend``); the simulated one reads a YAML inventory
(``simulated_backend``) and also lets tests and the demo inject health events and NVML errors. The
rest of the device plugin never imports ``pynvml``.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, Protocol, runtime_checkable


class BackendError(RuntimeError):
    """The GPU source failed (no driver, NVML error). The message is one line a person can act on."""


@dataclass(frozen=True)
class DiscoveredMig:
    uuid: str
    profile: str  # e.g. "1g.10gb"
    memory_mib: int
    gi: int | None = None
    ci: int | None = None
    start: int | None = None  # placement start (memory slot), when the backend reads it (dynamic MIG)


@dataclass(frozen=True)
class DiscoveredGpu:
    """A GPU as the backend sees it, before config decides how it is offered."""

    index: int
    uuid: str
    model: str
    memory_mib: int  # total framebuffer
    reserved_mib: int = 0  # driver-reserved (NVML memory v2), 0 when unknown
    numa_node: int | None = None  # None when unknown or < 0 in sysfs
    pci_bus_id: str | None = None
    mig_enabled: bool = False
    mig: tuple[DiscoveredMig, ...] = ()


@dataclass(frozen=True)
class HealthEvent:
    """A health change of one GPU (or one MIG instance of it, when ``mig_uuid`` is set)."""

    uuid: str
    healthy: bool
    reason: str  # e.g. "xid 79", "gpu answers again", "nvml: GPU is lost"
    xid: int | None = None
    mig_uuid: str | None = None


HealthCallback = Callable[[HealthEvent], None]


@runtime_checkable
class GpuBackend(Protocol):
    name: str

    def discover(self) -> list[DiscoveredGpu]:
        """All GPUs now; raises :class:`BackendError`."""
        ...

    def watch_health(self, stop: threading.Event, on_event: HealthCallback,
                     ignored_xids: frozenset[int]) -> None:
        """Block until ``stop`` is set, calling ``on_event`` on every change (unhealthy and back)."""
        ...

    def close(self) -> None:
        ...
