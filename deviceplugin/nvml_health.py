"""NVML health: Xid events on a thread, and a probe that brings recovered GPUs back.

As NVIDIA's plugin does (``internal/rm/health.go``): one event set, each GPU registered for
``XidCritical | DoubleBitEcc`` masked by what it supports, ``nvmlEventSetWait(5000)``, a Timeout means
nothing happened, only Xid events act, application Xids are ignored, a MIG GPU's event is matched to
the MIG device by GI/CI, and a failed wait marks every GPU unhealthy. Unlike it, every
``probe_seconds`` the watcher reads each device (memory info + UUID by UUID): a healthy GPU that is
lost turns unhealthy, and an unhealthy one that answers ``probes_to_recover`` times in a row is
reported healthy again (NVIDIA/k8s-device-plugin#189, HAMi#2200: devices that never come back).
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Protocol

from deviceplugin import health
from deviceplugin.backend import DiscoveredGpu, HealthCallback, HealthEvent
from vramshare import logs


class NvmlSession(Protocol):
    """What the watcher needs of the NVML backend (``NvmlBackend`` is one); a Protocol keeps the two
    modules from importing each other."""

    nvml: Any
    probe_seconds: float
    probes_to_recover: int
    clock: Callable[[], float]

    def call(self, function: str, *args: Any, **kwargs: Any) -> Any: ...
    def is_error(self, exc: BaseException, *names: str) -> bool: ...
    def devices(self) -> list[tuple[DiscoveredGpu, Any]]: ...

log = logs.get(__name__)

WAIT_MS = 5000
NO_INSTANCE = 0xFFFFFFFF  # GI/CI of an event that concerns the whole GPU
_LOST = ("NVMLError_GpuIsLost", "NVMLError_ResetRequired")


class XidWatcher:
    """One run of ``watch_health``: owns the event set and the health ledger until ``stop``."""

    def __init__(self, backend: NvmlSession, on_event: HealthCallback,
                 ignored_xids: frozenset[int]) -> None:
        self.backend = backend
        self.nvml = backend.nvml
        self.on_event = on_event
        self.ignored = ignored_xids
        self.ledger = health.HealthLedger(probes_to_recover=backend.probes_to_recover)
        self.gpus: dict[str, tuple[DiscoveredGpu, Any]] = {}
        self.event_set: Any = None

    def run(self, stop: threading.Event) -> None:
        self.gpus = {gpu.uuid: (gpu, handle) for gpu, handle in self.backend.devices()}
        event_set = self.backend.call("nvmlEventSetCreate")
        try:
            self._register(event_set)
            next_probe = self.backend.clock() + self.backend.probe_seconds
            while not stop.is_set():
                self._wait_once(event_set)
                if stop.is_set():
                    break
                if self.backend.clock() >= next_probe:
                    self._probe()
                    next_probe = self.backend.clock() + self.backend.probe_seconds
        finally:
            try:
                self.backend.call("nvmlEventSetFree", event_set)
            except self.nvml.NVMLError as exc:
                log.warning("nvml event set free failed", error=str(exc))

    def _register(self, event_set: Any) -> None:
        self.event_set = event_set
        for uuid in self.gpus:
            self._register_one(uuid)

    def _register_one(self, uuid: str) -> None:
        wanted = self.nvml.nvmlEventTypeXidCriticalError | self.nvml.nvmlEventTypeDoubleBitEccError
        handle = self.gpus[uuid][1]
        try:
            mask = wanted & int(self.backend.call("nvmlDeviceGetSupportedEventTypes", handle))
            if not mask:
                log.warning("gpu supports no Xid events; health checks off for it", gpu=uuid)
                return
            self.backend.call("nvmlDeviceRegisterEvents", handle, mask, self.event_set)
        except self.nvml.NVMLError as exc:
            if self.backend.is_error(exc, *_LOST):
                self._emit(self.ledger.mark_unhealthy(uuid, f"nvml: {exc}"))
            else:
                log.warning("cannot watch gpu events; health checks off for it", gpu=uuid, error=str(exc))

    def _wait_once(self, event_set: Any) -> None:
        try:
            data = self.backend.call("nvmlEventSetWait", event_set, WAIT_MS)
        except self.nvml.NVMLError_Timeout:
            return
        except self.nvml.NVMLError as exc:
            log.warning("nvml event wait failed; marking every gpu unhealthy", error=str(exc))
            self._all_unhealthy(f"nvml: event wait failed: {exc}")
            return
        if int(data.eventType) != self.nvml.nvmlEventTypeXidCriticalError:
            log.info("non-Xid nvml event skipped", event_type=hex(int(data.eventType)))
            return
        xid = int(data.eventData)
        try:
            uuid = str(self.backend.call("nvmlDeviceGetUUID", data.device))
        except self.nvml.NVMLError as exc:
            log.warning("xid on a gpu nvml cannot name; marking every gpu unhealthy", xid=xid, error=str(exc))
            if health.is_critical(xid, self.ignored):
                self._all_unhealthy(f"xid {xid}")
            return
        if not health.is_critical(xid, self.ignored):
            log.info("xid ignored (application error)", gpu=uuid, xid=xid)
            return
        if uuid not in self.gpus:
            log.warning("xid on a gpu discovered after the watch began", gpu=uuid, xid=xid)
            return
        matched, mig_uuid = self._mig_of(uuid, int(data.gpuInstanceId), int(data.computeInstanceId))
        if not matched:
            log.warning("xid on a MIG instance we do not know; ignored", gpu=uuid, xid=xid,
                        gi=int(data.gpuInstanceId), ci=int(data.computeInstanceId))
            return
        log.warning("gpu unhealthy", gpu=uuid, mig=mig_uuid, xid=xid)
        self._emit(self.ledger.mark_unhealthy(uuid, f"xid {xid}", xid, mig_uuid))

    def _mig_of(self, uuid: str, gi: int, ci: int) -> tuple[bool, str | None]:
        """(matched, MIG UUID) for an event's GI/CI; the MIG UUID is ``None`` for the whole GPU."""
        gpu = self.gpus[uuid][0]
        if not gpu.mig_enabled or gi == NO_INSTANCE or ci == NO_INSTANCE:
            return True, None
        mig = next((m.uuid for m in gpu.mig if m.gi == gi and m.ci == ci), None)
        return mig is not None, mig

    def _probe(self) -> None:
        """Read every device once: lost healthy GPUs go unhealthy, answering unhealthy ones recover."""
        unhealthy = set(self.ledger.unhealthy())
        for uuid in self.gpus:
            if (uuid, None) not in unhealthy:
                self._probe_healthy(uuid)
        for uuid, mig_uuid in sorted(unhealthy, key=lambda k: (k[0], k[1] or "")):
            handle = self._answers(mig_uuid or uuid)
            if handle is None:
                self.ledger.probe_failed(uuid, mig_uuid)
                continue
            event = self.ledger.probe_ok(uuid, mig_uuid)
            if event is not None and mig_uuid is None:
                # a reset GPU has a new handle; events registered on the old one never fire
                self.gpus[uuid] = (self.gpus[uuid][0], handle)
                self._register_one(uuid)
            self._emit(event)

    def _probe_healthy(self, uuid: str) -> None:
        try:
            self.backend.call("nvmlDeviceGetMemoryInfo", self.gpus[uuid][1])
        except self.nvml.NVMLError as exc:
            if self.backend.is_error(exc, *_LOST):
                log.warning("gpu unhealthy", gpu=uuid, error=str(exc))
                self._emit(self.ledger.mark_unhealthy(uuid, f"nvml: {exc}"))

    def _answers(self, uuid: str) -> Any:
        """A fresh handle by UUID, memory info, the UUID read back: the handle if all answer, else None."""
        try:
            handle = self.backend.call("nvmlDeviceGetHandleByUUID", uuid)
            self.backend.call("nvmlDeviceGetMemoryInfo", handle)
            if str(self.backend.call("nvmlDeviceGetUUID", handle)) != uuid:
                return None
            return handle
        except self.nvml.NVMLError as exc:
            log.debug("unhealthy device still not answering", gpu=uuid, error=str(exc))
            return None

    def _all_unhealthy(self, reason: str) -> None:
        for uuid in self.gpus:
            self._emit(self.ledger.mark_unhealthy(uuid, reason))

    def _emit(self, event: HealthEvent | None) -> None:
        if event is None:
            return
        if event.healthy:
            log.info("gpu healthy again", gpu=event.uuid, mig=event.mig_uuid, reason=event.reason)
        try:
            self.on_event(event)
        except Exception:  # a broken consumer must not stop health watching
            log.error("health callback failed", exc_info=True, gpu=event.uuid)
