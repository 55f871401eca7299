"""The real GPU backend: NVML through ``nvidia-ml-py`` (module ``pynvml``), read-only.

The ``nvml`` module object is injected (``NvmlBackend(nvml=pynvml)``), so tests pass a fake module
that raises pynvml's own exception classes; nothing here imports ``pynvml`` at module load. Every
NVML failure is counted (``errors``) for ``vramshare_nvml_errors_total`` and turned into a
:class:`BackendError` whose one line says which GPU and which read failed. Health watching lives in
:mod:`deviceplugin.nvml_health`.
"""
from __future__ import annotations

import importlib
import threading
import time
from collections import Counter
from typing import Any, Callable

from deviceplugin import migprofile, nvml_health, sysfs
from deviceplugin.backend import BackendError, DiscoveredGpu, DiscoveredMig, HealthCallback
from vramshare import config, logs

log = logs.get(__name__)

MIB = 1024 * 1024
NO_DRIVER = ("NVML: no NVIDIA driver found (libnvidia-ml.so.1 not loadable); "
             "run on a GPU node with the NVIDIA driver or use --backend simulated")
_INIT_HINTS = {
    "NVMLError_LibraryNotFound": NO_DRIVER,
    "NVMLError_DriverNotLoaded": "NVML: the NVIDIA kernel driver is not loaded; run on a GPU node with "
                                 "the NVIDIA driver or use --backend simulated",
    "NVMLError_NoPermission": "NVML: no permission to open /dev/nvidia*; run the device plugin with "
                              "the NVIDIA container runtime (runtimeClassName: nvidia)",
    "NVMLError_LibRmVersionMismatch": "NVML: libnvidia-ml.so does not match the loaded kernel driver; "
                                      "reboot the node or reinstall the driver",
}
# memory v2 (with driver-reserved memory) is missing on old drivers: read v1 and call reserved 0
_V1_FALLBACK = ("NVMLError_FunctionNotFound", "NVMLError_NotSupported", "NVMLError_ArgumentVersionMismatch")
ErrorHook = Callable[[str, str], None]  # (NVML function, error class name)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class NvmlBackend:
    """Implements :class:`deviceplugin.backend.GpuBackend` over NVML.

    NVML is initialised lazily by the first ``discover()``/``watch_health()`` and a failed init is
    retried on the next call: the driver container of the GPU operator often starts after us.
    """

    name = "nvml"

    def __init__(self, nvml: Any = None, sysfs_root: str = sysfs.DEFAULT_ROOT, *,
                 probe_seconds: float = 30.0, probes_to_recover: int = 3,
                 on_nvml_error: ErrorHook | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        # the one place the real module is loaded; it imports fine without a GPU or driver
        self.nvml = nvml if nvml is not None else importlib.import_module("pynvml")
        self.sysfs_root = sysfs_root
        self.probe_seconds = probe_seconds
        self.probes_to_recover = probes_to_recover
        self.clock = clock
        self.errors: Counter[tuple[str, str]] = Counter()  # (function, error class) -> count
        self._on_nvml_error = on_nvml_error
        self._lock = threading.RLock()
        self._initialized = False

    @classmethod
    def from_config(cls, health: config.HealthConfig, **kwargs: Any) -> "NvmlBackend":
        """A backend probing at the cadence of the config's ``health`` section."""
        return cls(probe_seconds=health.recovery_probe_seconds, probes_to_recover=health.probes_to_recover,
                   **kwargs)

    # -- NVML calls, counted -----------------------------------------------------------------
    def call(self, function: str, *args: Any, **kwargs: Any) -> Any:
        """Call ``nvml.<function>``; count and re-raise any NVML error (Timeout from a wait is not one)."""
        try:
            return getattr(self.nvml, function)(*args, **kwargs)
        except self.nvml.NVMLError as exc:
            if not (function == "nvmlEventSetWait" and isinstance(exc, self.nvml.NVMLError_Timeout)):
                self._count(function, exc)
            raise

    def _count(self, function: str, exc: BaseException) -> None:
        kind = type(exc).__name__
        with self._lock:
            self.errors[(function, kind)] += 1
        if self._on_nvml_error is not None:
            self._on_nvml_error(function, kind)

    @property
    def errors_total(self) -> int:
        with self._lock:
            return sum(self.errors.values())

    def is_error(self, exc: BaseException, *names: str) -> bool:
        return any(isinstance(exc, getattr(self.nvml, n)) for n in names if hasattr(self.nvml, n))

    # -- lifecycle ---------------------------------------------------------------------------
    def _ensure_init(self) -> None:
        with self._lock:
            if self._initialized:
                return
            try:
                self.call("nvmlInit")
            except self.nvml.NVMLError as exc:
                hint = _INIT_HINTS.get(type(exc).__name__, f"NVML: init failed: {_text(exc)}")
                raise BackendError(hint) from exc
            except OSError as exc:  # a broken library file rather than a missing one
                raise BackendError(f"{NO_DRIVER} ({exc})") from exc
            self._initialized = True
            log.info("nvml initialised", driver=self._driver_version())

    def _driver_version(self) -> str:
        try:
            return _text(self.call("nvmlSystemGetDriverVersion"))
        except self.nvml.NVMLError:
            return "unknown"

    def close(self) -> None:
        with self._lock:
            if not self._initialized:
                return
            self._initialized = False
            try:
                self.call("nvmlShutdown")
            except self.nvml.NVMLError as exc:
                log.warning("nvml shutdown failed", error=_text(exc))

    # -- discovery ---------------------------------------------------------------------------
    def discover(self) -> list[DiscoveredGpu]:
        return [gpu for gpu, _ in self.devices()]

    def devices(self) -> list[tuple[DiscoveredGpu, Any]]:
        """Every GPU with its NVML handle (the health watcher registers events on the handles)."""
        self._ensure_init()
        try:
            count = self.call("nvmlDeviceGetCount")
        except self.nvml.NVMLError as exc:
            raise BackendError(f"NVML: cannot count GPUs: {_text(exc)}") from exc
        return [self._read_gpu(i) for i in range(count)]

    def _read_gpu(self, index: int) -> tuple[DiscoveredGpu, Any]:
        what, uuid = "handle", "?"
        try:
            handle = self.call("nvmlDeviceGetHandleByIndex", index)
            what = "uuid"
            uuid = _text(self.call("nvmlDeviceGetUUID", handle))
            what = "name"
            model = _text(self.call("nvmlDeviceGetName", handle))
            what = "memory"
            total, reserved = self._memory(handle)
            what = "PCI info"
            bus_id = _text(self.call("nvmlDeviceGetPciInfo", handle).busId)
            what = "MIG mode"
            mig_enabled = self._mig_enabled(handle)
            what = "MIG devices"
            migs = self._read_migs(handle, total) if mig_enabled else ()
        except self.nvml.NVMLError as exc:
            raise BackendError(f"NVML: GPU {index} ({uuid}): reading {what} failed: {_text(exc)}") from exc
        try:
            numa = sysfs.numa_node(bus_id, self.sysfs_root)
        except sysfs.SysfsError as exc:
            log.warning("numa node unreadable; reporting none", gpu=uuid, error=str(exc))
            numa = None
        gpu = DiscoveredGpu(index=index, uuid=uuid, model=model, memory_mib=total // MIB,
                            reserved_mib=reserved // MIB, numa_node=numa, pci_bus_id=bus_id,
                            mig_enabled=mig_enabled, mig=migs)
        return gpu, handle

    def _memory(self, handle: Any) -> tuple[int, int]:
        """(total, reserved) bytes: memory v2 knows the driver-reserved part; v1 on old drivers."""
        v2 = getattr(self.nvml, "nvmlMemory_v2", None)
        if v2 is not None:
            try:
                info = self.call("nvmlDeviceGetMemoryInfo", handle, version=v2)
                return int(info.total), int(info.reserved)
            except self.nvml.NVMLError as exc:
                if not self.is_error(exc, *_V1_FALLBACK):
                    raise
        info = self.call("nvmlDeviceGetMemoryInfo", handle)
        return int(info.total), 0

    def _mig_enabled(self, handle: Any) -> bool:
        try:
            current, _pending = self.call("nvmlDeviceGetMigMode", handle)
        except self.nvml.NVMLError as exc:
            if self.is_error(exc, "NVMLError_NotSupported", "NVMLError_FunctionNotFound"):
                return False  # not a MIG-capable GPU
            raise
        return bool(current == self.nvml.NVML_DEVICE_MIG_ENABLE)

    def _read_migs(self, handle: Any, total: int) -> tuple[DiscoveredMig, ...]:
        migs = []
        for slot in range(self.call("nvmlDeviceGetMaxMigDeviceCount", handle)):
            try:
                mig = self.call("nvmlDeviceGetMigDeviceHandleByIndex", handle, slot)
            except self.nvml.NVMLError as exc:
                if self.is_error(exc, "NVMLError_NotFound", "NVMLError_InvalidArgument"):
                    continue  # an empty slot: instances need not be contiguous
                raise
            gi = int(self.call("nvmlDeviceGetGpuInstanceId", mig))
            migs.append(DiscoveredMig(
                uuid=_text(self.call("nvmlDeviceGetUUID", mig)),
                profile=self._mig_profile(handle, mig, gi, total),
                memory_mib=int(self.call("nvmlDeviceGetMemoryInfo", mig).total) // MIB,
                gi=gi, ci=int(self.call("nvmlDeviceGetComputeInstanceId", mig)),
                start=self._mig_start(handle, gi),
            ))
        return tuple(migs)

    def _mig_start(self, parent: Any, gi: int) -> int | None:
        """The GPU instance's placement start (dynamic MIG needs it); None when it cannot be read."""
        try:
            info = self.call("nvmlGpuInstanceGetInfo", self.call("nvmlDeviceGetGpuInstanceById", parent, gi))
            return int(info.placement.start)
        except (self.nvml.NVMLError, AttributeError) as exc:
            log.debug("mig placement unreadable; dynamic MIG stays off for this GPU", gi=gi, error=str(exc))
            return None

    # -- dynamic MIG (issue 24) -------------------------------------------------------------------
    @property
    def mig_nvml(self) -> Any:
        """The dynamic-MIG calls over this backend's NVML (errors counted like every other call)."""
        from deviceplugin.mig_nvml import NvmlMig
        return NvmlMig(self.nvml, self.call)

    def dynamic_mig_gpus(self) -> dict[str, tuple[Any, str, int]]:
        """GPU UUID -> (handle, NVML name, MiB) of every GPU in MIG mode (DynamicMig's ``gpus``)."""
        return {g.uuid: (h, g.model, g.memory_mib) for g, h in self.devices() if g.mig_enabled}

    def _mig_profile(self, parent: Any, mig: Any, gi: int, total: int) -> str:
        """The GI profile's name (``MIG 3g.40gb``); built from its slices and memory if it has none.

        Reading the GI needs more privilege than reading the MIG device, so when it fails the
        device's own attributes (slice count, memory) name the profile the same way.
        """
        try:
            profile_id = self.call("nvmlGpuInstanceGetInfo",
                                   self.call("nvmlDeviceGetGpuInstanceById", parent, gi)).profileId
            for p in range(self.nvml.NVML_GPU_INSTANCE_PROFILE_COUNT):
                try:
                    info = self.call("nvmlDeviceGetGpuInstanceProfileInfo", parent, p)
                except self.nvml.NVMLError:
                    continue  # profile not offered by this GPU
                if info.id == profile_id:
                    name = migprofile.strip_prefix(_text(getattr(info, "name", "")))
                    if migprofile.is_profile(name):
                        return name
                    return migprofile.profile_name(info.sliceCount, info.memorySizeMB, total)
        except self.nvml.NVMLError as exc:
            log.debug("mig profile info unreadable; using device attributes", gi=gi, error=_text(exc))
        attrs = self.call("nvmlDeviceGetAttributes", mig)
        return migprofile.profile_name(attrs.gpuInstanceSliceCount, attrs.memorySizeMB, total)

    # -- health ------------------------------------------------------------------------------
    def watch_health(self, stop: threading.Event, on_event: HealthCallback,
                     ignored_xids: frozenset[int]) -> None:
        """Watch Xid events and probe unhealthy GPUs until ``stop`` (see :mod:`nvml_health`)."""
        nvml_health.XidWatcher(self, on_event, ignored_xids).run(stop)
