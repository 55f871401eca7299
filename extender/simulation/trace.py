"""The Alibaba openb trace (cluster-trace-gpu-v2023) as slots and demands for the placement core.

Two views of a GPU request. ``share``: the paper's, every GPU is 1000 units whatever its model and a
task asks ``gpu_milli`` of each of ``num_gpu`` GPUs. ``memory``: GPUs offer their VRAM in MiB
(:data:`GPU_MIB`) and a task asks ``gpu_milli / 1000`` of a 16 GiB card (the trace's most common size:
T4, P100, V100M16) on each GPU, so the same request is a smaller share of a bigger card.
"""
from __future__ import annotations

import csv
from dataclasses import dataclass

from extender.cluster import Demand, HostDemand, Slot
from extender.workload import Shape

SHARE_UNITS = 1000
REFERENCE_MIB = 16384  # memory view: gpu_milli 1000 = a whole 16 GiB card's worth
# VRAM per model in the memory view. G1/G2/G3 are undisclosed in the trace: ASSUMED 16, 16 and 32 GiB.
# The cluster's CPU is sized for its GPUs; with G2 = 32 GiB (4,392 of the 6,212 GPUs) twice as many
# tasks arrive for the same % of memory and CPU runs out at ~55% allocated, which measures CPU, not
# placement. G3 nodes carry twice G2's host CPU and memory, hence 32 GiB.
GPU_MIB = {"P100": 16384, "T4": 16384, "V100M16": 16384, "V100M32": 32768, "A10": 24576,
           "G1": 16384, "G2": 16384, "G3": 32768}
VIEWS = ("share", "memory")


@dataclass(frozen=True)
class TraceNode:
    name: str
    cpu_milli: int
    memory_mib: int
    gpus: int
    model: str

    def slots(self, view: str) -> list[Slot]:
        cap = SHARE_UNITS if view == "share" else GPU_MIB.get(self.model, REFERENCE_MIB)
        return [Slot(f"{self.name}/gpu{i}", self.model, "shared", cap, True, i) for i in range(self.gpus)]


@dataclass(frozen=True)
class TracePod:
    name: str
    cpu_milli: int
    memory_mib: int
    num_gpu: int
    gpu_milli: int
    gpu_spec: tuple[str, ...] = ()

    def per_gpu(self, view: str) -> int:
        milli = min(self.gpu_milli, SHARE_UNITS)
        return milli if view == "share" else round(milli * REFERENCE_MIB / SHARE_UNITS)

    def demands(self, view: str) -> tuple[Demand, ...]:
        """One demand (the trace has one container per task); CPU-only tasks ask for no GPU."""
        if self.num_gpu <= 0 or self.gpu_milli <= 0:
            return ()
        return (Demand(self.per_gpu(view), self.num_gpu, "shared", self.gpu_spec),)

    @property
    def host(self) -> HostDemand:
        return HostDemand(self.cpu_milli, self.memory_mib)

    def gpu_request(self, view: str) -> int:
        """Total GPU amount asked: what 'arrived workload' adds up."""
        return self.per_gpu(view) * self.num_gpu if self.num_gpu > 0 and self.gpu_milli > 0 else 0

    def shape(self, view: str) -> Shape:
        """The paper's typical-pod key: (CPU, GPU share, GPU count, model constraint)."""
        return Shape(self.per_gpu(view) if self.num_gpu else 0, self.num_gpu, "shared", self.gpu_spec, self.cpu_milli)


def _int(row: dict[str, str], key: str) -> int:
    value = (row.get(key) or "0").strip()
    return int(float(value)) if value else 0


def load_nodes(path: str) -> list[TraceNode]:
    with open(path, newline="", encoding="utf-8") as fh:
        return [TraceNode(r["sn"], _int(r, "cpu_milli"), _int(r, "memory_mib"), _int(r, "gpu"), r.get("model", ""))
                for r in csv.DictReader(fh)]


def load_pods(path: str) -> list[TracePod]:
    """Tasks in file (trace) order; a missing ``gpu_spec`` column means no model constraint."""
    with open(path, newline="", encoding="utf-8") as fh:
        return [TracePod(r["name"], _int(r, "cpu_milli"), _int(r, "memory_mib"), _int(r, "num_gpu"),
                         _int(r, "gpu_milli"),
                         tuple(p for p in (r.get("gpu_spec") or "").split("|") if p.strip()))
                for r in csv.DictReader(fh)]
