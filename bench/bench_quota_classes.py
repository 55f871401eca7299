"""Quota classes on the GenAI trace (issue 14): over-limit minutes per class vs one class for everybody.

The protocol of ``bench_quota.py`` (57 containers with a full day, shuffled and packed ``k`` to an
80 GiB GPU, k = 2 and 3, 20 seeds; each tenant's request an equal share; limits decided from what
was seen a minute before; a tenant holds min(demand, limit) and a cut is honoured by the next
sample). In every group the first tenant (random, since groups are shuffled) is *guaranteed*, the
others *best-effort*:

* ``two-classes``: guaranteed = floor 1.0 x request, ceiling 1.5 x, lendingPriority 100;
  best-effort = floor 0.1 x request, ceiling k x (it may take most of an idle GPU), lendingPriority 0;
* ``one-class``: everybody in the default class (floor 0.5, ceiling 1.5: the shipped defaults);
* ``one-class-wide``: everybody floor 0.1, ceiling k x (the best-effort bounds for all, one rank).

Scored per class of tenant (the same tenants in every policy): % of container-minutes with demand
over limit, over-limit GiB-minutes, and GPU-minutes breaking the capacity invariant (must be 0).
Writes ``bench/results/quota_classes.json``. The machine is shared: CPU seconds are indicative.

    nice -n 10 python bench/bench_quota_classes.py [--quick]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from bench_quota import GPU_MIB, TRACE, WINDOW, _world, groupings, load_demand  # noqa: E402

from deviceplugin.quota.model import Bounds, GpuState, PolicyParams, Signals, TenantKey, TenantState  # noqa: E402
from deviceplugin.quota.policy import rebalance  # noqa: E402

STEP, MARGIN = 512, 1024
PARAMS = PolicyParams(floor_fraction=0.5, ceiling_fraction=1.5, step_mib=STEP, margin_mib=MARGIN)
# (floor fraction, ceiling fraction or None for k, rank)
GUARANTEED = (1.0, 1.5, 100)
BEST_EFFORT = (0.1, None, 0)


def _bounds(req: int, k: int, cls: tuple[float, float | None, int]) -> Bounds:
    floor, ceiling, _ = cls
    return Bounds(int(floor * req), int((ceiling or k) * req), MARGIN)


def run(demand: np.ndarray, classes: list[tuple[float, float | None, int]] | None) -> tuple[np.ndarray, np.ndarray]:
    """The policy as the loop runs it, with per-tenant class bounds and ranks (``None``: the defaults)."""
    k = len(demand)
    keys = [TenantKey("bench", f"t{i}", "c", pod_uid=f"u{i}") for i in range(k)]
    req = GPU_MIB // k
    bounds = [_bounds(req, k, c) if c else None for c in (classes or [None] * k)]
    ranks = [c[2] if c else 0 for c in (classes or [None] * k)]

    def decide(t: int, limits: np.ndarray, held: np.ndarray) -> np.ndarray:
        lo = max(0, t - WINDOW)
        states = tuple(TenantState(keys[i], req, int(limits[i, t - 1]), int(held[i, t - 1]),
                                   Signals(preemptions=1 if demand[i, t - 1] > limits[i, t - 1] else 0),
                                   bounds=bounds[i], peak_mib=int(demand[i, lo:t].max()),
                                   demand_mib=int(demand[i, t - 1]), rank=ranks[i])
                       for i in range(k))
        return np.array([d.limit_mib for d in rebalance(GpuState("GPU-bench", GPU_MIB, states), PARAMS)])
    return _world(demand, decide)


def _score(demand: np.ndarray, limits: np.ndarray, held: np.ndarray, rows: slice) -> dict[str, int]:
    over = np.maximum(0, demand[rows] - limits[rows])
    return {"minutes": int(demand[rows].size), "over_minutes": int((over > 0).sum()), "over_mib_min": int(over.sum())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="3 groupings instead of 20")
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--trace", default=TRACE)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "quota_classes.json"))
    args = ap.parse_args(argv)
    t0 = time.process_time()
    demand = load_demand(args.trace)
    seeds = list(range(3 if args.quick else args.seeds))
    results: dict[str, dict[str, dict[str, float]]] = {}
    for k in (2, 3):
        policies = {"two-classes": [GUARANTEED] + [BEST_EFFORT] * (k - 1), "one-class": None,
                    "one-class-wide": [(BEST_EFFORT[0], None, 0)] * k}
        per: dict[str, dict[str, float]] = {}
        for name, classes in policies.items():
            tot: dict[str, float] = defaultdict(float)
            for seed in seeds:
                for g in groupings(demand, k, seed):
                    limits, held = run(g, classes)
                    for cls, rows in (("guaranteed", slice(0, 1)), ("best_effort", slice(1, k))):
                        for key, v in _score(g, limits, held, rows).items():
                            tot[f"{cls}_{key}"] += v
                    committed = np.maximum(limits[:, 1:], held[:, :-1]).sum(axis=0)
                    tot["invariant_broken_gpu_minutes"] += int((committed > GPU_MIB).sum())
            per[name] = {f"{cls}_pct_minutes_over_limit":
                         round(100 * tot[f"{cls}_over_minutes"] / tot[f"{cls}_minutes"], 2)
                         for cls in ("guaranteed", "best_effort")}
            per[name].update({f"{cls}_over_limit_gib_min": round(tot[f"{cls}_over_mib_min"] / 1024, 1)
                              for cls in ("guaranteed", "best_effort")})
            all_over = tot["guaranteed_over_minutes"] + tot["best_effort_over_minutes"]
            per[name]["all_pct_minutes_over_limit"] = round(
                100 * all_over / (tot["guaranteed_minutes"] + tot["best_effort_minutes"]), 2)
            per[name]["invariant_broken_gpu_minutes"] = int(tot["invariant_broken_gpu_minutes"])
        results[f"k{k}"] = per
    summary = {f"k{k}_{name}_{cls}_pct": results[f"k{k}"][name][f"{cls}_pct_minutes_over_limit"]
               for k in (2, 3) for name in ("two-classes", "one-class", "one-class-wide")
               for cls in ("guaranteed", "best_effort")}
    doc = {"summary": summary, "results": results,
           "setup": {"gpu_mib": GPU_MIB, "containers": int(len(demand)), "minutes": int(demand.shape[1]),
                     "seeds": len(seeds), "lag_minutes": 1, "peak_window_minutes": WINDOW,
                     "requests": "equal share (capacity / k)", "guaranteed": "first tenant of each group",
                     "classes": {"guaranteed": {"floor": GUARANTEED[0], "ceiling": GUARANTEED[1],
                                                "rank": GUARANTEED[2]},
                                 "best_effort": {"floor": BEST_EFFORT[0], "ceiling": "k", "rank": BEST_EFFORT[2]},
                                 "one_class": {"floor": PARAMS.floor_fraction, "ceiling": PARAMS.ceiling_fraction}},
                     "step_mib": STEP, "margin_mib": MARGIN, "trace": "genai/pod_gpu_memory_used_bytes.csv",
                     "quick": args.quick, "cpu_seconds": round(time.process_time() - t0, 2),
                     "machine": "shared, 2 cores"}}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump(doc, fh, indent=2)
    print(json.dumps({"summary": summary, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
