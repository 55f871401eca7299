"""Expected GPU fragmentation of nodes for a target workload (Weng et al., ATC'23), vectorised.

For a task shape m a node's idle shared-GPU amount is a fragment when m cannot run there at all (too few
GPUs with enough free, wrong model, not enough CPU): then all of it is; when m can run, only the GPUs
too small for m are. A node's fragmentation is the popularity-weighted sum over shapes:

    F = T - sum_m w_m * fit_m * S_m     (T: idle total, S_m: idle on GPUs that can serve m)

which is the paper's ``NodeGpuShareFragAmount`` rewritten so every term is an array over
``[nodes, GPUs, shapes]``. CPU-only tasks (weight ``cpu_only_weight``) see every idle GPU as a fragment.
Where shapes carry host memory (ours; the paper's do not) a node short of memory cannot serve them
either: kube-scheduler's Fit would refuse it, so its idle GPUs are stranded just the same.
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
    return total - (fit * usable) @ wl.weight


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


def cluster_frag(free: np.ndarray, elig: np.ndarray, cpu_free: np.ndarray, wl: TargetWorkload) -> tuple[float, float]:
    """(fragmented amount, idle amount) of the whole cluster: the paper's fragmentation rate inputs."""
    return float(node_frag(free, elig, cpu_free, wl).sum()), float(free.sum())


def unlimited_cpu(n: int) -> np.ndarray:
    return np.full(n, _UNLIMITED, np.int64)
