"""Prometheus metrics for the quota loop, served next to vLLM's own ``/metrics``.

The numbers live in the engine-core process (it owns the scheduler and the block pool) but vLLM's
API server serves ``/metrics`` from process 0. Rather than reach into vLLM's engine-core-to-frontend
stats messages (an internal format that changes every release), the engine core publishes a tiny
JSON state file per engine and process 0 registers a collector that reads those files at scrape
time. Same mechanism in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), multi-process, and with
several data-parallel engines (label ``engine``). Files of dead writers are skipped.

Metric names (all gauges): ``vramshare_vllm_quota_mib``, ``vramshare_vllm_kv_block_cap``,
``vramshare_vllm_kv_blocks_used``, ``vramshare_vllm_kv_blocks_total``,
``vramshare_vllm_kv_block_bytes``, ``vramshare_vllm_kv_compression_bits``,
``vramshare_vllm_kv_memory_held_bytes``, ``vramshare_vllm_kv_demand_bytes``,
``vramshare_vllm_quota_generation_applied``,
``vramshare_vllm_release_mode{mode=unmap|throttle,reason=...}``; with the snapshot
connector also the counters ``vramshare_vllm_kv_snapshots_total`` and
``vramshare_vllm_kv_snapshot_tokens_restored_total``.
"""
from __future__ import annotations

import glob
import json
import os
import tempfile
from typing import Any, Iterator, Mapping, MutableMapping

from prometheus_client import REGISTRY, CollectorRegistry, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

ENV_STATE_DIR = "VRAMSHARE_VLLM_STATE_DIR"

# state key -> (metric name, help)
METRICS: dict[str, tuple[str, str]] = {
    "quota_mib": ("vramshare_vllm_quota_mib", "GPU memory quota this engine follows (MiB)"),
    "cap_blocks": ("vramshare_vllm_kv_block_cap", "KV blocks the scheduler may use under the quota"),
    "used_blocks": ("vramshare_vllm_kv_blocks_used", "KV blocks in use (running requests and pins)"),
    "usable_blocks": ("vramshare_vllm_kv_blocks_total", "KV blocks the engine allocated at start"),
    "block_bytes": ("vramshare_vllm_kv_block_bytes", "Bytes of one KV block over all layers"),
    "compression_bits": ("vramshare_vllm_kv_compression_bits",
                         "Bits per KV element in host snapshots (16 = uncompressed)"),
    "kv_held_bytes": ("vramshare_vllm_kv_memory_held_bytes",
                      "KV bytes the engine holds on the device (kvcached: mapped; else allocated)"),
    "kv_demand_bytes": ("vramshare_vllm_kv_demand_bytes",
                        "KV bytes the engine would hold unfenced: every token of its running, "
                        "waiting and preempted requests, from its scheduler"),
    "generation_applied": ("vramshare_vllm_quota_generation_applied",
                           "generation of quota.json in force: its cap holds and, when releasing, "
                           "the memory above it is given back"),
}
# What a shrink does to device memory: 1 on the engine's mode, "unmap" (kvcached returns the pages)
# or "throttle" (the cap stops the scheduler, the memory stays allocated).
RELEASE_MODE = ("vramshare_vllm_release_mode",
                "1 for how a quota shrink acts: unmap (memory returned) or throttle (nothing "
                "released); reason: why, when kvcached was asked for and could not run")
# Cumulative counts (exported as counters, ``_total``), present with the snapshot connector only.
COUNTERS: dict[str, tuple[str, str]] = {
    "snapshots_taken": ("vramshare_vllm_kv_snapshots", "Preempted requests kept as KV snapshots"),
    "snapshot_tokens_restored": ("vramshare_vllm_kv_snapshot_tokens_restored",
                                 "Prefill tokens restored from KV snapshots instead of recomputed"),
}


def ensure_state_dir(env: MutableMapping[str, str]) -> str:
    """The state directory shared by this vLLM process tree, created on first use.

    The first process that loads the plugin (process 0) picks it and exports it in the environment,
    so the engine-core and worker processes it spawns inherit the same directory.
    """
    path = env.get(ENV_STATE_DIR)
    if not path:
        path = os.path.join(tempfile.gettempdir(), f"vramshare-vllm-{os.getpid()}")
        env[ENV_STATE_DIR] = path
    os.makedirs(path, exist_ok=True)
    return path


def publish(state_dir: str, engine: str, state: Mapping[str, Any], prefix: str = "engine-") -> None:
    """Write one engine's state atomically (write + rename), tagged with the writer's pid."""
    doc = {"pid": os.getpid(), **state}
    final = os.path.join(state_dir, f"{prefix}{engine}.json")
    fd, tmp = tempfile.mkstemp(dir=state_dir, prefix=".engine-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(doc, fh)
        os.replace(tmp, final)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


WARM_PREFIX = "warm-"
# The warm tier (issue 23, vllm_patches/warm.py) publishes its own small file per engine (warm-<engine>.json)
SLEEP_STATE = ("vramshare_vllm_sleep_state", "1 for the engine's warm-tier state: awake, sleeping or waking")
WARM_METRICS: dict[str, tuple[str, str]] = {
    "wake_seconds": ("vramshare_vllm_wake_seconds", "Latency of the last wake: request arrival to serving (s)"),
    "sleep_freed_bytes": ("vramshare_vllm_sleep_freed_bytes", "GPU bytes the last sleep gave back"),
}


def publish_warm(state_dir: str, engine: str, state: Mapping[str, Any]) -> None:
    """The warm tier's state of one engine (atomic, like :func:`publish`, in its own file)."""
    publish(state_dir, f"{WARM_PREFIX}{engine}", state, prefix="")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_states(state_dir: str, prefix: str = "engine-") -> dict[str, dict[str, Any]]:
    """``{engine: state}`` for every live writer; unreadable or stale files are skipped."""
    out: dict[str, dict[str, Any]] = {}
    for path in sorted(glob.glob(os.path.join(state_dir, f"{prefix}*.json"))):
        try:
            with open(path) as fh:
                doc = json.load(fh)
        except (OSError, ValueError):
            continue
        if not isinstance(doc, dict) or not _alive(int(doc.get("pid", -1))):
            continue
        engine = os.path.basename(path)[len(prefix):-len(".json")]
        out[engine] = doc
    return out


class StateCollector(Collector):
    """Turns the published engine states into gauges at scrape time."""

    def __init__(self, state_dir: str) -> None:
        self.state_dir = state_dir

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        states = read_states(self.state_dir)
        for kind, table in ((GaugeMetricFamily, METRICS), (CounterMetricFamily, COUNTERS)):
            for key, (name, help_text) in table.items():
                family = kind(name, help_text, labels=["engine"])
                for engine, state in states.items():
                    if isinstance(state.get(key), (int, float)):
                        family.add_metric([engine], float(state[key]))
                yield family
        mode = GaugeMetricFamily(RELEASE_MODE[0], RELEASE_MODE[1],
                                 labels=["engine", "mode", "reason"])
        for engine, state in states.items():
            if isinstance(state.get("release_mode"), str):
                mode.add_metric([engine, state["release_mode"], str(state.get("release_reason") or "")],
                                1.0)
        yield mode
        warm = read_states(self.state_dir, WARM_PREFIX)
        if warm:
            sleep = GaugeMetricFamily(SLEEP_STATE[0], SLEEP_STATE[1], labels=["engine", "state"])
            for engine, state in warm.items():
                for name in ("awake", "sleeping", "waking"):
                    sleep.add_metric([engine, name], 1.0 if state.get("sleep_state") == name else 0.0)
            yield sleep
            for key, (name, help_text) in WARM_METRICS.items():
                family = GaugeMetricFamily(name, help_text, labels=["engine"])
                for engine, state in warm.items():
                    if isinstance(state.get(key), (int, float)) and not isinstance(state.get(key), bool):
                        family.add_metric([engine], float(state[key]))
                yield family


_mp_gauges: dict[str, Gauge] = {}


def set_multiprocess(engine: str, state: Mapping[str, Any]) -> bool:
    """Also write the gauges through prometheus_client's multi-process files, when that mode is on.

    With ``--api-server-count > 1`` vLLM serves ``/metrics`` from a fresh registry that only holds a
    ``MultiProcessCollector`` over ``PROMETHEUS_MULTIPROC_DIR``, which the engine core inherits; our
    collector is not in that registry, but gauges set here land in those files and are served. The
    cumulative snapshot counts are left out in this mode. Returns whether the mode is on.
    """
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return False
    for key, (name, help_text) in METRICS.items():
        if not isinstance(state.get(key), (int, float)):
            continue
        gauge = _mp_gauges.get(key)
        if gauge is None:  # registry=None: never doubles up with the collector in REGISTRY
            gauge = Gauge(name, help_text, ["engine"], registry=None, multiprocess_mode="mostrecent")
            _mp_gauges[key] = gauge
        gauge.labels(engine).set(float(state[key]))
    if isinstance(state.get("release_mode"), str):
        gauge = _mp_gauges.get("release_mode")
        if gauge is None:
            gauge = Gauge(RELEASE_MODE[0], RELEASE_MODE[1], ["engine", "mode", "reason"],
                          registry=None, multiprocess_mode="mostrecent")
            _mp_gauges["release_mode"] = gauge
        gauge.labels(engine, state["release_mode"], str(state.get("release_reason") or "")).set(1.0)
    return True


_registered: dict[int, StateCollector] = {}


def register_collector(state_dir: str, registry: CollectorRegistry = REGISTRY) -> StateCollector:
    """Register the collector once per registry (the plugin is loaded more than once per process);
    a later call moves it to ``state_dir``."""
    existing = _registered.get(id(registry))
    if existing is not None:
        existing.state_dir = state_dir  # a re-registered plugin (new state dir) is followed
        return existing
    collector = StateCollector(state_dir)
    registry.register(collector)
    _registered[id(registry)] = collector
    return collector
