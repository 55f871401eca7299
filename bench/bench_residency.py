"""What the residency term costs in placement quality (issue 23 item 3), on the openb traces.

    python bench/bench_residency.py [--seeds 3] [--trace default] [--max-steps 0.9 3] [--policy fgd|dra-fgd|dra-mig]

The replay of ``vramshare simulate`` (:func:`extender.simulation.replay.replay`: fgd, share view, shuffled
arrivals, seeds 42..), side by side in one process: fgd alone, and fgd plus the residency term (its
``bonus`` hook, :class:`ModelFiles`) for each ``--max-steps``. openb has
no model names, so every GPU pod is given one (seeded): a Zipf(1.1) draw over 300 models, each 15, 27.5
or 60 GiB; a node holds a model's files once a pod of that model was placed on it (nothing departs, as in
the paper's replay). Reports allocation at 100% arrived (the paper's metric; the target is at most 0.5
points below fgd) and the residency hit rate (placed pods whose model's files the node already held).
Writes bench/results/residency.json. ``--policy dra-fgd`` replays the DRA path's scorer instead (FGD for the
GPU the DRA allocator takes, first fit; the residency term is the same, issue 23), into residency-dra-fgd.json.
``--policy dra-mig``: the DRA path for pods asking MIG profiles (:mod:`extender.simulation.mig_replay`'s
``dra-frag``: dynamic-MIG GPUs, the allocator's first-fit partition, the MIG term; the residency term added
to it as :meth:`extender.dra_scoring.DraCluster.mig_scores` adds it); the metric is GPU tasks accepted, % of
arrived (the MIG bench's), into residency-dra-mig.json.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from extender import residency  # noqa: E402
from extender.simulation import mig_replay  # noqa: E402
from extender.simulation import report  # noqa: E402
from extender.simulation.arrival import arrivals  # noqa: E402
from extender.simulation.replay import build_state, replay  # noqa: E402
from extender.simulation.trace import load_nodes, load_pods  # noqa: E402
from extender.workload import typical_workload  # noqa: E402
from vramshare import traces  # noqa: E402

GIB = 1 << 30
#: what a variant is measured by, when not allocation at 100% arrived (the MIG bench's acceptance)
METRIC = {"dra-mig": "accepted_pct"}
N_MODELS = 300
SIZES = np.array([15, 27.5, 60]) * GIB


@dataclasses.dataclass
class ModelFiles:
    """The residency term in the replay (:class:`extender.simulation.replay.Bonus`): each GPU pod names
    a model (seeded Zipf draw); a node holds a model's files once a pod of it was placed there."""

    pods: list
    seed: int
    n_rows: int
    max_steps: float | None
    cfg: residency.ResidencyConfig
    placed_pods: int = 0
    hits: int = 0

    def __post_init__(self) -> None:
        mrng = np.random.default_rng(7 + self.seed)
        self.model_of = {p.name: int(mrng.zipf(1.1) % N_MODELS) for p in self.pods}
        self.size_of = SIZES[np.arange(N_MODELS) % 3]
        self.held: dict[int, np.ndarray] = {}

    def steps(self, pod, rows: np.ndarray) -> np.ndarray | None:
        m = self.model_of[pod.name]
        where = self.held.get(m)
        if self.max_steps is None or where is None or not pod.demands("share"):
            return None
        size = self.size_of[m]
        saved = size / self.cfg.remote_bytes_per_s - size / self.cfg.disk_bytes_per_s
        return np.where(where[rows], min(1.0, saved / self.cfg.saturate_s) * self.max_steps, 0.0)

    def placed(self, pod, row: int) -> None:
        if not pod.demands("share"):
            return
        m = self.model_of[pod.name]
        where = self.held.get(m)
        self.placed_pods += 1
        self.hits += int(where is not None and bool(where[row]))
        self.held.setdefault(m, np.zeros(self.n_rows, bool))[row] = True


def run(nodes, seq, seed: int, typical, max_steps: float | None, cfg: residency.ResidencyConfig,
        policy: str = "fgd") -> dict:
    if policy == "dra-mig":
        files = ModelFiles(seq, seed, len(nodes), max_steps, cfg)  # rows = node indices
        mr = mig_replay.replay(nodes, seq, "dra-frag", seed, bonus=files)
        return {METRIC[policy]: round(100.0 * mr.accepted / mr.arrived, 3), "accepted": mr.accepted,
                "arrived": mr.arrived,
                "residency_hit_pct": round(100.0 * files.hits / files.placed_pods, 2) if files.placed_pods else 0.0,
                "seconds": round(mr.seconds, 1)}
    state = build_state(nodes, "share")  # the replay builds the same rows: sizes the held-files table
    rows = max(state.row(n.name) for n in nodes) + 1
    files = ModelFiles(seq, seed, rows, max_steps, cfg)
    res = replay(nodes, seq, policy, "share", seed, typical, bonus=files)
    return {"allocated_pct_at_100": round(report.alloc_at(res, 100), 3),
            "unallocated_pct_at_130": round(100 - report.alloc_at(res, 130), 3),
            "residency_hit_pct": round(100.0 * files.hits / files.placed_pods, 2) if files.placed_pods else 0.0,
            "seconds": round(res.seconds, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--trace", default="default")
    ap.add_argument("--max-steps", type=float, nargs="*", default=[0.9, 3.0])
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "residency.json"))
    ap.add_argument("--quick", action="store_true", help="1 seed (smoke run; bench/run_all.py --quick)")
    ap.add_argument("--policy", default="fgd", choices=["fgd", "dra-fgd", "dra-mig"],
                    help="the scorer the term is added to (dra-fgd: the DRA path's, issue 23; dra-mig: its MIG term)")
    args = ap.parse_args()
    if args.policy != "fgd" and args.out.endswith("residency.json"):
        args.out = args.out.replace("residency.json", f"residency-{args.policy}.json")
    if args.quick:
        args.seeds = 1
        args.out = args.out.replace(".json", "-quick.json")
    cfg = residency.ResidencyConfig()
    nodes_csv, pods_csv = traces.find(traces.OPENB_NODES), traces.find(traces.openb_pods(args.trace))
    if nodes_csv is None or pods_csv is None:
        raise SystemExit(traces.not_found(traces.OPENB_NODES if nodes_csv is None else traces.openb_pods(args.trace)))
    nodes = load_nodes(nodes_csv)
    pods = load_pods(pods_csv)
    typical = typical_workload(p.shape("share") for p in pods)
    variants: dict[str, list[dict]] = {args.policy: []}
    for s in args.max_steps:
        variants[f"{args.policy}+residency(max_steps={s:g})"] = []
    for seed in range(42, 42 + args.seeds):
        seq = arrivals(pods, nodes, "share", seed)
        for name in variants:
            steps = None if name == args.policy else float(name.split("=")[1].rstrip(")"))
            r = run(nodes, seq, seed, typical, steps, cfg, args.policy)
            variants[name].append(r)
            print(f"[residency] seed {seed} {name}: {r}", file=sys.stderr, flush=True)
    metric = METRIC.get(args.policy, "allocated_pct_at_100")
    base = np.array([r[metric] for r in variants[args.policy]])
    summary = {}
    for name, runs in variants.items():
        a = np.array([r[metric] for r in runs])
        summary[name] = {metric: round(float(a.mean()), 3),
                         "delta_vs_fgd_per_seed": [round(float(x), 3) for x in a - base],
                         "delta_vs_fgd_mean": round(float((a - base).mean()), 3),
                         "residency_hit_pct": round(float(np.mean([r["residency_hit_pct"] for r in runs])), 2)}
    out = {"trace": args.trace, "policy": args.policy, "seeds": list(range(42, 42 + args.seeds)), "config": dataclasses.asdict(cfg),
           "models": {"count": N_MODELS, "zipf_a": 1.1, "sizes_gib": (SIZES / GIB).tolist()},
           "summary": summary, "per_seed": variants}
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump(out, fh, indent=2, default=float)
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
