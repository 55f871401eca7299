"""An engine on several GPUs follows each GPU's quota: the tightest per-GPU budget of the GPUs its
workers drive, for tensor-parallel (all GPUs of the engine) and data-parallel (each engine its own
slice) layouts (issue 20 item 4). At the worker/scheduler boundary: vLLM's scheduler and configs
are plain namespaces shaped like 0.32's; the CPU build cannot run TP/DP on this 2-core machine."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from vllm_patches import engine_cap
from vllm_patches import settings as qsettings
from vllm_patches.testing import write_quota
from vllm_patches.watcher import QuotaTracker

MIB = 1 << 20
BLOCK = 1 * MIB
UUIDS = ("GPU-a", "GPU-b", "GPU-c", "GPU-d")


class Pool:
    """vLLM's BlockPool as the cap sees it: a free count over ``num_gpu_blocks`` (block 0 null)."""

    def __init__(self, num_gpu_blocks: int) -> None:
        self.num_gpu_blocks = num_gpu_blocks
        self.free = num_gpu_blocks - 1

    def get_num_free_blocks(self) -> int:
        return self.free

    def get_new_blocks(self, n: int) -> list[int]:
        self.free -= n
        return list(range(n))

    def get_usage(self) -> float:
        return 1 - self.free / (self.num_gpu_blocks - 1)

    def reset_prefix_cache(self) -> bool:
        return True


def parallel(tp: int = 1, pp: int = 1, dp: int = 1, dp_rank: int = 0) -> SimpleNamespace:
    return SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp,
                           data_parallel_size=dp, data_parallel_size_local=dp,
                           data_parallel_rank=dp_rank, data_parallel_rank_local=dp_rank)


@pytest.fixture
def quota(tmp_path, monkeypatch) -> str:
    path = str(tmp_path / "quota.json")
    write_quota(path, {u: 300 for u in UUIDS}, 1)
    monkeypatch.setenv("VRAMSHARE_QUOTA_FILE", path)
    monkeypatch.setenv("VRAMSHARE_GPU_UUIDS", ",".join(UUIDS))
    monkeypatch.setenv("VRAMSHARE_QUOTA_POLL_S", "3600")
    monkeypatch.setenv("VRAMSHARE_VLLM_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.delenv("ENABLE_KVCACHED", raising=False)
    return path


def engine(pc: SimpleNamespace) -> engine_cap.EngineCap:
    """One engine's scheduler (100 usable blocks of 1 MiB, 200 MiB of KV at start quota 300)."""
    sched = SimpleNamespace(kv_cache_manager=SimpleNamespace(block_pool=Pool(101)),
                            max_model_len=16, block_size=16, running=[], waiting=[])
    cfg = SimpleNamespace(parallel_config=pc, kv_transfer_config=None,
                          cache_config=SimpleNamespace(kv_cache_memory_bytes=None))
    kvcfg = SimpleNamespace(num_blocks=101, kv_cache_tensors=[SimpleNamespace(size=101 * BLOCK)])
    found = qsettings.from_env()
    assert found is not None
    ec = engine_cap.attach(sched, cfg, kvcfg, found)
    assert ec is not None
    ec.watcher.stop()
    return ec


def shrink(ec: engine_cap.EngineCap, path: str, limits: dict[str, int], generation: int) -> int:
    write_quota(path, limits, generation)
    ec.watcher.poll_once()
    return ec.cap.cap


def test_data_parallel_engines_follow_their_own_gpu(quota: str) -> None:
    """Regression: DP engine 1 runs on GPU B; shrinking B must shrink it, shrinking A must not."""
    e0, e1 = engine(parallel(dp=2, dp_rank=0)), engine(parallel(dp=2, dp_rank=1))
    assert e0.cap.cap == e1.cap.cap == 100
    assert shrink(e1, quota, {**dict.fromkeys(UUIDS, 300), "GPU-b": 250}, 2) == 50
    assert shrink(e0, quota, {**dict.fromkeys(UUIDS, 300), "GPU-b": 250}, 2) == 100
    assert shrink(e1, quota, {**dict.fromkeys(UUIDS, 300), "GPU-a": 220}, 3) == 100
    assert shrink(e0, quota, {**dict.fromkeys(UUIDS, 300), "GPU-a": 220}, 3) == 20


def test_tensor_parallel_engine_follows_the_tightest_of_its_gpus(quota: str) -> None:
    ec = engine(parallel(tp=2))
    assert shrink(ec, quota, {"GPU-a": 300, "GPU-b": 240, "GPU-c": 10, "GPU-d": 10}, 2) == 40
    assert shrink(ec, quota, {"GPU-a": 260, "GPU-b": 280, "GPU-c": 10, "GPU-d": 10}, 3) == 60
    assert ec.generation_applied == 3
    # TP=2 x DP=2: engine 1 drives GPUs C and D
    write_quota(quota, dict.fromkeys(UUIDS, 300), 4)
    e1 = engine(parallel(tp=2, dp=2, dp_rank=1))
    assert shrink(e1, quota, {"GPU-a": 10, "GPU-b": 10, "GPU-c": 300, "GPU-d": 230}, 5) == 30


def test_engine_gpu_slices_follow_vllms_device_indices() -> None:
    """vLLM 0.32 ``get_device_indices``: DP local rank d drives [d x world, (d+1) x world)."""
    from vllm_patches.quota import engine_gpu_indices
    from vllm_patches.vllm_glue import engine_gpus

    assert engine_gpu_indices(0, 1) == (0,)
    assert engine_gpu_indices(1, 2) == (2, 3)
    assert engine_gpus(SimpleNamespace(parallel_config=parallel(tp=2, pp=2))) == (0, 1, 2, 3)
    assert engine_gpus(SimpleNamespace(parallel_config=parallel(dp=2, dp_rank=1))) == (1,)
    assert engine_gpus(SimpleNamespace(parallel_config=parallel(tp=2, dp=2, dp_rank=1)),
                       all_local_engines=True) == (0, 1, 2, 3)


def test_uneven_env_limits_are_per_gpu_and_the_tracker_takes_the_tightest() -> None:
    from vllm_patches.quota import env_limit_mib, env_limits_mib
    from vllm_patches.watcher import EngineTracker

    env = {"VRAMSHARE_MEMORY_LIMIT_MIB": "3072,1024"}
    assert env_limits_mib(env) == (3072, 1024)
    assert env_limit_mib(env, 0) == 3072 and env_limit_mib(env, 1) == 1024
    assert env_limit_mib({"VRAMSHARE_MEMORY_LIMIT_MIB": "512"}, 3) == 512
    tracker = EngineTracker([QuotaTracker(3072, "GPU-a", 0), QuotaTracker(1024, "GPU-b", 1)])
    assert tracker.limit_mib == 1024
    doc = json.dumps({"generation": 5, "gpus": [{"uuid": "GPU-a", "limitMiB": 900},
                                                 {"uuid": "GPU-b", "limitMiB": 1024}]})
    assert tracker.update(doc) == 900 and tracker.generation == 5
    assert tracker.update(doc) is None
