"""Dynamic MIG on the openb traces: partitions made for the pods that ask, against static partitions.

    python bench/bench_mig.py [--traces default gpushare40] [--seeds 5] [--name mig] [--policies P ...]

(``--policies static-uniform dra-random dra-frag --name mig_dra``: the DRA path, issue 24.)

The mapping and the policies are :mod:`extender.simulation.mig_replay`'s. The static side is chosen the
way an admin would, and then with hindsight:

* ``static-uniform``: NVIDIA mig-parted's named configurations (``all-1g``, ``all-2g``, ``all-3g``,
  ``all-balanced``, ``all-7g``), one for the whole cluster; the one that accepts most on the tuning seed
  (the first) is reported on every seed;
* ``static-mix``: each GPU cut, one after another, into the maximal layout that best covers what is still
  missing of that seed's own arrival mix (hindsight of the very arrivals it is measured on: an upper bound
  for any static partitioning chosen up front).

Writes bench/results/<name>.json and <name>.md (and <name>.png: accepted tasks per policy and trace).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from extender.simulation import arrival, trace  # noqa: E402
from extender.simulation import mig_replay as mr  # noqa: E402
from vramshare import mig, traces  # noqa: E402

REF = mig.MODELS["A100-SXM4-40GB"]
P = mig.Placed
#: mig-parted's example configurations (nvidia/mig-parted examples/config.yaml), on the reference card.
NAMED = {
    "all-1g": tuple(P(s, "1g.5gb") for s in range(7)),
    "all-2g": tuple(P(s, "2g.10gb") for s in (0, 2, 4)),
    "all-3g": (P(0, "3g.20gb"), P(4, "3g.20gb")),
    # 1x3g + 1x2g + 2x1g: the 3g must take slots 4-7 for the two 1g to fit (slot 7 takes no 1g).
    "all-balanced": (P(0, "2g.10gb"), P(2, "1g.5gb"), P(3, "1g.5gb"), P(4, "3g.20gb")),
    "all-7g": (P(0, "7g.40gb"),),
}


def _say(msg: str) -> None:
    print(f"[bench_mig {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


DEFAULT_POLICIES = ("static-uniform", "static-mix", "firstfit", "bestfit", "frag")
STATIC = ("static-uniform", "static-mix")


def run_trace(name: str, seeds: list[int], policies: tuple[str, ...] = DEFAULT_POLICIES) -> dict:
    nodes_csv, pods_csv = traces.find(traces.OPENB_NODES), traces.find(traces.openb_pods(name))
    if nodes_csv is None or pods_csv is None:
        raise SystemExit(traces.not_found(traces.OPENB_NODES if nodes_csv is None else traces.openb_pods(name)))
    nodes = trace.load_nodes(nodes_csv)
    pods = trace.load_pods(pods_csv)
    for layout in NAMED.values():
        assert not mig.check_layout(REF, layout), layout
    tune = arrival.arrivals(pods, nodes, "share", seeds[0])
    uniform = {}
    for label, layout in NAMED.items():
        run = mr.replay(nodes, tune, "static", seeds[0], mr.uniform_layouts(nodes, layout, REF))
        uniform[label] = run.accepted
        _say(f"{name}: tuning {label}: {run.accepted} accepted")
    chosen = max(uniform, key=uniform.__getitem__)
    runs: dict[str, list[dict]] = {p: [] for p in policies}
    for seed in seeds:
        seq = arrival.arrivals(pods, nodes, "share", seed)
        plan = {"static-uniform": lambda: mr.uniform_layouts(nodes, NAMED[chosen], REF),
                "static-mix": lambda: mr.mixed_layouts(nodes, seq)}
        for policy in runs:
            layouts = plan[policy]() if policy in plan else None
            run = mr.replay(nodes, seq, "static" if layouts else policy, seed, layouts)
            row = run.as_dict()
            row["policy"] = policy
            runs[policy].append(row)
            _say(f"{name} seed {seed} {policy}: {run.accepted}/{run.arrived} accepted, "
                 f"{run.slot_share:.1f}% of memory slots held, {run.seconds:.1f} s")
    summary = {}
    for policy, rows in runs.items():
        acc = np.array([r["accepted"] for r in rows], dtype=float)
        summary[policy] = {"accepted_mean": float(acc.mean()), "accepted_min": float(acc.min()),
                           "accepted_max": float(acc.max()),
                           "slot_share_mean": float(np.mean([r["slot_share"] for r in rows])),
                           "arrived_mean": float(np.mean([r["arrived"] for r in rows]))}
    for policy in (p for p in runs if p not in STATIC):
        for static in (p for p in STATIC if p in runs):
            gain = [100.0 * (d["accepted"] - s["accepted"]) / s["accepted"]
                    for d, s in zip(runs[policy], runs[static])]
            summary[policy][f"gain_vs_{static}_pct"] = {"mean": float(np.mean(gain)), "min": float(np.min(gain)),
                                                         "max": float(np.max(gain))}
    return {"trace": name, "seeds": seeds, "static_uniform_tuning": uniform, "static_uniform_chosen": chosen,
            "summary": summary, "runs": runs}


def markdown(results: list[dict]) -> str:
    lines = ["# Dynamic MIG on the openb traces (bench/bench_mig.py)", "",
             "Mapping: " + ", ".join(f"{k} -> {v}" for k, v in mr.GPU_MAP.items())
             + "; a shared task's `gpu_milli/1000` of the card's memory -> the smallest profile holding it; "
             "whole-GPU tasks -> one full-GPU instance per GPU. Arrivals: the FGD paper's (shuffled, 1.3x "
             "capacity, no departures).", ""]
    for res in results:
        lines += [f"## {res['trace']} (seeds {res['seeds']})", "",
                  f"static-uniform chosen on seed {res['seeds'][0]}: **{res['static_uniform_chosen']}** "
                  f"({', '.join(f'{k} {v}' for k, v in res['static_uniform_tuning'].items())} accepted)", "",
                  "| policy | GPU tasks accepted (mean, min-max) | memory slots held | vs static-uniform | vs static-mix |",
                  "| --- | --- | --- | --- | --- |"]
        for policy, s in res["summary"].items():
            g1 = s.get("gain_vs_static-uniform_pct")
            g2 = s.get("gain_vs_static-mix_pct")
            fmt = (lambda g: f"{g['mean']:+.1f}% ({g['min']:+.1f} to {g['max']:+.1f})" if g else "")
            lines.append(f"| {policy} | {s['accepted_mean']:.0f} ({s['accepted_min']:.0f}-{s['accepted_max']:.0f}) of "
                         f"{s['arrived_mean']:.0f} | {s['slot_share_mean']:.1f}% | {fmt(g1)} | {fmt(g2)} |")
        lines.append("")
    return "\n".join(lines)


def plot(results: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 4), squeeze=False)
    for ax, res in zip(axes[0], results):
        names = list(res["summary"])
        means = [res["summary"][p]["accepted_mean"] for p in names]
        lo = [m - res["summary"][p]["accepted_min"] for p, m in zip(names, means)]
        hi = [res["summary"][p]["accepted_max"] - m for p, m in zip(names, means)]
        ax.bar(names, means, yerr=[lo, hi], color=["#999", "#bbb", "#4c72b0", "#55a868", "#c44e52"])
        ax.set_title(f"openb {res['trace']}: GPU tasks accepted")
        ax.set_ylim(min(means) * 0.9, max(means) * 1.03)
        ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", nargs="+", default=["default", "gpushare40"])
    ap.add_argument("--seeds", type=int, default=5, help="seeds 42, 43, ... (the first also tunes static-uniform)")
    ap.add_argument("--name", default="mig")
    ap.add_argument("--policies", nargs="+", default=list(DEFAULT_POLICIES),
                    choices=list(STATIC) + [p for p in mr.POLICIES if p != "static"])
    args = ap.parse_args()
    seeds = [42 + i for i in range(args.seeds)]
    results = [run_trace(t, seeds, tuple(args.policies)) for t in args.traces]
    out = os.path.join(ROOT, "bench", "results")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{args.name}.json"), "w", encoding="utf-8") as fh:
        json.dump({"gpu_map": mr.GPU_MAP, "results": results}, fh, indent=1)
    with open(os.path.join(out, f"{args.name}.md"), "w", encoding="utf-8") as fh:
        fh.write(markdown(results))
    plot(results, os.path.join(out, f"{args.name}.png"))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
