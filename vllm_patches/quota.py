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

import json
import os
from dataclasses import dataclass
from typing import Any, Mapping

from vramshare import contract


class QuotaError(ValueError):
    """The quota document cannot be trusted (bad JSON, missing or negative fields)."""


@dataclass(frozen=True)
class GpuQuota:
    """One GPU's slice in MiB. ``floor <= limit <= ceiling`` once validated (0 ceiling = unbounded)."""

    uuid: str
    limit_mib: int
    floor_mib: int = 0
    ceiling_mib: int = 0


@dataclass(frozen=True)
class QuotaDoc:
    """A parsed ``quota.json``."""

    generation: int
    updated: str
    gpus: tuple[GpuQuota, ...]


def _int_field(entry: Mapping[str, Any], key: str, default: int | None = None) -> int:
    value = entry.get(key, default)
    # bool is an int in Python; a JSON true is not a size.
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        raise QuotaError(f"field {key!r} must be a number, got {value!r}")
    if value < 0 or value != value:  # negative or NaN
        raise QuotaError(f"field {key!r} must be >= 0, got {value!r}")
    return int(value)


def parse_quota(text: str | bytes) -> QuotaDoc:
    """Parse and validate a ``quota.json`` document; raise :class:`QuotaError` on anything odd.

    Validation is strict because the numbers size a memory allocation: a limit we cannot read is
    better ignored (keep the last good one) than guessed.
    """
    try:
        doc = json.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        raise QuotaError(f"not JSON: {exc}") from exc
    if not isinstance(doc, dict):
        raise QuotaError("top level must be an object")
    gpus_raw = doc.get("gpus")
    if not isinstance(gpus_raw, list) or not gpus_raw:
        raise QuotaError("'gpus' must be a non-empty list")
    gpus: list[GpuQuota] = []
    for entry in gpus_raw:
        if not isinstance(entry, dict):
            raise QuotaError("each 'gpus' entry must be an object")
        uuid = entry.get("uuid", "")
        if not isinstance(uuid, str):
            raise QuotaError("'uuid' must be a string")
        limit = _int_field(entry, "limitMiB")
        floor = _int_field(entry, "floorMiB", 0)
        ceiling = _int_field(entry, "ceilingMiB", 0)
        if floor > limit or (ceiling and limit > ceiling):
            raise QuotaError(f"need floorMiB <= limitMiB <= ceilingMiB, got {floor}/{limit}/{ceiling}")
        gpus.append(GpuQuota(uuid, limit, floor, ceiling))
    generation = doc.get("generation", 0)
    if isinstance(generation, bool) or not isinstance(generation, int):
        raise QuotaError(f"'generation' must be an integer, got {generation!r}")
    return QuotaDoc(generation, str(doc.get("updated", "")), tuple(gpus))


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
