"""kvcached on a vLLM it cannot run: detected in process 0, the engine starts in throttle mode and
says why (issue 20 item 1). Pure: no vLLM, no kvcached."""
from __future__ import annotations

import pytest

from vllm_patches import kvcached_compat as compat
from vllm_patches import release


@pytest.mark.parametrize("vllm,kvcached,ok", [
    ("0.30.0", "0.1.6", True), ("0.29.1", "0.1.6", True), ("0.17.0", "0.1.6", True),
    ("0.32.0", "0.1.6", False),  # the pinned vLLM: kvcached raises "no runner adapter"
    ("0.33.0", "0.1.6", False), ("0.31.0", "0.1.6", False), ("0.16.0", "0.1.6", False),
    ("0.24.0", "0.1.5", True), ("0.32.0", "0.1.5", False),
    ("0.30.0", "0.2.0", False), ("0.30.0", None, False),
    ("0.30.0+cpu", "0.1.6", True), ("0.31.0rc1", "0.1.6", False),
])
def test_supported_pairs_are_kvcacheds_own(vllm: str, kvcached: str | None, ok: bool) -> None:
    assert (compat.unsupported_reason(vllm, kvcached) is None) is ok


def test_an_unsupported_pair_switches_kvcached_off_for_the_process_tree() -> None:
    env = {"ENABLE_KVCACHED": "true", "KVCACHED_AUTOPATCH": "1"}
    reason = compat.fall_back_if_unsupported(env, "0.32.0", "0.1.6")
    assert reason == "kvcached 0.1.6 supports vLLM >=0.17.0,<0.31.0, not 0.32.0"
    # kvcached's patches read ENABLE_KVCACHED at every call: off, its EngineCore check never runs
    assert env["ENABLE_KVCACHED"] == "false" and env[compat.ENV_FALLBACK] == reason
    # the engine processes inherit the environment: the same answer there, kvcached stays off
    assert compat.fall_back_if_unsupported(dict(env), "0.32.0", "0.1.6") == reason
    chosen = release.choose(env, pool=object())
    assert chosen.mode == release.MODE_THROTTLE and chosen.reason == reason


def test_a_supported_pair_or_kvcached_off_changes_nothing() -> None:
    env = {"ENABLE_KVCACHED": "true"}
    assert compat.fall_back_if_unsupported(env, "0.30.0", "0.1.6") is None
    assert env == {"ENABLE_KVCACHED": "true"}
    assert compat.fall_back_if_unsupported({}, "0.32.0", "0.1.6") is None
    vouched = {"ENABLE_KVCACHED": "true", compat.ENV_ASSUME_SUPPORTED: "1"}
    assert compat.fall_back_if_unsupported(vouched, "0.33.0", "0.1.6") is None
    assert vouched["ENABLE_KVCACHED"] == "true"


def test_kvcached_on_but_not_managing_the_pool_throttles_with_a_reason() -> None:
    class VllmPool:  # vLLM's own BlockPool: no kv_cache_manager
        pass

    chosen = release.choose({"ENABLE_KVCACHED": "true"}, VllmPool())
    assert chosen.mode == release.MODE_THROTTLE and "did not patch" in chosen.reason
    assert release.choose({}, VllmPool()).reason == ""  # kvcached not asked for: no reason


def test_the_segment_name_from_the_container_is_kept() -> None:
    env = {"ENABLE_KVCACHED": "1", "KVCACHED_IPC_NAME": "vramshare_0123456789abcdef"}
    assert release.check_ipc_name(env) == "vramshare_0123456789abcdef"
    assert release.check_ipc_name({}) is None
