"""Giving the physical memory of capped KV blocks back, where the platform allows it.

A cap alone keeps the memory allocated: the engine stops *using* the blocks above it, but the KV
tensor still holds them, so the GPU's free memory does not grow until the engine restarts. With CUDA
virtual memory management (``cuMemCreate`` / ``cuMemMap`` / ``cuMemUnmap``, as kvcached does) the KV
tensor is a reserved virtual range backed by physical pages that can be unmapped and mapped again;
then a shrink can unmap the pages behind free blocks above the cap and a grow can map them back.

vLLM 0.32 allocates the KV cache with plain ``torch.empty`` (no VMM), and the CPU backend has no
such API at all, so the only implementation here is :class:`KeepMapped`: it records what a VMM
backend would release (block IDs and bytes) and logs it. The hook stays so a VMM backend can slot in
without touching the cap logic: it must only release blocks that are free in the pool, and must map
them back before :meth:`Releaser.on_cap` returns on a grow.
"""
from __future__ import annotations

from typing import Protocol

from vramshare import logs

log = logs.get(__name__)


class Releaser(Protocol):
    """Called by the engine cap after every cap change."""

    def on_cap(self, old_cap: int, new_cap: int, usable_blocks: int, block_bytes: int) -> None:
        ...


class KeepMapped:
    """No physical release (no CUDA VMM here); remembers what a VMM backend would unmap."""

    def __init__(self) -> None:
        self.unreleased_bytes = 0

    def on_cap(self, old_cap: int, new_cap: int, usable_blocks: int, block_bytes: int) -> None:
        self.unreleased_bytes = (usable_blocks - new_cap) * block_bytes
        if new_cap < old_cap:
            log.info("kv blocks capped but memory kept mapped (no CUDA VMM backend)",
                     would_release_mib=round(self.unreleased_bytes / (1 << 20), 1),
                     blocks_above_cap=usable_blocks - new_cap)
