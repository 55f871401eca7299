"""Compressed host-memory snapshots of a request's KV blocks, and their restore into other blocks.

Pure torch. A snapshot gathers the blocks of one request from every layer's KV tensor, compresses
them (:mod:`vllm_patches.codecs` per token and head, or :mod:`vllm_patches.kivi` with keys per
channel) and moves them to host memory (pinned when the cache lives on a GPU, so the copy back can
overlap). Restoring decompresses into *any* blocks, because a resumed request gets whatever blocks
the pool hands out, not the ones it lost.

Layouts (``block_dim`` says which dimension indexes blocks):

* vLLM's CPU layout, per layer ``[blocks, heads, tokens, 2 * head_size]``: K and V of a head side
  by side in the last dimension (``block_dim=0``);
* 5-D GPU layouts ``[2, blocks, tokens, heads, head_size]`` (``block_dim=1``, untested on a GPU).

Codecs never grow or degrade a cache that is already 8-bit or smaller (``--kv-cache-dtype fp8``):
:func:`effective_codec` turns them into ``none`` there, and the blocks are stored raw.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Union

import torch

from .codecs import CODECS, Compressed, codec_bits, compress, decompress
from .kivi import SCHEMES as KIVI_SCHEMES
from .kivi import KiviKV, compress_kv, decompress_kv

ENV_SNAPSHOT_CODEC = "VRAMSHARE_KV_SNAPSHOT_CODEC"
# Lossless by default: a lossy snapshot makes a preempted request's continuation differ from
# stock vLLM's recompute (greedy outputs of a random-weight Llama changed under int8 per token).
DEFAULT_SNAPSHOT_CODEC = "none"
SNAPSHOT_CODECS = CODECS + tuple(KIVI_SCHEMES)

Layer = Union[Compressed, KiviKV]


def effective_codec(codec: str, cache_elem_bytes: int) -> str:
    """``codec`` for a 16/32-bit cache; ``none`` (raw) for an 8-bit one (fp8 / int8 KV cache).

    An 8-bit codec would add scales to data already 8 bits wide, and any codec would quantize
    values the cache already rounded once: larger or lossier, never both smaller and exact.
    """
    codec_bits(codec)
    return "none" if cache_elem_bytes < 2 else codec


def snapshot_block_bytes(raw_block_bytes: int, codec: str, cache_elem_bytes: int) -> int:
    """Host bytes of one block's snapshot (payload; scales add ~3%), for the host budget."""
    codec = effective_codec(codec, cache_elem_bytes)
    return raw_block_bytes if codec == "none" else raw_block_bytes * codec_bits(codec) // (8 * cache_elem_bytes)


@dataclass
class KvSnapshot:
    """One request's KV: a compressed tensor per layer, ``num_blocks`` blocks each."""

    codec: str
    num_blocks: int
    num_tokens: int
    layers: list[Layer]
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


def split_kv(blocks: torch.Tensor, head_size: int, block_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of gathered blocks as ``[blocks, heads, tokens, head_size]`` (tokens second to last)."""
    if block_dim == 0 and blocks.dim() == 4 and blocks.shape[-1] == 2 * head_size:
        return blocks[..., :head_size], blocks[..., head_size:]
    if block_dim == 1 and blocks.dim() == 5 and blocks.shape[0] == 2:
        return blocks[0].transpose(1, 2), blocks[1].transpose(1, 2)
    raise ValueError(f"KIVI snapshots need a known KV layout, got {tuple(blocks.shape)} "
                     f"with blocks on dim {block_dim}")


def join_kv(k: torch.Tensor, v: torch.Tensor, block_dim: int) -> torch.Tensor:
    """Inverse of :func:`split_kv`."""
    if block_dim == 0:
        return torch.cat([k, v], dim=-1)
    return torch.stack([k.transpose(1, 2), v.transpose(1, 2)], dim=0)


def _pack(blocks: torch.Tensor, codec: str, head_size: int, block_dim: int) -> Layer:
    if codec in KIVI_SCHEMES:
        k, v = split_kv(blocks, head_size, block_dim)
        return compress_kv(k, v, codec)
    return compress(_head_view(blocks, head_size), codec)


def _unpack(packed: Layer, dtype: torch.dtype, block_dim: int) -> torch.Tensor:
    if isinstance(packed, KiviKV):
        k, v = decompress_kv(packed)
        return join_kv(k, v, block_dim).to(dtype)
    blocks = decompress(packed).to(dtype)
    return blocks.reshape(*blocks.shape[:-2], -1)


def take(kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int], *, codec: str,
         head_size: int, num_tokens: int = 0, block_dim: int = 0) -> KvSnapshot:
    """Compress ``block_ids`` of every layer into host memory (raw for 8-bit caches)."""
    if not block_ids:
        raise ValueError("a snapshot needs at least one block")
    codec = effective_codec(codec, kv_caches[0].element_size())
    layers: list[Layer] = []
    raw = 0
    for cache in kv_caches:
        ids = torch.as_tensor(list(block_ids), dtype=torch.long, device=cache.device)
        blocks = cache.index_select(block_dim, ids)
        raw += blocks.numel() * blocks.element_size()
        if codec == "none":  # raw bytes: also right for fp8 / uint8 caches torch cannot scale
            packed: Layer = Compressed("none", blocks, None, blocks.shape, blocks.dtype)
        else:
            packed = _pack(blocks, codec, head_size, block_dim)
        on_gpu = cache.device.type == "cuda"
        host = packed.to("cpu") if on_gpu else packed
        if on_gpu:
            host = _pinned(host)
        layers.append(host)
    return KvSnapshot(codec, len(block_ids), num_tokens, layers, raw)


def _pinned(layer: Layer) -> Layer:
    if isinstance(layer, KiviKV):
        for q in (layer.keys, layer.values):
            q.data = q.data.pin_memory()
        return layer
    layer.data = layer.data.pin_memory()
    return layer


def _blocks_of(packed: Layer, cache: torch.Tensor, block_dim: int) -> torch.Tensor:
    on_device = packed.to(cache.device, non_blocking=True)
    if isinstance(on_device, Compressed) and on_device.codec == "none":
        return on_device.data.reshape(on_device.shape)
    return _unpack(on_device, cache.dtype, block_dim)


def restore(snapshot: KvSnapshot, kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int], *,
            block_dim: int = 0) -> None:
    """Write the snapshot into ``block_ids`` (new blocks of the resumed request), layer by layer."""
    if len(block_ids) != snapshot.num_blocks:
        raise ValueError(f"snapshot holds {snapshot.num_blocks} blocks, got {len(block_ids)} targets")
    restore_from(snapshot, kv_caches, block_ids, first_block=0, block_dim=block_dim)


def restore_from(snapshot: KvSnapshot, kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int],
                 *, first_block: int, block_dim: int = 0) -> None:
    """Restore snapshot blocks ``first_block ..`` into ``block_ids`` (the rest came from elsewhere,
    e.g. vLLM's own prefix cache, and must not be overwritten with lossy copies)."""
    if len(kv_caches) != len(snapshot.layers):
        raise ValueError(f"snapshot has {len(snapshot.layers)} layers, cache has {len(kv_caches)}")
    count = len(block_ids)
    if first_block < 0 or first_block + count > snapshot.num_blocks:
        raise ValueError(f"blocks {first_block}..{first_block + count} outside the snapshot's "
                         f"{snapshot.num_blocks}")
    if count == 0:
        return
    for cache, packed in zip(kv_caches, snapshot.layers):
        blocks = _blocks_of(packed, cache, block_dim).narrow(block_dim, first_block, count)
        ids = torch.as_tensor(list(block_ids), dtype=torch.long, device=cache.device)
        if cache.element_size() == 1:  # fp8: torch has no index_copy_ for float8 on CPU; bytes
            cache.view(torch.uint8).index_copy_(block_dim, ids, blocks.view(torch.uint8))
        else:
            cache.index_copy_(block_dim, ids, blocks)
