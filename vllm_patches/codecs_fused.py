"""The KV codecs as single tensor expressions, for ``torch.compile`` to fuse into one kernel.

Same math and the same bytes as :mod:`vllm_patches.codecs` (tests check bit equality), written
without the chunk loop and scratch buffers: eager PyTorch runs each elementwise op as its own pass
over memory, which on CPU makes compression ~10x slower than a copy; a compiler fuses the whole
expression into one read of the input and one write of payload and scales. Compiling costs tens of
seconds on CPU (C++/OpenMP via Inductor) and a few on CUDA (Triton), so it pays for long-running
engines and benchmarks, not for one-off calls; :func:`compiled` caches one compiled pair per codec.
"""
from __future__ import annotations

import functools
from typing import Callable

import torch

from .codecs import QMAX, TINY_SCALE, Compressed, codec_bits

_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn, "int4": torch.uint8}


def quantize(x: torch.Tensor, codec: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(payload, bf16 scales)`` of ``x`` viewed as ``[rows, head_size]``."""
    qmax = QMAX[codec]
    xf = x.reshape(-1, x.shape[-1]).float()
    scale = (xf.abs().amax(-1, keepdim=True) / qmax).clamp_min(TINY_SCALE)
    # round the scale up to a bf16 value (see codecs.compress)
    scale = ((scale.view(torch.int32) + 0xFFFF) & -0x10000).view(torch.float32)
    y = xf * scale.reciprocal()
    if codec == "fp8":
        data = y.to(torch.float8_e4m3fn)
    elif codec == "int8":
        data = torch.round(y).to(torch.int8)
    else:
        q = (torch.round(y) + 8.0).to(torch.uint8)
        half = q.shape[-1] // 2
        data = q[:, :half] | (q[:, half:] << 4)
    return data, scale.to(torch.bfloat16)


def dequantize(data: torch.Tensor, scale: torch.Tensor, codec: str,
               dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`quantize`, as ``[rows, head_size]`` in ``dtype``."""
    if codec == "int4":
        q = torch.cat(((data & 0x0F), (data >> 4)), dim=-1).float() - 8.0
    else:
        q = data.float()
    return (q * scale.float()).to(dtype)


def compress(x: torch.Tensor, codec: str,
             fn: Callable[[torch.Tensor, str], tuple[torch.Tensor, torch.Tensor]] = quantize) -> Compressed:
    """A :class:`~vllm_patches.codecs.Compressed` built by ``fn`` (eager or compiled)."""
    codec_bits(codec)
    if codec == "none":
        return Compressed(codec, x.clone(), None, x.shape, x.dtype)
    data, scale = fn(x, codec)
    return Compressed(codec, data, scale, x.shape, x.dtype)


def decompress(c: Compressed, fn: Callable[..., torch.Tensor] = dequantize) -> torch.Tensor:
    if c.codec == "none":
        return c.data.clone()
    assert c.scale is not None
    return fn(c.data, c.scale, c.codec, c.dtype).reshape(c.shape)


@functools.lru_cache(maxsize=None)
def compiled(codec: str) -> tuple[Callable[[torch.Tensor], Compressed], Callable[[Compressed], torch.Tensor]]:
    """``(compress, decompress)`` for one codec, compiled on first call (shapes specialised)."""
    cq = torch.compile(quantize, dynamic=False)
    cdq = torch.compile(dequantize, dynamic=False)
    return (lambda x: compress(x, codec, cq)), (lambda c: decompress(c, cdq))
