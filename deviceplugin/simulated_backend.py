"""A GPU backend without GPUs: an inventory file, plus faults injected on purpose.

It runs the device plugin, the demo and the tests on any machine. It behaves like the NVML backend
where the rest of the plugin can tell: the same :class:`DiscoveredGpu` values, the same Xid ignore
list applied in ``watch_health``, transitions only, and recovery reported as "gpu answers again".
Faults come in through methods, from any thread:

* ``inject_xid(uuid, 79)`` / ``inject_xid(uuid, 94, mig_uuid=...)``: a critical-error event;
* ``lose_gpu(uuid)``: the GPU stops answering (NVML's "GPU is lost");
* ``recover(uuid)``: it answers again;
* ``fail_discover(times=2)``: the next ``discover()`` calls raise :class:`BackendError`.

Its MIG GPUs of a model :mod:`vramshare.mig` has a table for are cut by :attr:`mig_nvml` (a
:class:`~deviceplugin.simulated_mig.SimulatedMig`): the file's instances get placements, the device
plugin's dynamic-MIG path creates and destroys instances through it, and ``discover()`` reports what
exists now, as NVML would.

Two optional attributes make a simulated node stand in for more: ``usage_replay`` (a
``simulated_usage.UsageReplay``) feeds the quota loop per-container use, and ``enforcement_facts``
(an ``enforcement.NodeFacts``) says what the node's driver would offer, for mode detection.
"""
from __future__ import annotations

import importlib.resources
import queue
import threading
from dataclasses import dataclass
from typing import Any, Sequence

import dataclasses

from deviceplugin import health, inventory_file
from deviceplugin.backend import BackendError, DiscoveredGpu, HealthCallback, HealthEvent
from deviceplugin.simulated_mig import SimulatedMig
from vramshare import logs, mig

log = logs.get(__name__)

_POLL_SECONDS = 0.05  # how soon watch_health notices ``stop``; events themselves wake it at once
LOST_REASON = "nvml: GPU is lost"


def demo_inventory_path() -> str:
    """The packaged inventory ``vramshare demo`` runs on (two H100s, an H200, an A100 in MIG mode)."""
    return str(importlib.resources.files("deviceplugin.inventories").joinpath("demo-node.yaml"))


@dataclass(frozen=True)
class _Fault:
    kind: str  # "xid" | "lost" | "recover" | "close"
    uuid: str = ""
    mig_uuid: str | None = None
    xid: int | None = None


class SimulatedBackend:
    """Implements :class:`deviceplugin.backend.GpuBackend` over a fixed list of GPUs."""

    name = "simulated"

    def __init__(self, gpus: Sequence[DiscoveredGpu]) -> None:
        self.mig_nvml = SimulatedMig()
        self._gpus = [self._cut(g) for g in gpus]
        self._lock = threading.Lock()
        self._faults: "queue.Queue[_Fault]" = queue.Queue()
        self._discover_failures: list[str] = []
        self._closed = False
        self.discover_calls = 0
        self.usage_replay: Any = None  # simulated_usage.UsageReplay: the quota loop runs on this node
        self.enforcement_facts: Any = None  # enforcement.NodeFacts; None: no driver (cooperative)

    @classmethod
    def from_file(cls, path: str, host: str = "") -> "SimulatedBackend":
        """``host`` (the node name) salts derived UUIDs, so nodes sharing one file stay distinct."""
        return cls(inventory_file.load(path, host))

    @classmethod
    def from_dict(cls, raw: Any, host: str = "") -> "SimulatedBackend":
        return cls(inventory_file.from_dict(raw, host))

    @classmethod
    def demo(cls) -> "SimulatedBackend":
        return cls.from_file(demo_inventory_path())

    def _cut(self, gpu: DiscoveredGpu) -> DiscoveredGpu:
        table = mig.model_for(gpu.model, gpu.memory_mib) if gpu.mig_enabled else None
        placed = self.mig_nvml.add_gpu(gpu.uuid, table, gpu.mig) if table is not None else None
        if table is not None and placed is None:
            log.warning("simulated MIG instances fit no placement; the GPU stays static", gpu=gpu.uuid)
        return gpu if placed is None else dataclasses.replace(gpu, mig=tuple(placed))

    def restarted(self) -> "SimulatedBackend":
        """The same GPUs seen by a new process (a plugin restart): MIG instances made so far stay."""
        again = SimulatedBackend(self._gpus)
        again.mig_nvml = self.mig_nvml
        return again

    def dynamic_mig_gpus(self) -> dict[str, tuple[Any, str, int]]:
        """GPU UUID -> (handle, NVML name, MiB) of every GPU :attr:`mig_nvml` cuts (DynamicMig's ``gpus``)."""
        cut = set(self.mig_nvml.gpus())
        return {g.uuid: (g.uuid, g.model, g.memory_mib) for g in self._gpus if g.uuid in cut}

    # -- GpuBackend ------------------------------------------------------------------------
    def discover(self) -> list[DiscoveredGpu]:
        with self._lock:
            self.discover_calls += 1
            if self._closed:
                raise BackendError("simulated backend is closed")
            if self._discover_failures:
                raise BackendError(self._discover_failures.pop(0))
            cut = set(self.mig_nvml.gpus())
            return [dataclasses.replace(g, mig=self.mig_nvml.discovered(g.uuid)) if g.uuid in cut else g
                    for g in self._gpus]

    def watch_health(self, stop: threading.Event, on_event: HealthCallback,
                     ignored_xids: frozenset[int]) -> None:
        """Deliver injected faults as transitions until ``stop`` is set or the backend is closed."""
        ledger = health.HealthLedger()
        while not stop.is_set():
            try:
                fault = self._faults.get(timeout=_POLL_SECONDS)
            except queue.Empty:
                if self._closed:
                    return
                continue
            if fault.kind == "close":
                return
            event = self._apply(ledger, fault, ignored_xids)
            if event is not None:
                log.warning("gpu health changed", gpu=event.uuid, mig=event.mig_uuid,
                            healthy=event.healthy, reason=event.reason, backend=self.name)
                on_event(event)

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._faults.put(_Fault("close"))

    # -- fault injection -------------------------------------------------------------------
    def inject_xid(self, uuid: str, xid: int, mig_uuid: str | None = None) -> None:
        self._check(uuid, mig_uuid)
        self._faults.put(_Fault("xid", uuid, mig_uuid, xid))

    def lose_gpu(self, uuid: str) -> None:
        self._check(uuid, None)
        self._faults.put(_Fault("lost", uuid))

    def recover(self, uuid: str, mig_uuid: str | None = None) -> None:
        self._check(uuid, mig_uuid)
        self._faults.put(_Fault("recover", uuid, mig_uuid))

    def fail_discover(self, times: int = 1, message: str = "NVML: Unknown Error") -> None:
        """Make the next ``times`` calls of ``discover()`` raise ``BackendError(message)``."""
        with self._lock:
            self._discover_failures.extend([message] * times)

    def _check(self, uuid: str, mig_uuid: str | None) -> None:
        """Refuse faults on devices that do not exist: a typo in a test must not pass silently."""
        with self._lock:
            gpu = next((g for g in self._gpus if g.uuid == uuid), None)
        if gpu is None:
            raise KeyError(f"no simulated GPU {uuid}")
        migs = self.mig_nvml.discovered(uuid) if uuid in self.mig_nvml.gpus() else gpu.mig
        if mig_uuid is not None and all(m.uuid != mig_uuid for m in migs):
            raise KeyError(f"GPU {uuid} has no MIG instance {mig_uuid}")

    @staticmethod
    def _apply(ledger: health.HealthLedger, fault: _Fault,
               ignored_xids: frozenset[int]) -> HealthEvent | None:
        if fault.kind == "xid":
            assert fault.xid is not None
            if not health.is_critical(fault.xid, ignored_xids):
                log.info("xid ignored (application error)", gpu=fault.uuid, xid=fault.xid)
                return None
            return ledger.mark_unhealthy(fault.uuid, f"xid {fault.xid}", fault.xid, fault.mig_uuid)
        if fault.kind == "lost":
            return ledger.mark_unhealthy(fault.uuid, LOST_REASON)
        return ledger.mark_healthy(fault.uuid, health.RECOVERED_REASON, fault.mig_uuid)
