"""When snapshots pay and when the connector stays off (issue 20 item 6). Pure, no vLLM."""
from __future__ import annotations

from types import SimpleNamespace

from vllm_patches.snapshot_policy import costs_hybrid_manager, worth_snapshot


def test_a_preempted_request_whose_blocks_stay_cached_gets_no_snapshot() -> None:
    # prefix caching on (vLLM's default): its blocks survive while the pool has truly free ones
    assert not worth_snapshot(True, raw_free_blocks=40, request_blocks=8)  # the quota cap's case
    assert worth_snapshot(True, raw_free_blocks=3, request_blocks=8)  # pool full: evicted soon
    assert worth_snapshot(False, raw_free_blocks=40, request_blocks=8)  # freed blocks are lost


def test_snapshots_never_switch_off_the_hybrid_manager_unasked() -> None:
    assert costs_hybrid_manager(None, platform_supports_hma=True, model_uses_hma=True)
    assert not costs_hybrid_manager(True, True, True)  # the operator turned HMA off: their call
    assert not costs_hybrid_manager(None, True, False)  # a plain full-attention model: no cost
    assert not costs_hybrid_manager(None, False, True)  # CPU: vLLM runs without HMA anyway


def test_which_models_use_the_hybrid_manager() -> None:
    from vllm_patches.vllm_glue import model_uses_hma

    def mc(hybrid=False, window=None, chunk=None) -> SimpleNamespace:
        return SimpleNamespace(is_hybrid=hybrid, get_sliding_window=lambda: window,
                               attention_chunk_size=chunk)

    assert model_uses_hma(mc(hybrid=True)) and model_uses_hma(mc(window=4096))
    assert model_uses_hma(mc(chunk=8192)) and not model_uses_hma(mc())
