"""On a GPU with kvcached: a quota shrink returns device memory (the release mode says so).

Skipped without CUDA, the CUDA build of vLLM, or kvcached (``pip install 'vramshare[kvcached]'``);
none of them exists on the CI machines, so this has not run yet. Measures free device memory
(``torch.cuda.mem_get_info``, i.e. cudaMemGetInfo) of an idle engine before and after a shrink.
"""
from __future__ import annotations

import importlib.util
import json
import os
import time

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
if importlib.util.find_spec("kvcached") is None:
    pytest.skip("needs kvcached (pip install 'vramshare[kvcached]', builds with CUDA)",
                allow_module_level=True)

MIB = 1 << 20


def write_quota(path: str, mib: int, generation: int) -> None:
    with open(path + ".tmp", "w") as fh:
        json.dump({"generation": generation, "gpus": [{"uuid": "", "limitMiB": mib}]}, fh)
    os.replace(path + ".tmp", path)


def test_shrink_unmaps_kv_pages(tmp_path) -> None:
    from vllm_patches.testing import save_random_llama

    model = save_random_llama(str(tmp_path / "m"), seed=0)
    quota = str(tmp_path / "quota.json")
    write_quota(quota, 2048, 1)
    os.environ.update({"VRAMSHARE_QUOTA_FILE": quota, "VRAMSHARE_QUOTA_POLL_S": "0.2",
                       "ENABLE_KVCACHED": "true", "KVCACHED_AUTOPATCH": "1",
                       "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model, load_format="auto", skip_tokenizer_init=True, max_model_len=512,
              enforce_eager=True, dtype="bfloat16")
    ec = llm.llm_engine.engine_core.engine_core.scheduler._vramshare
    assert ec.releaser.mode == "unmap"
    prompts = [TokensPrompt(prompt_token_ids=list(range(3, 400))) for _ in range(32)]
    llm.generate(prompts, SamplingParams(max_tokens=64, ignore_eos=True, detokenize=False))
    torch.cuda.synchronize()
    free_before, _ = torch.cuda.mem_get_info()
    write_quota(quota, 1024, 2)
    time.sleep(2)
    free_after, _ = torch.cuda.mem_get_info()
    released = free_after - free_before
    assert released >= 256 * MIB, f"only {released / MIB:.0f} MiB returned after a 1024 MiB shrink"
