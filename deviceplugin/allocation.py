"""Allocation choices as pure functions: check a request, pick preferred IDs, say what a container gets.

Everything here works on plain values (device IDs, :class:`PluginDevice`, GPU shares) so it can be
tested exhaustively without a kubelet: the servicer translates protobuf to these calls and back, the
allocator adds the lock, the steering hint and the quota files. Refusals carry a kind (bad request vs. the
node cannot serve it now) that the servicer maps to a gRPC status code and a message a person can act
on, because the kubelet turns any Allocate error into a final ``UnexpectedAdmissionError``.
"""
from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from deviceplugin import enforcement
from deviceplugin.devices import PluginDevice
from vramshare import contract
from vramshare.config import Config, DeviceListStrategy


class RefusalKind(str, enum.Enum):
    INVALID = "invalid"  # the request itself is wrong (unknown ID, wrong resource, bad size)
    PRECONDITION = "precondition"  # valid, but the node cannot serve it (unhealthy GPU, quota dir unwritable)
    UNAVAILABLE = "unavailable"  # a dependency did not answer (kept for the gRPC mapping)


class Refusal(Exception):
    """An Allocate or GetPreferredAllocation the plugin will not serve; ``str()`` is the reason."""

    def __init__(self, kind: RefusalKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class GpuShare:
    """What one container may use of one device: the UUID it sees (GPU or MIG) and its MiB."""

    uuid: str
    mib: int

    @property
    def mig(self) -> bool:
        """A MIG instance (NVML names them ``MIG-...``; the inventory refuses any other spelling)."""
        return self.uuid.startswith("MIG-")


@dataclass(frozen=True)
class ContainerSpec:
    """What the kubelet injects into the container; a protobuf-free ContainerAllocateResponse."""

    envs: Mapping[str, str]
    mounts: tuple[tuple[str, str, bool], ...] = ()  # (container_path, host_path, read_only)
    cdi_devices: tuple[str, ...] = ()
    annotations: Mapping[str, str] = field(default_factory=dict)


def validate_request(ids: Sequence[str], resource: str, devices: Mapping[str, PluginDevice],
                     owner_of: Mapping[str, str]) -> tuple[PluginDevice, ...]:
    """The devices an Allocate names, or a :class:`Refusal` saying which ID is wrong and why.

    ``owner_of`` maps device IDs of *other* resources to their resource, to tell "wrong resource"
    apart from "unknown".
    """
    if not ids:
        raise Refusal(RefusalKind.INVALID, f"Allocate for {resource} named no devices")
    dupes = sorted(i for i, n in Counter(ids).items() if n > 1)
    if dupes:
        raise Refusal(RefusalKind.INVALID, f"Allocate for {resource} names {dupes[0]} more than once")
    chosen = []
    for device_id in ids:
        dev = devices.get(device_id)
        if dev is None:
            other = owner_of.get(device_id)
            if other:
                raise Refusal(RefusalKind.INVALID, f"device {device_id} belongs to {other}, not {resource}")
            raise Refusal(RefusalKind.INVALID, f"device {device_id} is not a {resource} device of this node "
                                               f"(it has {len(devices)}); the kubelet's device list is stale")
        if not dev.healthy:
            raise Refusal(RefusalKind.PRECONDITION, f"device {device_id} is unhealthy (GPU {dev.gpu_uuid}); "
                                                    "delete the pod so it is scheduled on a healthy GPU")
        chosen.append(dev)
    return tuple(chosen)


def shares_of(devices: Sequence[PluginDevice], units: bool) -> tuple[GpuShare, ...]:
    """Memory units add up per GPU, in the order GPUs first appear; MIG/whole GPUs are one share each."""
    if not units:
        return tuple(GpuShare(d.id, d.mib) for d in devices)
    mib: dict[str, int] = {}
    for d in devices:
        mib[d.gpu_uuid] = mib.get(d.gpu_uuid, 0) + d.mib
    return tuple(GpuShare(u, m) for u, m in mib.items())


def preferred(available: Sequence[str], must_include: Sequence[str], size: int,
              gpu_of: Mapping[str, str], targets: Mapping[str, int] | None = None) -> list[str]:
    """Exactly ``size`` IDs from ``available`` including ``must_include``, packed onto as few GPUs as fit.

    ``targets`` (GPU UUID -> units, or a MIG/whole-GPU device ID -> 1) is the extender's plan when
    :mod:`deviceplugin.kubelet.steering` finds the one pod it can be; otherwise
    the GPU whose available devices fit the rest with the least left over wins (best fit), and when
    none fits alone the fullest GPUs are taken first. Deterministic, no side effects.
    """
    if size < 0 or size > len(set(available) | set(must_include)):
        raise Refusal(RefusalKind.INVALID, f"asked to prefer {size} of {len(available)} available devices")
    chosen = list(dict.fromkeys(must_include))[:size]
    taken = set(chosen)
    free: dict[str, list[str]] = {}
    for device_id in available:
        if device_id not in taken:
            free.setdefault(gpu_of.get(device_id, device_id), []).append(device_id)

    def take(gpu: str, n: int) -> None:
        ids = free.get(gpu, [])
        chosen.extend(ids[:n])
        taken.update(ids[:n])
        free[gpu] = ids[n:]

    for target, n in (targets or {}).items():
        if target not in free and target in gpu_of:  # a MIG instance or whole GPU: the device itself
            if target not in taken and len(chosen) < size and target in set(available):
                free[gpu_of[target]].remove(target)
                chosen.append(target)
                taken.add(target)
            continue
        already = sum(1 for i in chosen if gpu_of.get(i, i) == target)
        take(target, max(0, min(n - already, size - len(chosen))))
    if len(chosen) < size:
        anchor = [gpu_of.get(i, i) for i in chosen]
        for gpu in dict.fromkeys(anchor):  # keep growing on the GPUs already in the answer
            take(gpu, size - len(chosen))
    while len(chosen) < size:
        need = size - len(chosen)
        fits = [g for g, ids in free.items() if len(ids) >= need]
        gpu = (min(fits, key=lambda g: (len(free[g]), g)) if fits
               else max((g for g in free if free[g]), key=lambda g: (len(free[g]), g)))
        take(gpu, need)
    return chosen


def cdi_name(uuid: str) -> str:
    """The CDI name of a whole GPU in NVIDIA's generated spec (``--device-name-strategy=uuid``)."""
    return f"nvidia.com/gpu={uuid}"


def kvcached_ipc_name(allocation_key: str) -> str:
    """kvcached's segment name for one allocation: set in the container, so every engine process
    (API server, engine core, workers) uses it from its first ``import vllm`` on."""
    return f"vramshare_{allocation_key}"


def container_spec(shares: Sequence[GpuShare], config: Config, quota_host_dir: str | None,
                   allocation_key: str | None = None, users: int = 1) -> ContainerSpec:
    """Env, mounts and CDI devices for a container holding ``shares`` (DESIGN.md section 3); ``users``:
    how many containers get the same spec at once (a DRA claim's), each fenced at its share."""
    uuids = [s.uuid for s in shares]
    limits = sorted({s.mib for s in shares})
    envs = {
        contract.ENV_GPU_UUIDS: ",".join(uuids),
        # one number when every GPU gets the same (gpu-count splits evenly), else one per GPU in order
        contract.ENV_MEMORY_LIMIT_MIB: str(limits[0]) if len(limits) == 1 else ",".join(str(s.mib) for s in shares),
    }
    if allocation_key:
        envs[contract.ENV_KVCACHED_IPC_NAME] = kvcached_ipc_name(allocation_key)
    mounts: list[tuple[str, str, bool]] = []
    cdi: tuple[str, ...] = ()
    strategy = config.device_list_strategy
    if strategy is DeviceListStrategy.ENVVAR:
        envs[contract.ENV_VISIBLE_DEVICES] = ",".join(uuids)
    elif strategy is DeviceListStrategy.CDI_CRI:
        cdi = tuple(cdi_name(u) for u in uuids)
    else:  # volume-mounts: the NVIDIA container toolkit reads the device list from mount names
        envs[contract.ENV_VISIBLE_DEVICES] = _VOLUME_MOUNT_ROOT
        mounts += [(f"{_VOLUME_MOUNT_ROOT}/{u}", "/dev/null", True) for u in uuids]
    fence = enforcement.container_fence(shares, config.enforcement, users)  # issue 9: driver / mps modes
    envs.update(fence.envs)
    mounts += fence.mounts
    if quota_host_dir is not None:
        mounts.append((contract.CONTAINER_QUOTA_DIR, quota_host_dir, True))
        envs[contract.ENV_QUOTA_FILE] = f"{contract.CONTAINER_QUOTA_DIR}/{contract.QUOTA_FILE_NAME}"
    return ContainerSpec(envs=envs, mounts=tuple(mounts), cdi_devices=cdi)


_VOLUME_MOUNT_ROOT = "/var/run/nvidia-container-devices"
