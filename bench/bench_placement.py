"""Placement benchmark: the FGD paper's comparison on the openb traces, plus the core's own latency.

    python bench/bench_placement.py [--seeds 10] [--traces default gpushare40 ...] [--skip-latency] [--name N]

Runs ``vramshare simulate`` (the extender's placement code) on the default trace with every policy and
on the other traces with fgd, fgd-paper and bestfit; writes bench/results/<name>.json (summaries,
per seed; name defaults to placement), bench/results/placement/<trace>/{table.md,allocation.png,summary.json} and
bench/results/placement.md (all tables). The latency part times filter_nodes + score_nodes (fgd) in
process over synthetic 500- and 5,000-node clusters of 8 GPUs; the HTTP path is bench_extender's job.
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

from extender.cluster import ClusterState, Demand, Slot  # noqa: E402
from extender.placement import filter_nodes, score_nodes  # noqa: E402
from extender.simulation import main as simulate  # noqa: E402
from extender.simulation.main import BASELINES, OURS  # noqa: E402

TRACES = os.environ.get("VRAMSHARE_TRACES", os.path.join(ROOT, "..", "shared", "traces", "openb"))
OTHERS = ["fgd", "fgd-paper", "bestfit"]


def run_trace(trace: str, policies: list[str], seeds: int, view: str, out: str) -> dict:
    args = argparse.Namespace(
        nodes=os.path.join(TRACES, "openb_node_list_gpu_node.csv"),
        pods=os.path.join(TRACES, f"openb_pod_list_{trace}.csv"),
        policy=policies, seeds=seeds, view=view, order="shuffle", out=out)
    if simulate.run(args) != 0:
        raise SystemExit(f"simulate failed for {trace}")
    with open(os.path.join(out, "summary.json"), encoding="utf-8") as fh:
        return json.load(fh)


def synthetic(nodes: int, rng: np.random.Generator) -> ClusterState:
    """``nodes`` nodes of 8 x 80 GiB GPUs, each GPU 0-100% used in 1 GiB steps."""
    st = ClusterState(gpus_per_node=8)
    for n in range(nodes):
        st.set_node(f"node-{n}", [Slot(f"GPU-{n}-{g}", "NVIDIA-A100-SXM4-80GB", capacity=81920, index=g)
                                  for g in range(8)])
        used = rng.integers(0, 81, 8) * 1024
        allocs = [(f"GPU-{n}-{g}", int(u)) for g, u in enumerate(used) if u > 0]
        if allocs:
            st.add_pod(f"bench/fill-{n}", f"node-{n}", allocs)
    for size in rng.choice([4, 8, 16, 20, 24, 40, 80], 1000):
        st.observe([Demand(int(size) * 1024)])
    return st


def latency(nodes: int, requests: int = 60) -> dict:
    """Filter + prioritize (fgd) per request, in ms; the cluster changes a little between requests."""
    rng = np.random.default_rng(0)
    st = synthetic(nodes, rng)
    names = st.nodes()
    times = []
    for i in range(requests):
        demand = [Demand(int(rng.choice([8, 16, 20, 40])) * 1024)]
        t0 = time.perf_counter()
        fitting, _ = filter_nodes(st, demand, names)
        score_nodes(st, demand, fitting, "fgd")
        times.append((time.perf_counter() - t0) * 1000)
        st.remove_pod(f"bench/fill-{i % nodes}")  # one node changes per request, as after a bind
    t = np.array(times[5:])
    return {"nodes": nodes, "gpus_per_node": 8, "requests": len(t), "p50_ms": round(float(np.median(t)), 2),
            "p99_ms": round(float(np.percentile(t, 99)), 2), "first_ms": round(times[0], 2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--traces", nargs="*", default=["default", "gpushare40", "gpuspec10", "multigpu20"])
    ap.add_argument("--view", choices=["share", "memory"], default="share")
    ap.add_argument("--skip-latency", action="store_true")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--name", default="placement", help="results file stem (default placement)")
    args = ap.parse_args()
    result: dict = {"seeds": args.seeds, "view": args.view, "traces": {}}
    tables = []
    for trace in args.traces:
        policies = OURS[:1] + BASELINES + OURS[1:] if trace == "default" else OTHERS
        out = os.path.join(args.out, "placement", trace if args.view == "share" else f"{trace}-{args.view}")
        result["traces"][trace] = run_trace(trace, policies, args.seeds, args.view, out)
        with open(os.path.join(out, "table.md"), encoding="utf-8") as fh:
            tables.append(f"### {trace}\n\n{fh.read()}")
    if not args.skip_latency:
        result["core_latency"] = [latency(500), latency(5000)]
    name = args.name if args.view == "share" else f"{args.name}-{args.view}"
    with open(os.path.join(args.out, f"{name}.json"), "w", encoding="utf-8") as fh:
        json.dump(result, fh, indent=2)
    with open(os.path.join(args.out, f"{name}.md"), "w", encoding="utf-8") as fh:
        fh.write("\n".join(tables))
    print(json.dumps(result.get("core_latency", []), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
