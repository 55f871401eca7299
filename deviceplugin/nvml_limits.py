"""Per-container GPU memory limits through NVML (driver R615+, cgroup v2): the driver-mode fence.

``nvmlDeviceSetMemoryLimits_v1(device, {nameSpace=<cgroup path>, softLimit, hardLimit})`` moves a
container's limits at any time (privileged); ``nvmlDeviceGetMemoryLimits_v1`` reads them back with
``currentUsed``, the container's use on that GPU, which needs no host PID namespace. A container's
cgroup is found from its runtime ID under the cgroup v2 root (systemd driver:
``/kubepods.slice/kubepods-<qos>.slice/kubepods-<qos>-pod<uid>.slice/cri-containerd-<id>.scope``;
cgroupfs driver: ``/kubepods/<qos>/pod<uid>/<id>``), as ``/proc/<pid>/cgroup`` would name it.
Every NVML failure becomes :class:`LimitError` naming the GPU, the cgroup and the NVML error.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any, Callable

from vramshare import contract, logs

log = logs.get("vramshare.nvml_limits")
MIB = 1 << 20
_SEARCH_DEPTH = 5


class LimitError(RuntimeError):
    """A memory-limit call failed; the message names the GPU, the cgroup and the NVML error."""


@dataclass(frozen=True)
class CgroupLimits:
    soft_mib: int
    hard_mib: int | None  # None: unlimited (NVML_DEVICE_MEMORY_LIMIT_MAX)
    used_mib: int


class CgroupFinder:
    """Container runtime ID -> its cgroup v2 path (``/kubepods.slice/...``), and pod UID -> its
    containers' (:meth:`pod_cgroups`), each cached while it exists."""

    def __init__(self, root: str = contract.HOST_CGROUP_ROOT) -> None:
        self.root = root
        self._cache: dict[str, str] = {}
        self._pods: dict[str, str] = {}  # pod UID -> its pod cgroup
        self._lock = threading.Lock()

    def find(self, container_id: str) -> str | None:
        with self._lock:
            hit = self._cache.get(container_id)
            if hit is not None and os.path.isdir(os.path.join(self.root, hit.lstrip("/"))):
                return hit
            found = self._search(container_id)
            if found is None:
                self._cache.pop(container_id, None)
            else:
                self._cache[container_id] = found
            return found

    def pod_cgroups(self, pod_uid: str) -> list[str]:
        """The cgroups of the containers in pod ``pod_uid`` (the subdirectories of its pod cgroup, the
        sandbox's included), sorted; none when the pod has no cgroup here (not started, or gone). The
        kubelet names the pod cgroup ``pod<uid>`` under its QoS class's (``GetPodContainerName``;
        Guaranteed: under kubepods itself); the systemd driver writes each part with ``_`` for ``-`` and
        joins them into one slice name: ``kubepods-burstable-pod<uid_with_underscores>.slice``."""
        names = (f"pod{pod_uid}", f"pod{pod_uid.replace('-', '_')}.slice")
        with self._lock:
            hit = self._pods.get(pod_uid)
            if hit is None or not os.path.isdir(os.path.join(self.root, hit.lstrip("/"))):
                hit = self._search(lambda d: d == names[0] or ("-" + d).endswith("-" + names[1]))
                if hit is None:
                    self._pods.pop(pod_uid, None)
                    return []
                self._pods[pod_uid] = hit
        try:
            subs = sorted(e.name for e in os.scandir(os.path.join(self.root, hit.lstrip("/"))) if e.is_dir())
        except OSError:  # removed between the two looks: the pod is gone
            return []
        return [f"{hit}/{d}" for d in subs]

    def _search(self, match: str | Callable[[str], bool]) -> str | None:
        """The first cgroup under ``kubepods*`` whose name contains ``match`` (a container ID), or for
        which ``match`` is true."""
        hit = (lambda d: match in d) if isinstance(match, str) else match
        base = self.root.rstrip("/")
        for top in sorted(os.listdir(base)) if os.path.isdir(base) else []:
            if not top.startswith("kubepods"):
                continue
            for dirpath, dirnames, _files in os.walk(os.path.join(base, top)):
                depth = dirpath[len(base):].count(os.sep)
                for d in dirnames:
                    if hit(d):
                        return "/" + os.path.relpath(os.path.join(dirpath, d), base)
                if depth >= _SEARCH_DEPTH:
                    dirnames[:] = []
        return None


class NvmlMemoryLimits:
    """Set and read one cgroup's limits on one GPU. ``nvml`` is pynvml (initialised) or a fake."""

    def __init__(self, nvml: Any) -> None:
        self.nvml = nvml
        self._handles: dict[str, Any] = {}

    def _handle(self, uuid: str) -> Any:
        if uuid not in self._handles:
            self._handles[uuid] = self.nvml.nvmlDeviceGetHandleByUUID(uuid)
        return self._handles[uuid]

    def set(self, uuid: str, cgroup: str, soft_mib: int, hard_mib: int) -> None:
        soft, hard = max(0, min(soft_mib, hard_mib)) * MIB, max(0, hard_mib) * MIB
        try:
            arg = self.nvml.c_nvmlSetMemoryLimits_v1_t(nameSpace=cgroup.encode(), softLimit=soft, hardLimit=hard)
            self.nvml.nvmlDeviceSetMemoryLimits_v1(self._handle(uuid), arg)
        except Exception as exc:  # noqa: BLE001 - pynvml raises NVMLError_* subclasses
            self._handles.pop(uuid, None)
            raise LimitError(f"set limits of {cgroup} on {uuid} to soft {soft_mib} / hard {hard_mib} MiB: "
                             f"{type(exc).__name__}: {exc}") from exc

    def gpu_used_mib(self, uuid: str) -> int:
        """Memory in use on the whole GPU (memory v2: without the driver's reservation, where known)."""
        try:
            v2 = getattr(self.nvml, "nvmlMemory_v2", None)
            try:
                info = self.nvml.nvmlDeviceGetMemoryInfo(self._handle(uuid), version=v2) if v2 else None
            except Exception:  # noqa: BLE001 - old driver: v1 counts the reservation as used
                info = None
            info = info or self.nvml.nvmlDeviceGetMemoryInfo(self._handle(uuid))
        except Exception as exc:  # noqa: BLE001
            self._handles.pop(uuid, None)
            raise LimitError(f"read memory of {uuid}: {type(exc).__name__}: {exc}") from exc
        return int(info.used) // MIB

    def get(self, uuid: str, cgroup: str) -> CgroupLimits:
        try:
            arg = self.nvml.c_nvmlGetMemoryLimits_v1_t(nameSpace=cgroup.encode())
            self.nvml.nvmlDeviceGetMemoryLimits_v1(self._handle(uuid), arg)
        except Exception as exc:  # noqa: BLE001
            self._handles.pop(uuid, None)
            raise LimitError(f"read limits of {cgroup} on {uuid}: {type(exc).__name__}: {exc}") from exc
        hard = int(arg.hardLimit)
        unlimited = hard >= int(getattr(self.nvml, "NVML_DEVICE_MEMORY_LIMIT_MAX", 1 << 64) or 1 << 64)
        return CgroupLimits(int(arg.softLimit) // MIB, None if unlimited else hard // MIB, int(arg.currentUsed) // MIB)
