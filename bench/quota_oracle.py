"""How good must the forecast be? The default policy (``bench_quota.run_new``, ``PolicyParams()``) with its
forecast (:func:`deviceplugin.quota.headroom.forecast`) replaced by an oracle that knows something of
each tenant's demand next minute, in this process only (a measuring instrument: nothing shipped reads
it). Issue 19: if even the exact next-minute demand, run through the default's rules, misses more than
the fair reference, the rules cost the difference; what is left over the oracle is the forecast's cost.

Oracles (each narrows the default's own forecast sample to the values that agree with what it knows,
or replaces it):

- ``point``: the exact demand next minute;
- ``direction``: whether it goes up, down, or stays within 256 MiB;
- ``rises``: whether it rises by more than 1 GiB.

    nice python bench/quota_oracle.py [--seeds 20] [--oracles point,direction,rises] [--world demand]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from collections import defaultdict
from typing import Callable

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import bench_quota as bq  # noqa: E402
from deviceplugin.quota import headroom  # noqa: E402
from deviceplugin.quota.model import PolicyParams  # noqa: E402

Sample = list[tuple[int, float]]
_FORECAST = headroom.forecast
_NEXT: dict[str, object] = {"demand": None, "i": 0, "oracle": "point"}  # minute t's demands, next tenant


def _agreeing(sample: Sample, keep: Callable[[int], bool]) -> Sample:
    """The sample's values that ``keep`` accepts, reweighted; the whole sample when none is left."""
    kept = [(v, w) for v, w in sample if keep(v)]
    total = sum(w for _, w in kept)
    return [(v, w / total) for v, w in kept] if kept and total > 0 else sample


def _side(v: int, now: int, tol: int = 256) -> int:
    return 0 if abs(v - now) <= tol else (1 if v > now else -1)


def oracle_forecast(recent: list[int], now: int) -> Sample:
    """Stands in for ``headroom.forecast``: the policy asks once per tenant, in key order, each tick."""
    i = int(_NEXT["i"])  # type: ignore[call-overload]
    _NEXT["i"] = i + 1
    d = int(_NEXT["demand"][i])  # type: ignore[index]
    sample = _FORECAST(recent, now)
    if _NEXT["oracle"] == "point":
        return [(d, 1.0)]
    if _NEXT["oracle"] == "direction":
        return _agreeing(sample, lambda v: _side(v, now) == _side(d, now))
    if _NEXT["oracle"] == "rises":
        return _agreeing(sample, lambda v: (v - now > 1024) == (d - now > 1024))
    raise ValueError(f"unknown oracle {_NEXT['oracle']!r}")


def run_oracle(demand: np.ndarray, oracle: str, world: str) -> tuple[np.ndarray, np.ndarray]:
    """``bench_quota.run_new`` with the default's params, its forecast answered by ``oracle``."""
    world_of = bq._world

    def world_seeing_ahead(dem: np.ndarray, decide):
        def decide_t(t: int, limits: np.ndarray, held: np.ndarray) -> np.ndarray:
            _NEXT.update(demand=dem[:, t], i=0, oracle=oracle)
            return decide(t, limits, held)
        return world_of(dem, decide_t)
    bq._world, headroom.forecast = world_seeing_ahead, oracle_forecast
    try:
        return bq.run_new(demand, PolicyParams(), world)
    finally:
        bq._world, headroom.forecast = world_of, _FORECAST


def _score_seed(oracle: str, world: str, seed: int) -> dict[str, float]:
    demand = bq._DEMAND  # the workers' copy, set by bench_quota's own initializer
    _, held_back = bq.split(len(demand))
    tot: dict[str, float] = defaultdict(float)
    for g in bq.groupings(demand[held_back], 3, seed):
        for key, v in bq.score(g, *run_oracle(g, oracle, world)).items():
            tot[key] += v
    return dict(tot)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=20, help="groupings of the held-back containers, k = 3")
    ap.add_argument("--oracles", default="point,direction,rises")
    ap.add_argument("--world", default="demand", choices=bq.WORLDS)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--trace", default=bq.TRACE)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "quota_oracle.json"))
    args = ap.parse_args(argv)
    wall = time.perf_counter()
    demand = bq.load_demand(args.trace)
    tasks = [(o, args.world, s) for o in args.oracles.split(",") for s in range(args.seeds)]
    with multiprocessing.Pool(args.jobs, initializer=bq._init, initargs=(demand, None)) as pool:
        scored = pool.starmap(_score_seed, tasks, chunksize=1)
    rows: dict[str, dict[str, float]] = {}
    for (oracle, _, _), sc in zip(tasks, scored):
        row = rows.setdefault(oracle, defaultdict(float))
        for key, v in sc.items():
            row[key] += v
    results = {o: {"pct_container_minutes_over_limit": round(100 * r["over_minutes"] / r["minutes"], 2),
                   "pct_owner_short_while_another_borrows": round(100 * r["owner_short_minutes"] / r["minutes"], 2),
                   "limit_changes_per_container_hour": round(r["limit_changes"] / (r["minutes"] / 60), 2)}
               for o, r in rows.items()}
    doc = {"results": {"held_back": {"k3": {f"default-{o}@{args.world}": v for o, v in results.items()}}},
           "setup": {"groupings": args.seeds, "world": args.world, "split": "bench_quota.split (held back)",
                     "command": "nice python bench/quota_oracle.py "
                                + " ".join(argv if argv is not None else sys.argv[1:]),
                     "wall_seconds": round(time.perf_counter() - wall, 1), "machine": "shared, 2 cores"}}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump(doc, fh, indent=2)
    print(json.dumps(doc["results"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
