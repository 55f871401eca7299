"""kvcached on the pinned vLLM (0.32): kvcached 0.1.6's own ``EngineCorePatch`` refuses to build the
engine ("kvcached has no runner adapter for vLLM 0.32.0"); with the plugin the engine starts, in
throttle mode, with the reason on ``vramshare_vllm_release_mode`` (issue 20 item 1).

kvcached's patch is applied to vLLM's ``EngineCore`` as its autopatch does on ``import vllm``
(vendored verbatim, ``kvcached_py/kvcached/integration/vllm/patches.py``), and taken off after."""
from __future__ import annotations

import json
import os
from typing import Any, Iterator

import pytest

pytest.importorskip("vllm", reason="needs the vLLM engine: pip install -e '.[vllm]'")

from tests.vllm_patches.kvcached_pool import load_kvcached  # noqa: E402

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.filterwarnings("ignore:`torch.distributed.reduce_op` is deprecated:FutureWarning"),
]

TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 512,
        "intermediate_size": 1024, "num_hidden_layers": 2, "num_attention_heads": 8,
        "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 512, "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2, "rope_theta": 10000.0, "hidden_act": "silu"}


@pytest.fixture
def kvcached_patched_vllm(tmp_path) -> Iterator[dict[str, Any]]:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(TINY))
    quota = tmp_path / "quota.json"
    quota.write_text(json.dumps({"generation": 1, "gpus": [{"uuid": "", "limitMiB": 40}]}))
    load_kvcached()
    env = {"VRAMSHARE_QUOTA_FILE": str(quota), "VRAMSHARE_ACTIVATION_MIB": "4",
           "VRAMSHARE_QUOTA_POLL_S": "3600", "VRAMSHARE_VLLM_STATE_DIR": str(tmp_path / "state"),
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "ENABLE_KVCACHED": "true",
           "KVCACHED_AUTOPATCH": "1", "VRAMSHARE_KVCACHED_FALLBACK": "",
           "VRAMSHARE_KVCACHED_ASSUME_SUPPORTED": ""}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    import vllm.v1.engine.core as core
    from kvcached.integration.vllm.patches import EngineCorePatch

    saved_attrs = {name: core.EngineCore.__dict__[name] for name in
                   ("__init__", "step_with_batch_queue", "shutdown") if name in core.EngineCore.__dict__}
    assert EngineCorePatch().apply(core)  # kvcached 0.1.6 on vLLM 0.32: this patch takes
    try:
        yield {"model": str(tmp_path / "m")}
    finally:
        for name, value in saved_attrs.items():
            setattr(core.EngineCore, name, value)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def test_unsupported_kvcached_falls_back_to_throttle_and_the_engine_starts(kvcached_patched_vllm):
    from prometheus_client import REGISTRY, generate_latest
    from vllm import LLM

    from vllm_patches import plugin

    plugin.register(force=True)  # process 0, before the engine: kvcached off for the tree
    assert os.environ["ENABLE_KVCACHED"] == "false"
    llm = LLM(model=kvcached_patched_vllm["model"], load_format="dummy", skip_tokenizer_init=True,
              max_model_len=128, max_num_seqs=4, max_num_batched_tokens=128, enforce_eager=True,
              dtype="bfloat16", block_size=32)
    try:
        ec = llm.llm_engine.engine_core.engine_core.scheduler._vramshare
        reason = "kvcached 0.1.6 supports vLLM >=0.17.0,<0.31.0, not 0.32.0"
        assert ec.releaser.mode == "throttle" and ec.releaser.reason == reason
        ec.publish()
        text = generate_latest(REGISTRY).decode()
        assert f'vramshare_vllm_release_mode{{engine="0",mode="throttle",reason="{reason}"}} 1.0' in text
    finally:
        llm.llm_engine.engine_core.shutdown()
