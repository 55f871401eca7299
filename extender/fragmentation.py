"""Expected GPU fragmentation of nodes for a target workload (Weng et al., ATC'23), vectorised.

For a task shape m a node's idle shared-GPU amount is a fragment when m cannot run there at all (too few
GPUs with enough free, wrong model, not enough CPU): then all of it is; when m can run, only the GPUs
too small for m are. A node's fragmentation is the popularity-weighted sum over shapes:

    F = T - sum_m w_m * fit_m * S_m     (T: idle total, S_m: idle on GPUs that can serve m)

which is the paper's ``NodeGpuShareFragAmount`` rewritten so every term is an array over
``[nodes, GPUs, shapes]``. CPU-only tasks (weight ``cpu_only_weight``) see every idle GPU as a fragment.
Where shapes carry host memory (ours; the paper's do not) a node short of memory cannot serve them
either: kube-scheduler's Fit would refuse it, so its idle GPUs are stranded just the same.
``host_stranded`` is ours: the same stranding measured smoothly, at the workload's CPU and memory per GPU.
Pure numpy, no I/O.
"""
from __future__ import annotations

import numpy as np

from extender.workload import TargetWorkload

_UNLIMITED = np.iinfo(np.int64).max // 4


def serving(free: np.ndarray, elig: np.ndarray, wl: TargetWorkload) -> np.ndarray:
    """``[n, G, M]`` bool: slot g can serve one GPU of shape m (eligible and enough free)."""
    return (free[:, :, None] >= wl.per_gpu[None, None, :]) & elig


def host_fit(cpu_free: np.ndarray, mem_free: np.ndarray | None, wl: TargetWorkload) -> np.ndarray:
    """``[n, M]``: the node has the CPU (and, where shapes carry it, the memory) each shape needs."""
    ok = cpu_free[:, None] >= wl.cpu[None, :]
    if wl.mem is not None and mem_free is not None:
        ok &= mem_free[:, None] >= wl.mem[None, :]
    return ok


def node_frag(free: np.ndarray, elig: np.ndarray, cpu_free: np.ndarray, wl: TargetWorkload,
              mem_free: np.ndarray | None = None) -> np.ndarray:
    """``[n]`` expected fragmentation of each node (``free``: shared idle per slot, ``[n, G]``)."""
    total = free.sum(axis=1)
    if wl.empty:
        return total.astype(np.float64)
    ge = serving(free, elig, wl)
    count = ge.sum(axis=1)  # [n, M]
    usable = (free[:, :, None] * ge).sum(axis=1)  # [n, M]
    fit = (count >= wl.count[None, :]) & host_fit(cpu_free, mem_free, wl)
    # A row-wise sum, not ``@``: BLAS's matrix-vector product rounds a row differently depending on how
    # many rows share the call, and the memo computes rows in batches of any size; one node's value must
    # not depend on which others were stale with it (the wire and the simulator must agree bit for bit).
    return total - ((fit * usable) * wl.weight).sum(axis=1)


def frag_after_each_slot(free: np.ndarray, elig: np.ndarray, cpu_free: np.ndarray, wl: TargetWorkload,
                         amount: int, cpu: int, mem_free: np.ndarray | None = None, mem: int = 0) -> np.ndarray:
    """``[n, G]`` fragmentation after placing ``amount`` on slot g (meaningful where it fits).

    Only slot g changes, so counts and usable sums are updated by differences instead of recomputing
    the node: O(n * G * M) for all n * G choices at once.
    """
    total_after = free.sum(axis=1) - amount  # [n]
    if wl.empty:
        return np.broadcast_to(total_after[:, None], free.shape).astype(np.float64)
    # int32 halves memory traffic on the [n, G, M] temporaries (amounts are MiB or milli-GPU)
    rm = wl.per_gpu.astype(np.int32)[None, None, :]
    f = free.astype(np.int32)[:, :, None]
    f2 = f - np.int32(amount)
    ge = (f >= rm) & elig
    ge2 = (f2 >= rm) & elig
    count2 = ge.sum(axis=1, dtype=np.int32)[:, None, :] - ge + ge2  # [n, G, M]
    fge = f * ge
    usable2 = fge.sum(axis=1, dtype=np.int32)[:, None, :] - fge + f2 * ge2
    cpu_ok = host_fit(cpu_free - cpu, None if mem_free is None else mem_free - mem, wl)  # [n, M]
    fit2 = (count2 >= wl.count.astype(np.int32)[None, None, :]) & cpu_ok[:, None, :]
    return total_after[:, None] - (fit2 * usable2) @ wl.weight


def host_per_unit(wl: TargetWorkload) -> tuple[float, float]:
    """(CPU, memory) the target workload asks per slot unit of GPU, popularity-weighted; 0 where unknown.
    Computed once per published workload (it is immutable; FGD asks on every node it scores)."""
    cached = _PER_UNIT.get(id(wl))
    if cached is not None and cached[0] is wl:
        return cached[1]
    out = _host_per_unit(wl)
    if len(_PER_UNIT) >= 8:
        _PER_UNIT.clear()
    _PER_UNIT[id(wl)] = (wl, out)
    return out


#: id(workload) -> (the workload, its host_per_unit): the workload is kept, so its id is never reused
_PER_UNIT: dict[int, tuple[TargetWorkload, tuple[float, float]]] = {}


def _host_per_unit(wl: TargetWorkload) -> tuple[float, float]:
    gpu = float((wl.weight * wl.per_gpu * wl.count).sum()) if not wl.empty else 0.0
    if gpu <= 0:
        return 0.0, 0.0
    mem = float((wl.weight * wl.mem).sum()) / gpu if wl.mem is not None else 0.0
    return float((wl.weight * wl.cpu).sum()) / gpu, mem


def host_stranded(idle: np.ndarray, cpu_free: np.ndarray, mem_free: np.ndarray, wl: TargetWorkload) -> np.ndarray:
    """``[n]`` idle GPU (slot units) that the node's CPU or memory cannot feed at the workload's ratio.

    A GPU only gets used together with the CPU and memory its pod asks. The per-shape test in
    :func:`node_frag` sees a node's CPU run out only once a whole shape stops fitting; until then a
    placement that eats the CPU next to idle GPUs looks free. Here the node can serve at most
    ``cpu_free / cpu_per_unit`` (and likewise memory) of its idle GPU; the rest is stranded, and it grows
    smoothly with every core taken. Hosts that publish no allocatable CPU or memory strand nothing.
    """
    cpu_unit, mem_unit = host_per_unit(wl)
    servable = np.full(idle.shape, np.inf)
    if cpu_unit > 0:
        servable = np.minimum(servable, np.maximum(cpu_free, 0) / cpu_unit)
    if mem_unit > 0:
        servable = np.minimum(servable, np.maximum(mem_free, 0) / mem_unit)
    return np.maximum(idle - servable, 0.0)


def cluster_frag(free: np.ndarray, elig: np.ndarray, cpu_free: np.ndarray, wl: TargetWorkload) -> tuple[float, float]:
    """(fragmented amount, idle amount) of the whole cluster: the paper's fragmentation rate inputs."""
    return float(node_frag(free, elig, cpu_free, wl).sum()), float(free.sum())


def unlimited_cpu(n: int) -> np.ndarray:
    return np.full(n, _UNLIMITED, np.int64)
