"""KIVI-style KV codec: keys per channel in token groups, values per token (arXiv 2402.02750).

Pure torch. Keys of real models have a few *outlier channels* (dimensions far larger than the rest,
for every token, often with a large mean). A per-token scale is set by the outlier and flattens the
other channels onto a few levels; a per-channel scale over a group of tokens gives each channel its
own range. Values have no such structure and their error is averaged by the attention weights, so
they stay per token. Key groups divide a KV block (32 tokens in vLLM by default): a snapshot always
holds whole blocks.

Schemes (bytes per token at head size 64 against 256 of bf16 K+V):

=========  =====================================================  ==========================  =====
scheme     keys                                                   values                      ratio
=========  =====================================================  ==========================  =====
``kivi8``  8-bit asymmetric, per channel over 32 tokens           8-bit symmetric, per token  1.91x
``kivi4``  4-bit asymmetric, per channel over 16 tokens           4-bit asymmetric, per token
                                                                  and 16-channel group        3.20x
=========  =====================================================  ==========================  =====

Asymmetric (min/max) grids matter for keys: an outlier channel with a large mean sits far from 0,
and a symmetric grid would spend half its levels on values that never occur. The per-group metadata
is 1 byte each, so that the asymmetric grid fits the same budget as a bf16 symmetric scale:

* scale: "log8", ``2**(e/8)`` for an int8 ``e``, rounded *up* (at most 9% coarser than ideal,
  range 2**-16 .. 2**15.9);
* zero point: fp8 e4m3 rounded *down* (toward -inf), so every value is >= the zero point and the
  grid is computed from the stored zero; the range grows by at most 12.5% of ``|zero|``. When a
  tensor has zero points beyond e4m3's +-448, all of its zero points are stored divided by one
  power of two (``zero_scale``, one float per tensor).

Symmetric value scales are bf16, rounded up, as in :mod:`vllm_patches.codecs`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# scheme -> (bits, key token group, value channel group (0 = whole head), values asymmetric)
SCHEMES: dict[str, tuple[int, int, int, bool]] = {"kivi8": (8, 32, 0, False),
                                                  "kivi4": (4, 16, 16, True)}
TINY = 1e-30
E4M3_MAX = 448.0


def _round_up_bf16(x: torch.Tensor) -> torch.Tensor:
    """Positive fp32 -> the next bf16-representable value (as fp32)."""
    return ((x.contiguous().view(torch.int32) + 0xFFFF) & -0x10000).view(torch.float32)


def log8_encode_up(s: torch.Tensor) -> torch.Tensor:
    """int8 ``e`` with ``2**(e/8) >= s`` (saturating at both ends)."""
    e = torch.ceil(8.0 * torch.log2(s.clamp_min(TINY)))
    # guard against log2 / exp2 rounding both ways: the smallest e whose decoded value is >= s
    e = torch.where(torch.exp2((e - 1) / 8.0) >= s, e - 1, e)
    e = torch.where(torch.exp2(e / 8.0) < s, e + 1, e)
    return e.clamp_(-128, 127).to(torch.int8)


def log8_decode(e: torch.Tensor) -> torch.Tensor:
    return torch.exp2(e.float() / 8.0)


def e4m3_floor(z: torch.Tensor) -> torch.Tensor:
    """The largest e4m3 value <= ``z`` (saturated to +-448), as uint8 bits."""
    zc = z.clamp(-E4M3_MAX, E4M3_MAX)
    bits = zc.to(torch.float8_e4m3fn).view(torch.uint8).to(torch.int16)
    up = bits.to(torch.uint8).view(torch.float8_e4m3fn).float() > zc
    # one step toward -inf: smaller magnitude for positives, larger for negatives; +0 -> -min
    positive = bits < 0x80
    down = torch.where(positive, torch.where(bits == 0, torch.full_like(bits, 0x81), bits - 1),
                       bits + 1)
    return torch.where(up, down, bits).to(torch.uint8)


def e4m3_decode(bits: torch.Tensor) -> torch.Tensor:
    return bits.view(torch.float8_e4m3fn).float()


def _zero_scale(mins: torch.Tensor) -> float:
    """A power of two (>= 1) that brings every zero point into e4m3's +-448, once per tensor."""
    worst = float(mins.abs().max()) if mins.numel() else 0.0
    if worst <= E4M3_MAX:
        return 1.0
    return float(2.0 ** math.ceil(math.log2(worst / E4M3_MAX)))


@dataclass
class Quantized:
    """A tensor viewed as ``[rows, a, b]`` and quantized over axis 1 (``a``) or 2 (``b``)."""

    data: torch.Tensor
    scale: torch.Tensor  # bf16 (symmetric) or int8 log8 (asymmetric)
    zero: torch.Tensor | None  # uint8 e4m3 bits (asymmetric)
    bits: int
    view: tuple[int, int]  # (a, b)
    shape: torch.Size
    dtype: torch.dtype
    zero_scale: float = 1.0  # power of two the e4m3 zero points are multiplied by

    @property
    def nbytes(self) -> int:
        n = self.data.numel() * self.data.element_size()
        n += self.scale.numel() * self.scale.element_size()
        return n + (0 if self.zero is None else self.zero.numel())

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "Quantized":
        zero = None if self.zero is None else self.zero.to(device, non_blocking=non_blocking)
        return Quantized(self.data.to(device, non_blocking=non_blocking),
                         self.scale.to(device, non_blocking=non_blocking), zero, self.bits,
                         self.view, self.shape, self.dtype, self.zero_scale)


def quantize(x: torch.Tensor, view: tuple[int, int], axis: int, bits: int,
             asym: bool) -> Quantized:
    """Quantize ``x`` seen as ``[-1, *view]`` with one grid per slice along ``axis`` (1 or 2)."""
    a, b = view
    if x.numel() % (a * b):
        raise ValueError(f"shape {tuple(x.shape)} is not whole groups of {a}x{b}")
    if bits == 4 and b % 2:
        raise ValueError(f"4-bit packs pairs; the last group dimension {b} is odd")
    xf = x.reshape(-1, a, b).to(torch.float32, copy=True)  # worked on in place below
    zero_scale = 1.0
    if asym:
        mins = xf.amin(axis, keepdim=True)
        zero_scale = _zero_scale(mins)
        zero = e4m3_floor(mins / zero_scale)
        lo = e4m3_decode(zero) * zero_scale
        levels = float((1 << bits) - 1)
        scale = log8_encode_up((xf.amax(axis, keepdim=True) - lo) / levels)
        xf.sub_(lo).mul_(log8_decode(scale).reciprocal_())
        q = xf.round_().clamp_(0, levels).to(torch.uint8)
        zero_out: torch.Tensor | None = zero
    else:
        qmax = float((1 << (bits - 1)) - 1)
        s = _round_up_bf16((xf.abs().amax(axis, keepdim=True) / qmax).clamp_min(TINY))
        xf.mul_(s.reciprocal())
        q = xf.round_().clamp_(-qmax, qmax)
        q = q.to(torch.int8) if bits == 8 else q.add_(8.0).to(torch.uint8)
        scale, zero_out = s.bfloat16(), None
    if bits == 4:
        half = b // 2
        q = q[..., :half] | (q[..., half:] << 4)
    return Quantized(q, scale, zero_out, bits, view, x.shape, x.dtype, zero_scale)


def dequantize(c: Quantized) -> torch.Tensor:
    q = c.data
    if c.bits == 4:
        q = torch.cat([q & 0x0F, q >> 4], dim=-1)
    xf = q.to(torch.float32)
    if c.zero is None:
        if c.bits == 4:
            xf.sub_(8.0)
        xf.mul_(c.scale.float())
    else:
        xf.mul_(log8_decode(c.scale)).add_(e4m3_decode(c.zero) * c.zero_scale)
    return xf.to(c.dtype).reshape(c.shape)


@dataclass
class KiviKV:
    """Keys and values of some blocks, compressed."""

    scheme: str
    keys: Quantized
    values: Quantized

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "KiviKV":
        return KiviKV(self.scheme, self.keys.to(device, non_blocking),
                      self.values.to(device, non_blocking))


def scheme_bits(scheme: str) -> int:
    if scheme not in SCHEMES:
        raise ValueError(f"unknown KIVI scheme {scheme!r}; choose one of {', '.join(SCHEMES)}")
    return SCHEMES[scheme][0]


def compress_kv(k: torch.Tensor, v: torch.Tensor, scheme: str) -> KiviKV:
    """``k``, ``v``: ``[..., tokens, head_size]``, token axis second to last, tokens a multiple of
    the scheme's key group (a block holds 32 tokens in vLLM's default)."""
    scheme_bits(scheme)
    bits, group, vgroup, vasym = SCHEMES[scheme]
    dim = k.shape[-1]
    if k.shape[-2] % group:
        raise ValueError(f"{k.shape[-2]} tokens are not whole groups of {group}")
    keys = quantize(k, (group, dim), 1, bits, True)
    vg = vgroup or dim
    if dim % vg:
        raise ValueError(f"head size {dim} is not whole groups of {vg} channels")
    values = quantize(v, (dim // vg, vg), 2, bits, vasym)
    return KiviKV(scheme, keys, values)


def decompress_kv(c: KiviKV) -> tuple[torch.Tensor, torch.Tensor]:
    return dequantize(c.keys), dequantize(c.values)
