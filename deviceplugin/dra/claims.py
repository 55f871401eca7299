"""What an allocated ResourceClaim gives this node: its results for our driver and pool, resolved to GPUs.

The kubelet hands Prepare only the claim's namespace, name and UID; the plugin reads the claim and
takes ``status.allocation.devices.results`` (device, request, ``shareID``, ``consumedCapacity``) for
its own driver and pool. A shared GPU's share is its consumed memory; an exclusive GPU or a MIG
instance is the whole device. Pure: dicts in, frozen values or a :class:`ClaimError` out.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from vramshare import quantity


from deviceplugin.dra.slices import DeviceRef

_MIB = 1024 * 1024


class ClaimError(ValueError):
    """A claim this plugin cannot prepare; the message says which claim and why."""


@dataclass(frozen=True)
class Share:
    """One allocation result of ours: a device (a whole one, or a share of a shared GPU)."""

    request: str
    pool: str
    device: str
    share_id: str | None
    mib: int  # consumed memory (a share), or the device's whole memory


@dataclass(frozen=True)
class ResolvedShare:
    """A :class:`Share` with the GPU (or MIG instance) it names on this node."""

    share: Share
    uuid: str  # what the container sees
    gpu_uuid: str


@dataclass(frozen=True)
class ClaimRef:
    namespace: str
    name: str
    uid: str


def base_request(name: str) -> str:
    """``<request>`` of a ``<request>/<subrequest>`` result name (``firstAvailable``), else the name:
    resourceclaim.BaseRequestRef, which kubeletplugin's ``stripSubrequestNames`` applies to every
    ``Device.request_names`` it answers, because the kubelet matches a container's
    ``resources.claims[].request`` (a base name) against them exactly."""
    return name.split("/", 1)[0]


def quantity_mib(value: Any, where: str) -> int:
    """A quantity in whole MiB, rounded up (the allocator already rounded to our step)."""
    try:
        return -(-quantity.byte_count(value, where) // _MIB)
    except quantity.QuantityError as exc:
        raise ClaimError(str(exc)) from None


def our_shares(claim: Mapping[str, Any], driver: str, pool: str) -> tuple[Share, ...]:
    """The allocation results of ``claim`` for ``driver`` and ``pool``; an unallocated claim is an error."""
    meta = claim.get("metadata") or {}
    where = f"claim {meta.get('namespace')}/{meta.get('name')}"
    allocation = (claim.get("status") or {}).get("allocation")
    if not allocation:
        raise ClaimError(f"{where} is not allocated; the kubelet prepares only allocated claims")
    results = ((allocation.get("devices") or {}).get("results")) or []
    out = []
    for i, r in enumerate(results):
        if r.get("driver") != driver or r.get("pool") != pool:
            continue
        consumed = (r.get("consumedCapacity") or {})
        memory = consumed.get("memory", consumed.get(f"{driver}/memory"))
        out.append(Share(request=str(r.get("request", "")), pool=pool, device=str(r.get("device", "")),
                         share_id=r.get("shareID"),
                         mib=quantity_mib(memory, f"{where} results[{i}].consumedCapacity.memory")
                         if memory is not None else 0))
    return tuple(out)


def device_capacity_mib(ref: DeviceRef, unit_mib: int) -> int:
    """What one device can give: a shared GPU its schedulable memory (whole units, as published),
    an exclusive GPU its memory, a MIG instance (or partition) its own."""
    if ref.mig is not None:
        return ref.mig.memory_mib
    if ref.partition is not None:
        return ref.partition.profile.memory_mib
    if ref.shared:
        return ref.gpu.units * unit_mib
    return ref.gpu.memory_mib


def resolve(shares: tuple[Share, ...], devices: Mapping[str, DeviceRef], where: str,
            unit_mib: int) -> tuple[ResolvedShare, ...]:
    """Map each share to its GPU; refuse unknown devices, unhealthy ones, and shares that do not fit:
    one larger than its device, or several on one device that add up past it (the allocation results
    come from another process; an over-size one would write a quota the GPU cannot honour)."""
    out = []
    per_device: dict[str, int] = {}
    for s in shares:
        ref = devices.get(s.device)
        if ref is None:
            raise ClaimError(f"{where}: device {s.device} is not a device of this node's pool")
        if not ref.healthy:
            raise ClaimError(f"{where}: device {s.device} (GPU {ref.gpu.uuid}) is unhealthy; delete the pod "
                             "so its claim is allocated on a healthy GPU")
        capacity = device_capacity_mib(ref, unit_mib)
        if ref.shared:
            if s.share_id is None or s.mib <= 0:
                raise ClaimError(f"{where}: shared device {s.device} allocated without shareID/consumedCapacity "
                                 "(is the DRAConsumableCapacity feature gate on?)")
            if s.mib > capacity:
                raise ClaimError(f"{where}: result for device {s.device} consumes {s.mib} MiB, more than its "
                                 f"{capacity} MiB")
            whole = s.mib
        else:
            whole = capacity
        per_device[s.device] = per_device.get(s.device, 0) + whole
        if per_device[s.device] > capacity:
            raise ClaimError(f"{where}: results on device {s.device} add up to {per_device[s.device]} MiB, more "
                             f"than its {capacity} MiB")
        out.append(ResolvedShare(Share(s.request, s.pool, s.device, s.share_id, whole), ref.uuid, ref.gpu.uuid))
    return tuple(out)
