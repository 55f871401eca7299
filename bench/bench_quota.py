"""Quota feedback loop vs static quotas, replaying real per-container GPU memory demand.

Trace: ``shared/traces/genai/pod_gpu_memory_used_bytes.csv`` (72 containers x 1,441 samples, one a
minute). The containers with a (nearly) full day are taken in a fixed order and packed three to an
80 GiB GPU. Each minute every tenant has a demand; a policy has set its limit beforehand. Compared:

* ``static-equal``: each tenant's limit is an equal third of the GPU, for ever;
* ``static-p95``: each tenant's limit is its own p95 demand (scaled down to fit the GPU when the
  three p95s do not), i.e. the best static request an oracle could set;
* ``feedback-*``: the quota loop's policy with requests = the static limits above. At minute t it
  sees the demand of minute t-1 (what NVML showed at its last tick) and a preemption signal when
  that demand exceeded its limit (what vLLM over quota would report), and sets the limits for t.

Per policy: tenant-minutes over limit (would be throttled or preempted), over-limit MiB-min, mean
reserved-but-unused MiB per GPU, and limit changes per tenant-hour. ``unavoidable`` counts minutes
in which the three demands together exceed the GPU, which no quota can fix (a lower bound on the
over-limit minutes of any policy; ``unavoidable_over_limit_gib_min`` is the same bound in MiB-min). Invariants (bounds, sum
<= capacity) are checked on every decision. Writes ``bench/results/quota.json``.

    nice -n 10 python bench/bench_quota.py [--quick]
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import tempfile
import time
from collections import defaultdict
from typing import Callable

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from deviceplugin.quota.loop import QuotaLoop  # noqa: E402
from deviceplugin.quota.model import (GpuState, PolicyParams, Signals, Tenant, TenantKey,  # noqa: E402
                                      TenantState)
from deviceplugin.quota.policy import rebalance  # noqa: E402
from deviceplugin.quota.telemetry import UsageSample  # noqa: E402

TRACE = os.path.join(HERE, "..", "..", "shared", "traces", "genai", "pod_gpu_memory_used_bytes.csv")
GPU_MIB = 80 * 1024
PER_GPU = 3
MIB = 1 << 20


def load_demand(path: str) -> np.ndarray:
    """MiB demand, one row per container with >= 1,400 samples (sorted by id), one column a minute."""
    by_c: dict[str, dict[float, float]] = defaultdict(dict)
    with open(path, encoding="utf-8") as fh:
        for row in csv.DictReader(fh):
            by_c[row["container_ip"]][float(row["timestamp_anon"])] = float(row["value"])
    times = sorted({t for d in by_c.values() for t in d})
    rows = []
    for cid in sorted(c for c, d in by_c.items() if len(d) >= 1400):
        series, last = [], 0.0
        for t in times:  # a missing sample repeats the last one
            last = by_c[cid].get(t, last)
            series.append(last)
        rows.append(series)
    return np.floor(np.array(rows) / MIB).astype(np.int64)


def static_limits(demand: np.ndarray, kind: str) -> np.ndarray:
    """Per-tenant fixed limits of one GPU group (these are also the feedback loop's requests)."""
    if kind == "equal":
        return np.full(len(demand), GPU_MIB // len(demand), dtype=np.int64)
    p95 = np.percentile(demand, 95, axis=1)
    if p95.sum() > GPU_MIB:
        p95 = p95 * GPU_MIB / p95.sum()
    return np.floor(p95).astype(np.int64)


def replay_static(demand: np.ndarray, limits: np.ndarray) -> tuple[np.ndarray, int]:
    return np.repeat(limits[:, None], demand.shape[1], axis=1), 0


def replay_feedback(demand: np.ndarray, requests: np.ndarray, params: PolicyParams) -> tuple[np.ndarray, int]:
    """Limits minute by minute from the policy, fed the previous minute's demand."""
    keys = [TenantKey("bench", f"t{i}", "c", pod_uid=f"u{i}") for i in range(len(demand))]
    n = demand.shape[1]
    out = np.zeros_like(demand)
    cur = [int(r) for r in requests]
    out[:, 0] = cur
    for t in range(1, n):
        states = tuple(TenantState(k, int(requests[i]), cur[i], int(demand[i, t - 1]),
                                   Signals(preemptions=1 if demand[i, t - 1] > out[i, t - 1] else 0))
                       for i, k in enumerate(keys))
        ds = rebalance(GpuState("GPU-bench", GPU_MIB, states), params)
        assert sum(d.limit_mib for d in ds) <= GPU_MIB, "capacity invariant broken"
        for i, d in enumerate(ds):
            assert d.floor_mib <= d.limit_mib <= d.ceiling_mib, "bounds invariant broken"
            cur[i] = d.limit_mib
            out[i, t] = d.limit_mib
    return out, 0


def score(demand: np.ndarray, limits: np.ndarray) -> dict[str, float]:
    over = np.maximum(0, demand - limits)
    unused = np.maximum(0, limits - demand).sum(axis=0)  # per minute, over the GPU's tenants
    changes = int((np.diff(limits, axis=1) != 0).sum())
    hours = demand.shape[0] * demand.shape[1] / 60
    return {"over_limit_tenant_minutes": int((over > 0).sum()), "over_limit_mib_min": int(over.sum()),
            "mean_unused_reserved_mib": float(unused.mean()), "limit_changes_per_tenant_hour": changes / hours}


def loop_tick_cost(groups: list[np.ndarray], ticks: int) -> float:
    """Milliseconds per QuotaLoop.run_once on one GPU with real file writes (adapters included)."""
    demand = groups[0]
    keys = [TenantKey("bench", f"t{i}", "c", pod_uid=f"u{i}") for i in range(len(demand))]
    tenants = [Tenant(k, (("GPU-bench", GPU_MIB // len(keys)),)) for k in keys]
    minute = [0]

    class Source:
        name = "trace"

        def list_tenants(self) -> list[Tenant]:
            return tenants

        def read_usage(self) -> list[UsageSample]:
            return [UsageSample("GPU-bench", int(demand[i, minute[0]]), pod_uid=k.pod_uid)
                    for i, k in enumerate(keys)]

    with tempfile.TemporaryDirectory() as root:
        loop = QuotaLoop(Source(), lambda: {"GPU-bench": GPU_MIB}, [Source()], PolicyParams(), root)
        t0 = time.perf_counter()
        for minute[0] in range(ticks):
            loop.run_once()
        return (time.perf_counter() - t0) * 1000 / ticks


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="4 GPUs instead of all")
    ap.add_argument("--trace", default=TRACE)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "quota.json"))
    args = ap.parse_args(argv)
    t_start = time.process_time()
    demand = load_demand(args.trace)
    groups = [demand[i:i + PER_GPU] for i in range(0, len(demand) - PER_GPU + 1, PER_GPU)]
    if args.quick:
        groups = groups[:4]
    base = PolicyParams(floor_fraction=0.5, ceiling_fraction=1.5, step_mib=512, margin_mib=1024)
    wide = PolicyParams(floor_fraction=0.5, ceiling_fraction=1.5, step_mib=512, margin_mib=4096)
    policies: dict[str, Callable[[np.ndarray], tuple[np.ndarray, int]]] = {
        "static-equal": lambda d: replay_static(d, static_limits(d, "equal")),
        "static-p95": lambda d: replay_static(d, static_limits(d, "p95")),
        "feedback-equal": lambda d: replay_feedback(d, static_limits(d, "equal"), base),
        "feedback-equal-margin4g": lambda d: replay_feedback(d, static_limits(d, "equal"), wide),
        "feedback-p95": lambda d: replay_feedback(d, static_limits(d, "p95"), base),
    }
    results: dict[str, dict[str, float]] = {}
    for name, run in policies.items():
        per_gpu = [score(d, run(d)[0]) for d in groups]
        results[name] = {k: (sum(g[k] for g in per_gpu) if k.startswith("over") else
                             float(np.mean([g[k] for g in per_gpu]))) for k in per_gpu[0]}
    unavoidable = int(sum((d.sum(axis=0) > GPU_MIB).sum() for d in groups))
    floor_mib_min = int(sum(np.maximum(0, d.sum(axis=0) - GPU_MIB).sum() for d in groups))
    tick_ms = loop_tick_cost(groups, 60)
    se, fe = results["static-equal"], results["feedback-equal"]
    sp, fp = results["static-p95"], results["feedback-p95"]
    summary = {
        "gpus": len(groups), "tenants": len(groups) * PER_GPU, "minutes": int(demand.shape[1]),
        "over_limit_minutes_static_equal": se["over_limit_tenant_minutes"],
        "over_limit_minutes_feedback_equal": fe["over_limit_tenant_minutes"],
        "over_limit_minutes_static_p95": sp["over_limit_tenant_minutes"],
        "over_limit_minutes_feedback_p95": fp["over_limit_tenant_minutes"],
        "over_limit_gib_min_static_equal": round(se["over_limit_mib_min"] / 1024, 1),
        "over_limit_gib_min_feedback_equal": round(fe["over_limit_mib_min"] / 1024, 1),
        "over_limit_gib_min_static_p95": round(sp["over_limit_mib_min"] / 1024, 1),
        "over_limit_gib_min_feedback_p95": round(fp["over_limit_mib_min"] / 1024, 1),
        "mean_unused_reserved_gib_static_equal": round(se["mean_unused_reserved_mib"] / 1024, 2),
        "mean_unused_reserved_gib_feedback_equal": round(fe["mean_unused_reserved_mib"] / 1024, 2),
        "mean_unused_reserved_gib_static_p95": round(sp["mean_unused_reserved_mib"] / 1024, 2),
        "mean_unused_reserved_gib_feedback_p95": round(fp["mean_unused_reserved_mib"] / 1024, 2),
        "limit_changes_per_tenant_hour_feedback_equal": round(fe["limit_changes_per_tenant_hour"], 2),
        "unavoidable_gpu_minutes_demand_over_capacity": unavoidable,  # lower bound on over-limit minutes
        "unavoidable_over_limit_gib_min": round(floor_mib_min / 1024, 1),
        "loop_tick_ms_3_tenants_with_file_writes": round(tick_ms, 2),
    }
    doc = {"summary": summary, "policies": results,
           "setup": {"gpu_mib": GPU_MIB, "tenants_per_gpu": PER_GPU, "trace": "genai/pod_gpu_memory_used_bytes.csv",
                     "params": {"floor_fraction": 0.5, "ceiling_fraction": 1.5, "step_mib": 512,
                                "margin_mib": 1024, "margin_mib_wide": 4096},
                     "quick": args.quick, "cpu_seconds": round(time.process_time() - t_start, 2)}}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump(doc, fh, indent=2)
    print(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
