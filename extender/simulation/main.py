"""``vramshare simulate``: compare placement policies on a production trace, as the FGD paper does.

Thin entry point: reads the trace, builds one arrival sequence per seed (shared by every policy),
replays it per policy through :mod:`extender.placement`, and writes the report. Progress goes to
stderr, the markdown table to stdout.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from extender import policy_catalog
from extender.simulation import report
from extender.simulation.arrival import arrivals
from extender.simulation.kube_model import Profile, ProfileError
from extender.simulation.replay import RunResult, replay, replay_as_scheduler
from extender.simulation.trace import load_nodes, load_pods
from extender.workload import typical_workload
from vramshare import traces
from vramshare.errors import UsageError

OURS = ["fgd", "binpack", "spread"]
BASELINES = ["fgd-paper", "bestfit", "gpupacking", "dotprod", "random"]
FIRST_SEED = 42  # the paper's tune seeds are 42..51


def _say(message: str) -> None:
    print(f"[simulate {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _load(loader: Any, path: str, flag: str, columns: str) -> Any:
    """A trace file that is not one is the user's to fix: one line naming it and the columns wanted."""
    try:
        return loader(path)
    except KeyError as exc:
        raise UsageError(f"{flag} {path}: not an openb CSV (missing column {exc}; want {columns})") from None
    except (ValueError, UnicodeDecodeError, OSError) as exc:
        raise UsageError(f"{flag} {path}: not an openb CSV ({exc})") from None


def run(args: argparse.Namespace) -> int:
    for what, path in (("--nodes", args.nodes), ("--pods", args.pods)):
        if not path or not os.path.exists(path):
            print(f"vramshare simulate: {what} {path or '(none)'}: not found; pass the openb CSV, or: "
                  f"{traces.not_found(traces.OPENB_NODES if what == '--nodes' else traces.openb_pods())}",
                  file=sys.stderr)
            return 2
    chosen = args.policy or OURS[:1] + BASELINES + OURS[1:]
    known = policy_catalog.names()
    unknown = [p for p in chosen if p not in known]
    if unknown:
        print(f"vramshare simulate: unknown policy {', '.join(unknown)} (known: {', '.join(known)})", file=sys.stderr)
        return 2
    if args.seeds < 1:
        print("vramshare simulate: --seeds must be at least 1", file=sys.stderr)
        return 2
    order = getattr(args, "order", "shuffle")
    profile = None
    if getattr(args, "as_scheduler", None):
        try:
            profile = Profile.from_yaml(args.as_scheduler)
        except (OSError, ProfileError) as exc:
            print(f"vramshare simulate: --as-scheduler {args.as_scheduler}: {exc}", file=sys.stderr)
            return 2
    nodes, pods = _load(load_nodes, args.nodes, "--nodes", "sn,cpu_milli,memory_mib,gpu,model"), \
        _load(load_pods, args.pods, "--pods", "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec")
    typical = typical_workload(p.shape(args.view) for p in pods)
    _say(f"{len(nodes)} nodes, {sum(n.gpus for n in nodes)} GPUs, {len(pods)} tasks; policies {', '.join(chosen)}; "
         f"{args.seeds} seed(s); {args.view} view; order {order}")
    results: dict[str, list[RunResult]] = {p: [] for p in chosen}
    for seed in range(FIRST_SEED, FIRST_SEED + args.seeds):
        seq = arrivals(pods, nodes, args.view, seed, order=order)
        for policy in chosen:
            if profile is not None:
                result = replay_as_scheduler(nodes, seq, policy, args.view, seed, typical, profile)
            else:
                result = replay(nodes, seq, policy, args.view, seed, typical, progress=_say)
            results[policy].append(result)
            _say(f"{policy} seed {seed}: allocated {report.alloc_at(result, 100):.2f}% at 100% arrived, "
                 f"unallocated {100 - report.alloc_at(result, 130):.2f}% at 130% ({result.seconds:.0f}s)")
    meta = {"nodes": traces.shown(args.nodes), "pods": traces.shown(args.pods), "view": args.view, "seeds": args.seeds, "order": order,
            "first_seed": FIRST_SEED, "tie_break": "first best node in a per-seed random node order"}
    if profile is not None:
        meta["tie_break"] = "as kube-scheduler with the extender: one 10 per cycle (CRC-32 node order), random among equal totals"
        meta["scheduler_profile"] = {"config": args.as_scheduler, **vars(profile)}
    report.write(args.out, results, meta)
    with open(os.path.join(args.out, "table.md"), encoding="utf-8") as fh:
        sys.stdout.write(fh.read())
    _say(f"wrote {args.out}/summary.json, table.md, allocation.png")
    return 0
