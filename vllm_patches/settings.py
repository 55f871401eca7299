"""Where this process's quota comes from, resolved from the environment once per process.

The plugin is active only when the container has a quota: ``VRAMSHARE_MEMORY_LIMIT_MIB`` is set or
the quota file exists. Without either it must be a no-op, because the same image also runs outside
vramshare (a developer laptop, a whole-GPU pod).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

from .quota import QuotaError, env_limit_mib, env_limits_mib, gpu_uuid_for_rank, quota_path
from .watcher import DEFAULT_POLL_S, ENV_POLL_S, EngineTracker, QuotaTracker, read_file


@dataclass(frozen=True)
class QuotaSettings:
    """The quota sources of this container."""

    env_limit_mib: int | None
    path: str
    poll_s: float
    env: Mapping[str, str]

    def tracker(self, local_rank: int = 0) -> QuotaTracker:
        """A tracker for one GPU (position in ``VRAMSHARE_GPU_UUIDS``), primed with the file."""
        tracker = QuotaTracker(env_limit_mib(self.env, local_rank),
                               gpu_uuid_for_rank(self.env, local_rank), local_rank)
        body = read_file(self.path)
        if body is not None:
            tracker.update(body)
        return tracker

    def engine_tracker(self, gpu_indices: "tuple[int, ...] | list[int]") -> EngineTracker:
        """The tightest limit over the GPUs one engine drives, primed with the file."""
        return EngineTracker([self.tracker(i) for i in gpu_indices])

    def current_limit_mib(self, local_rank: int = 0) -> int:
        """The limit right now: the quota file when it is readable, else the env limit."""
        return self.engine_limit_mib((local_rank,))

    def engine_limit_mib(self, gpu_indices: "tuple[int, ...] | list[int]") -> int:
        """The tightest limit over ``gpu_indices`` right now."""
        limit = self.engine_tracker(gpu_indices).limit_mib
        if limit is None:
            raise QuotaError(f"no usable quota for GPUs {list(gpu_indices)}: quota file {self.path} "
                             f"has no valid entry and VRAMSHARE_MEMORY_LIMIT_MIB is unset")
        return limit


def from_env(env: Mapping[str, str] | None = None) -> QuotaSettings | None:
    """Settings when this container has a quota, else None (the plugin then does nothing)."""
    env = os.environ if env is None else env
    limits = env_limits_mib(env)
    limit = None if limits is None else min(limits)
    path = quota_path(env)
    if limit is None and not os.path.exists(path):
        return None
    poll = float(env.get(ENV_POLL_S, "") or DEFAULT_POLL_S)
    return QuotaSettings(limit, path, poll, env)
