"""Allocate and GetPreferredAllocation for every resource: one lock, the pod handshake, the files.

This is where the pure choices (:mod:`allocation`, :mod:`handshake`) meet the node's state and the
outside world, each behind a narrow interface: a :class:`PodDirectory` (the API server, or nothing
when standalone), a :class:`HeldDevices` source (the kubelet's PodResources) and the quota files.
Allocate calls are serialized by one lock, so two pods of the same size are matched in assume order
and a unit is never granted twice. Every failure is a :class:`~allocation.Refusal`, never a fake grant.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Mapping, Protocol, Sequence

from deviceplugin import allocation, handshake
from deviceplugin.allocation import ContainerSpec, GpuShare, Refusal, RefusalKind
from deviceplugin.metrics import PluginMetrics
from deviceplugin.node_state import NodeState, Snapshot
from deviceplugin.quota_files import QuotaFiles
from vramshare import contract, logs
from vramshare.inventory import GpuMode

log = logs.get(__name__)


class DirectoryError(Exception):
    """The API server did not answer or refused; the message says which call."""


class Conflict(DirectoryError):
    """The pod changed since it was read (resourceVersion mismatch)."""


class PodDirectory(Protocol):
    """The pods bound to this node, and the one write Allocate makes: the allocation state."""

    cached: bool  # pending_pods() may lag the API server unless asked for ``fresh``

    def pending_pods(self, fresh: bool = False) -> list[Mapping[str, Any]]:
        """Pending pods bound to this node; ``fresh`` bypasses any cache."""
        ...

    def set_allocation_state(self, pod: handshake.PodRef, state: str) -> Mapping[str, Any]: ...


#: A device the kubelet has handed out: (namespace/name, container, resource).
Holder = tuple[str, str, str]


class HeldDevices(Protocol):
    """What the kubelet says is allocated now (PodResources List), by device ID."""

    def held(self) -> dict[str, Holder]: ...


class Allocator:
    def __init__(self, state: NodeState, quota: QuotaFiles, metrics: PluginMetrics, node_name: str = "",
                 directory: PodDirectory | None = None, kubelet: HeldDevices | None = None) -> None:
        self._state = state
        self._quota = quota
        self._metrics = metrics
        self._node = node_name
        self._directory = directory
        self._kubelet = kubelet
        self._lock = threading.Lock()
        self._served: set[handshake.Served] = set()
        self._held: dict[str, Holder] = {}

    # -- restart recovery -------------------------------------------------------------------
    def recover(self) -> int:
        """Rebuild what is allocated from the kubelet (PodResources) and the pods' annotations."""
        if self._kubelet is None:
            return 0
        held = self._kubelet.held()
        uids = {}
        if self._directory is not None:
            for pod in self._directory.pending_pods(fresh=True):
                meta = pod.get("metadata") or {}
                uids[f"{meta.get('namespace', 'default')}/{meta.get('name', '')}"] = meta.get("uid", "")
        with self._lock:
            self._held = dict(held)
            self._served = {(uids[key], c, r) for key, c, r in held.values() if key in uids}
        log.info("recovered allocations", devices=len(held), containers=len(set(held.values())))
        return len(held)

    # -- GetPreferredAllocation ------------------------------------------------------------
    def preferred(self, resource: str, available: Sequence[str], must_include: Sequence[str],
                  size: int) -> list[str]:
        """Best-fit IDs on one GPU, on the pod's assigned GPU(s) when the handshake finds the pod."""
        snap = self._state.snapshot
        gpu_of = {d.id: d.gpu_uuid for d in snap.devices.get(resource, ())}
        targets = None
        if resource == snap.config.names.gpu_memory and self._directory is not None:
            try:
                match = self._match(snap, resource, size, prune=False)
                if match is not None:
                    unit = snap.inventory.unit_mib
                    targets = {g.uuid: g.mib // unit
                               for g in handshake.parse_assignment(match.assignment_text, match.container)}
            except (Refusal, handshake.AssignmentError):
                targets = None  # only a hint: Allocate reports the real problem
        return allocation.preferred(available, must_include, size, gpu_of, targets)

    # -- Allocate ---------------------------------------------------------------------------
    def allocate(self, resource: str, ids: Sequence[str]) -> ContainerSpec:
        started = time.perf_counter()
        with self._lock:
            try:
                spec, who = self._allocate_locked(resource, list(ids))
            except Refusal as refusal:
                self._metrics.allocation(resource, refusal.kind.value, time.perf_counter() - started)
                log.warning("allocate refused", resource=resource, devices=len(ids), reason=str(refusal))
                raise
        self._metrics.allocation(resource, "ok", time.perf_counter() - started)
        log.info("allocated", resource=resource, devices=len(ids), **who)
        return spec

    def _allocate_locked(self, resource: str, ids: list[str]) -> tuple[ContainerSpec, dict[str, str]]:
        snap = self._state.snapshot
        names = snap.config.names
        devs = allocation.validate_request(ids, resource, snap.device_map(resource), snap.resource_of)
        self._check_not_held(ids)
        units = resource == names.gpu_memory
        match = self._match(snap, resource, len(ids), prune=True) if self._directory is not None else None
        if match is None:
            shares = allocation.shares_of(devs, units)
            owner: Holder = ("", "", resource)
            quota_dir = self._quota.unmatched_dir(ids)
            unknown = "(standalone)" if self._directory is None else "(none: no assumed pod of this size)"
            who = {"pod": unknown, "gpu": ",".join(s.uuid for s in shares)}
        else:
            shares = self._assigned(snap, match, len(ids)) if units else allocation.shares_of(devs, units)
            owner = (match.pod.key, match.container, resource)
            quota_dir = self._quota.container_dir(match.pod.uid, match.container)
            who = {"pod": match.pod.key, "container": match.container, "gpu": ",".join(s.uuid for s in shares)}
        try:
            self._quota.write_initial(quota_dir, shares)
        except OSError as exc:
            raise Refusal(RefusalKind.PRECONDITION, f"cannot write quota file under {quota_dir}: {exc.strerror}")
        if match is not None:
            if match.completes_pod:
                self._set_state(match.pod, contract.STATE_ALLOCATED)
            self._served.add((match.pod.uid, match.container, resource))
        for device_id in ids:
            self._held[device_id] = owner
        return allocation.container_spec(shares, snap.config, quota_dir), who

    def _match(self, snap: Snapshot, resource: str, size: int, prune: bool) -> handshake.Match | None:
        assert self._directory is not None
        if not prune:
            with self._lock:
                served = frozenset(self._served)
        for fresh in ((False, True) if self._directory.cached else (True,)):  # a cache may lag: then ask afresh
            try:
                pods = self._directory.pending_pods(fresh=fresh)
            except DirectoryError as exc:
                raise Refusal(RefusalKind.UNAVAILABLE, f"cannot read this node's pods from the API server ({exc}); "
                                                       "the pod's GPU assignment is unknown, recreate the pod") from None
            if prune and fresh:  # containers of pods no longer pending cannot be matched again
                live = {(p.get("metadata") or {}).get("uid") for p in pods}
                self._served = {s for s in self._served if s[0] in live}
            if prune:
                served = frozenset(self._served)
            match = handshake.find_match(pods, snap.config.names, self._node, resource, size, served)
            if match is not None:
                return match
        return None

    def _assigned(self, snap: Snapshot, match: handshake.Match, size: int) -> tuple[GpuShare, ...]:
        """The extender's GPUs for this container, checked against this node; a bad one fails the pod."""
        try:
            gpus = handshake.parse_assignment(match.assignment_text, match.container)
            want = size * snap.inventory.unit_mib
            if sum(g.mib for g in gpus) != want:
                raise handshake.AssignmentError(
                    f"assignment gives container {match.container!r} {sum(g.mib for g in gpus)} MiB "
                    f"but it requests {size} units = {want} MiB")
            for g in gpus:
                gpu = snap.inventory.gpu(g.uuid)
                if gpu is None or gpu.mode is not GpuMode.SHARED:
                    raise handshake.AssignmentError(f"assigned GPU {g.uuid} is not a shared GPU of this node")
                if not gpu.healthy:
                    raise handshake.AssignmentError(f"assigned GPU {g.uuid} is unhealthy")
        except handshake.AssignmentError as exc:
            reason = str(exc)
            self._set_state(match.pod, contract.STATE_FAILED_PREFIX + reason)
            raise Refusal(RefusalKind.PRECONDITION, f"pod {match.pod.key}: {reason}") from None
        return tuple(GpuShare(g.uuid, g.mib) for g in gpus)

    def _set_state(self, pod: handshake.PodRef, state: str) -> None:
        try:
            self._directory.set_allocation_state(pod, state)  # type: ignore[union-attr]
        except DirectoryError as exc:
            raise Refusal(RefusalKind.UNAVAILABLE, f"cannot mark pod {pod.key} {state!r}: {exc}") from None
        log.info("pod allocation state", pod=pod.key, state=state)

    def _check_not_held(self, ids: Sequence[str]) -> None:
        """The kubelet frees devices without telling us, so a stale hold is checked against PodResources."""
        if not any(i in self._held for i in ids):
            return
        if self._kubelet is None:
            return  # the kubelet is the authority on what is free
        try:
            self._held = self._kubelet.held()
        except Exception as exc:  # noqa: BLE001 - any failure here just means "cannot double-check"
            log.warning("cannot read pod resources", error=str(exc))
            return
        for device_id in ids:
            holder = self._held.get(device_id)
            if holder is not None:
                raise Refusal(RefusalKind.PRECONDITION,
                              f"device {device_id} is still held by {holder[0]} container {holder[1]} "
                              "(kubelet PodResources); the kubelet's device state is inconsistent")
