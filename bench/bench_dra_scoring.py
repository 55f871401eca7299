"""The extender's DRA view under claim churn: in-place claim updates vs rebuilding the view per event.

    python bench/bench_dra_scoring.py [--nodes 2000] [--events 200]

A cluster of N nodes x 8 shared GPUs published as ResourceSlices, 2N allocated claims; then claim
events, each followed by one prioritize of a pending pod over every node (fgd). Baseline in the
same process: the view rebuilt from every slice and claim after each event. Writes
bench/results/dra-scoring.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tests.extender.test_dra_scoring import NAMES, claim, node_slices, pod  # noqa: E402
from extender.dra_scoring import DraCluster  # noqa: E402


def build(n: int) -> DraCluster:
    dra = DraCluster(NAMES, 1024)
    for i in range(n):
        for s in node_slices(f"n{i}", 8):
            dra.put("ResourceSlice", s)
    for i in range(2 * n):
        dra.put("ResourceClaim", claim(f"c{i}", 20, allocated=[(f"n{i % n}", f"gpu-{i % 8}", 20)]))
    dra.put("ResourceClaim", claim("mine", 16))
    return dra


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=2000)
    ap.add_argument("--events", type=int, default=200)
    args = ap.parse_args()
    dra = build(args.nodes)
    names = [f"n{i}" for i in range(args.nodes)]
    t = time.perf_counter()
    dra.state()
    full_build_ms = (time.perf_counter() - t) * 1000
    results = {}
    for mode in ("in_place", "rebuild_per_event"):
        events = args.events if mode == "in_place" else max(5, args.events // 20)
        t = time.perf_counter()
        for k in range(events):
            dra.put("ResourceClaim", claim(f"{mode}{k}", 8, allocated=[(f"n{k % args.nodes}", "gpu-0", 8)]))
            if mode == "rebuild_per_event":
                dra._state = None  # the baseline: forget the view, as a rebuild-on-any-change cache does
            scores = dra.score(pod("mine"), names, "fgd")
        per_event_ms = (time.perf_counter() - t) * 1000 / events
        results[mode] = {"events": events, "ms_per_event_and_score": round(per_event_ms, 2)}
        assert max(s for _, s in scores) == 10
    doc = {"nodes": args.nodes, "gpus_per_node": 8, "claims": 2 * args.nodes,
           "full_build_ms": round(full_build_ms, 1),
           "results": results, "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "note": "shared 2-core machine, other jobs running"}
    with open(os.path.join(ROOT, "bench", "results", "dra-scoring.json"), "w", encoding="utf-8") as fh:
        json.dump(doc, fh, indent=1)
    print(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
