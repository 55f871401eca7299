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


@dataclass(frozen=True)
class Signals:
    """vLLM pressure signals of one tenant; ``None`` means the tenant did not report it."""

    kv_usage: float | None = None  # vllm:kv_cache_usage_perc, 1.0 = full
    waiting: int | None = None  # vllm:num_requests_waiting
    preemptions: int | None = None  # increase of vllm:num_preemptions_total since the last tick
    running: int | None = None  # vllm:num_requests_running


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


@dataclass(frozen=True)
class GpuState:
    """One GPU: its schedulable capacity (after reserved and foreign memory) and its tenants."""

    uuid: str
    capacity_mib: int
    tenants: tuple[TenantState, ...]


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
    headroom: str = "peak"  # "peak": use + margin up to the window's peak; "forecast": see quota/headroom.py

    @classmethod
    def from_config(cls, cfg: QuotaConfig) -> "PolicyParams":
        """The bounds under ``quota:`` in the v1 config."""
        return cls(floor_fraction=cfg.floor_fraction, ceiling_fraction=cfg.ceiling_fraction,
                   step_mib=cfg.step_mib, margin_mib=cfg.margin_mib, kv_pressure=cfg.kv_pressure,
                   protect_requests=cfg.protect_requests, share_spare=cfg.share_spare,
                   headroom=cfg.headroom)

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
