"""The device plugin's dynamic-MIG path: make a placement's instance at Allocate, reap what nobody holds.

The kubelet allocates ``vramshare.io/mig-<profile>`` devices whose IDs are placements
(:mod:`vramshare.mig_plan`): the extender chose the placement and GetPreferredAllocation steered the
kubelet to it. Allocate hands the ID here; the plan it names is made by
:class:`deviceplugin.mig_dynamic.DynamicMig` (serialized per GPU, idempotent per plan, adopting what NVML
shows after a crash, never touching MIG mode or an instance with processes), and the container gets the
MIG device's UUID. Then the node's GPUs are read again, so ListAndWatch and the inventory show the new
instance (and drop the placements it made impossible).

Reaping follows each reconcile round that read PodResources: an instance no container holds is destroyed
after ``dynamicMig.graceSeconds``. An instance made in the last :data:`FRESH_S` seconds counts as held
whatever PodResources says (the kubelet records an allocation only after Allocate answers). Only GPUs
the admin listed in ``dynamicMig.gpus`` are ever changed.

With ``deviceListStrategy: cdi-cri`` each made instance gets its CDI entry before Allocate answers, and
each round drops the entries of instances NVML no longer shows (:mod:`deviceplugin.kubelet.mig_cdi`).
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable, Iterable

from prometheus_client import CollectorRegistry

from deviceplugin.kubelet import reconcile
from deviceplugin.kubelet.mig_cdi import MigCdi, MigCdiError
from deviceplugin.backend import GpuBackend
from deviceplugin.mig_dynamic import DynamicMig, MigError, MigMetrics, MigPlan
from deviceplugin.node_state import NodeState
from deviceplugin.quota_files import QuotaFiles, allocation_key
from vramshare import logs, mig_plan

log = logs.get(__name__)
FRESH_S = 30.0  # a just-made instance is held whatever PodResources says, for this long


class MigNode:
    """Dynamic MIG for the GPUs the backend can cut and the config allows; ``None`` from :meth:`build`
    when there are none (nothing on the Allocate path changes then)."""

    def __init__(self, backend: GpuBackend, state: NodeState, dynamic: DynamicMig,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._backend = backend
        self._state = state
        self.dynamic = dynamic
        self._clock = clock
        self.fresh_seconds = FRESH_S
        self._fresh: dict[MigPlan, float] = {}
        self.quota: QuotaFiles | None = None  # allocation dirs: which partition isolation: mig units got
        self.cdi: MigCdi | None = None  # cdi-cri: made instances' CDI specs
        self._lock = threading.Lock()
        self._cdi_lock = threading.Lock()  # a spec written vs. the sweep listing what NVML shows

    @classmethod
    def build(cls, backend: GpuBackend, state: NodeState, registry: CollectorRegistry) -> "MigNode | None":
        nvml = getattr(backend, "mig_nvml", None)
        gpus_of = getattr(backend, "dynamic_mig_gpus", None)
        if nvml is None or gpus_of is None:
            return None
        snap = state.snapshot
        allowed = {g.uuid for g in snap.inventory.gpus if g.dynamic_mig is not None}
        gpus = {u: h for u, h in gpus_of().items() if u in allowed}
        if not gpus:
            return None
        metrics = MigMetrics(registry)
        dynamic = DynamicMig(nvml, gpus, grace_seconds=snap.config.dynamic_mig.grace_seconds, metrics=metrics)
        log.info("dynamic MIG on", gpus=",".join(sorted(gpus)), grace_s=dynamic.grace_seconds)
        return cls(backend, state, dynamic)

    def make(self, device_id: str) -> str:
        """The MIG device UUID of the instance ``device_id`` names, made if missing; :class:`MigError`."""
        placement = mig_plan.parse(device_id)
        plan = MigPlan(placement.gpu_uuid, placement.profile, placement.start)
        made = self.dynamic.ensure(plan)
        with self._lock:
            self._fresh[plan] = self._clock()
        if not made.mig_uuid:
            raise MigError(f"MIG {plan.key}: NVML shows no MIG device for GPU instance {made.gi}")
        if self.cdi is not None:
            self._write_cdi(plan, made.gi, made.mig_uuid)
        log.info("mig instance ready", gpu=plan.gpu_uuid, profile=plan.profile, start=plan.start,
                 mig=made.mig_uuid, adopted=made.adopted)
        self.refresh()
        return made.mig_uuid

    def reap(self, held_ids: Iterable[str]) -> list[MigPlan]:
        """Destroy unheld instances past the grace; ``held_ids``: every device ID PodResources lists."""
        held = set()
        for device_id in held_ids:
            p = mig_plan.try_parse(device_id)
            if p is not None:
                held.add(MigPlan(p.gpu_uuid, p.profile, p.start))
        now = self._clock()
        with self._lock:
            self._fresh = {p: t for p, t in self._fresh.items() if now - t < self.fresh_seconds}
            held |= set(self._fresh)
        gone = self.dynamic.reap(held)
        if gone:
            self.refresh()
        self.sync_cdi()
        return gone

    def _write_cdi(self, plan: MigPlan, gi: int, mig_uuid: str) -> None:
        """The instance's CDI entry, in place before Allocate answers; :class:`MigError` if it cannot be."""
        assert self.cdi is not None
        inst = next((i for _n, i in self.dynamic.instances(plan.gpu_uuid) if i.gi == gi), None)
        ci = inst.cis[0] if inst is not None and inst.cis else 0
        with self._cdi_lock:
            try:
                self.cdi.write(mig_uuid, plan.gpu_uuid, gi, ci)
            except MigCdiError as exc:
                raise MigError(f"MIG {plan.key}: {exc}") from None

    def sync_cdi(self) -> None:
        """Drop the CDI entries of instances NVML no longer shows (reaped, crashed before answering)."""
        if self.cdi is None:
            return
        with self._cdi_lock:
            try:
                live = {i.mig_uuid for u in self.dynamic.gpus for _n, i in self.dynamic.instances(u) if i.mig_uuid}
                self.cdi.sync(live)
            except Exception as exc:  # noqa: BLE001 - the next round sweeps again
                log.warning("mig cdi sweep failed", error=f"{type(exc).__name__}: {exc}")

    def _isolation_held(self, held: list[Any]) -> list[str]:
        """The placement IDs memory-unit holders were served as (issue 24), from their allocation dirs."""
        if self.quota is None:
            return []
        keys = {allocation_key(ids) for e in reconcile.group(held).values() for ids in e.values()}
        return [a.mig_plan for a in self.quota.allocations(keys).values() if a.mig_plan]

    def refresh(self) -> None:
        """Read the GPUs again: the device lists and the inventory follow what NVML shows now."""
        try:
            self._state.on_discovered(self._backend.discover())
        except Exception as exc:  # noqa: BLE001 - the lists catch up on the next change
            log.warning("rediscovery after a MIG change failed", error=f"{type(exc).__name__}: {exc}")

    def on_held(self, held: Any) -> None:
        """Reconciler hook: the PodResources answer of a round (``reconcile.Held`` values). Memory units
        served as an ``isolation: mig`` partition hold it too: their allocation directory says which."""
        try:
            held = list(held)
            self.reap([*(i for h in held for i in h.device_ids), *self._isolation_held(held)])
        except Exception as exc:  # noqa: BLE001 - reaping waits for the next round
            log.warning("mig reap failed", error=f"{type(exc).__name__}: {exc}")
