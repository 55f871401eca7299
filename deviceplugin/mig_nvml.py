"""Dynamic MIG through NVML: read a GPU's profiles and placements, list, create and destroy instances.

The calls and their order are those of NVIDIA's own tools (go-nvlib's ``pkg/nvlib/device/mig_device.go``
and ``nvidia-smi mig -cgi/-cci/-dci/-dgi``): profile info per ``NVML_GPU_INSTANCE_PROFILE_*`` index
(``NotSupported``/``InvalidArgument`` for profiles the card lacks), possible placements with the
count-then-fill pattern, ``nvmlDeviceGetGpuInstances`` per profile to see GPU instances even when they
have no compute instance yet (a crash between the two creates leaves exactly that),
``nvmlDeviceCreateGpuInstanceWithPlacement`` then ``nvmlGpuInstanceCreateComputeInstance`` with the
full-slice compute profile, and for removal compute instances first (NVML refuses to destroy a GPU
instance that still has one: ``InUse``). Nothing here enables or disables MIG mode.

The ``nvml`` module is injected (pynvml, or the tests' fake that raises pynvml's own exceptions).
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any, Callable

from deviceplugin import migprofile

#: Compute-instance profile index for a GPU instance of N slices (NVML_COMPUTE_INSTANCE_PROFILE_*).
_CI_PROFILE = {1: 0x0, 2: 0x1, 3: 0x2, 4: 0x3, 7: 0x4, 8: 0x5, 6: 0x6}
MAX_INSTANCES = 8  # GPU instances one GPU can hold (7 on A100/H100/H200, 8 leaves room)


@dataclass(frozen=True)
class ProfileInfo:
    """One GPU-instance profile as this GPU's driver reports it."""

    index: int          # NVML_GPU_INSTANCE_PROFILE_*
    profile_id: int     # info.id
    name: str           # "3g.40gb"
    slices: int
    instance_count: int
    memory_mib: int
    placements: tuple[tuple[int, int], ...]  # (start, size) in memory slots


@dataclass(frozen=True)
class GpuInstance:
    """A GPU instance that exists, with its compute instances and MIG device."""

    gi: int
    profile_id: int
    start: int
    size: int
    cis: tuple[int, ...] = ()
    mig_uuid: str | None = None
    busy: bool = False  # processes run on it


class MigNvmlError(RuntimeError):
    """An NVML call of the dynamic-MIG path failed; the message says which and why, in one line."""

    def __init__(self, message: str, nvml_error: str = "") -> None:
        super().__init__(message)
        self.nvml_error = nvml_error


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class NvmlMig:
    """The NVML calls; ``call`` is :meth:`NvmlBackend.call` (counted errors) or ``getattr`` of the module."""

    def __init__(self, nvml: Any, call: Callable[..., Any] | None = None) -> None:
        self.nvml = nvml
        self._call = call if call is not None else (lambda fn, *a, **k: getattr(nvml, fn)(*a, **k))

    def call(self, function: str, *args: Any, what: str = "") -> Any:
        try:
            return self._call(function, *args)
        except self.nvml.NVMLError as exc:
            raise MigNvmlError(f"NVML {function}{' (' + what + ')' if what else ''}: {_text(exc)}",
                               type(exc).__name__) from exc

    def _missing(self, exc: BaseException) -> bool:
        return any(isinstance(exc, getattr(self.nvml, n)) for n in
                   ("NVMLError_NotSupported", "NVMLError_InvalidArgument", "NVMLError_NotFound")
                   if hasattr(self.nvml, n))

    # -- reading ----------------------------------------------------------------------------
    def profiles(self, handle: Any, total_mib: int) -> list[ProfileInfo]:
        """Every GPU-instance profile this GPU offers, with its possible placements."""
        out = []
        for index in range(int(self.nvml.NVML_GPU_INSTANCE_PROFILE_COUNT)):
            try:
                info = self._call("nvmlDeviceGetGpuInstanceProfileInfo", handle, index)
            except self.nvml.NVMLError as exc:
                if self._missing(exc):
                    continue
                raise MigNvmlError(f"NVML nvmlDeviceGetGpuInstanceProfileInfo({index}): {_text(exc)}",
                                   type(exc).__name__) from exc
            name = migprofile.strip_prefix(_text(getattr(info, "name", "")))
            if not migprofile.is_profile(name):
                name = migprofile.profile_name(int(info.sliceCount), int(info.memorySizeMB), total_mib << 20)
            out.append(ProfileInfo(index, int(info.id), name, int(info.sliceCount),
                                   int(getattr(info, "instanceCount", 0)), int(info.memorySizeMB),
                                   self.placements(handle, int(info.id))))
        return out

    def placements(self, handle: Any, profile_id: int) -> tuple[tuple[int, int], ...]:
        count = ctypes.c_uint(0)
        self.call("nvmlDeviceGetGpuInstancePossiblePlacements", handle, profile_id, None, ctypes.byref(count),
                  what=f"profile {profile_id}, count")
        if count.value == 0:
            return ()
        array = (self.nvml.c_nvmlGpuInstancePlacement_t * count.value)()
        self.call("nvmlDeviceGetGpuInstancePossiblePlacements", handle, profile_id, array, ctypes.byref(count),
                  what=f"profile {profile_id}")
        return tuple((int(array[i].start), int(array[i].size)) for i in range(count.value))

    def instances(self, handle: Any, profiles: list[ProfileInfo]) -> list[GpuInstance]:
        """Every GPU instance on the GPU (with or without compute instances), by profile."""
        out = []
        for p in profiles:
            count = ctypes.c_uint(0)
            array = (self.nvml.c_nvmlGpuInstance_t * MAX_INSTANCES)()
            self.call("nvmlDeviceGetGpuInstances", handle, p.profile_id, array, ctypes.byref(count),
                      what=f"profile {p.name}")
            for i in range(count.value):
                gi = array[i]
                info = self.call("nvmlGpuInstanceGetInfo", gi)
                cis = self._compute_instances(gi, p.slices)
                out.append(GpuInstance(int(info.id), int(info.profileId), int(info.placement.start),
                                       int(info.placement.size), tuple(cis)))
        return self._with_devices(handle, out)

    def _compute_instances(self, gi: Any, slices: int) -> list[int]:
        ci_profile = self.call("nvmlGpuInstanceGetComputeInstanceProfileInfo", gi, _CI_PROFILE.get(slices, 0),
                               self.nvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
        count = ctypes.c_uint(0)
        array = (self.nvml.c_nvmlComputeInstance_t * MAX_INSTANCES)()
        self.call("nvmlGpuInstanceGetComputeInstances", gi, int(ci_profile.id), array, ctypes.byref(count))
        return [int(self.call("nvmlComputeInstanceGetInfo", array[i]).id) for i in range(count.value)]

    def _with_devices(self, handle: Any, instances: list[GpuInstance]) -> list[GpuInstance]:
        """Attach each instance's MIG device UUID and whether processes run on it."""
        devices: dict[tuple[int, int], tuple[str, bool]] = {}
        for slot in range(int(self.call("nvmlDeviceGetMaxMigDeviceCount", handle))):
            try:
                mig = self._call("nvmlDeviceGetMigDeviceHandleByIndex", handle, slot)
            except self.nvml.NVMLError as exc:
                if self._missing(exc):
                    continue
                raise MigNvmlError(f"NVML nvmlDeviceGetMigDeviceHandleByIndex({slot}): {_text(exc)}",
                                   type(exc).__name__) from exc
            key = (int(self.call("nvmlDeviceGetGpuInstanceId", mig)), int(self.call("nvmlDeviceGetComputeInstanceId", mig)))
            busy = bool(self.call("nvmlDeviceGetComputeRunningProcesses", mig))
            devices[key] = (_text(self.call("nvmlDeviceGetUUID", mig)), busy)
        out = []
        for inst in instances:
            uuid, busy = next((devices[(inst.gi, ci)] for ci in inst.cis if (inst.gi, ci) in devices), (None, False))
            out.append(GpuInstance(inst.gi, inst.profile_id, inst.start, inst.size, inst.cis, uuid, busy))
        return out

    # -- changing ---------------------------------------------------------------------------
    def create(self, handle: Any, profile: ProfileInfo, start: int) -> int:
        """A GPU instance of ``profile`` at ``start``; its GI id."""
        placement = self.nvml.c_nvmlGpuInstancePlacement_t()
        placement.start = start
        placement.size = next((size for s, size in profile.placements if s == start), 0)
        gi = self.call("nvmlDeviceCreateGpuInstanceWithPlacement", handle, profile.profile_id,
                       ctypes.byref(placement), what=f"{profile.name}@{start}")
        return int(self.call("nvmlGpuInstanceGetInfo", gi).id)

    def _full_ci(self, handle: Any, gi_id: int, slices: int) -> tuple[Any, int]:
        """GPU instance ``gi_id``'s handle and the ID of its full-slice compute-instance profile."""
        gi = self.call("nvmlDeviceGetGpuInstanceById", handle, gi_id, what=f"GI {gi_id}")
        ci_profile = self.call("nvmlGpuInstanceGetComputeInstanceProfileInfo", gi, _CI_PROFILE.get(slices, 0),
                               self.nvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
        return gi, int(ci_profile.id)

    def create_ci(self, handle: Any, gi_id: int, slices: int) -> int:
        """The full-slice compute instance of GPU instance ``gi_id``; its CI id."""
        gi, profile_id = self._full_ci(handle, gi_id, slices)
        ci = self.call("nvmlGpuInstanceCreateComputeInstance", gi, profile_id, what=f"GI {gi_id}")
        return int(self.call("nvmlComputeInstanceGetInfo", ci).id)

    def destroy(self, handle: Any, gi_id: int, slices: int) -> None:
        """Compute instances first, then the GPU instance (NVML refuses the other order)."""
        gi, profile_id = self._full_ci(handle, gi_id, slices)
        count = ctypes.c_uint(0)
        array = (self.nvml.c_nvmlComputeInstance_t * MAX_INSTANCES)()
        self.call("nvmlGpuInstanceGetComputeInstances", gi, profile_id, array, ctypes.byref(count))
        for i in range(count.value):
            self.call("nvmlComputeInstanceDestroy", array[i], what=f"GI {gi_id}")
        self.call("nvmlGpuInstanceDestroy", gi, what=f"GI {gi_id}")
