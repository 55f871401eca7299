"""The runtime KV block cap: how many KV blocks the scheduler may hold under the current quota.

Pure core, no vLLM. Stock vLLM allocates its KV cache once and cannot resize it. When the quota
loop shrinks this container's quota we cannot give the memory back (except with CUDA virtual memory,
see :mod:`vllm_patches.release`), but we can stop the scheduler from *using* more blocks than the new
quota pays for. The block pool then looks full to the scheduler at the cap, and vLLM's own
preemption does the rest: nothing new to crash on, and the quota loop sees the engine settle inside
its quota. On a grow the cap rises again, up to the blocks the engine holds.

The cap is computed from the engine's non-KV footprint, which we take as ``start quota - KV bytes
the engine got``: whatever the starting quota did not give to the KV cache went to weights,
activations and graphs, and that part does not change when the quota does.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

MIB = 1 << 20


def cap_blocks(limit_mib: int, non_kv_bytes: int, block_bytes: int, usable_blocks: int,
               min_blocks: int) -> int:
    """Blocks the KV cache may use under ``limit_mib``, clamped to ``[min_blocks, usable_blocks]``.

    ``min_blocks`` (one full-length request) wins over the quota: below it the scheduler could not
    run any request and would stall forever, which is worse than overshooting a quota that was set
    below the engine's minimum in the first place (the caller logs that case).
    """
    if block_bytes <= 0:
        raise ValueError(f"block_bytes must be > 0, got {block_bytes}")
    kv_bytes = limit_mib * MIB - non_kv_bytes
    fits = max(0, kv_bytes // block_bytes)
    return max(min(min_blocks, usable_blocks), min(usable_blocks, fits))


def capped_free(raw_free: int, usable_blocks: int, cap: int) -> int:
    """Free blocks the scheduler may take: the pool's free blocks, less what the cap withholds.

    ``used = usable - raw_free``; the scheduler may grow ``used`` up to ``cap`` and no further. When a
    shrink leaves ``used`` above the cap the answer is 0, so every allocation fails like a full cache
    and vLLM preempts until the running set fits again.
    """
    used = usable_blocks - raw_free
    return max(0, min(raw_free, cap - used))


def cap_usage(raw_free: int, usable_blocks: int, cap: int) -> float:
    """``used / cap`` clamped to ``[0, 1]`` (0 for an empty cap)."""
    if cap <= 0:
        return 0.0
    return min(1.0, max(0.0, (usable_blocks - raw_free) / cap))


@dataclass(frozen=True)
class CapState:
    """A consistent snapshot of the cap for metrics and logs."""

    quota_mib: int
    cap_blocks: int
    usable_blocks: int
    used_blocks: int
    block_bytes: int
    below_minimum: bool


class KvCap:
    """The cap for one block pool, set from the watcher thread and read by the scheduler thread.

    Reads are a single attribute load (atomic under the GIL), so the scheduler's hot path takes no
    lock; the lock only keeps concurrent quota updates from interleaving.
    """

    def __init__(self, *, start_limit_mib: int, usable_blocks: int, block_bytes: int,
                 min_blocks: int, pool_limits: bool = False,
                 start_kv_bytes: int | None = None) -> None:
        # pool_limits: the pool itself offers only what the cap allows (kvcached's limit), so its
        # free count is already capped and must not be capped a second time.
        self.pool_limits = pool_limits
        self.usable_blocks = usable_blocks
        self.block_bytes = block_bytes
        self.min_blocks = min_blocks
        # What the starting quota did not give to KV: weights, activations, graphs, rounding.
        # kvcached reserves a *virtual* pool larger than the quota's KV: then the KV budget the
        # plan gave at start (``start_kv_bytes``) is what the blocks stand for, not the pool size.
        kv_start = usable_blocks * block_bytes
        if start_kv_bytes is not None:
            kv_start = min(kv_start, start_kv_bytes)
        self.non_kv_bytes = start_limit_mib * MIB - kv_start
        self.quota_mib = start_limit_mib
        self.cap = cap_blocks(start_limit_mib, self.non_kv_bytes, block_bytes, usable_blocks,
                              min_blocks)
        self.below_minimum = False
        self._lock = threading.Lock()

    def set_limit(self, limit_mib: int) -> tuple[int, int]:
        """Apply a new quota; return ``(old_cap, new_cap)``."""
        with self._lock:
            old = self.cap
            self.quota_mib = limit_mib
            self.cap = cap_blocks(limit_mib, self.non_kv_bytes, self.block_bytes,
                                  self.usable_blocks, self.min_blocks)
            fits = (limit_mib * MIB - self.non_kv_bytes) // self.block_bytes
            self.below_minimum = fits < min(self.min_blocks, self.usable_blocks)
            return old, self.cap

    def set_offered(self, blocks: int) -> None:
        """With ``pool_limits``: the cap is what the pool offers under the limit it was given."""
        with self._lock:
            self.cap = max(0, min(blocks, self.usable_blocks))

    def used(self, raw_free: int) -> int:
        """Blocks in use: of the whole pool, or (``pool_limits``) of what the pool offers."""
        if self.pool_limits:
            return max(0, self.cap - raw_free)
        return self.usable_blocks - raw_free

    def free(self, raw_free: int) -> int:
        """The scheduler's view of free blocks (see :func:`capped_free`); counted once: a pool that
        enforces the limit itself is passed through."""
        if self.pool_limits:
            return raw_free
        return capped_free(raw_free, self.usable_blocks, self.cap)

    def usage(self, raw_free: int) -> float:
        """Fraction of the cap in use, in ``[0, 1]``: what ``vllm:kv_cache_usage_perc`` should say.

        Blocks withheld by the cap are not "used"; an engine over its cap right after a shrink
        reads 1.0 (full) until preemption brings it under.
        """
        if self.pool_limits:
            return 0.0 if self.cap <= 0 else min(1.0, self.used(raw_free) / self.cap)
        return cap_usage(raw_free, self.usable_blocks, self.cap)

    def state(self, raw_free: int) -> CapState:
        return CapState(self.quota_mib, self.cap, self.usable_blocks,
                        self.used(raw_free), self.block_bytes, self.below_minimum)
