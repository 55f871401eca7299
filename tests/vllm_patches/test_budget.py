"""KV budget arithmetic and the runtime block cap (pure core, no vLLM)."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_patches.budget import (MIB, Headroom, ModelShape, QuotaTooSmall, activation_bytes,
                                 kv_bytes_per_token, min_kv_bytes,
                                 headroom_from_env, llama_param_count, min_blocks_for, plan_kv,
                                 slice_request, weights_bytes)
from vllm_patches.cap import KvCap, cap_blocks, cap_usage, capped_free

# Llama-2-7B: 6,738,415,616 parameters (the published count).
LLAMA2_7B = ModelShape(hidden_size=4096, intermediate_size=11008, num_layers=32, num_heads=32,
                       num_kv_heads=32, head_size=128, vocab_size=32000, dtype_bytes=2)


def test_llama_param_count_matches_published_7b() -> None:
    assert llama_param_count(LLAMA2_7B) == 6_738_415_616
    assert weights_bytes(LLAMA2_7B) == 2 * 6_738_415_616
    assert weights_bytes(LLAMA2_7B, bits_per_param=4) == 6_738_415_616 // 2


def test_tied_embeddings_drop_the_lm_head() -> None:
    tied = ModelShape(**{**LLAMA2_7B.__dict__, "tie_word_embeddings": True})
    assert llama_param_count(LLAMA2_7B) - llama_param_count(tied) == 32000 * 4096


def test_activation_estimate_by_hand() -> None:
    shape = ModelShape(128, 256, 2, 2, 2, 64, 512, 2)
    # per token (4*128 + 6*64 + 3*256) * 2 bytes = 3328; logits 3 * 4 seqs * 512 * 4 bytes = 24576
    assert activation_bytes(shape, 64, 4, factor=1.0) == 64 * 3328 + 24576
    assert activation_bytes(shape, 64, 4, factor=2.0) == 2 * (64 * 3328 + 24576)


def test_headroom_defaults_and_overrides() -> None:
    shape = LLAMA2_7B
    cpu = headroom_from_env({}, shape, 2048, 256, on_cuda=False, cuda_graphs=False)
    assert cpu.cudagraph_bytes == 0 and cpu.runtime_bytes == 0
    assert cpu.activation_bytes == activation_bytes(shape, 2048, 256)
    gpu = headroom_from_env({}, shape, 2048, 256, on_cuda=True, cuda_graphs=True)
    assert gpu.cudagraph_bytes == 512 * MIB and gpu.runtime_bytes == 512 * MIB
    env = {"VRAMSHARE_ACTIVATION_MIB": "100", "VRAMSHARE_CUDAGRAPH_MIB": "0",
           "VRAMSHARE_RUNTIME_OVERHEAD_MIB": "64"}
    assert headroom_from_env(env, shape, 2048, 256, on_cuda=True, cuda_graphs=True) == \
        Headroom(100 * MIB, 0, 64 * MIB)
    factor = headroom_from_env({"VRAMSHARE_ACTIVATION_FACTOR": "1"}, shape, 2048, 256,
                               on_cuda=False, cuda_graphs=False)
    assert factor.activation_bytes == activation_bytes(shape, 2048, 256, 1.0)
    with pytest.raises(ValueError):
        headroom_from_env({"VRAMSHARE_CUDAGRAPH_MIB": "-1"}, shape, 1, 1, on_cuda=True, cuda_graphs=True)


def test_plan_is_quota_minus_weights_minus_headroom() -> None:
    plan = plan_kv(20480, 13_476_831_232, Headroom(1 * 1024 * MIB, 512 * MIB, 512 * MIB))
    assert plan.kv_bytes == 20480 * MIB - 13_476_831_232 - 2048 * MIB
    assert plan.non_kv_bytes == 13_476_831_232 + 2048 * MIB


def test_model_that_cannot_fit_is_refused_with_both_numbers() -> None:
    with pytest.raises(QuotaTooSmall) as err:
        plan_kv(8192, weights_bytes(LLAMA2_7B), Headroom(0, 0, 0))
    assert "12852.5 MiB" in str(err.value) and "8192 MiB" in str(err.value)
    with pytest.raises(QuotaTooSmall, match="leaves no KV cache"):
        plan_kv(14000, weights_bytes(LLAMA2_7B), Headroom(2000 * MIB, 0, 0))


def test_slice_request_judges_the_slice() -> None:
    total = 80 * 1024 * MIB
    # Two tenants already hold 50 GiB: stock vLLM (0.92 x total) would refuse; a 20 GiB slice starts.
    assert slice_request(30 * 1024 * MIB, total, 20 * 1024 * MIB) == 20 * 1024 * MIB
    with pytest.raises(ValueError, match="less than this container's GPU memory quota"):
        slice_request(10 * 1024 * MIB, total, 20 * 1024 * MIB)


def test_min_blocks() -> None:
    assert min_blocks_for(64, 128) == 1
    assert min_blocks_for(4096, 16) == 256
    assert min_blocks_for(4097, 16) == 257


def test_cap_blocks_follows_the_quota_and_clamps() -> None:
    non_kv, block = 100 * MIB, 2 * MIB
    assert cap_blocks(300, non_kv, block, 100, 1) == 100  # 100 blocks fit exactly
    assert cap_blocks(250, non_kv, block, 100, 1) == 75
    assert cap_blocks(251, non_kv, block, 100, 1) == 75  # partial blocks do not count
    assert cap_blocks(1000, non_kv, block, 100, 1) == 100  # never above what the engine holds
    assert cap_blocks(50, non_kv, block, 100, 4) == 4  # never below one full request
    with pytest.raises(ValueError):
        cap_blocks(1, 0, 0, 1, 1)


def test_capped_free() -> None:
    assert capped_free(raw_free=60, usable_blocks=100, cap=100) == 60
    assert capped_free(raw_free=60, usable_blocks=100, cap=50) == 10  # 40 used, 10 more allowed
    assert capped_free(raw_free=30, usable_blocks=100, cap=50) == 0  # 70 used > cap: look full


def test_kv_cap_shrink_and_grow() -> None:
    cap = KvCap(start_limit_mib=300, usable_blocks=100, block_bytes=2 * MIB, min_blocks=2)
    assert cap.non_kv_bytes == 100 * MIB and cap.cap == 100
    assert cap.set_limit(200) == (100, 50)
    assert cap.free(raw_free=80) == 30
    assert cap.set_limit(90) == (50, 2) and cap.below_minimum
    assert cap.set_limit(400) == (2, 100) and not cap.below_minimum
    state = cap.state(raw_free=70)
    assert (state.quota_mib, state.cap_blocks, state.used_blocks) == (400, 100, 30)


@given(st.integers(1, 500), st.data())
def test_usage_is_against_the_cap(usable: int, data: st.DataObject) -> None:
    """An idle engine reads 0 whatever the cap; a full cap reads 1; never outside [0, 1]."""
    cap = data.draw(st.integers(1, usable))
    used = data.draw(st.integers(0, usable))
    usage = cap_usage(usable - used, usable, cap)
    assert 0.0 <= usage <= 1.0
    assert cap_usage(usable, usable, cap) == 0.0
    assert usage == min(1.0, used / cap)


def test_quota_below_one_full_length_request_is_refused_with_our_reason() -> None:
    """vLLM would say "0.0 GiB > 0.0 GiB" for a small model; we name the quota and the fix."""
    per_token = kv_bytes_per_token(LLAMA2_7B, 2)
    assert per_token == 2 * 32 * 32 * 128 * 2  # 512 KiB per token for Llama-2-7B in bf16
    need = min_kv_bytes(4096, 16, per_token)
    assert need == (256 + 1) * 16 * per_token  # whole blocks plus the null block
    weights = weights_bytes(LLAMA2_7B)
    quota_mib = (weights + need) // MIB - 10  # ~10 MiB short
    with pytest.raises(QuotaTooSmall) as err:
        plan_kv(quota_mib, weights, Headroom(0, 0, 0), need, 4096)
    text = str(err.value)
    assert f"quota {quota_mib} MiB" in text and "max_model_len 4096" in text
    assert f"{need / MIB:.2f} MiB" in text and "lower max_model_len" in text
    assert plan_kv(quota_mib + 20, weights, Headroom(0, 0, 0), need, 4096).kv_bytes >= need
