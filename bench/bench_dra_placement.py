"""What vramshare's node scoring adds on the DRA path: scored vs unscored DRA placement on openb.

    python bench/bench_dra_placement.py [--seeds 3] [--trace default]

On the DRA path kube-scheduler's allocator takes the first fitting devices of a node (first fit in
GPU order) and, having no scorer for shared devices, any feasible node. ``dra-random`` is that
(the baseline, run in the same process on the same arrival sequences); ``dra-fgd`` adds vramshare's
FGD node score computed for the GPU the allocator will take; ``fgd`` (the device-plugin path, where the
extender also picks the GPU) is the ceiling. Writes bench/results/dra-placement.json and .md.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from extender.simulation import report  # noqa: E402
from extender.simulation.arrival import arrivals  # noqa: E402
from extender.simulation.main import FIRST_SEED  # noqa: E402
from extender.simulation.replay import replay  # noqa: E402
from extender.simulation.trace import load_nodes, load_pods  # noqa: E402
from extender.workload import typical_workload  # noqa: E402
from vramshare import traces  # noqa: E402

TRACES = os.path.dirname(traces.find(traces.OPENB_NODES) or traces.OPENB_NODES)  # $VRAMSHARE_TRACES/openb
POLICIES = ["dra-random", "dra-fgd", "fgd"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--trace", default="default")
    args = parser.parse_args()
    nodes = load_nodes(os.path.join(TRACES, "openb_node_list_gpu_node.csv"))
    pods = load_pods(os.path.join(TRACES, f"openb_pod_list_{args.trace}.csv"))
    typical = typical_workload(p.shape("share") for p in pods)
    runs: dict[str, list[dict]] = {p: [] for p in POLICIES}
    for seed in range(FIRST_SEED, FIRST_SEED + args.seeds):
        seq = arrivals(pods, nodes, "share", seed)
        for policy in POLICIES:
            r = replay(nodes, seq, policy, "share", seed, typical)
            runs[policy].append({"seed": seed, "allocated_at_100": round(report.alloc_at(r, 100), 3),
                                 "unallocated_at_130": round(100 - report.alloc_at(r, 130), 3),
                                 "failed_tasks": r.failed, "seconds": round(r.seconds, 1)})
            print(f"{policy} seed {seed}: {runs[policy][-1]}", file=sys.stderr, flush=True)

    def mean(policy: str, key: str) -> float:
        return round(sum(x[key] for x in runs[policy]) / len(runs[policy]), 3)

    summary = {p: {"allocated_at_100": mean(p, "allocated_at_100"), "unallocated_at_130": mean(p, "unallocated_at_130"),
                   "failed_tasks": mean(p, "failed_tasks")} for p in POLICIES}
    gain = [round(a["allocated_at_100"] - b["allocated_at_100"], 3)
            for a, b in zip(runs["dra-fgd"], runs["dra-random"])]
    doc = {"trace": args.trace, "seeds": args.seeds, "view": "share", "when": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                          time.gmtime()),
           "note": "shared 2-core machine; allocation figures do not depend on speed",
           "summary": summary, "dra_fgd_minus_dra_random_per_seed": gain, "runs": runs}
    out = os.path.join(ROOT, "bench", "results")
    with open(os.path.join(out, "dra-placement.json"), "w", encoding="utf-8") as fh:
        json.dump(doc, fh, indent=1)
    lines = ["| policy | GPU allocated % @100% arrived | unallocated % @130% | failed tasks |", "|---|---|---|---|"]
    lines += [f"| {p} | {s['allocated_at_100']} | {s['unallocated_at_130']} | {s['failed_tasks']} |"
              for p, s in summary.items()]
    with open(os.path.join(out, "dra-placement.md"), "w", encoding="utf-8") as fh:
        fh.write(f"openb `{args.trace}`, share view, {args.seeds} seeds (same arrival sequence per seed for every "
                 "policy)\n\n" + "\n".join(lines) + f"\n\ndra-fgd minus dra-random per seed: {gain}\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
