"""The quota this vLLM process must live in: parse ``quota.json`` and the environment, pick this GPU.

Pure core, no vLLM. The contract (DESIGN.md section 3) gives a container two sources:

* ``VRAMSHARE_MEMORY_LIMIT_MIB`` -- the per-GPU limit at Allocate time. It never changes for the life
  of the container, so it is the fallback, not the truth.
* ``/var/run/vramshare/quota.json`` (or ``VRAMSHARE_QUOTA_FILE``) -- written atomically by the quota
  loop, ``{"generation", "updated", "gpus": [{"uuid", "limitMiB", "floorMiB", "ceilingMiB"}]}``. It
  changes at runtime; the newest readable generation wins.

A malformed or half-written file must never take a running engine down or shrink it to zero: parsing
raises :class:`QuotaError`, and :class:`QuotaTracker` keeps the last good quota when that happens.
"""
from __future__ import annotations

import os
from typing import Mapping

from vramshare import contract
from vramshare.contract import quota_file


#: One model and one codec with the node agent that writes the file (:mod:`vramshare.contract.quota_file`):
#: what it refuses, this plugin refuses, with the same reason.
QuotaError = quota_file.QuotaFileError
GpuQuota = quota_file.GpuQuota
QuotaDoc = quota_file.QuotaFile
parse_quota = quota_file.parse


def select_gpu(doc: QuotaDoc, uuid: str | None, index: int = 0) -> GpuQuota | None:
    """This process's entry: by UUID when we know it, else by position (local rank), else None.

    The position fallback matters on CPU and in tests, where there is no UUID; the device plugin
    lists the GPUs in the order of ``VRAMSHARE_GPU_UUIDS``, which is the order CUDA numbers them.
    """
    if uuid:
        for gpu in doc.gpus:
            if gpu.uuid == uuid:
                return gpu
        return None
    if 0 <= index < len(doc.gpus):
        return doc.gpus[index]
    return None


def quota_path(env: Mapping[str, str]) -> str:
    """Where the quota file lives in this container."""
    return env.get(contract.ENV_QUOTA_FILE) or os.path.join(contract.CONTAINER_QUOTA_DIR,
                                                           contract.QUOTA_FILE_NAME)


def env_limits_mib(env: Mapping[str, str]) -> tuple[int, ...] | None:
    """``VRAMSHARE_MEMORY_LIMIT_MIB`` per GPU: one number for every GPU, or a comma-separated list
    in ``VRAMSHARE_GPU_UUIDS`` order (DESIGN.md section 3, uneven splits); None when unset.
    Raises :class:`QuotaError` on anything that is not a positive integer."""
    raw = env.get(contract.ENV_MEMORY_LIMIT_MIB, "").strip()
    if not raw:
        return None
    out = []
    for part in raw.split(","):
        try:
            value = int(part.strip())
        except ValueError as exc:
            raise QuotaError(f"{contract.ENV_MEMORY_LIMIT_MIB}={raw!r} is not an integer list") from exc
        if value <= 0:
            raise QuotaError(f"{contract.ENV_MEMORY_LIMIT_MIB}={raw!r} must be > 0")
        out.append(value)
    return tuple(out)


def env_limit_mib(env: Mapping[str, str], index: int = 0) -> int | None:
    """The env limit of the GPU at ``index`` (a single number applies to every GPU)."""
    limits = env_limits_mib(env)
    if limits is None:
        return None
    if len(limits) == 1:
        return limits[0]
    return limits[index] if 0 <= index < len(limits) else None


def engine_gpu_indices(local_dp_rank: int, world_size: int) -> tuple[int, ...]:
    """Positions in ``VRAMSHARE_GPU_UUIDS`` of the GPUs one engine's workers drive.

    vLLM gives data-parallel engine ``d`` (local rank) the devices ``[d x world, (d+1) x world)``
    of the container's visible devices, ``world = TP x PP`` (``get_device_indices`` in
    ``vllm/v1/engine/utils.py``, 0.32); its workers' ``local_rank`` counts inside that slice.
    """
    start = max(0, local_dp_rank) * max(1, world_size)
    return tuple(range(start, start + max(1, world_size)))


def gpu_uuid_for_rank(env: Mapping[str, str], local_rank: int) -> str | None:
    """The UUID of the GPU this rank drives, from ``VRAMSHARE_GPU_UUIDS`` (comma separated)."""
    uuids = [u.strip() for u in env.get(contract.ENV_GPU_UUIDS, "").split(",") if u.strip()]
    return uuids[local_rank] if 0 <= local_rank < len(uuids) else None
