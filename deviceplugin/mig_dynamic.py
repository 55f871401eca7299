"""Dynamic MIG on the node: make the GPU instance a plan names, and remove the ones nobody holds.

A plan is (GPU, profile, placement start): the scheduler side chose it (extender at bind, or the DRA
allocator), the node makes it when the kubelet allocates or prepares. The rules, each a fault peers have
had:

* **serialized per physical GPU**: two plans on one GPU never race NVML (one lock per GPU UUID);
* **idempotent per plan**: what NVML shows is the only record. An instance of the plan's profile at the
  plan's start *is* the plan's instance, however it came there (a retried Allocate, a restart after a
  crash between the GPU-instance and compute-instance creates, an admin's ``nvidia-smi mig -cgi``): it is
  adopted, a missing compute instance added, never a second one created;
* **never disturbs a running GPU**: MIG mode is never changed; an instance with processes is never
  destroyed; a plan whose placement is taken by another instance fails with the reason (the reaper may
  free it later, the plan never evicts it);
* **garbage after a grace**: an instance no container holds is destroyed once it has been unheld for
  ``grace_seconds`` (a restarting pod's instance survives its restart); a GPU instance without a compute
  instance (a crash between the creates, or between the two removals) has no MIG device, so no container
  can hold it: an unheld one goes at once.

The NVML calls are :class:`deviceplugin.mig_nvml.NvmlMig`'s; the geometry is :mod:`vramshare.mig`'s.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram

from deviceplugin.mig_nvml import GpuInstance, MigNvmlError, NvmlMig, ProfileInfo
from vramshare import contract, logs, mig

log = logs.get(__name__)
_PREFIX = contract.METRICS_PREFIX + "mig_"


@dataclass(frozen=True, order=True)
class MigPlan:
    """One GPU instance a container is to get: its GPU, profile and placement start."""

    gpu_uuid: str
    profile: str
    start: int

    @property
    def key(self) -> str:
        return f"{self.gpu_uuid}/{self.profile}@{self.start}"


@dataclass(frozen=True)
class MadeInstance:
    plan: MigPlan
    gi: int
    mig_uuid: str
    adopted: bool  # it existed already (retry, restart, admin)


class MigError(RuntimeError):
    """A plan cannot be made now; the message is the reason the kubelet shows."""


class MigMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.created = Counter(_PREFIX + "instances_created", "GPU instances created for plans", ["gpu"],
                               registry=self.registry)
        self.adopted = Counter(_PREFIX + "instances_adopted", "Plans that found their instance made", ["gpu"],
                               registry=self.registry)
        self.destroyed = Counter(_PREFIX + "instances_destroyed", "Unheld GPU instances destroyed", ["gpu"],
                                 registry=self.registry)
        self.failures = Counter(_PREFIX + "failures", "Plans or removals that failed, by reason",
                                ["gpu", "reason"], registry=self.registry)
        self.create_seconds = Histogram(_PREFIX + "create_seconds", "Time to create a GPU + compute instance",
                                        buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30), registry=self.registry)


@dataclass
class _Gpu:
    handle: Any
    name: str
    total_mib: int
    lock: threading.Lock
    profiles: list[ProfileInfo] | None = None


class DynamicMig:
    """Makes and removes GPU instances for plans; ``gpus`` maps GPU UUID -> (NVML handle, name, MiB)."""

    def __init__(self, nvml: NvmlMig, gpus: dict[str, tuple[Any, str, int]], *, grace_seconds: float = 60.0,
                 clock: Callable[[], float] = time.monotonic, metrics: MigMetrics | None = None) -> None:
        self.nvml = nvml
        self.grace_seconds = grace_seconds
        self.clock = clock
        self.metrics = metrics if metrics is not None else MigMetrics()
        self._gpus = {u: _Gpu(h, n, m, threading.Lock()) for u, (h, n, m) in gpus.items()}
        self._unheld_since: dict[tuple[str, int], float] = {}

    # -- reading -----------------------------------------------------------------------------
    @property
    def gpus(self) -> frozenset[str]:
        """UUIDs of the GPUs this maker may change."""
        return frozenset(self._gpus)

    def _profiles(self, gpu: _Gpu) -> list[ProfileInfo]:
        if gpu.profiles is None:
            gpu.profiles = self.nvml.profiles(gpu.handle, gpu.total_mib)
        return gpu.profiles

    def _gpu(self, uuid: str) -> _Gpu:
        gpu = self._gpus.get(uuid)
        if gpu is None:
            raise MigError(f"GPU {uuid} is not a dynamic-MIG GPU of this node")
        return gpu

    def instances(self, uuid: str) -> list[tuple[str, GpuInstance]]:
        """(profile name, instance) of every GPU instance on the GPU, as NVML shows it now."""
        gpu = self._gpu(uuid)
        with gpu.lock:
            return self._named(gpu)

    def _named(self, gpu: _Gpu) -> list[tuple[str, GpuInstance]]:
        profiles = self._profiles(gpu)
        by_id = {p.profile_id: p.name for p in profiles}
        return [(by_id.get(i.profile_id, f"id{i.profile_id}"), i) for i in self.nvml.instances(gpu.handle, profiles)]

    def creatable(self, uuid: str) -> dict[str, list[int]]:
        """Per profile, the starts where one more instance could be created now (for the inventory)."""
        gpu = self._gpu(uuid)
        model = mig.model_for(gpu.name, gpu.total_mib)
        if model is None:
            return {}
        with gpu.lock:
            layout = [mig.Placed(i.start, name) for name, i in self._named(gpu) if name in model.names]
        return {p.name: mig.free_starts(model, layout, p.name) for p in model.profiles}

    # -- making --------------------------------------------------------------------------------
    def ensure(self, plan: MigPlan) -> MadeInstance:
        """The plan's instance, made if missing; :class:`MigError` with the reason otherwise."""
        gpu = self._gpu(plan.gpu_uuid)
        with gpu.lock:
            try:
                return self._ensure(gpu, plan)
            except MigNvmlError as exc:
                self.metrics.failures.labels(plan.gpu_uuid, exc.nvml_error or "nvml").inc()
                raise MigError(f"MIG {plan.key}: {exc}") from exc

    def _ensure(self, gpu: _Gpu, plan: MigPlan) -> MadeInstance:
        profile = next((p for p in self._profiles(gpu) if p.name == plan.profile), None)
        if profile is None:
            self.metrics.failures.labels(plan.gpu_uuid, "unknown-profile").inc()
            raise MigError(f"MIG {plan.key}: the GPU offers no profile {plan.profile}")
        if plan.start not in {s for s, _ in profile.placements}:
            self.metrics.failures.labels(plan.gpu_uuid, "illegal-placement").inc()
            raise MigError(f"MIG {plan.key}: {plan.profile} cannot start at {plan.start} "
                           f"(legal: {[s for s, _ in profile.placements]})")
        size = next(size for s, size in profile.placements if s == plan.start)
        span = set(range(plan.start, plan.start + size))
        for name, inst in self._named(gpu):
            if inst.profile_id == profile.profile_id and inst.start == plan.start:
                return self._adopt(gpu, plan, profile, inst)
            if span & set(range(inst.start, inst.start + inst.size)):
                self.metrics.failures.labels(plan.gpu_uuid, "placement-taken").inc()
                raise MigError(f"MIG {plan.key}: slots {inst.start}-{inst.start + inst.size - 1} are held by "
                               f"{name} (GPU instance {inst.gi}{', in use' if inst.busy else ''})")
        started = self.clock()
        gi = self.nvml.create(gpu.handle, profile, plan.start)
        self.nvml.create_ci(gpu.handle, gi, profile.slices)
        made = self._find(gpu, plan, profile)
        self.metrics.created.labels(plan.gpu_uuid).inc()
        self.metrics.create_seconds.observe(max(0.0, self.clock() - started))
        log.info("mig instance created", gpu=plan.gpu_uuid, profile=plan.profile, start=plan.start, gi=gi,
                 mig=made.mig_uuid)
        return MadeInstance(plan, made.gi, made.mig_uuid or "", adopted=False)

    def _adopt(self, gpu: _Gpu, plan: MigPlan, profile: ProfileInfo, inst: GpuInstance) -> MadeInstance:
        if not inst.cis:  # a crash between the two creates left the GPU instance alone
            self.nvml.create_ci(gpu.handle, inst.gi, profile.slices)
            log.info("mig compute instance added to an existing GPU instance", gpu=plan.gpu_uuid, gi=inst.gi)
            inst = self._find(gpu, plan, profile)
        self.metrics.adopted.labels(plan.gpu_uuid).inc()
        self._unheld_since.pop((plan.gpu_uuid, inst.gi), None)
        return MadeInstance(plan, inst.gi, inst.mig_uuid or "", adopted=True)

    def _find(self, gpu: _Gpu, plan: MigPlan, profile: ProfileInfo) -> GpuInstance:
        for _name, inst in self._named(gpu):
            if inst.profile_id == profile.profile_id and inst.start == plan.start and inst.mig_uuid:
                return inst
        raise MigError(f"MIG {plan.key}: created, but NVML shows no MIG device for it")

    # -- removing ------------------------------------------------------------------------------
    def release(self, plan: MigPlan) -> bool:
        """Destroy the plan's instance now (DRA's NodeUnprepareResources: the claim is done with it);
        False when there is none (never made, or already gone: a retried Unprepare). An instance with
        processes is never destroyed: :class:`MigError`, so the caller keeps its record and retries."""
        gpu = self._gpu(plan.gpu_uuid)
        with gpu.lock:
            try:
                profile = next((p for p in self._profiles(gpu) if p.name == plan.profile), None)
                if profile is None:
                    return False
                inst = next((i for _n, i in self._named(gpu)
                             if i.profile_id == profile.profile_id and i.start == plan.start), None)
                if inst is None:
                    return False
                if inst.busy:
                    self.metrics.failures.labels(plan.gpu_uuid, "in-use").inc()
                    raise MigError(f"MIG {plan.key}: GPU instance {inst.gi} still has processes; not destroyed")
                self.nvml.destroy(gpu.handle, inst.gi, profile.slices)
            except MigNvmlError as exc:
                self.metrics.failures.labels(plan.gpu_uuid, exc.nvml_error or "nvml").inc()
                raise MigError(f"MIG {plan.key}: {exc}") from exc
            self._unheld_since.pop((plan.gpu_uuid, inst.gi), None)
            self.metrics.destroyed.labels(plan.gpu_uuid).inc()
            log.info("mig instance destroyed", gpu=plan.gpu_uuid, profile=plan.profile, start=plan.start, gi=inst.gi)
            return True

    def reap(self, held: Iterable[MigPlan]) -> list[MigPlan]:
        """Destroy instances no plan in ``held`` names once unheld for the grace period; never one with
        processes. Returns the plans (profile@start) of what was destroyed."""
        keep = {(p.gpu_uuid, p.profile, p.start) for p in held}
        now = self.clock()
        gone: list[MigPlan] = []
        for uuid, gpu in self._gpus.items():
            with gpu.lock:
                slices = {p.profile_id: p.slices for p in self._profiles(gpu)}
                seen = set()
                for name, inst in self._named(gpu):
                    key = (uuid, inst.gi)
                    seen.add(key)
                    if (uuid, name, inst.start) in keep:
                        self._unheld_since.pop(key, None)
                        continue
                    since = self._unheld_since.setdefault(key, now)
                    if inst.cis and now - since < self.grace_seconds:
                        continue  # a GPU instance without compute instance serves no one: no grace
                    if inst.busy:
                        log.warning("unheld mig instance has processes; left alone", gpu=uuid, gi=inst.gi,
                                    profile=name)
                        continue
                    try:
                        self.nvml.destroy(gpu.handle, inst.gi, slices.get(inst.profile_id, 1))
                    except MigNvmlError as exc:
                        self.metrics.failures.labels(uuid, exc.nvml_error or "nvml").inc()
                        log.warning("mig instance not destroyed", gpu=uuid, gi=inst.gi, error=str(exc))
                        continue
                    self._unheld_since.pop(key, None)
                    self.metrics.destroyed.labels(uuid).inc()
                    gone.append(MigPlan(uuid, name, inst.start))
                    log.info("unheld mig instance destroyed", gpu=uuid, gi=inst.gi, profile=name, start=inst.start)
                for key in [k for k in self._unheld_since if k[0] == uuid and k not in seen]:
                    del self._unheld_since[key]
        return gone
