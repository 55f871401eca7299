"""Dynamic MIG without a GPU: the calls of :class:`deviceplugin.mig_nvml.NvmlMig`, answered from the tables.

The simulated backend's MIG GPUs get GPU and compute instances made and destroyed here, so the demo and
the integration tests run the device plugin's real dynamic-MIG path (:mod:`deviceplugin.mig_dynamic`)
unchanged. Profiles and placements are :mod:`vramshare.mig`'s (NVIDIA's MIG user guide, "Supported MIG
Profiles": A100 40/80 GB, H100 80 GB, H200 141 GB). Refusals are those the driver gives, named by
pynvml's exception class as :class:`~deviceplugin.mig_nvml.MigNvmlError` carries them from the NVML
backend: ``NVMLError_InvalidArgument`` for a start the profile lacks, ``NVMLError_InsufficientResources``
for a placement that overlaps or a limit reached, ``NVMLError_InUse`` for removing a GPU instance that
still has its compute instance or a compute instance with processes, ``NVMLError_NotFound`` for an id
that is gone. Faults come in through :meth:`fail_next`; processes through :meth:`set_busy`.

Never on a production path: it backs ``SimulatedBackend`` only.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Sequence

from deviceplugin.backend import DiscoveredMig
from deviceplugin.inventory_file import derived_mig_uuid
from deviceplugin.mig_nvml import GpuInstance, MigNvmlError, ProfileInfo
from vramshare import mig


@dataclass
class _Instance:
    gi: int
    profile: mig.MigProfile
    start: int
    ci: int | None = None
    uuid: str | None = None
    busy: bool = False
    memory_mib: int = 0  # what the MIG device reports (the file's figure for the instances it lists)


class _Gpu:
    def __init__(self, uuid: str, table: mig.MigModel) -> None:
        self.uuid = uuid
        self.table = table
        self.instances: dict[int, _Instance] = {}
        self.made = 0  # instances ever made: new MIG UUIDs never repeat an old one

    def placed(self) -> list[mig.Placed]:
        return [mig.Placed(i.start, i.profile.name) for i in self.instances.values()]


class SimulatedMig:
    """An :class:`~deviceplugin.mig_nvml.NvmlMig` look-alike over per-GPU tables; handles are GPU UUIDs."""

    def __init__(self) -> None:
        self._gpus: dict[str, _Gpu] = {}
        self._lock = threading.Lock()
        self._faults: dict[str, list[str]] = {}
        self.calls: list[str] = []  # every changing call, in order (tests read it)

    # -- set-up (the backend) ----------------------------------------------------------------
    def add_gpu(self, uuid: str, table: mig.MigModel, existing: Sequence[DiscoveredMig]) -> list[DiscoveredMig] | None:
        """Take over a GPU the inventory file cut into ``existing`` (profiles in the file's order); the
        same instances with their placements, or ``None`` (the GPU stays static) when they cannot sit on
        one GPU of ``table`` together."""
        if any(m.profile not in table.names for m in existing):
            return None
        layout = mig.fit_layout(table, [m.profile for m in existing])
        if layout is None:
            return None
        gpu = _Gpu(uuid, table)
        starts: dict[str, list[int]] = {}
        for p in layout:
            starts.setdefault(p.profile, []).append(p.start)
        out = []
        for n, m in enumerate(existing):
            start = starts[m.profile].pop(0)
            gi = m.gi if m.gi is not None and m.gi not in gpu.instances else n + 1
            gpu.instances[gi] = _Instance(gi, table.profile(m.profile), start, m.ci if m.ci is not None else 0, m.uuid,
                                          memory_mib=m.memory_mib)
            out.append(DiscoveredMig(m.uuid, m.profile, m.memory_mib, gi, m.ci, start))
        gpu.made = len(existing)
        with self._lock:
            self._gpus[uuid] = gpu
        return out

    def discovered(self, uuid: str) -> tuple[DiscoveredMig, ...]:
        """The GPU's MIG devices as the backend reports them (GI + CI pairs only, by start)."""
        with self._lock:
            gpu = self._gpus[uuid]
            return tuple(DiscoveredMig(i.uuid, i.profile.name, i.memory_mib or i.profile.memory_mib, i.gi, i.ci,
                                       i.start)
                         for i in sorted(gpu.instances.values(), key=lambda i: i.gi)
                         if i.ci is not None and i.uuid)

    def gpus(self) -> list[str]:
        with self._lock:
            return sorted(self._gpus)

    def layout(self, uuid: str) -> list[mig.Placed]:
        with self._lock:
            return sorted(self._gpus[uuid].placed())

    # -- faults ------------------------------------------------------------------------------
    def fail_next(self, function: str, error: str = "NVMLError_Unknown") -> None:
        """The next call of ``function`` (``create``, ``create_ci``, ``destroy``) fails with ``error``."""
        with self._lock:
            self._faults.setdefault(function, []).append(error)

    def set_busy(self, mig_uuid: str, busy: bool = True) -> None:
        """Processes run (or no longer run) on a MIG device."""
        with self._lock:
            for gpu in self._gpus.values():
                for inst in gpu.instances.values():
                    if inst.uuid == mig_uuid:
                        inst.busy = busy
                        return
        raise KeyError(f"no simulated MIG device {mig_uuid}")

    def _fault(self, function: str, what: str) -> None:
        queue = self._faults.get(function)
        if queue:
            error = queue.pop(0)
            raise MigNvmlError(f"NVML {function} ({what}): injected {error}", error)

    # -- NvmlMig -----------------------------------------------------------------------------
    def profiles(self, handle: Any, total_mib: int) -> list[ProfileInfo]:
        with self._lock:
            table = self._gpu(handle).table
        return [ProfileInfo(p.nvml_index, p.profile_id, p.name, p.compute_slices, p.max_count, p.memory_mib,
                            tuple((s, p.memory_slots) for s in p.starts)) for p in table.profiles]

    def instances(self, handle: Any, profiles: list[ProfileInfo]) -> list[GpuInstance]:
        with self._lock:
            gpu = self._gpu(handle)
            return [GpuInstance(i.gi, i.profile.profile_id, i.start, i.profile.memory_slots,
                                (i.ci,) if i.ci is not None else (), i.uuid if i.ci is not None else None, i.busy)
                    for i in sorted(gpu.instances.values(), key=lambda i: i.gi)]

    def create(self, handle: Any, profile: ProfileInfo, start: int) -> int:
        with self._lock:
            gpu = self._gpu(handle)
            what = f"{profile.name}@{start}"
            self._fault("create", what)
            p = gpu.table.profile(profile.name)
            if start not in p.starts:
                raise MigNvmlError(f"NVML nvmlDeviceCreateGpuInstanceWithPlacement ({what}): Invalid Argument",
                                   "NVMLError_InvalidArgument")
            if start not in mig.free_starts(gpu.table, gpu.placed(), p.name):
                raise MigNvmlError(f"NVML nvmlDeviceCreateGpuInstanceWithPlacement ({what}): Insufficient "
                                   "Resources", "NVMLError_InsufficientResources")
            gi = next(n for n in range(1, 64) if n not in gpu.instances)  # lowest free id, as the driver
            gpu.instances[gi] = _Instance(gi, p, start)
            self.calls.append(f"create {gpu.uuid} {what} gi={gi}")
            return gi

    def create_ci(self, handle: Any, gi_id: int, slices: int) -> int:
        with self._lock:
            gpu = self._gpu(handle)
            self._fault("create_ci", f"GI {gi_id}")
            inst = self._instance(gpu, gi_id)
            if inst.ci is not None:
                raise MigNvmlError(f"NVML nvmlGpuInstanceCreateComputeInstance (GI {gi_id}): Insufficient "
                                   "Resources", "NVMLError_InsufficientResources")
            gpu.made += 1
            inst.ci = 0
            inst.uuid = derived_mig_uuid(gpu.uuid, 1000 + gpu.made, inst.profile.name)
            self.calls.append(f"create_ci {gpu.uuid} gi={gi_id}")
            return 0

    def destroy(self, handle: Any, gi_id: int, slices: int) -> None:
        with self._lock:
            gpu = self._gpu(handle)
            self._fault("destroy", f"GI {gi_id}")
            inst = self._instance(gpu, gi_id)
            if inst.busy:
                raise MigNvmlError(f"NVML nvmlComputeInstanceDestroy (GI {gi_id}): In use by another client",
                                   "NVMLError_InUse")
            del gpu.instances[gi_id]
            self.calls.append(f"destroy {gpu.uuid} gi={gi_id}")

    def _gpu(self, handle: Any) -> _Gpu:
        gpu = self._gpus.get(str(handle))
        if gpu is None:
            raise MigNvmlError(f"NVML: GPU {handle} is not in MIG mode here", "NVMLError_NotSupported")
        return gpu

    @staticmethod
    def _instance(gpu: _Gpu, gi_id: int) -> _Instance:
        inst = gpu.instances.get(gi_id)
        if inst is None:
            raise MigNvmlError(f"NVML nvmlDeviceGetGpuInstanceById (GI {gi_id}): Not Found", "NVMLError_NotFound")
        return inst

