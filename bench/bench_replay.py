"""Replay the openb trace through the real wire and compare with ``vramshare simulate`` on the same order.

    python bench/bench_replay.py                      # 1,213 nodes, default trace, share view, seed 42
    python bench/bench_replay.py --pods 2000 --view memory
    python bench/bench_replay.py --scheduler-config my-scheduler-config.yaml

The API server stand-in (:mod:`standins.apiserver`) holds the openb nodes: each carries the
vramshare inventory annotation (share view: every GPU is 1000 units of 1 "MiB", so ``memoryUnitMiB: 1``;
memory view: its VRAM in MiB) and ``status.allocatable`` CPU, memory and 110 pods. The extender runs
as in production (``extender.main.start``: list + watch through the official client, HTTP verbs, binder
writing the assignment and the Binding). The stand-in scheduler (:class:`ProfileDriver`) does what
kube-scheduler does for the profile in the scheduler configuration (default
``deploy/daemonset/scheduler-config.yaml``): in-tree Fit, the extender's filter for pods it is
interested in, prioritize combined with the default scores and the extender's weight, bind.

Pods arrive in trace order (``arrivals(order="trace")`` with the seed: the same tuning to 130% the
simulator uses), one at a time: create the pod, wait until the extender's watch has seen it (kube-scheduler's
informer would have it too), schedule, and for pods bound by the default binder wait until the
extender's cache shows them (so every cycle sees the same state the simulator's does).

Compared, on the same sequence: ``replay_as_scheduler`` (the simulator placing as kube-scheduler with the
extender, same profile, same seed): placements must be identical; and ``replay`` (the simulator's
headline mode: every pod placed by the policy, ties in a per-seed random order).

Writes bench/results/replay.json (figures, time, cycles/s, differences).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import platform
import sys
import time
from typing import Any, Callable, Sequence


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from extender import main as extender_main  # noqa: E402
from extender.simulation import report  # noqa: E402
from extender.simulation.arrival import arrivals, gpu_capacity  # noqa: E402
from extender.simulation.kube_model import Profile  # noqa: E402
from extender.simulation.replay import (MAX_PODS, RunResult, Tracker, kube_model_for, replay,  # noqa: E402
                                        replay_as_scheduler)
from extender.simulation.trace import GPU_MIB, REFERENCE_MIB, SHARE_UNITS, TraceNode, TracePod, load_nodes, load_pods  # noqa: E402
from extender.workload import TargetWorkload, typical_workload  # noqa: E402
from standins.apiserver import PODS, ApiServerDouble  # noqa: E402
from standins.scheduler import ProfileDriver  # noqa: E402
from vramshare import contract, inventory, traces  # noqa: E402
from vramshare.config import Config, Policy  # noqa: E402

NAMES = contract.Names()
TRACES = os.path.dirname(traces.find(traces.OPENB_NODES) or traces.OPENB_NODES)  # $VRAMSHARE_TRACES/openb
SCHEDULER_CONFIG = os.path.join(ROOT, "deploy", "daemonset", "scheduler-config.yaml")
RESULTS = os.path.join(ROOT, "bench", "results", "replay.json")
NAMESPACE = "replay"


def gpu_mib(node: TraceNode, view: str) -> int:
    return SHARE_UNITS if view == "share" else GPU_MIB.get(node.model, REFERENCE_MIB)


def node_manifest(node: TraceNode, view: str) -> dict[str, Any]:
    """A Node as the device plugin and the kubelet would publish it: inventory in units of 1 MiB."""
    mib = gpu_mib(node, view)
    gpus = tuple(inventory.Gpu(index=i, uuid=f"GPU-{node.name}-{i}", model=node.model, memory_mib=mib, units=mib)
                 for i in range(node.gpus))
    text = inventory.NodeInventory(unit_mib=1, gpus=gpus).to_json()
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": node.name, "annotations": {NAMES.inventory: text}},
            "status": {"allocatable": {"cpu": f"{node.cpu_milli}m", "memory": f"{node.memory_mib}Mi",
                                       "pods": str(MAX_PODS), NAMES.gpu_memory: str(mib * node.gpus)}}}


def pod_manifest(pod: TracePod, view: str) -> dict[str, Any]:
    """A trace task as a pod of the vramshare-scheduler profile (its GPU share as gpu-memory units)."""
    requests: dict[str, str] = {"cpu": f"{pod.cpu_milli}m"}
    if pod.memory_mib:
        requests["memory"] = f"{pod.memory_mib}Mi"
    limits: dict[str, str] = {}
    ann: dict[str, str] = {}
    if pod.demands(view):
        units = str(pod.per_gpu(view) * pod.num_gpu)
        requests[NAMES.gpu_memory] = limits[NAMES.gpu_memory] = units
        if pod.num_gpu > 1:
            ann[NAMES.gpu_count] = str(pod.num_gpu)
        if pod.gpu_spec:
            ann[NAMES.gpu_models] = "|".join(pod.gpu_spec)
    res: dict[str, Any] = {"requests": requests}
    if limits:
        res["limits"] = limits
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": pod.name, "namespace": NAMESPACE, "annotations": ann},
            "spec": {"schedulerName": "vramshare-scheduler",
                     "containers": [{"name": "task", "image": "trace", "resources": res}]}}


def _wait(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    delay = 0.0002
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("the extender's watch did not catch up")
        time.sleep(delay)
        delay = min(0.005, delay * 2)


def _report_allocated(api: ApiServerDouble, ext: Any, name: str) -> None:
    """Play the device plugin's reconciler: the kubelet admitted the pod on the GPUs it was steered to,
    so its assignment becomes ``allocated`` and the extender's same-size hold on the node ends (the
    simulator has no holds: without this the wire would steer later same-size pods elsewhere)."""
    def report(obj: dict[str, Any]) -> None:
        obj["metadata"].setdefault("annotations", {})[NAMES.allocation_state] = contract.STATE_ALLOCATED

    api.update(PODS, NAMESPACE, name, report, manager=contract.FIELD_MANAGER_DEVICE_PLUGIN)
    key = f"{NAMESPACE}/{name}"

    def released() -> bool:
        with ext.acct.lock:
            return key not in ext.acct.holds.held_pods()

    _wait(released)


def through_wire(nodes: Sequence[TraceNode], seq: Sequence[TracePod], view: str, policy: str, profile: Profile,
                 seed: int, typical: TargetWorkload, placed: list[tuple[str, str]] | None = None,
                 progress: Callable[[str], None] | None = None) -> tuple[RunResult, dict[str, Any]]:
    """Replay ``seq`` through the API stand-in, the HTTP extender and the stand-in scheduler;
    ``typical`` only measures fragmentation (as the simulator does)."""
    config = dataclasses.replace(Config(), memory_unit_mib=1)
    with ApiServerDouble() as api:
        for n in nodes:
            api.create_node(node_manifest(n, view))
        ext = extender_main.start_for_url(api.url, config, policy=Policy(policy))
        try:
            if not ext.wait_ready(60):
                raise TimeoutError("extender not ready")
            _wait(lambda: len(ext.acct.slots) == len(nodes), 60)
            driver = ProfileDriver(ext.url, [n.name for n in nodes], kube_model_for(nodes, profile, seed),
                                   lambda pod, node: api.bind_pod(NAMESPACE, pod["metadata"]["name"], node))
            track = Tracker(float(gpu_capacity(nodes, view)), typical, len(seq))
            started = last = time.monotonic()
            counts = {"extender_cycles": 0, "default_cycles": 0}
            try:
                for t, pod in enumerate(seq):
                    key = f"{NAMESPACE}/{pod.name}"
                    manifest = api.create_pod(pod_manifest(pod, view))
                    gpu = bool(pod.demands(view))
                    if gpu:
                        _wait(lambda: key in ext.acct.pods)
                    out = driver.schedule_one(manifest)
                    if out.node and not ext.acct.state.has_pod(key):  # bound by the default binder
                        _wait(lambda: ext.acct.state.has_pod(key))
                    if out.node and gpu:
                        _report_allocated(api, ext, pod.name)
                    counts["extender_cycles" if profile.interested(["cpu"] + ([NAMES.gpu_memory] if gpu else []))
                           else "default_cycles"] += 1
                    if placed is not None:
                        placed.append((pod.name, out.node))
                    with ext.acct.lock:
                        track.record(t, ext.acct.state, pod.gpu_request(view),
                                     (pod.gpu_request(view) if out.node else None))
                    now = time.monotonic()
                    if progress and now - last > 10:
                        last = now
                        progress(f"wire: {t + 1}/{len(seq)} pods, {now - started:.0f}s")
            finally:
                driver.close()
            seconds = time.monotonic() - started
        finally:
            ext.stop()
    return track.result(policy, seed, seconds), {"seconds": round(seconds, 1),
                                                  "cycles_per_s": round(len(seq) / seconds, 1), **counts}


def figures(run: RunResult) -> dict[str, float]:
    return {"allocated_pct_at_100": round(report.alloc_at(run, 100), 3),
            "unallocated_pct_at_130": round(100 - report.alloc_at(run, 130), 3), "failed": run.failed}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default="default")
    ap.add_argument("--view", choices=["share", "memory"], default="share")
    ap.add_argument("--policy", default="fgd")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--pods", type=int, default=0, help="replay only the first N of the sequence (default all)")
    ap.add_argument("--quick", action="store_true", help="the first 1,500 pods only (no figures at 100%%)")
    ap.add_argument("--scheduler-config", default=SCHEDULER_CONFIG)
    ap.add_argument("--extender-weight", type=int, help="override the configuration's extender weight")
    ap.add_argument("--out", default=RESULTS)
    args = ap.parse_args(argv)
    logging.getLogger().setLevel(logging.WARNING)  # one info line per bind would cost more than the bind

    def say(msg: str) -> None:
        print(f"[replay {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    nodes = load_nodes(os.path.join(TRACES, "openb_node_list_gpu_node.csv"))
    pods = load_pods(os.path.join(TRACES, f"openb_pod_list_{args.trace}.csv"))
    seq = arrivals(pods, nodes, args.view, args.seed, order="trace")
    if args.pods or args.quick:
        seq = seq[: args.pods or 1500]
    typical = typical_workload(p.shape(args.view) for p in pods)
    profile = Profile.from_yaml(args.scheduler_config)
    if args.extender_weight is not None:
        profile = dataclasses.replace(profile, extender_weight=args.extender_weight)
    say(f"{len(nodes)} nodes, {len(seq)} pods in trace order (seed {args.seed}), {args.view} view, "
        f"extender weight {profile.extender_weight}, managed {len(profile.managed)} resources")
    wire_placed: list[tuple[str, str]] = []
    wire, timing = through_wire(nodes, seq, args.view, args.policy, profile, args.seed, typical, wire_placed, say)
    say(f"wire: {timing}")
    sim_placed: list[tuple[str, str]] = []
    t0 = time.monotonic()
    sim = replay_as_scheduler(nodes, seq, args.policy, args.view, args.seed, typical, profile, sim_placed)
    sim_s = time.monotonic() - t0
    paper = replay(nodes, seq, args.policy, args.view, args.seed, typical)
    differ = [(w, s) for w, s in zip(wire_placed, sim_placed) if w != s]
    doc = {
        "benchmark": "replay", "trace": args.trace, "view": args.view, "policy": args.policy, "seed": args.seed,
        "order": "trace", "nodes": len(nodes), "pods": len(seq),
        "scheduler_config": os.path.relpath(args.scheduler_config, ROOT),
        "overrides": {"extender_weight": args.extender_weight},
        "profile": dataclasses.asdict(profile),
        "through_wire": {**figures(wire), **timing},
        "simulate_as_scheduler": {**figures(sim), "seconds": round(sim_s, 1)},
        "simulate_policy_only": {**figures(paper), "seconds": round(paper.seconds, 1)},
        "placements_differing": len(differ), "first_differences": differ[:5],
        "delta_wire_minus_sim_as_scheduler": {
            k: round(figures(wire)[k] - figures(sim)[k], 3) for k in ("allocated_pct_at_100", "unallocated_pct_at_130")},
        "delta_wire_minus_simulate": {
            k: round(figures(wire)[k] - figures(paper)[k], 3) for k in ("allocated_pct_at_100", "unallocated_pct_at_130")},
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "loadavg_1m": round(os.getloadavg()[0], 2),
                    "note": "shared 2-core machine, other work running"},
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    doc["profile"]["managed"] = list(profile.managed)
    doc["summary"] = {"placements_differing": len(differ), "pods": len(seq),
                      "wire_allocated_pct_at_100": doc["through_wire"]["allocated_pct_at_100"],
                      "wire_unallocated_pct_at_130": doc["through_wire"]["unallocated_pct_at_130"],
                      "simulate_allocated_pct_at_100": doc["simulate_policy_only"]["allocated_pct_at_100"],
                      "simulate_unallocated_pct_at_130": doc["simulate_policy_only"]["unallocated_pct_at_130"],
                      "wire_seconds": timing["seconds"], "wire_cycles_per_s": timing["cycles_per_s"]}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump(doc, fh, indent=2)
    print(json.dumps({k: doc[k] for k in ("through_wire", "simulate_as_scheduler", "simulate_policy_only",
                                           "placements_differing", "delta_wire_minus_sim_as_scheduler",
                                           "delta_wire_minus_simulate")}, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
