"""The simulated GPU inventory file: YAML in, :class:`DiscoveredGpu` out, strictly checked.

Schema (every key but ``model`` and ``memoryMiB`` optional)::

    gpus:
      - model: NVIDIA H100 80GB HBM3
        memoryMiB: 81559
        reservedMiB: 0            # driver-reserved memory (NVML memory v2)
        numaNode: 0               # null or absent: unknown
        pciBusId: "0000:3b:00.0"
        uuid: GPU-...             # derived from model+index when absent
      - model: NVIDIA A100-SXM4-80GB
        memoryMiB: 81920
        mig: [3g.40gb, 2g.20gb, {profile: 1g.10gb, memoryMiB: 9856, uuid: MIG-..., gi: 13, ci: 0}]
        migMemoryMiB: {3g.40gb: 40192}   # exact sizes by profile; else the name's GB x 1024

A mistake raises :class:`InventoryFileError` naming the key (``gpus[1].memoryMiB: ...``): a demo or a
test that runs on a typo would teach the wrong thing.
"""
from __future__ import annotations

import uuid as uuidlib
from typing import Any

import yaml

from deviceplugin import migprofile
from deviceplugin.backend import BackendError, DiscoveredGpu, DiscoveredMig

_NAMESPACE = uuidlib.UUID("6f1e3c1a-9d7b-4f0e-8a51-7a6d2b0c9e11")  # fixed: UUIDs stay stable across runs
_TOP_KEYS = {"gpus", "description"}
_GPU_KEYS = {"model", "memoryMiB", "reservedMiB", "numaNode", "pciBusId", "uuid", "mig", "migMemoryMiB"}
_MIG_KEYS = {"profile", "memoryMiB", "uuid", "gi", "ci"}


class InventoryFileError(BackendError):
    """A simulated inventory that cannot be used; the message names the bad key."""


def derived_gpu_uuid(model: str, index: int, host: str = "") -> str:
    """A deterministic GPU UUID in NVIDIA's ``GPU-8-4-4-4-12`` form. ``host`` (the node name) keeps
    several simulated nodes built from one file from announcing the same UUIDs, as real GPUs never do."""
    key = f"{host}/{model}/{index}" if host else f"{model}/{index}"
    return f"GPU-{uuidlib.uuid5(_NAMESPACE, key)}"


def derived_mig_uuid(gpu_uuid: str, n: int, profile: str) -> str:
    return f"MIG-{uuidlib.uuid5(_NAMESPACE, f'{gpu_uuid}/{n}/{profile}')}"


def load(path: str, host: str = "") -> list[DiscoveredGpu]:
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except OSError as exc:
        raise InventoryFileError(f"cannot read inventory {path}: {exc.strerror}") from exc
    try:
        return parse(text, host)
    except InventoryFileError as exc:
        raise InventoryFileError(f"{path}: {exc}") from exc


def parse(text: str, host: str = "") -> list[DiscoveredGpu]:
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise InventoryFileError(f"inventory is not valid YAML: {exc}") from exc
    return from_dict(raw, host)


def from_dict(raw: Any, host: str = "") -> list[DiscoveredGpu]:
    top = _mapping(raw, _TOP_KEYS, "inventory")
    gpus_raw = top.get("gpus")
    if not isinstance(gpus_raw, list) or not gpus_raw:
        raise InventoryFileError(f"gpus: expected a non-empty list of GPUs, got {gpus_raw!r}")
    gpus = [_gpu(g, i, host) for i, g in enumerate(gpus_raw)]
    seen: dict[str, str] = {}
    for i, gpu in enumerate(gpus):
        for where, uuid in [(f"gpus[{i}].uuid", gpu.uuid)] + [
                (f"gpus[{i}].mig[{j}].uuid", m.uuid) for j, m in enumerate(gpu.mig)]:
            if uuid in seen:
                raise InventoryFileError(f"{where}: {uuid} is already used by {seen[uuid]}")
            seen[uuid] = where
    return gpus


def _mapping(obj: Any, allowed: set[str], where: str) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise InventoryFileError(f"{where}: expected a mapping, got {obj!r}")
    for key in obj:
        if key not in allowed:
            raise InventoryFileError(f"{where}.{key}: unknown key (known: {', '.join(sorted(allowed))})")
    return obj


def _int(obj: dict[str, Any], key: str, where: str, *, minimum: int, default: Any = ...) -> Any:
    if key not in obj:
        if default is ...:
            raise InventoryFileError(f"{where}.{key}: missing")
        return default
    value = obj[key]
    if value is None and default is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise InventoryFileError(f"{where}.{key}: expected an integer >= {minimum}, got {value!r}")
    return value


def _str(obj: dict[str, Any], key: str, where: str, default: Any = ...) -> Any:
    if key not in obj:
        if default is ...:
            raise InventoryFileError(f"{where}.{key}: missing")
        return default
    value = obj[key]
    if not isinstance(value, str) or not value.strip():
        raise InventoryFileError(f"{where}.{key}: expected a non-empty string, got {value!r}")
    return value.strip()


def _gpu(raw: Any, index: int, host: str = "") -> DiscoveredGpu:
    where = f"gpus[{index}]"
    g = _mapping(raw, _GPU_KEYS, where)
    model = _str(g, "model", where)
    memory = _int(g, "memoryMiB", where, minimum=1)
    reserved = _int(g, "reservedMiB", where, minimum=0, default=0)
    if reserved >= memory:
        raise InventoryFileError(f"{where}.reservedMiB: {reserved} is not below memoryMiB {memory}")
    uuid = _str(g, "uuid", where, default=None) or derived_gpu_uuid(model, index, host)
    if not uuid.startswith("GPU-"):
        raise InventoryFileError(f"{where}.uuid: {uuid!r} does not start with GPU- as NVIDIA UUIDs do")
    mig_raw = g.get("mig")
    if mig_raw is not None and not isinstance(mig_raw, list):
        raise InventoryFileError(f"{where}.mig: expected a list of MIG profiles, got {mig_raw!r}")
    sizes = _sizes(g.get("migMemoryMiB"), f"{where}.migMemoryMiB")
    migs = tuple(_mig(m, f"{where}.mig[{j}]", uuid, j, sizes) for j, m in enumerate(mig_raw or []))
    if sum(m.memory_mib for m in migs) > memory:
        raise InventoryFileError(f"{where}.mig: the instances hold more than memoryMiB {memory}")
    return DiscoveredGpu(
        index=index, uuid=uuid, model=model, memory_mib=memory, reserved_mib=reserved,
        numa_node=_int(g, "numaNode", where, minimum=0, default=None),
        pci_bus_id=_str(g, "pciBusId", where, default=None),
        mig_enabled=mig_raw is not None, mig=migs,
    )


def _sizes(raw: Any, where: str) -> dict[str, int]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise InventoryFileError(f"{where}: expected a mapping of MIG profile to MiB, got {raw!r}")
    for profile in raw:
        if not isinstance(profile, str) or not migprofile.is_profile(profile):
            raise InventoryFileError(f"{where}.{profile}: not a MIG profile like 1g.10gb")
        _int(raw, profile, where, minimum=1)
    return dict(raw)


def _mig(raw: Any, where: str, gpu_uuid: str, n: int, sizes: dict[str, int]) -> DiscoveredMig:
    m = {"profile": raw} if isinstance(raw, str) else _mapping(raw, _MIG_KEYS, where)
    profile = _str(m, "profile", where)
    if not migprofile.is_profile(profile):
        raise InventoryFileError(f"{where}.profile: {profile!r} is not a MIG profile like 1g.10gb")
    default = sizes.get(profile) or migprofile.profile_memory_mib(profile)
    memory = _int(m, "memoryMiB", where, minimum=1, default=default)
    uuid = _str(m, "uuid", where, default=None) or derived_mig_uuid(gpu_uuid, n, profile)
    if not uuid.startswith("MIG-"):
        raise InventoryFileError(f"{where}.uuid: {uuid!r} does not start with MIG- as NVIDIA MIG UUIDs do")
    return DiscoveredMig(uuid=uuid, profile=profile, memory_mib=memory,
                         gi=_int(m, "gi", where, minimum=0, default=n + 1),
                         ci=_int(m, "ci", where, minimum=0, default=0))
