"""Compressed host-memory snapshots of a request's KV blocks, and their restore into other blocks.

Pure torch. A snapshot gathers the blocks of one request from every layer's KV tensor, compresses
them per token and head (:mod:`vllm_patches.codecs`) and moves them to host memory (pinned when the
cache lives on a GPU, so the copy back can overlap). Restoring decompresses into *any* blocks,
because a resumed request gets whatever blocks the pool hands out, not the ones it lost.

Layout: the caller says which dimension indexes blocks (``block_dim``) and the head size. The last
dimension must hold whole head vectors; vLLM's CPU layout packs K and V of a head into it
(``[blocks, heads, tokens, 2 * head_size]``), GPU layouts keep ``head_size``. Viewing the last
dimension as ``[-1, head_size]`` gives one scale per token, head, and K or V in every case.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .codecs import Compressed, compress, decompress

ENV_SNAPSHOT_CODEC = "VRAMSHARE_KV_SNAPSHOT_CODEC"
DEFAULT_SNAPSHOT_CODEC = "int8"


@dataclass
class KvSnapshot:
    """One request's KV: a compressed tensor per layer, ``num_blocks`` blocks each."""

    codec: str
    num_blocks: int
    num_tokens: int
    layers: list[Compressed]
    raw_bytes: int

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    @property
    def ratio(self) -> float:
        """Bytes of the blocks in the cache over bytes of the snapshot."""
        return self.raw_bytes / max(1, self.nbytes)


def _head_view(t: torch.Tensor, head_size: int) -> torch.Tensor:
    if t.shape[-1] % head_size:
        raise ValueError(f"last dimension {t.shape[-1]} is not a multiple of head size {head_size}")
    return t.reshape(*t.shape[:-1], t.shape[-1] // head_size, head_size)


def take(kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int], *, codec: str,
         head_size: int, num_tokens: int = 0, block_dim: int = 0) -> KvSnapshot:
    """Compress ``block_ids`` of every layer into host memory."""
    if not block_ids:
        raise ValueError("a snapshot needs at least one block")
    layers: list[Compressed] = []
    raw = 0
    for cache in kv_caches:
        ids = torch.as_tensor(list(block_ids), dtype=torch.long, device=cache.device)
        blocks = cache.index_select(block_dim, ids)
        raw += blocks.numel() * blocks.element_size()
        packed = compress(_head_view(blocks, head_size), codec)
        on_gpu = cache.device.type == "cuda"
        host = packed.to("cpu") if on_gpu else packed
        if on_gpu:
            host.data = host.data.pin_memory()
        layers.append(host)
    return KvSnapshot(codec, len(block_ids), num_tokens, layers, raw)


def restore(snapshot: KvSnapshot, kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int], *,
            block_dim: int = 0) -> None:
    """Write the snapshot into ``block_ids`` (new blocks of the resumed request), layer by layer."""
    if len(block_ids) != snapshot.num_blocks:
        raise ValueError(f"snapshot holds {snapshot.num_blocks} blocks, got {len(block_ids)} targets")
    if len(kv_caches) != len(snapshot.layers):
        raise ValueError(f"snapshot has {len(snapshot.layers)} layers, cache has {len(kv_caches)}")
    for cache, packed in zip(kv_caches, snapshot.layers):
        on_device = packed.to(cache.device, non_blocking=True)
        blocks = decompress(on_device).to(cache.dtype)
        blocks = blocks.reshape(*blocks.shape[:-2], -1)
        ids = torch.as_tensor(list(block_ids), dtype=torch.long, device=cache.device)
        cache.index_copy_(block_dim, ids, blocks)


def restore_from(snapshot: KvSnapshot, kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int],
                 *, first_block: int, block_dim: int = 0) -> None:
    """Restore snapshot blocks ``first_block ..`` into ``block_ids`` (the rest came from elsewhere,
    e.g. vLLM's own prefix cache, and must not be overwritten with lossy copies)."""
    count = len(block_ids)
    if first_block < 0 or first_block + count > snapshot.num_blocks:
        raise ValueError(f"blocks {first_block}..{first_block + count} outside the snapshot's "
                         f"{snapshot.num_blocks}")
    if count == 0:
        return
    for cache, packed in zip(kv_caches, snapshot.layers):
        blocks = decompress(packed.to(cache.device, non_blocking=True)).to(cache.dtype)
        blocks = blocks.reshape(*blocks.shape[:-2], -1).narrow(block_dim, first_block, count)
        ids = torch.as_tensor(list(block_ids), dtype=torch.long, device=cache.device)
        cache.index_copy_(block_dim, ids, blocks)
