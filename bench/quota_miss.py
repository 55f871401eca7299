"""Where the default quota policy's over-limit container-minutes come from (issue 19, tuning half).

For every container-minute the policy (``bench_quota.run_new``) leaves over its limit, one cause, in
this order:

(a) ``forced``: the reference (``--reference``: ``clairvoyant-fair``, perfect foresight keeping the
    release rule and protecting out of free memory, or ``clairvoyant-reclaim``, which also cuts a loan
    an owner needs) leaves that container over at that minute too;
(s) ``swap``: the reference leaves as many containers over at that minute, another one instead
    (the default covered that one): not a loss, a different victim; taken from the (e), then the (c)
    containers of that minute first;
(f) ``ceiling``: its demand is above its ceiling (``ceilingFraction`` x request): no limit reaches it;
(b) ``forecast``: memory nobody held at the decision (capacity - sum of what every tenant held the
    minute before) covered its rise, after the protected rises of the others, but the forecast put it
    elsewhere (``b-elsewhere``: it went to co-tenants' raises) or not high enough (``b-low``: it
    stayed unused or was split as spare);
(d) ``protected``: the unheld memory covered its rise, but not after the co-tenants' protected rises
    (their use within min(seen, request) above what they held, which the rule covers first);
(c) ``release-lag``: the unheld memory was not enough, but co-tenants held memory the minute before
    that they no longer needed (their demand now is below what they held): a cut came too late;
(e) ``other``: co-tenants really needed what they held.

    nice python bench/quota_miss.py [--seeds 5] [--part tune] [--k 3] [--rows default] [--out ...]

Writes ``bench/results/quota_miss.json`` (percent of all container-minutes per cause; the causes add
up to the row's over-limit percent, and ``default_better_than_fair`` is what clairvoyant-fair loses
where the row does not: row % - fair % = b + c + d + e + f - that). The ``:beyond-window`` /
``:within-window`` split of (b) says whether the demand was above anything the row's forecast
sample held (its window's levels and now + its changes).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import bench_quota as bq  # noqa: E402

CAUSES = ("a-forced", "s-swap", "f-ceiling", "b-elsewhere", "b-low", "d-protected", "c-release-lag", "e-other")


def classify(demand: np.ndarray, limits: np.ndarray, held: np.ndarray, fair_limits: np.ndarray,
             ceiling: int, world: str) -> Counter:
    """One grouping's over-limit container-minutes, by cause (see the module docstring)."""
    k, n = demand.shape
    req = bq.GPU_MIB // k
    out: Counter = Counter()
    sub = out
    for t in range(1, n):
        over = np.nonzero(demand[:, t] > limits[:, t])[0]
        if not len(over):
            continue
        h = held[:, t - 1]
        unheld = bq.GPU_MIB - int(h.sum())
        if world == "demand":
            seen = np.maximum(h, demand[:, t - 1])
        else:
            seen = h + np.where(demand[:, t - 1] > limits[:, t - 1], 1024, 0)
        raise_ = np.maximum(0, limits[:, t] - h)
        protect = np.maximum(0, np.minimum(np.minimum(limits[:, t], seen), req) - h)
        releasable = np.maximum(0, h - demand[:, t])
        fair_only = int(((demand[:, t] > fair_limits[:, t]) & (demand[:, t] <= limits[:, t])).sum())
        minute: list[str] = []
        for i in over:
            rise = max(0, int(demand[i, t] - h[i]))
            others = [j for j in range(k) if j != i]
            if demand[i, t] > fair_limits[i, t]:
                c = "a-forced"
            elif demand[i, t] > ceiling:
                c = "f-ceiling"
            elif rise <= unheld - int(protect[others].sum()):
                c = "b-low" if rise <= unheld - int(raise_[others].sum()) else "b-elsewhere"
                win = held[i, max(0, t - 1 - bq.FORECAST_WINDOW):t - 1]
                top = max(int(win.max()) if len(win) else 0,
                          int(seen[i]) + (int(np.diff(win).max()) if len(win) > 1 else 0))
                sub[c + (":beyond-window" if demand[i, t] > top else ":within-window")] += 1
            elif rise <= unheld:
                c = "d-protected"
            elif rise <= unheld + int(releasable[others].sum()):
                c = "c-release-lag"
            else:
                c = "e-other"
            minute.append(c)
        order = ("e-other", "c-release-lag", "d-protected", "b-elsewhere", "b-low", "f-ceiling")
        minute.sort(key=lambda c: order.index(c) if c in order else len(order))
        for j, c in enumerate(minute):
            if c != "a-forced" and fair_only > 0:
                c, fair_only = "s-swap", fair_only - 1
            out[c] += 1
        out["fair-only-left"] += fair_only  # minutes where the default beat clairvoyant-fair
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "quota_miss.json"))
    ap.add_argument("--part", default="tune", choices=("tune", "held_back"))
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--rows", default="default")
    ap.add_argument("--worlds", default="demand,held")
    ap.add_argument("--trace", default=bq.TRACE)
    ap.add_argument("--reference", default="clairvoyant-fair", choices=("clairvoyant-fair", "clairvoyant-reclaim"),
                    help="the perfect-foresight row misses are classified against (a, s)")
    args = ap.parse_args(argv)
    demand = bq.load_demand(args.trace)
    tune, heldb = bq.split(len(demand))
    data = demand[tune if args.part == "tune" else heldb]
    totals: dict[str, Counter] = {}
    minutes = 0
    for seed in range(args.seeds):
        for g in bq.groupings(data, args.k, seed):
            minutes += g.size
            fair, _ = bq.REFERENCE[args.reference](g)
            for row in args.rows.split(","):
                params = bq.CAUSAL[row](args.k)
                ceiling = params.ceiling_of(bq.GPU_MIB // args.k)
                for world in args.worlds.split(","):
                    lim, hld = bq.run_new(g, params, world)
                    totals.setdefault(f"{row}@{world}", Counter()).update(
                        classify(g, lim, hld, fair, ceiling, world))
    doc = {name: {"pct_over": round(100 * sum(c[x] for x in CAUSES) / minutes, 2),
                  **{cause: round(100 * c[cause] / minutes, 2) for cause in CAUSES},
                  "default_better_than_fair": round(100 * c["fair-only-left"] / minutes, 2),
                  **{x: round(100 * v / minutes, 2) for x, v in sorted(c.items()) if ":" in x}}
           for name, c in totals.items()}
    out = {"part": args.part, "k": args.k, "groupings": args.seeds, "reference": args.reference,
           "container_minutes": minutes,
           "pct_of_container_minutes": doc,
           "command": "nice python bench/quota_miss.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump(out, fh, indent=1)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
