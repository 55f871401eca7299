"""On a GPU with kvcached: a quota shrink returns device memory, or, where kvcached cannot run the
installed vLLM, the engine still starts, in throttle mode, saying why.

Needs CUDA, the CUDA build of vLLM and kvcached (``pip install 'vramshare[kvcached]'``: kvcached
0.1.6 with a vLLM it supports, >=0.29,<0.31 with Model Runner V2); skipped otherwise, and it has not
run yet (no GPU on the CI machines). Free device memory is ``torch.cuda.mem_get_info``
(cudaMemGetInfo) of an idle engine before and after a shrink.
"""
from __future__ import annotations

import importlib.util
import os
import time
from importlib import metadata

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]

torch = pytest.importorskip("torch")

from vllm_patches.testing import write_quota  # noqa: E402
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
if importlib.util.find_spec("kvcached") is None:
    pytest.skip("needs kvcached (pip install 'vramshare[kvcached]', builds with CUDA)",
                allow_module_level=True)

MIB = 1 << 20


def start_engine(tmp_path):  # noqa: ANN001, ANN201
    from vllm_patches.testing import save_random_llama

    model = save_random_llama(str(tmp_path / "m"), seed=0)
    quota = str(tmp_path / "quota.json")
    write_quota(quota, 2048, 1)
    os.environ.update({"VRAMSHARE_QUOTA_FILE": quota, "VRAMSHARE_QUOTA_POLL_S": "0.2",
                       "ENABLE_KVCACHED": "true", "KVCACHED_AUTOPATCH": "1",
                       "KVCACHED_IPC_NAME": f"vramshare_gputest_{os.getpid()}",
                       "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    from vllm import LLM

    llm = LLM(model=model, load_format="auto", skip_tokenizer_init=True, max_model_len=512,
              enforce_eager=True, dtype="bfloat16")
    return llm, quota, llm.llm_engine.engine_core.engine_core.scheduler._vramshare


def test_shrink_unmaps_kv_pages_or_the_engine_says_why_not(tmp_path) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_patches.kvcached_compat import unsupported_reason

    reason = unsupported_reason(metadata.version("vllm"), metadata.version("kvcached"))
    llm, quota, ec = start_engine(tmp_path)  # starts either way
    if reason is not None:  # e.g. vLLM 0.32 with kvcached 0.1.6: no runner adapter
        assert ec.releaser.mode == "throttle" and ec.releaser.reason == reason
        return
    assert ec.releaser.mode == "unmap" and ec.cap.pool_limits
    prompts = [TokensPrompt(prompt_token_ids=list(range(3, 400))) for _ in range(32)]
    llm.generate(prompts, SamplingParams(max_tokens=64, ignore_eos=True, detokenize=False))
    torch.cuda.synchronize()
    free_before, _ = torch.cuda.mem_get_info()
    write_quota(quota, 1024, 2)
    deadline = time.monotonic() + 10
    while ec.generation_applied != 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ec.generation_applied == 2, "the shrink was not acknowledged"
    free_after, _ = torch.cuda.mem_get_info()
    released = free_after - free_before
    assert released >= 256 * MIB, f"only {released / MIB:.0f} MiB returned after a 1024 MiB shrink"
    assert ec.cap.block_bytes * ec.cap.cap <= 1024 * MIB
