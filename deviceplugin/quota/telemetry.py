"""Where the quota loop learns what tenants use: reader Protocols and the NVML per-process reader.

Every reader returns plain samples and raises :class:`TelemetryError` (one line a person can act on)
for anything it cannot read, so the loop can log it and keep the last good quotas. NVML is the
primary source (per process, sub-second, no extra daemon); the dcgm-exporter and vLLM scrapes live in
``scrape.py``. PIDs are host PIDs, so this reader is used only with ``quota.processAttribution:
true`` and ``hostPID: true``; a PID is tied to its pod through ``/proc/<pid>/cgroup``, as
dcgm-exporter does, for both cgroup v1 and v2 layouts.
"""
from __future__ import annotations

import importlib
import os
import re
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Protocol, runtime_checkable

from vramshare import logs

log = logs.get("vramshare.quota.telemetry")
MIB = 1 << 20


class TelemetryError(RuntimeError):
    """A telemetry source could not be read; the loop keeps its last good quotas."""


@dataclass(frozen=True)
class UsageSample:
    """Memory one process or container holds on one GPU; identity fields are filled where known."""

    gpu_uuid: str
    used_mib: int
    pod_uid: str | None = None
    namespace: str | None = None
    pod: str | None = None
    container: str | None = None
    container_id: str | None = None
    pid: int | None = None


@dataclass(frozen=True)
class VllmSample:
    """One scrape of a vLLM /metrics page. ``preemptions_total`` is the raw counter."""

    kv_usage: float | None = None
    waiting: int | None = None
    preemptions_total: float | None = None
    running: int | None = None  # vllm:num_requests_running (idle detection)
    finished_total: float | None = None  # vllm:request_success_total, summed over reasons and engines (raw)
    extra: dict[str, float] = field(default_factory=dict)  # the plugin's vramshare_vllm_* gauges
    # the plugin's release signals (SIGNALS.md), combined over the server's engines: the weakest
    # release mode (one throttling engine makes the server's cut free nothing for its part), KV
    # bytes held and demanded (sums), and the oldest quota generation any engine has applied
    release_mode: str | None = None
    kv_held_bytes: float | None = None
    kv_demand_bytes: float | None = None
    generation_applied: int | None = None


@runtime_checkable
class UsageReader(Protocol):
    """Per-GPU memory use, attributed as far as the source can (NVML: pod UID; DCGM: pod names)."""

    name: str

    def read_usage(self) -> list[UsageSample]:
        """All samples now; raises :class:`TelemetryError`. A reader that sees every process of a GPU
        (NVML) also sets ``whole_gpus``, the GPUs it read: their unattributed memory is known, not just
        unmatched (the node reports it to the scheduler, :mod:`vramshare.foreign`)."""
        ...


@runtime_checkable
class SignalReader(Protocol):
    """vLLM pressure signals of one tenant, scraped from its metrics endpoint."""

    def read_signals(self, url: str) -> VllmSample:
        """One scrape; raises :class:`TelemetryError`."""
        ...


# -- PID -> pod ---------------------------------------------------------------------------------
_POD_RE = re.compile(r"pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})")
_CID_RE = re.compile(r"(?:^|[-/])([0-9a-f]{64})(?:\.scope)?$")


def parse_cgroup(text: str) -> tuple[str | None, str | None]:
    """``(pod uid, container id)`` from the text of ``/proc/<pid>/cgroup``; ``None`` where absent.

    v1: ``12:memory:/kubepods/burstable/pod<uid>/<cid>``; v2 (systemd driver):
    ``0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid_with_underscores>.slice/
    cri-containerd-<cid>.scope``. Not a pod (a host process) gives ``(None, None)``.
    """
    for line in text.splitlines():
        path = line.split(":", 2)[-1].strip()
        m = _POD_RE.search(path)
        if not m:
            continue
        cid = _CID_RE.search(path)
        return m.group(1).replace("_", "-"), cid.group(1) if cid else None
    return None, None


def _cgroup_text(pid: int, proc_root: str) -> str | None:
    """``/proc/<pid>/cgroup``, or None: the process exited between the NVML call and now, or this process
    does not see the host's PIDs (no ``hostPID``)."""
    try:
        with open(os.path.join(proc_root, str(pid), "cgroup"), encoding="utf-8") as fh:
            return fh.read()
    except OSError:
        return None


# -- NVML ---------------------------------------------------------------------------------------
class NvmlProcessReader:
    """Per-process GPU memory from NVML (``nvmlDeviceGetComputeRunningProcesses``), tied to pods.

    ``nvml`` is the ``pynvml`` module (``nvidia-ml-py``) or a fake with the same functions; it is
    initialised lazily so a node without a driver logs one clear error per tick instead of crashing.
    """

    name = "nvml"

    def __init__(self, nvml: ModuleType | Any | None = None, proc_root: str = "/proc") -> None:
        self._nvml = nvml
        self._proc_root = proc_root
        self._ready = False
        self.whole_gpus: frozenset[str] = frozenset()  # the GPUs the last read listed every process of

    def _lib(self) -> Any:
        if self._nvml is None:
            self._nvml = importlib.import_module("pynvml")
        if not self._ready:
            self._nvml.nvmlInit()
            self._ready = True
        return self._nvml

    def read_usage(self) -> list[UsageSample]:
        try:
            nv = self._lib()
            out: list[UsageSample] = []
            read = set()
            for i in range(nv.nvmlDeviceGetCount()):
                handle = nv.nvmlDeviceGetHandleByIndex(i)
                uuid = nv.nvmlDeviceGetUUID(handle)
                uuid = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
                samples, known = self._samples(uuid, nv.nvmlDeviceGetComputeRunningProcesses(handle))
                out.extend(samples)
                if known:
                    read.add(uuid)
            self.whole_gpus = frozenset(read)
            return out
        except Exception as exc:  # pynvml raises NVMLError subclasses; a fake may raise anything
            if type(exc).__name__.startswith("NVMLError") or isinstance(exc, (OSError, AttributeError)):
                self._ready = False  # re-init next time (driver reload, GPU lost)
                raise TelemetryError(f"nvml: {type(exc).__name__}: {exc}") from exc
            raise

    def _samples(self, uuid: str, procs: list[Any]) -> tuple[list[UsageSample], bool]:
        """The GPU's samples, and whether every process on it was placed: one whose cgroup cannot be read
        (it exited, or no ``hostPID``) may be a pod's, so the GPU's unattributed memory is not proven
        foreign this time (``whole_gpus`` leaves it out; the quota loop still counts it, as before)."""
        out, known = [], True
        for p in procs:
            used = getattr(p, "usedGpuMemory", None)
            if used is None:  # not reported (vGPU, no permission): cannot attribute bytes
                log.debug("nvml process without memory figure", gpu=uuid, pid=p.pid)
                continue
            text = _cgroup_text(p.pid, self._proc_root)
            known &= text is not None
            pod_uid, cid = parse_cgroup(text) if text is not None else (None, None)
            out.append(UsageSample(gpu_uuid=uuid, used_mib=int(used) // MIB, pod_uid=pod_uid,
                                   container_id=cid, pid=int(p.pid)))
        return out, known
