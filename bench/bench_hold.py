"""What the per-node, per-signature hold costs a burst of same-size replicas, and what it buys.

A Deployment scaled to R replicas of one size arrives at once on a cluster of 20 empty nodes. A
kube-scheduler-like loop schedules them one cycle at a time (filter, prioritize) and binds
asynchronously, as kube-scheduler does; a pod the extender turns away is retried after kube-scheduler's
backoff (``podInitialBackoffSeconds`` 1 s, doubling up to ``podMaxBackoffSeconds`` 10 s; a pod update,
such as the device plugin's ``allocated`` report, is the cluster event that lets it go then). The
kubelet/device-plugin stand-in (bench/soak_harness.py) admits each bound pod after a random delay and
reports its actual GPUs.

Same seed, same process, two configs: ``hold`` (``holdTimeoutSeconds: 30``) and ``no_hold`` (0).
Figures: seconds until every replica is bound and until every one is admitted; steering misses (a pod
that got another pod's GPUs because the device plugin could not tell them apart).

    python bench/bench_hold.py                       # R = 20, 60, 120 on 20 nodes x 4 GPUs
    python bench/bench_hold.py --quick               # R = 20, 60

``--silent BASELINE_TREE`` (issue 18): the device plugins never report ``allocated`` (their reconciler
is down), holds on. Two bursts, each run twice in this process with the same seed: the extender of
BASELINE_TREE (a checkout of the code before, e.g. ``git archive main``) and this tree's. 120 x 16 GiB
on 20 nodes x 4 GPUs; 160 x 79 GiB on 20 nodes x 8 GPUs (one replica per GPU). Writes
``bench/results/hold_silent.json``.
"""
from __future__ import annotations

import argparse
import heapq
import json
import os
import platform
import sys
import threading
import time
from typing import Any

import urllib3

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.bench_soak import UNIT, node_obj, pod_obj  # noqa: E402
from bench.soak_harness import N, ExtenderProcess, KubeletSim, bind_body, post  # noqa: E402
from standins.apiserver import ApiServerDouble  # noqa: E402
from vramshare import inventory  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "hold.json")
SILENT_RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "hold_silent.json")


def burst(replicas: int, hold: bool, args: argparse.Namespace, root: str | None = None,
          report: bool = True) -> dict[str, Any]:
    with ApiServerDouble() as api:
        capacity = {}
        for i in range(args.nodes):
            node = api.create_node(node_obj(f"node-{i:02d}", "NVIDIA A100-SXM4-80GB", 81920,
                                            getattr(args, "gpus_per_node", 4)))
            inv = inventory.NodeInventory.from_json(node["metadata"]["annotations"][N.inventory])
            capacity[f"node-{i:02d}"] = {g.uuid: g.units for g in inv.gpus}
        nodes = sorted(capacity)
        ext = ExtenderProcess(api.url, "version: v1\nextender:\n  policy: fgd\n"
                                       f"  holdTimeoutSeconds: {30 if hold else 0}\n", root=root)
        ext.start()
        assert ext.wait_ready(), "extender did not start"
        kubelet = KubeletSim(api, capacity, UNIT, (args.admit_min_s, args.admit_max_s), args.seed, report=report)
        kubelet.start()
        http = urllib3.PoolManager(retries=False, maxsize=8)
        pods = [api.create_pod(pod_obj(f"r{i}", args.gib, 1)) for i in range(replicas)]
        t0 = time.monotonic()
        ready: list[tuple[float, int, dict]] = [(t0, i, p) for i, p in enumerate(pods)]
        attempts: dict[str, int] = {}
        bound_at: dict[str, float] = {}
        lock = threading.Lock()
        binds: list[threading.Thread] = []
        turned_away = 0

        def retry(pod: dict) -> None:
            name = pod["metadata"]["name"]
            with lock:
                attempts[name] = attempts.get(name, 0) + 1
                delay = min(args.max_backoff_s, args.initial_backoff_s * 2 ** (attempts[name] - 1))
                heapq.heappush(ready, (time.monotonic() + delay, int(name[1:]), pod))

        def bind(pod: dict, node: str) -> None:
            res = post(urllib3.PoolManager(retries=False), ext.url, "bind", bind_body(pod, node))
            if res["Error"]:
                retry(pod)
            else:
                with lock:
                    bound_at[pod["metadata"]["name"]] = time.monotonic()

        while len(bound_at) < replicas and time.monotonic() - t0 < args.max_seconds:
            with lock:
                item = heapq.heappop(ready) if ready and ready[0][0] <= time.monotonic() else None
            if item is None:
                time.sleep(0.005)
                continue
            pod = item[2]
            out = post(http, ext.url, "filter", {"Pod": pod, "NodeNames": nodes})
            fitting = out["NodeNames"] or []
            if not fitting:
                turned_away += 1
                retry(pod)
                continue
            node = fitting[0]
            if len(fitting) > 1:
                scores = post(http, ext.url, "prioritize", {"Pod": pod, "NodeNames": fitting})
                node = max(scores, key=lambda s: s["Score"])["Host"]
            t = threading.Thread(target=bind, args=(pod, node))  # kube-scheduler binds asynchronously
            t.start()
            binds.append(t)
        all_bound = time.monotonic() - t0
        for t in binds:
            t.join(10)
        while kubelet.stats.admitted + kubelet.stats.admission_failures < len(bound_at) \
                and time.monotonic() - t0 < args.max_seconds + 30:
            time.sleep(0.01)
        all_admitted = time.monotonic() - t0
        kubelet.stop_event.set()
        kubelet.join(5)
        ext.kill()
    return {"replicas": replicas, "bound": len(bound_at), "all_bound_s": round(all_bound, 2),
            "all_admitted_s": round(all_admitted, 2), "filter_turned_away": turned_away,
            "steering_misses": kubelet.stats.steering_misses, "ambiguous_admissions": kubelet.stats.ambiguous, "unsteered_admissions": kubelet.stats.unsteered,
            "admission_failures": kubelet.stats.admission_failures}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--replicas", type=int, action="append")
    ap.add_argument("--nodes", type=int, default=20)
    ap.add_argument("--gib", type=int, default=16)
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--admit-min-s", type=float, default=0.2, help="bind to allocated report, fastest")
    ap.add_argument("--admit-max-s", type=float, default=1.0, help="bind to allocated report, slowest")
    ap.add_argument("--initial-backoff-s", type=float, default=1.0)
    ap.add_argument("--max-backoff-s", type=float, default=10.0)
    ap.add_argument("--max-seconds", type=float, default=120)
    ap.add_argument("--silent", metavar="BASELINE_TREE", help="device plugins never report; before/after")
    args = ap.parse_args(argv)
    if args.silent:
        return silent(args)
    sizes = args.replicas or ([20, 60] if args.quick else [20, 60, 120])
    rows = []
    for r in sizes:
        for hold in (True, False):
            print(f"burst of {r}, {'hold' if hold else 'no hold'} ...", file=sys.stderr, flush=True)
            rows.append({"hold": hold, **burst(r, hold, args)})
    summary = {}
    for r in sizes:
        h = next(x for x in rows if x["replicas"] == r and x["hold"])
        n = next(x for x in rows if x["replicas"] == r and not x["hold"])
        summary[f"r{r}.all_bound_s.hold"] = h["all_bound_s"]
        summary[f"r{r}.all_bound_s.no_hold"] = n["all_bound_s"]
        summary[f"r{r}.all_admitted_s.hold"] = h["all_admitted_s"]
        summary[f"r{r}.all_admitted_s.no_hold"] = n["all_admitted_s"]
        summary[f"r{r}.steering_misses.hold"] = h["steering_misses"]
        summary[f"r{r}.steering_misses.no_hold"] = n["steering_misses"]
    doc = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                       "note": "shared 2-core machine, other work running"},
           "args": vars(args), "runs": rows, "summary": summary}
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w", encoding="utf-8") as fh:
        json.dump(doc, fh, indent=2)
    print(json.dumps(summary, indent=2))
    return 0


def silent(args: argparse.Namespace) -> int:
    """Issue 18 item 6: bursts on nodes whose device plugin never reports, before (BASELINE_TREE) and after."""
    rows = []
    for replicas, gib, nodes, gpus in ((120, 16, 20, 4), (160, 79, 20, 8)):
        for label, root in (("before", os.path.abspath(args.silent)), ("after", None)):
            run = argparse.Namespace(**{**vars(args), "gib": gib, "nodes": nodes, "gpus_per_node": gpus,
                                        "max_seconds": max(args.max_seconds, 300)})
            print(f"silent burst of {replicas} x {gib} GiB on {nodes} nodes x {gpus} GPUs, {label} ...",
                  file=sys.stderr, flush=True)
            rows.append({"code": label, "gib": gib, "nodes": nodes, "gpus_per_node": gpus,
                         **burst(replicas, True, run, root=root, report=False)})
    summary = {f"r{r['replicas']}x{r['gib']}gib.all_bound_s.{r['code']}": r["all_bound_s"] for r in rows}
    summary.update({f"r{r['replicas']}x{r['gib']}gib.bound.{r['code']}": r["bound"] for r in rows})
    doc = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                       "note": "shared 2-core machine, other work running"},
           "scenario": "holds on (30 s), device plugins never report allocated; same seed, same process; "
                       "'before' runs the extender of the baseline tree",
           "args": vars(args), "runs": rows, "summary": summary}
    os.makedirs(os.path.dirname(SILENT_RESULTS), exist_ok=True)
    with open(SILENT_RESULTS, "w", encoding="utf-8") as fh:
        json.dump(doc, fh, indent=2)
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
