"""Placement benchmark: the FGD paper's comparison on the openb traces, plus the core's own latency.

    python bench/bench_placement.py [--seeds 10] [--traces default gpushare40 ...] [--policies fgd ...]
                                    [--skip-latency] [--name N]

Runs ``vramshare simulate`` (the extender's placement code) on the default trace with every policy and
on the other traces with fgd, fgd-paper and bestfit; writes bench/results/<name>.json (summaries,
per seed; name defaults to placement), bench/results/placement/<trace>/{table.md,allocation.png,summary.json} and
bench/results/placement.md (all tables). The latency part times filter_nodes + score_nodes (fgd) in
process over synthetic 500- and 5,000-node clusters of 8 GPUs; the HTTP path is bench_extender's job.

``--policies`` re-runs only those policies and keeps the stored per-seed results of the others (a
policy whose code did not change gives the same numbers on the same seeds), so one change costs one
policy's runs. Traces not named keep their stored results. Each table gets the per-seed difference of
fgd against fgd-paper: both see the same arrival sequence per seed, so the pairs are what to compare.
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
from extender.simulation import report  # noqa: E402
from extender.simulation.main import BASELINES, OURS  # noqa: E402
from vramshare import traces  # noqa: E402

TRACES = os.path.dirname(traces.find(traces.OPENB_NODES) or traces.OPENB_NODES)  # $VRAMSHARE_TRACES/openb
OTHERS = ["fgd", "fgd-paper", "bestfit"]


def _load(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def run_trace(trace: str, policies: list[str], seeds: int, view: str, out: str, keep: list[str]) -> dict:
    """Simulate ``policies``; stored results of the ``keep`` policies (same seeds) are merged back in."""
    stored = _load(os.path.join(out, "summary.json")).get("policies", {})
    kept = {p: stored[p] for p in keep if p in stored and p not in policies
            and len(stored[p]["per_seed"]["seeds"]) == seeds}
    args = argparse.Namespace(
        nodes=os.path.join(TRACES, "openb_node_list_gpu_node.csv"),
        pods=os.path.join(TRACES, f"openb_pod_list_{trace}.csv"),
        policy=policies, seeds=seeds, view=view, order="shuffle", out=out)
    if simulate.run(args) != 0:
        raise SystemExit(f"simulate failed for {trace}")
    summary = _load(os.path.join(out, "summary.json"))
    if kept:
        summary["policies"].update(kept)
        summary["meta"]["reused_from_earlier_runs"] = sorted(kept)
        with open(os.path.join(out, "summary.json"), "w", encoding="utf-8") as fh:
            json.dump(summary, fh, indent=2)
        with_paper = view == "share" and trace == "default"
        with open(os.path.join(out, "table.md"), "w", encoding="utf-8") as fh:
            fh.write(f"Trace `openb_pod_list_{trace}.csv`, {view} view, {seeds} seed(s), arrival order: shuffle; "
                     f"re-used stored runs of {', '.join(sorted(kept))}\n\n"
                     + report.markdown(summary["policies"], with_paper))
    return summary


def paired(summary: dict, policy: str = "fgd", against: str = "fgd-paper") -> str:
    """Markdown lines: per seed, ``policy`` minus ``against`` on both metrics (same arrival sequence)."""
    pol = summary.get("policies", {})
    if policy not in pol or against not in pol:
        return ""
    a, b = pol[policy]["per_seed"], pol[against]["per_seed"]
    if a["seeds"] != b["seeds"]:
        return ""
    da = np.subtract(a["allocated_pct_at_100"], b["allocated_pct_at_100"])
    du = np.subtract(a["unallocated_pct_at_130"], b["unallocated_pct_at_130"])
    lines = [f"\n{policy} minus {against}, per seed (same arrival sequence):\n",
             "| seed | " + " | ".join(str(s) for s in a["seeds"]) + " | mean | seeds better |",
             "|---" * (len(a["seeds"]) + 3) + "|",
             "| allocated @100 | " + " | ".join(f"{x:+.2f}" for x in da) + f" | {da.mean():+.2f} | {(da > 0).sum()}/{len(da)} |",
             "| unallocated @130 | " + " | ".join(f"{x:+.2f}" for x in du) + f" | {du.mean():+.2f} | {(du < 0).sum()}/{len(du)} |"]
    return "\n".join(lines) + "\n"


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
    ap.add_argument("--other-seeds", type=int, default=5, help="seeds for the traces other than default")
    ap.add_argument("--traces", nargs="*", default=["default", "gpushare40", "gpuspec10", "multigpu20"])
    ap.add_argument("--view", choices=["share", "memory"], default="share")
    ap.add_argument("--policies", nargs="*", default=None,
                    help="re-run only these; the others keep their stored results (default: run all)")
    ap.add_argument("--skip-latency", action="store_true")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--name", default="placement", help="results file stem (default placement)")
    args = ap.parse_args()
    name = args.name if args.view == "share" else f"{args.name}-{args.view}"

    def trace_dir(trace: str) -> str:
        return os.path.join(args.out, "placement", trace if args.view == "share" else f"{trace}-{args.view}")

    for trace in args.traces:
        every = OURS[:1] + BASELINES + OURS[1:] if trace == "default" else OTHERS
        chosen = every if args.policies is None else [p for p in every if p in args.policies]
        run_trace(trace, chosen, args.seeds if trace == "default" else args.other_seeds, args.view,
                  trace_dir(trace), every)
    # read back from disk, not from memory: another invocation may have refreshed other traces meanwhile
    stored = _load(os.path.join(args.out, f"{name}.json"))
    traces = list(dict.fromkeys([*stored.get("traces", {}), *args.traces]))
    result: dict = {"seeds": args.seeds, "view": args.view,
                    "traces": {t: _load(os.path.join(trace_dir(t), "summary.json")) for t in traces}}
    result["core_latency"] = stored.get("core_latency", [])
    if not args.skip_latency:
        result["core_latency"] = [latency(500), latency(5000)]
    tables = []
    for trace in traces:
        with open(os.path.join(trace_dir(trace), "table.md"), encoding="utf-8") as fh:
            tables.append(f"### {trace}\n\n{fh.read()}{paired(result['traces'][trace])}")
    with open(os.path.join(args.out, f"{name}.json"), "w", encoding="utf-8") as fh:
        json.dump(result, fh, indent=2)
    with open(os.path.join(args.out, f"{name}.md"), "w", encoding="utf-8") as fh:
        fh.write("\n".join(tables))
    print(json.dumps(result.get("core_latency", []), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
