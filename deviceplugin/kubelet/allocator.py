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
from vramshare import logs, mig, mig_plan

log = logs.get(__name__)


class PodSource(Protocol):
    """This node's pods as last seen (a watch-fed cache): never an API call. A source that can also read
    them now has ``refresh() -> bool`` (:class:`deviceplugin.pod_cache.NodePodCache`), which an Allocate
    that found no pod it serves calls once: the kubelet's own watch can be ahead of ours."""

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
        if resource == snap.config.names.gpu_memory:
            available = _outside_isolation(snap, available, must_include, size, gpu_of, targets)
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

    def _isolated(self, shares: tuple[allocation.GpuShare, ...], size: int,
                  snap: Any) -> tuple[str, allocation.GpuShare] | None:
        """Memory units of a dynamic-MIG GPU (issue 24): the ``isolation: mig`` pod's planned partition,
        made now, as (placement ID, the MIG device and its MiB); None for units of shared GPUs. Units there
        are granted to nobody else: a memory request without the annotation never lands on a MIG GPU."""
        dynamic = {g.uuid for g in snap.inventory.gpus if g.dynamic_mig is not None}
        on_mig = [s.uuid for s in shares if s.uuid in dynamic]
        names = snap.config.names
        if not on_mig:
            who = (steering.isolated_here(self._pods.pods(), names, self._node, size)
                   if dynamic and self._pods is not None else [])
            if who:
                raise Refusal(RefusalKind.PRECONDITION,
                              f"{size} units of shared GPU(s) {', '.join(s.uuid for s in shares)}: the pod assumed "
                              f"here with this size is {', '.join(who)}, annotated {names.isolation}: mig with a "
                              "MIG partition planned; refusing to run it on shared memory")
            return None
        if len(shares) != 1:
            raise Refusal(RefusalKind.PRECONDITION,
                          f"memory units of dynamic-MIG GPU {on_mig[0]} are one MIG partition and cannot be "
                          "combined with units of other GPUs")
        if self.make_mig is None or self._pods is None:
            raise Refusal(RefusalKind.PRECONDITION,
                          f"memory units of dynamic-MIG GPU {on_mig[0]} are served only as the partition planned "
                          f"for a pod annotated {names.isolation}: mig, and this plugin cannot make it")
        gpu = next(g for g in snap.inventory.gpus if g.uuid == on_mig[0])
        assert gpu.dynamic_mig is not None
        table = mig.MODELS[gpu.dynamic_mig.table]
        fit = mig.smallest_fitting(table, size * snap.inventory.unit_mib)
        if fit is None:
            raise Refusal(RefusalKind.PRECONDITION,
                          f"no MIG profile of GPU {on_mig[0]} ({table.name}) holds {size} memory units")
        placement_id, why = steering.isolation_plan(self._pods.pods(), names, self._node, on_mig[0], size, fit.name)
        refresh = getattr(self._pods, "refresh", None)
        if placement_id is None and refresh is not None and refresh():  # our watch may lag the kubelet's
            placement_id, why = steering.isolation_plan(self._pods.pods(), names, self._node, on_mig[0], size,
                                                        fit.name)
        if placement_id is None:
            raise Refusal(RefusalKind.PRECONDITION,
                          f"memory units of dynamic-MIG GPU {on_mig[0]} go only to a pod annotated "
                          f"{names.isolation}: mig, as the partition the scheduler planned for it: {why}")
        try:
            mig_uuid = self.make_mig(placement_id)
        except (MigError, mig_plan.PlanError) as exc:
            raise Refusal(RefusalKind.PRECONDITION, str(exc)) from None
        log.info("isolation: mig units served as a partition", gpu=gpu.uuid, units=size,
                 placement=placement_id, mig=mig_uuid)
        return placement_id, allocation.GpuShare(mig_uuid, fit.memory_mib)

    def _allocate(self, resource: str, ids: list[str]) -> tuple[ContainerSpec, dict[str, str]]:
        snap = self._state.snapshot
        devs = allocation.validate_request(ids, resource, snap.device_map(resource), snap.resource_of)
        shares = allocation.shares_of(devs, resource == snap.config.names.gpu_memory)
        if self._pods is not None and self._recording is not None and not self._recording():
            units = resource == snap.config.names.gpu_memory
            got = {s.uuid: (s.mib // snap.inventory.unit_mib if units else 1) for s in shares}
            why = steering.tie(self._pods.pods(), snap.config.names, self._node, resource, got,
                               snap.inventory.unit_mib)
            refresh = getattr(self._pods, "refresh", None)
            if why is not None and refresh is not None and refresh():  # our watch may lag the kubelet's
                why = steering.tie(self._pods.pods(), snap.config.names, self._node, resource, got,
                                   snap.inventory.unit_mib)
            if why is not None:
                raise Refusal(RefusalKind.UNAVAILABLE,
                              f"PodResources is down, so where this container runs cannot be recorded, and {why}: "
                              "refusing rather than granting GPUs the scheduler's books would not show; "
                              "the pod's controller retries")
        shares = self._made(shares)
        isolated = (self._isolated(shares, len(ids), snap) if resource == snap.config.names.gpu_memory
                    else None)
        if isolated is not None:
            shares = (isolated[1],)
        quota_dir = self._quota.allocation_dir(ids)
        with self._lock:
            try:
                self._quota.write_initial(quota_dir, shares)
                self._quota.stamp(quota_dir)  # PodResources has no UID: whose this Allocate is, is decided later
                if isolated is not None:
                    self._quota.record_mig_plan(quota_dir, isolated[0], isolated[1].mib)
                else:
                    self._quota.clear_mig_plan(quota_dir)
            except (OSError, ValueError) as exc:
                why = (exc.strerror or str(exc)) if isinstance(exc, OSError) else str(exc)
                raise Refusal(RefusalKind.PRECONDITION, f"cannot write quota file under {quota_dir}: {why}") from None
        where = {"gpu": ",".join(s.uuid for s in shares), "mib": ",".join(str(s.mib) for s in shares),
                 "quota_dir": quota_dir}
        key = allocation_key(ids)
        return allocation.container_spec(shares, snap.config, quota_dir, key), where


def _outside_isolation(snap: Any, available: Sequence[str], must_include: Sequence[str], size: int,
                       gpu_of: Mapping[str, str], targets: Mapping[str, int] | None) -> list[str]:
    """``available`` less the memory units of dynamic-MIG GPUs the plan does not name (issue 24): they are
    granted only as an ``isolation: mig`` pod's partition, so best fit never offers them to anyone else.
    Left as they are when too few would remain (Allocate then refuses, saying why)."""
    dynamic = {g.uuid for g in snap.inventory.gpus if g.dynamic_mig is not None} - set(targets or {})
    if not dynamic:
        return list(available)
    kept = [i for i in available if gpu_of.get(i, i) not in dynamic]
    return kept if len(set(kept) | set(must_include)) >= size else list(available)
