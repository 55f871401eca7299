"""The engine-state bridge behind the vramshare_vllm_* gauges (pure, no vLLM)."""
from __future__ import annotations

import json
import os

from prometheus_client import CollectorRegistry, generate_latest

from vllm_patches import metrics


def test_published_state_becomes_gauges(tmp_path) -> None:
    state_dir = str(tmp_path)
    metrics.publish(state_dir, "0", {"quota_mib": 512, "cap_blocks": 40, "used_blocks": 7,
                                     "usable_blocks": 63, "block_bytes": 131072,
                                     "compression_bits": 8})
    # A dead writer's file (pid 0x7fffffff cannot exist) and a garbage file are skipped.
    with open(os.path.join(state_dir, "engine-1.json"), "w") as fh:
        json.dump({"pid": 2**31 - 1, "quota_mib": 1}, fh)
    with open(os.path.join(state_dir, "engine-2.json"), "w") as fh:
        fh.write("{")
    registry = CollectorRegistry()
    metrics.register_collector(state_dir, registry)
    metrics.register_collector(state_dir, registry)  # idempotent: no duplicate-timeseries error
    text = generate_latest(registry).decode()
    assert 'vramshare_vllm_quota_mib{engine="0"} 512.0' in text
    assert 'vramshare_vllm_kv_block_cap{engine="0"} 40.0' in text
    assert 'vramshare_vllm_kv_blocks_used{engine="0"} 7.0' in text
    assert 'vramshare_vllm_kv_compression_bits{engine="0"} 8.0' in text
    assert 'engine="1"' not in text and 'engine="2"' not in text


def test_state_dir_is_exported_for_child_processes(tmp_path) -> None:
    env: dict[str, str] = {}
    path = metrics.ensure_state_dir(env)
    assert env[metrics.ENV_STATE_DIR] == path and os.path.isdir(path)
    os.rmdir(path)
    env = {metrics.ENV_STATE_DIR: str(tmp_path / "x")}
    assert metrics.ensure_state_dir(env) == str(tmp_path / "x")


def test_snapshot_counters_only_when_published(tmp_path) -> None:
    metrics.publish(str(tmp_path), "3", {"quota_mib": 1, "snapshots_taken": 2,
                                         "snapshot_tokens_restored": 160})
    registry = CollectorRegistry()
    metrics.register_collector(str(tmp_path), registry)
    text = generate_latest(registry).decode()
    assert 'vramshare_vllm_kv_snapshot_tokens_restored_total{engine="3"} 160.0' in text
    assert 'vramshare_vllm_kv_snapshots_total{engine="3"} 2.0' in text
    assert "# TYPE vramshare_vllm_kv_snapshots_total counter" in text


def test_multiprocess_prometheus_mode(tmp_path, monkeypatch) -> None:
    """--api-server-count > 1: the served registry reads PROMETHEUS_MULTIPROC_DIR files only."""
    import subprocess
    import sys

    from prometheus_client import multiprocess

    mp_dir = tmp_path / "prom"
    mp_dir.mkdir()
    code = ("from vllm_patches import metrics; import sys; "
            "sys.exit(0 if metrics.set_multiprocess('0', {'quota_mib': 640, 'cap_blocks': 12}) else 3)")
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(mp_dir)}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(mp_dir))
    text = generate_latest(registry).decode()
    assert 'vramshare_vllm_quota_mib{engine="0"} 640.0' in text
    assert 'vramshare_vllm_kv_block_cap{engine="0"} 12.0' in text
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    assert metrics.set_multiprocess("0", {"quota_mib": 1}) is False  # mode off: nothing written


def test_release_mode_and_held_bytes_are_exported(tmp_path) -> None:
    metrics.publish(str(tmp_path), "0", {"quota_mib": 1, "release_mode": "throttle",
                                         "kv_held_bytes": 4096})
    registry = CollectorRegistry()
    metrics.register_collector(str(tmp_path), registry)
    text = generate_latest(registry).decode()
    assert 'vramshare_vllm_release_mode{engine="0",mode="throttle",reason=""} 1.0' in text
    assert 'vramshare_vllm_kv_memory_held_bytes{engine="0"} 4096.0' in text


def test_demand_generation_and_fallback_reason_are_exported(tmp_path) -> None:
    """The names SIGNALS.md fixes for the quota loop (issue 19 reads them)."""
    why = "kvcached 0.1.6 supports vLLM >=0.17.0,<0.31.0, not 0.32.0"
    metrics.publish(str(tmp_path), "1", {"quota_mib": 1, "release_mode": "throttle",
                                         "release_reason": why, "kv_demand_bytes": 3 << 20,
                                         "generation_applied": 7})
    registry = CollectorRegistry()
    metrics.register_collector(str(tmp_path), registry)
    text = generate_latest(registry).decode()
    assert f'vramshare_vllm_release_mode{{engine="1",mode="throttle",reason="{why}"}} 1.0' in text
    assert 'vramshare_vllm_kv_demand_bytes{engine="1"} 3.145728e+06' in text
    assert 'vramshare_vllm_quota_generation_applied{engine="1"} 7.0' in text
