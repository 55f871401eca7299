"""KV compression codecs, per token and head: int8, fp8 (e4m3) and int4 (two per byte), with scales.

Pure torch, CPU and CUDA alike. A KV tensor's last dimension is the head dimension in every vLLM
layout, so "per token and head" is "one scale per vector along the last dimension", whatever the
other dimensions are (blocks, K/V, heads, tokens). That makes the codecs layout-agnostic: they take
any ``[..., head_size]`` tensor.

Scales are stored as bfloat16: 2 bytes per (token, head) keeps int8 at 1.94x and int4 at 3.76x of
bf16 for head size 64 (fp32 scales would cost int8 its 1.9x), and unlike float16 it keeps full range
(K/V rows of 1e-3 would need fp16 subnormal scales). The scale is rounded *up* to bf16 and values are
quantized with the rounded scale, so the stored scale is exactly the one used and no clamp is needed;
the price is a step at most 2^-7 coarser than ideal.

Symmetric absmax scaling: ``scale = max|x| / qmax``. int4 uses levels -7..7 stored as 1..15 (0 unused),
so unpacking needs no sign extension; element ``j`` shares a byte with element ``j + head_size/2``
(low and high nibble), so both packing and unpacking work on contiguous halves and vectorize.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

CODECS = ("none", "int8", "fp8", "int4")
QMAX = {"int8": 127.0, "fp8": 448.0, "int4": 7.0}
_BITS = {"none": 16, "int8": 8, "fp8": 8, "int4": 4, "kivi8": 8, "kivi4": 4}  # kivi: vllm_patches.kivi
TINY_SCALE = 1e-30  # floor for all-zero vectors (a normal bf16 number)


def codec_bits(name: str) -> int:
    """Bits per element a codec stores (16 for ``none``); ValueError on an unknown name."""
    if name not in _BITS:
        raise ValueError(f"unknown KV codec {name!r}; choose one of {', '.join(_BITS)}")
    return _BITS[name]


@dataclass
class Compressed:
    """One compressed tensor: payload, per-vector scales, and what to restore it to."""

    codec: str
    data: torch.Tensor
    scale: torch.Tensor | None
    shape: torch.Size
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        size = self.data.numel() * self.data.element_size()
        if self.scale is not None:
            size += self.scale.numel() * self.scale.element_size()
        return size

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "Compressed":
        """Move payload and scales (e.g. to pinned host memory for a snapshot)."""
        scale = None if self.scale is None else self.scale.to(device, non_blocking=non_blocking)
        return Compressed(self.codec, self.data.to(device, non_blocking=non_blocking), scale,
                          self.shape, self.dtype)


def _chunk_rows(x: torch.Tensor) -> int:
    """Rows per step: whole tensor on GPUs, ~1 MiB of fp32 on CPU.

    On CPU every full-size fp32 temporary costs a page-faulting allocation and a trip through DRAM;
    working through cache-sized chunks with reused scratch buffers makes compression a few passes
    over L2 instead, which is what keeps it within a small factor of a plain copy.
    """
    if x.device.type != "cpu":
        return max(1, x.numel() // max(1, x.shape[-1]))
    return max(1, (1 << 18) // max(1, x.shape[-1]))


@functools.lru_cache(maxsize=1)
def _fp8_table() -> torch.Tensor:
    """The fp32 value of each of the 256 e4m3 bit patterns (NaN patterns stay NaN)."""
    return torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()


def compress(x: torch.Tensor, codec: str) -> Compressed:
    """Compress ``x`` (``[..., head_size]``, any float dtype) with one scale per last-dim vector."""
    if codec not in CODECS:
        raise ValueError(f"per-vector codec must be one of {', '.join(CODECS)}, got {codec!r} "
                         f"(KIVI schemes need K and V apart: vllm_patches.kivi.compress_kv)")
    if codec == "none":
        return Compressed(codec, x.clone(), None, x.shape, x.dtype)
    dim = x.shape[-1]
    if codec == "int4" and dim % 2:
        raise ValueError(f"int4 packs pairs; head size {dim} is odd")
    flat = x.reshape(-1, dim)
    rows, qmax = flat.shape[0], QMAX[codec]
    width = dim // 2 if codec == "int4" else dim
    dtype = {"int8": torch.int8, "fp8": torch.float8_e4m3fn, "int4": torch.uint8}[codec]
    data = torch.empty(rows, width, dtype=dtype, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.bfloat16, device=x.device)
    step = _chunk_rows(x)
    buf = torch.empty(min(rows, step), dim, dtype=torch.float32, device=x.device)
    amax = torch.empty(min(rows, step), 1, dtype=torch.float32, device=x.device)
    qbuf = torch.empty(min(rows, step), dim, dtype=torch.uint8, device=x.device) if codec == "int4" else None
    tmp = torch.empty_like(buf)
    for s in range(0, rows, step):
        n = min(step, rows - s)
        b, a, sc = buf[:n], amax[:n], scale[s:s + n]
        b.copy_(flat[s:s + n])
        torch.amax(torch.abs(b, out=tmp[:n]), dim=-1, keepdim=True, out=a)
        a.div_(qmax).clamp_min_(TINY_SCALE)
        # Round the scale *up* to a bf16 value (positive float: add 0xFFFF to the bits, drop the low
        # 16), so |x / scale| <= qmax, the bf16 copy is exact, and no clamp pass is needed.
        a.view(torch.int32).add_(0xFFFF).bitwise_and_(-0x10000)
        sc.copy_(a)
        a.reciprocal_()
        b.mul_(a)
        if codec == "fp8":
            data[s:s + n].copy_(b)
        elif codec == "int8":
            data[s:s + n].copy_(b.round_())
        else:  # levels -7..7 -> 1..15; element j in the low nibble, j + dim/2 in the high one
            assert qbuf is not None
            q = qbuf[:n]
            q.copy_(b.round_().add_(8.0))
            torch.bitwise_or(q[:, :width], q[:, width:] << 4, out=data[s:s + n])
    return Compressed(codec, data, scale, x.shape, x.dtype)


def decompress(c: Compressed, out: torch.Tensor | None = None) -> torch.Tensor:
    """Restore a :class:`Compressed` to its original shape and dtype (into ``out`` if given)."""
    if out is None:
        out = torch.empty(c.shape, dtype=c.dtype, device=c.data.device)
    if c.codec == "none":
        return out.copy_(c.data)
    assert c.scale is not None
    dim = c.shape[-1]
    flat = out.view(-1, dim)
    rows = flat.shape[0]
    step = _chunk_rows(flat)
    buf = torch.empty(min(rows, step), dim, dtype=torch.float32, device=c.data.device)
    sbuf = torch.empty(min(rows, step), 1, dtype=torch.float32, device=c.data.device)
    ibuf = torch.empty(min(rows, step), dim, dtype=torch.int32, device=c.data.device)
    for s in range(0, rows, step):
        n = min(step, rows - s)
        b, sc = buf[:n], sbuf[:n]
        chunk = c.data[s:s + n]
        if c.codec == "int4":
            half = dim // 2
            b[:, :half].copy_(chunk & 0x0F)
            b[:, half:].copy_(chunk >> 4)
            b.sub_(8.0)
        elif c.codec == "fp8" and chunk.device.type == "cpu":
            # PyTorch converts fp8 element by element on CPU; a 256-entry table lookup is faster.
            idx = ibuf[:n].view(-1)
            idx.copy_(chunk.view(torch.uint8).reshape(-1))
            torch.index_select(_fp8_table(), 0, idx, out=b.view(-1))
        else:
            b.copy_(chunk)
        b.mul_(sc.copy_(c.scale[s:s + n]))
        flat[s:s + n].copy_(b)
    return out


def compression_ratio(c: Compressed, baseline_bytes_per_elem: int = 2) -> float:
    """Size of the tensor in bf16/fp16 over its compressed size."""
    elems = 1
    for d in c.shape:
        elems *= d
    return elems * baseline_bytes_per_elem / c.nbytes
