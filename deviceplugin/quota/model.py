"""What the quota policy reads and returns: plain frozen dataclasses, no I/O.

Kept apart from the policy so adapters (telemetry readers, the loop, the bench) can build these
without importing the algorithm, and so the policy's inputs are visible in one place.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

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


@dataclass(frozen=True)
class Signals:
    """vLLM pressure signals of one tenant; ``None`` means the tenant did not report it."""

    kv_usage: float | None = None  # vllm:kv_cache_usage_perc, 1.0 = full
    waiting: int | None = None  # vllm:num_requests_waiting
    preemptions: int | None = None  # increase of vllm:num_preemptions_total since the last tick


@dataclass(frozen=True)
class TenantState:
    """A tenant of one GPU as the loop sees it now."""

    key: TenantKey
    request_mib: int  # what the scheduler reserved on this GPU
    current_mib: int | None  # the limit in force; None before the first quota (then the request)
    used_mib: int | None  # observed now (NVML / DCGM); None when no telemetry attributed to it
    signals: Signals = field(default_factory=Signals)


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

    @classmethod
    def from_config(cls, cfg: QuotaConfig) -> "PolicyParams":
        """The bounds under ``quota:`` in the v1 config."""
        return cls(floor_fraction=cfg.floor_fraction, ceiling_fraction=cfg.ceiling_fraction,
                   step_mib=cfg.step_mib, margin_mib=cfg.margin_mib, kv_pressure=cfg.kv_pressure)

    def floor_of(self, request_mib: int) -> int:
        """Rounded down, as in the first quota file the device plugin writes at Allocate."""
        return math.floor(self.floor_fraction * request_mib)

    def ceiling_of(self, request_mib: int) -> int:
        return max(self.floor_of(request_mib), math.floor(self.ceiling_fraction * request_mib))


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

    @property
    def changed(self) -> bool:
        return self.limit_mib != self.previous_mib
