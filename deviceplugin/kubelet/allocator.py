"""Allocate and GetPreferredAllocation for every resource: the GPU follows the device IDs.

Allocate is pod-agnostic and makes no API call (DESIGN.md section 3, "allocation"): the kubelet never
says which pod it serves, but the IDs it passes name the GPU(s) and the size (``<uuid>::<n>``, a MIG
UUID, a GPU UUID), so the container gets exactly those, and a quota directory keyed by the allocation.
Nothing here reads pods, so an API outage cannot fail or slow admission, and a plugin restart loses
nothing Allocate needs. Which pod holds what is learnt afterwards from the kubelet's PodResources
(:mod:`deviceplugin.kubelet.reconcile`). The extender's plan only *steers* GetPreferredAllocation, from the
watch-fed pod cache (:mod:`deviceplugin.kubelet.steering`). Every failure is a :class:`~allocation.Refusal`
with a reason, never a fake grant.

While PodResources is down (``recording`` says so) nobody can record where a pod really runs, so the
books keep the extender's plan: an Allocate is then granted only when :func:`steering.tie` finds that
the devices are the plan of whichever assumed pod the kubelet is admitting, and refused otherwise
(``UNAVAILABLE``, with the reason: the kubelet fails the pod's admission with it and the workload's
controller makes a new pod), rather than granting GPUs the books will never show (issue 17).
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable, Mapping, Protocol, Sequence

from deviceplugin import allocation
from deviceplugin.kubelet import steering
from deviceplugin.allocation import ContainerSpec, Refusal, RefusalKind
from deviceplugin.metrics import PluginMetrics
from deviceplugin.mig_dynamic import MigError
from deviceplugin.node_state import NodeState
from deviceplugin.quota_files import QuotaFiles, allocation_key
from vramshare import logs, mig_plan

log = logs.get(__name__)


class PodSource(Protocol):
    """This node's pods as last seen (a watch-fed cache): never an API call."""

    def pods(self) -> list[Mapping[str, Any]]: ...


class Allocator:
    """``pods`` (optional) only steers GetPreferredAllocation; ``on_allocated`` is told after each
    Allocate (the reconciler wakes up to record the holder once the kubelet lists it)."""

    def __init__(self, state: NodeState, quota: QuotaFiles, metrics: PluginMetrics, node_name: str = "",
                 pods: PodSource | None = None, on_allocated: Callable[[], None] | None = None,
                 recording: Callable[[], bool] | None = None,
                 make_mig: Callable[[str], str] | None = None) -> None:
        self._state = state
        self._quota = quota
        self._metrics = metrics
        self._node = node_name
        self._pods = pods
        self._on_allocated = on_allocated
        self._recording = recording  # whether PodResources is read (None: no books to keep right)
        self._lock = threading.Lock()  # one quota write per allocation at a time
        self.make_mig = make_mig  # dynamic MIG (issue 24): placement ID -> the MIG UUID of its made instance

    # -- GetPreferredAllocation ------------------------------------------------------------
    def preferred(self, resource: str, available: Sequence[str], must_include: Sequence[str],
                  size: int) -> list[str]:
        """Best-fit IDs, on the GPU(s) of the extender's plan when every assumed pod it can be agrees on it."""
        snap = self._state.snapshot
        gpu_of = {d.id: d.gpu_uuid for d in snap.devices.get(resource, ())}
        targets = None
        if self._pods is not None:
            free: dict[str, int] = {}
            for device_id in set(available) | set(must_include):
                free[device_id] = 1
                group = gpu_of.get(device_id, device_id)
                if group != device_id:
                    free[group] = free.get(group, 0) + 1
            hint = steering.steer(self._pods.pods(), snap.config.names, self._node, resource, size,
                                  snap.inventory.unit_mib, free)
            targets = hint.targets
            self._metrics.steering(resource, "steered" if targets else "best-fit")
            log.debug("preferred allocation", resource=resource, size=size, pod=hint.pod or "(none)",
                      steered=targets is not None, reason=hint.reason)
        return allocation.preferred(available, must_include, size, gpu_of, targets)

    # -- Allocate ---------------------------------------------------------------------------
    def allocate(self, resource: str, ids: Sequence[str]) -> ContainerSpec:
        started = time.perf_counter()
        try:
            spec, where = self._allocate(resource, list(ids))
        except Refusal as refusal:
            self._metrics.allocation(resource, refusal.kind.value, time.perf_counter() - started)
            log.warning("allocate refused", resource=resource, devices=len(ids), reason=str(refusal))
            raise
        self._metrics.allocation(resource, "ok", time.perf_counter() - started)
        log.info("allocated", resource=resource, devices=len(ids), **where)
        if self._on_allocated is not None:
            self._on_allocated()
        return spec

    def _made(self, shares: tuple[allocation.GpuShare, ...]) -> tuple[allocation.GpuShare, ...]:
        """Dynamic MIG: each placement device becomes the instance made for it (the ID is the plan)."""
        if not any(mig_plan.is_placement_id(s.uuid) for s in shares):
            return shares
        if self.make_mig is None:
            raise Refusal(RefusalKind.PRECONDITION, "dynamic MIG is not on for this GPU on this node")
        out = []
        for s in shares:
            if mig_plan.is_placement_id(s.uuid):
                try:
                    out.append(allocation.GpuShare(self.make_mig(s.uuid), s.mib))
                except (MigError, mig_plan.PlanError) as exc:
                    raise Refusal(RefusalKind.PRECONDITION, str(exc)) from None
            else:
                out.append(s)
        return tuple(out)

    def _allocate(self, resource: str, ids: list[str]) -> tuple[ContainerSpec, dict[str, str]]:
        snap = self._state.snapshot
        devs = allocation.validate_request(ids, resource, snap.device_map(resource), snap.resource_of)
        shares = allocation.shares_of(devs, resource == snap.config.names.gpu_memory)
        if self._pods is not None and self._recording is not None and not self._recording():
            units = resource == snap.config.names.gpu_memory
            got = {s.uuid: (s.mib // snap.inventory.unit_mib if units else 1) for s in shares}
            why = steering.tie(self._pods.pods(), snap.config.names, self._node, resource, got,
                               snap.inventory.unit_mib)
            if why is not None:
                raise Refusal(RefusalKind.UNAVAILABLE,
                              f"PodResources is down, so where this container runs cannot be recorded, and {why}: "
                              "refusing rather than granting GPUs the scheduler's books would not show; "
                              "the pod's controller retries")
        shares = self._made(shares)
        quota_dir = self._quota.allocation_dir(ids)
        with self._lock:
            try:
                self._quota.write_initial(quota_dir, shares)
                self._quota.stamp(quota_dir)  # PodResources has no UID: whose this Allocate is, is decided later
            except (OSError, ValueError) as exc:
                why = (exc.strerror or str(exc)) if isinstance(exc, OSError) else str(exc)
                raise Refusal(RefusalKind.PRECONDITION, f"cannot write quota file under {quota_dir}: {why}") from None
        where = {"gpu": ",".join(s.uuid for s in shares), "mib": ",".join(str(s.mib) for s in shares),
                 "quota_dir": quota_dir}
        key = allocation_key(ids)
        return allocation.container_spec(shares, snap.config, quota_dir, key), where
