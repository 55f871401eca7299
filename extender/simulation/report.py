"""Figures from replay runs: the paper's metrics, a markdown table, summary.json and a PNG plot.

Metrics follow the paper's analysis scripts (``merge_alloc_discrete``): after every task the arrived
GPU request and the allocated GPU are recorded as % of capacity; the value "at x% arrived" is the mean
allocation over the tasks whose arrived % rounds to x (within +-1 when none does). Unallocated at 130%
is 100 minus the allocation there.
"""
from __future__ import annotations

import json
import os
from typing import Mapping, Sequence

import numpy as np

from extender.simulation.replay import RunResult

# Weng et al. ATC'23, openb default trace, share view, 10 seeds (extender-anchors.md section 4).
PAPER = {"fgd-paper": (95.23, 4.61), "bestfit": (92.86, 6.92), "gpupacking": (91.78, 8.00),
         "dotprod": (90.62, 9.15), "random": (86.30, 12.53)}


def alloc_at(run: RunResult, pct: int) -> float:
    arrived = np.round(run.arrived)
    hit = arrived == pct
    if not hit.any():
        hit = (arrived >= pct - 1) & (arrived <= pct + 1)
    return float(run.allocated[hit].mean()) if hit.any() else float("nan")


def frag_at(run: RunResult, pct: int) -> float:
    for arrived, rate in run.frag:
        if arrived >= pct:
            return rate
    return float("nan")


def summarize(results: Mapping[str, Sequence[RunResult]]) -> dict[str, dict]:
    out = {}
    for policy, runs in results.items():
        a100 = [round(alloc_at(r, 100), 3) for r in runs]
        u130 = [round(100 - alloc_at(r, 130), 3) for r in runs]
        out[policy] = {
            "allocated_pct_at_100": round(float(np.mean(a100)), 3),
            "unallocated_pct_at_130": round(float(np.mean(u130)), 3),
            "allocated_pct_at_100_std": round(float(np.std(a100)), 3),
            "unallocated_pct_at_130_std": round(float(np.std(u130)), 3),
            "frag_rate_pct_at_80": round(float(np.mean([frag_at(r, 80) for r in runs])), 2),
            "frag_rate_pct_at_90": round(float(np.mean([frag_at(r, 90) for r in runs])), 2),
            "failed_tasks": [r.failed for r in runs],
            "seconds_per_run": round(float(np.mean([r.seconds for r in runs])), 1),
            "per_seed": {"seeds": [r.seed for r in runs], "allocated_pct_at_100": a100,
                         "unallocated_pct_at_130": u130},
        }
    return out


def markdown(summary: Mapping[str, dict], with_paper: bool) -> str:
    head = "| policy | allocated % @100% arrived | unallocated % @130% | frag rate % @80 / @90 | s/run |"
    rule = "|---|---|---|---|---|"
    if with_paper:
        head += " paper alloc / unalloc |"
        rule += "---|"
    lines = [head, rule]
    for policy, s in sorted(summary.items(), key=lambda kv: -kv[1]["allocated_pct_at_100"]):
        line = (f"| {policy} | {s['allocated_pct_at_100']:.2f} ± {s['allocated_pct_at_100_std']:.2f} "
                f"| {s['unallocated_pct_at_130']:.2f} ± {s['unallocated_pct_at_130_std']:.2f} "
                f"| {s['frag_rate_pct_at_80']:.1f} / {s['frag_rate_pct_at_90']:.1f} | {s['seconds_per_run']:.0f} |")
        if with_paper:
            ref = PAPER.get(policy)
            line += f" {ref[0]:.2f} / {ref[1]:.2f} |" if ref else " |"
        lines.append(line)
    return "\n".join(lines) + "\n"


def _mean_over_seeds(curves: Sequence[Sequence[float]]) -> np.ndarray:
    """Column means ignoring NaN (grid points a run never reached), NaN where no run has a value."""
    a = np.asarray(curves, dtype=np.float64)
    have = ~np.isnan(a)
    n = have.sum(axis=0)
    return np.where(n > 0, np.where(have, a, 0.0).sum(axis=0) / np.maximum(n, 1), np.nan)


GRID = np.arange(0, 131)


def curves(results: Mapping[str, Sequence[RunResult]]) -> dict[str, dict[str, list[float]]]:
    """Per policy, mean over seeds on the 0..130% arrived grid: allocated % and fragmentation rate %."""
    out = {}
    for policy, runs in results.items():
        alloc = _mean_over_seeds([[alloc_at(r, int(x)) for x in GRID] for r in runs])
        frag = _mean_over_seeds([np.interp(GRID, [a for a, _ in r.frag], [f for _, f in r.frag]) for r in runs])
        out[policy] = {"allocated_pct": [round(float(v), 3) for v in alloc],
                       "frag_rate_pct": [round(float(v), 3) for v in frag]}
    return out


def plot(results: Mapping[str, Sequence[RunResult]], path: str, title: str, unit: str = "GPU") -> None:
    """Allocation, unallocated (the paper's Figure 7 style) and fragmentation rate against arrived
    workload, mean over seeds. ``unit`` names what is allocated (``GPU`` shares, ``GPU memory``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = GRID
    fig, (ax1, ax3, ax2) = plt.subplots(1, 3, figsize=(17, 4.5))
    for policy, c in curves(results).items():
        alloc = np.array(c["allocated_pct"])
        ax1.plot(grid, alloc, label=policy, lw=1.4)
        ax3.plot(grid, np.minimum(grid, 100) - alloc, label=policy, lw=1.4)
        ax2.plot(grid, c["frag_rate_pct"], label=policy, lw=1.4)
    ax1.plot(grid, np.minimum(grid, 100), color="grey", ls=":", lw=1, label="ideal")
    ax1.set(xlabel="arrived workload (% of GPU capacity)", ylabel=f"{unit} allocated (% of capacity)",
            xlim=(60, 130), ylim=(60, 100), title=f"{unit} allocation")
    ax3.set(xlabel="arrived workload (% of capacity)",
            ylabel=f"{unit} unallocated while wanted (% of capacity)", xlim=(60, 130), ylim=(0, 25),
            title=f"unallocated {unit} (min(arrived, 100) - allocated)")
    ax2.set(xlabel="arrived workload (% of GPU capacity)", ylabel="fragmented (% of idle GPU)",
            xlim=(0, 130), ylim=(0, 100), title="fragmentation rate")
    for ax in (ax1, ax2, ax3):
        ax.grid(alpha=0.3)
    ax1.legend(fontsize=8)
    ax3.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(out_dir: str, results: Mapping[str, Sequence[RunResult]], meta: dict) -> dict:
    """summary.json, table.md and allocation.png under ``out_dir``; returns the summary."""
    os.makedirs(out_dir, exist_ok=True)
    summary = summarize(results)
    with_paper = meta.get("view") == "share" and os.path.basename(str(meta.get("pods", ""))) == "openb_pod_list_default.csv"
    table = markdown(summary, with_paper)
    with open(os.path.join(out_dir, "summary.json"), "w", encoding="utf-8") as fh:
        json.dump({"meta": meta, "policies": summary, "curves_on_arrived_grid": curves(results)}, fh)
    with open(os.path.join(out_dir, "table.md"), "w", encoding="utf-8") as fh:
        fh.write(f"Trace `{os.path.basename(str(meta.get('pods')))}`, {meta.get('view')} view, "
                 f"{meta.get('seeds')} seed(s), arrival order: {meta.get('order')}\n\n{table}")
    plot(results, os.path.join(out_dir, "allocation.png"),
         f"{os.path.basename(str(meta.get('pods')))} ({meta.get('view')} view, {meta.get('seeds')} seeds)",
         "GPU memory" if meta.get("view") == "memory" else "GPU")
    return summary
