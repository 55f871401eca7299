"""What the quota policy reads and returns: plain frozen dataclasses, no I/O.

Kept apart from the policy so adapters (telemetry readers, the loop, the bench) can build these
without importing the algorithm, and so the policy's inputs are visible in one place.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from deviceplugin.quota.classes import PodMeta
from vramshare.config import QuotaConfig


#: Label names of a tenant on every metric about it (quota loop and warm tier): the tenant's pod, not the
#: scraped one. Prometheus adds namespace/pod/container to every target (the node agent's own), so plain
#: names would collide and come out as exported_namespace etc. (issue 22).
TENANT_LABELS = ("tenant_namespace", "tenant_pod", "tenant_container")


@dataclass(frozen=True, order=True)
class TenantKey:
    """One container of one pod. Ordered by name so every decision is deterministic."""

    namespace: str
    pod: str
    container: str
    pod_uid: str = ""

    def __str__(self) -> str:
        return f"{self.namespace}/{self.pod}/{self.container}"


@dataclass(frozen=True)
class Tenant:
    """A container holding vramshare memory on this node, as the tenant source lists it."""

    key: TenantKey
    gpus: tuple[tuple[str, int], ...]  # (gpu uuid, requested MiB) per GPU it was assigned
    metrics_url: str | None = None  # its vLLM /metrics endpoint, when it has one
    container_ids: frozenset[str] = frozenset()  # runtime IDs (no scheme), to match cgroups
    quota_dir: str | None = None  # where its quota.json lives, when not <root>/<pod-uid>/<container>
    # what quota-class selection reads (labels, priorityClassName, annotation); not part of its identity
    meta: PodMeta | None = field(default=None, compare=False)
    # how many of its containers run at once, at most (a DRA claim that several containers name): the
    # driver fence splits its limit among that many cgroups, keeping a share for one not started yet
    sharers: int = 1
    # the ordinary init containers among ``container_ids``: each ends and the next container takes its
    # place at its CDI share, so the fence keeps that share out of what the others may grow to
    init_ids: frozenset[str] = frozenset()


class Phase(str, enum.Enum):
    """A tenant's warmth (the seed's hot / warm / cold states). ``cold`` = no process (unknown use)."""

    HOT = "hot"  # serving: its limit follows its use plus headroom
    WARM = "warm"  # idle for ``idleSeconds``: shrunk toward its floor, memory lent to co-tenants
    WAKING = "waking"  # a warm tenant that shows traffic again: restored ahead of everybody
    COLD = "cold"  # no telemetry (not started, restarting): its limit is held


@dataclass(frozen=True)
class Bounds:
    """One tenant's bounds on one GPU. Explicit per tenant so quota classes can supply their own."""

    floor_mib: int
    ceiling_mib: int
    margin_mib: int  # least headroom kept above its use

    def clamp(self, mib: int) -> int:
        return max(self.floor_mib, min(self.ceiling_mib, mib))


class Release(str, enum.Enum):
    """What a cut of a tenant's limit buys (``vramshare_vllm_release_mode``, SIGNALS.md).

    ``release``: the engine gives the memory above its cap back to the GPU (``unmap``: kvcached or the
    plugin's own unmapping), so a loan to it can be called back within a tick or two, and a shrink
    it acknowledged is free at once. ``throttle``: the cap stops growth but frees nothing until its
    use drops; a loan to it may never come back, so it gets none (issue 19). ``unknown`` (no plugin
    metrics: another engine, an older plugin) is treated as ``throttle``: a driver hard limit fences
    growth but reclaims nothing either."""

    RELEASE = "release"
    THROTTLE = "throttle"
    UNKNOWN = "unknown"

    @classmethod
    def of_mode(cls, mode: str | None) -> "Release":
        if mode is None:
            return cls.UNKNOWN
        return cls.RELEASE if mode in RELEASING_MODES else cls.THROTTLE


# release modes (vramshare_vllm_release_mode{mode}) in which a cut returns memory to the GPU
RELEASING_MODES = frozenset({"unmap", "kvcached", "release"})


@dataclass(frozen=True)
class Signals:
    """vLLM pressure signals of one tenant; ``None`` means the tenant did not report it."""

    kv_usage: float | None = None  # vllm:kv_cache_usage_perc, 1.0 = full
    waiting: int | None = None  # vllm:num_requests_waiting
    preemptions: int | None = None  # increase of vllm:num_preemptions_total since the last tick
    running: int | None = None  # vllm:num_requests_running
    #: increase of vllm:request_success_total since the last tick: requests that came and went between
    #: two ticks, which no gauge shows (idle detection, wake ahead)
    finished: int | None = None
    release_mode: str | None = None  # vramshare_vllm_release_mode's active mode (unmap | throttle)
    kv_held_mib: int | None = None  # vramshare_vllm_kv_memory_held_bytes: KV memory the engine holds
    kv_demand_mib: int | None = None  # vramshare_vllm_kv_demand_bytes: KV it would hold if unfenced
    generation_applied: int | None = None  # vramshare_vllm_quota_generation_applied: the file it follows

    @property
    def release(self) -> Release:
        return Release.of_mode(self.release_mode)


@dataclass(frozen=True)
class TenantState:
    """A tenant of one GPU as the loop sees it now."""

    key: TenantKey
    request_mib: int  # what the scheduler reserved on this GPU
    current_mib: int | None  # the limit in force; None before the first quota (then the request)
    used_mib: int | None  # observed now (NVML / DCGM / driver currentUsed); None when no telemetry
    signals: Signals = field(default_factory=Signals)
    bounds: Bounds | None = None  # None: the defaults of PolicyParams for its request
    peak_mib: int | None = None  # highest use (or demand) over the recent window: headroom sizing
    demand_mib: int | None = None  # what it would use if unfenced, when a source knows; None = used
    phase: Phase = Phase.HOT
    rank: int = 0  # its quota class's lendingPriority: under pressure lower ranks lend and are cut first
    recent_mib: tuple[int, ...] | None = None  # uses over the loop's window, oldest first: the forecast's input
    # starting: a container whose engine has not shown its use for long yet (``startup_ticks``): it
    # counts at its request from the moment it exists, restored ahead of lenders, and its limit
    # grows only as they release (issue 19). No sample yet means it holds nothing.
    starting: bool = False
    # a releasing engine acknowledged the file carrying its current limit (generation applied): the
    # memory above that limit, beyond what the engine cannot give back, is free now (issue 20 item 5)
    shrink_acked: bool = False
    # the highest limit the engine may still grow to (engines that report generations): the limit in
    # force, or one before it while it has not acknowledged a lower one; that memory is not free yet
    unacked_mib: int | None = None
    # the limit its engine last acknowledged (it fences itself there until it applies a newer file):
    # "at its limit" is measured against this one; None = the limit in force
    engine_mib: int | None = None
    # a starting engine that has reported no generation yet may have read any file written since
    # Allocate's and grow to it before it says so: co-tenants and the node's books count it at this
    # much, but its own limit is granted from its use (a container not started yet reads the newest
    # file when it starts, so lowering it for a lender that has not released yet is what fits it)
    unreported_mib: int | None = None


@dataclass(frozen=True)
class Claim:
    """Memory promised on this node to a container that is not a tenant yet: a pod the extender bound
    here that the device plugin has not reported allocated, or a quota file no tenant owns (Allocate
    wrote it, the pod is not linked yet). Counted at its request until it becomes a tenant."""

    name: str  # namespace/pod/container, or the quota directory: for logs
    gpus: tuple[tuple[str, int], ...]  # (gpu uuid, MiB)
    # the directory of the quota file its engine will read, when its source wrote one (a DRA claim the
    # preparer wrote): fitted to free memory like an unowned Allocate file, counted at ``gpus``
    quota_dir: str | None = None
    # the runtime IDs of the containers its devices are in, when its source knows them (a DRA claim that
    # several pods share), and how many of them run at once: in driver mode the fence holds each at its
    # share of ``gpus``, so together they never hold more than was promised
    container_ids: frozenset[str] = frozenset()
    sharers: int = 1
    init_ids: frozenset[str] = frozenset()  # the ordinary init containers among them (as ``Tenant.init_ids``)
    # the UIDs of the pods it was reserved for, when its source knows them (a prepared DRA claim's
    # checkpoint): a process whose cgroup names one is the claim's, even while no container of it is known
    pod_uids: frozenset[str] = frozenset()
    # per pod that may still start containers naming it (those it was prepared for, not done, whether the
    # pod cache lists them or not, and the running pods that joined it), how many run at once: in driver
    # mode each one not found keeps its CDI share out of what the others may hold (then ``sharers`` is the
    # CDI spec's divisor, Prepare's count); () where the source cannot say: ``sharers`` counts them all
    pod_slots: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class GpuState:
    """One GPU: its schedulable capacity (after reserved and foreign memory) and its tenants."""

    uuid: str
    capacity_mib: int
    tenants: tuple[TenantState, ...]
    # claims of containers that are not tenants yet (pods bound here, not yet reported allocated;
    # quota files no tenant owns yet), at their request: memory the extender promised, never lent
    reserved_mib: int = 0


@dataclass(frozen=True)
class PolicyParams:
    """Admin bounds. Fractions are of each tenant's request; MiB figures are absolute."""

    floor_fraction: float = 0.5
    ceiling_fraction: float = 1.5
    step_mib: int = 512  # limits move in multiples of this; smaller changes are not made
    margin_mib: int = 1024  # headroom kept above observed use: a tenant is never cut below use+margin
    kv_pressure: float = 0.90  # kv_cache_usage_perc at or above this counts as pressure
    protect_requests: bool = True  # overload: use within each request is covered before any beyond it
    share_spare: bool = True  # memory nobody asked for is split evenly as headroom (measured better)
    # "forecast" (quota/headroom.py), "learned" (quota/learned.py), "peak": use + margin up to the window's peak
    headroom: str = "forecast"
    # "releasing": only engines that give memory back on a cut are raised beyond their request (a
    # loan to anyone else may never come back when a reservation needs it); "any": the old rule
    loans: str = "releasing"

    @classmethod
    def from_config(cls, cfg: QuotaConfig) -> "PolicyParams":
        """The bounds under ``quota:`` in the v1 config."""
        return cls(floor_fraction=cfg.floor_fraction, ceiling_fraction=cfg.ceiling_fraction,
                   step_mib=cfg.step_mib, margin_mib=cfg.margin_mib, kv_pressure=cfg.kv_pressure,
                   protect_requests=cfg.protect_requests, share_spare=cfg.share_spare,
                   headroom=cfg.headroom, loans=cfg.loans)

    def floor_of(self, request_mib: int) -> int:
        """Rounded down, as in the first quota file the device plugin writes at Allocate."""
        return math.floor(self.floor_fraction * request_mib)

    def ceiling_of(self, request_mib: int) -> int:
        return max(self.floor_of(request_mib), math.floor(self.ceiling_fraction * request_mib))

    def bounds_of(self, request_mib: int) -> Bounds:
        """The default per-tenant bounds (a quota class may hand the policy others)."""
        return Bounds(self.floor_of(request_mib), self.ceiling_of(request_mib), self.margin_mib)


@dataclass(frozen=True)
class Decision:
    """The policy's answer for one tenant on one GPU: the new limit and why."""

    key: TenantKey
    gpu_uuid: str
    limit_mib: int
    previous_mib: int
    floor_mib: int
    ceiling_mib: int
    reason: str
    phase: Phase = Phase.HOT
    held_mib: int = 0  # what counts against the GPU for this tenant: max(limit, measured use)

    @property
    def changed(self) -> bool:
        return self.limit_mib != self.previous_mib
