"""Extender latency over HTTP on loopback, the way kube-scheduler calls it (nodeCacheCapable: NodeNames).

For 500 and 5,000 nodes of 8 GPUs, populated with a realistic mix of used memory, one keep-alive
connection runs scheduling cycles back to back: POST /filter with every node name, then POST
/prioritize with the nodes that fit (kube-scheduler serialises cycles, so this is its throughput
bound). Reported: p50/p99 per verb and cycles per second, from the fastest of ``--repeat`` runs (on a
shared machine other work only ever adds time), plus the CPU milliseconds one cycle costs. A baseline server in the same process,
on the same HTTP stack, only parses the request and echoes every name back: the difference is the
placement work, the baseline itself the protocol overhead.

    python bench/bench_extender.py            # 500 and 5,000 nodes
    python bench/bench_extender.py --quick    # fewer cycles
    python bench/bench_extender.py --profile  # also print where the server spends its time (5,000)

Aims: p99 < 5 ms per verb at 500 nodes, < 20 ms at 5,000; >= 400 cycles/s at 500.
"""
from __future__ import annotations

import argparse
import cProfile
import http.client
import io
import json
import os
import platform
import pstats
import random
import sys
import threading
import time
from typing import Any

import numpy as np
import orjson

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from extender import accounting, app, http_server, metrics, wire  # noqa: E402
from vramshare import contract, inventory  # noqa: E402
from vramshare.config import Config, Policy  # noqa: E402

NAMES = contract.Names()
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "extender.json")
MODELS = [("NVIDIA A100-SXM4-80GB", 81920), ("NVIDIA H100 80GB HBM3", 81559), ("NVIDIA L40S", 46068)]
SIZES_GIB = [4, 8, 10, 16, 20, 24, 40]  # typical inference replicas


def node_obj(name: str, model: str, mib: int) -> dict[str, Any]:
    gpus = tuple(inventory.Gpu(index=i, uuid=f"GPU-{name}-{i}", model=model, memory_mib=mib,
                               units=inventory.units_for(mib, 0, 1024)) for i in range(8))
    text = inventory.NodeInventory(unit_mib=1024, gpus=gpus).to_json()
    return {"metadata": {"name": name, "annotations": {NAMES.inventory: text}}}


def pod_obj(name: str, gib: int, count: int = 1) -> dict[str, Any]:
    ann = {NAMES.gpu_count: str(count)} if count > 1 else {}
    return {"metadata": {"name": name, "namespace": "bench", "uid": f"uid-{name}", "annotations": ann},
            "spec": {"schedulerName": "vramshare-scheduler", "containers": [
                {"name": "vllm", "resources": {"limits": {NAMES.gpu_memory: str(gib * count)}}}]},
            "status": {"phase": "Running"}}


def populate(nodes: int, rng: random.Random, policy: Policy) -> accounting.Accounting:
    """``nodes`` 8-GPU nodes, each GPU filled to a random level by pods of typical sizes (about 60%)."""
    acct = accounting.Accounting(Config())
    serial = 0
    for n in range(nodes):
        model, mib = MODELS[n % len(MODELS)]
        name = f"node-{n:05d}"
        acct.apply_node("ADDED", node_obj(name, model, mib))
        for g in range(8):
            cap = (mib // 1024) * 1024
            used = 0
            target = cap * rng.choice([0.0, 0.3, 0.5, 0.7, 0.9, 1.0, 1.0, 1.0])
            while True:
                gib = rng.choice(SIZES_GIB)
                if used + gib * 1024 > target:
                    break
                serial += 1
                pod = pod_obj(f"p{serial}", gib)
                asg = {"vllm": [{"uuid": f"GPU-{name}-{g}", "mib": gib * 1024}]}
                pod["metadata"]["annotations"].update({NAMES.assignment: orjson.dumps(asg).decode(),
                                                       NAMES.assume_time: "1"})
                pod["spec"]["nodeName"] = name
                acct.apply_pod("ADDED", pod)  # also feeds FGD's workload window
                used += gib * 1024
    return acct


class EchoApp:
    """The baseline: parse the request, answer every name as fitting (or a flat score)."""

    def handle(self, method: str, path: str, body: bytes) -> app.Response:
        args = wire.decode_extender_args(body)
        if path == "/filter":
            return app.Response(200, wire.encode_filter_result(wire.FilterResult(passed=list(args.names)), args))
        return app.Response(200, wire.encode_host_priorities([(n, 0) for n in args.names]))


def serve(handler: Any) -> http_server.ExtenderHTTPServer:
    server = http_server.ExtenderHTTPServer(handler, "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True).start()
    return server


def post(conn: http.client.HTTPConnection, path: str, body: bytes) -> tuple[float, Any]:
    start = time.perf_counter()
    conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = orjson.loads(resp.read())
    return time.perf_counter() - start, data


def run_cycles(url: str, names: list[str], pods: list[dict[str, Any]]) -> dict[str, Any]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    lat: dict[str, list[float]] = {"filter": [], "prioritize": []}
    fitting_counts = []
    try:
        post(conn, "/filter", orjson.dumps({"Pod": pods[0], "Nodes": None, "NodeNames": names}))  # warm-up
        start, cpu_start = time.perf_counter(), time.process_time()
        for pod in pods:
            dt, result = post(conn, "/filter", orjson.dumps({"Pod": pod, "Nodes": None, "NodeNames": names}))
            lat["filter"].append(dt)
            fitting = result["NodeNames"]
            fitting_counts.append(len(fitting))
            if len(fitting) > 1:
                dt, _ = post(conn, "/prioritize", orjson.dumps({"Pod": pod, "Nodes": None, "NodeNames": fitting}))
                lat["prioritize"].append(dt)
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    finally:
        conn.close()
    # CPU time (client + server, one process) per cycle: what the cycle costs on an idle core, whatever
    # else the machine runs; wall-clock figures on a shared machine include waiting for a CPU.
    out: dict[str, Any] = {"cycles": len(pods), "cycles_per_s": round(len(pods) / wall, 1),
                           "cpu_ms_per_cycle": round(cpu / len(pods) * 1000, 3),
                           "mean_fitting_nodes": round(float(np.mean(fitting_counts)), 1)}
    for verb, xs in lat.items():
        if xs:
            arr = np.array(xs) * 1000
            out[verb] = {"p50_ms": round(float(np.percentile(arr, 50)), 3),
                         "p99_ms": round(float(np.percentile(arr, 99)), 3),
                         "max_ms": round(float(arr.max()), 3), "n": len(xs)}
    return out


def best_of(repeat: int, url: str, names: list[str], pods: list[dict[str, Any]]) -> dict[str, Any]:
    """The fastest of ``repeat`` runs (a shared machine only ever adds time), with every run's figures."""
    runs = [run_cycles(url, names, pods) for _ in range(repeat)]
    best = max(runs, key=lambda r: r["cycles_per_s"])
    return {**best, "repeats": [{"cycles_per_s": r["cycles_per_s"], "filter_p99_ms": r["filter"]["p99_ms"],
                                 "prioritize_p99_ms": r.get("prioritize", {}).get("p99_ms")} for r in runs]}


def bench_size(nodes: int, cycles: int, policy: Policy, profile: bool, repeat: int) -> dict[str, Any]:
    rng = random.Random(nodes)
    t0 = time.perf_counter()
    acct = populate(nodes, rng, policy)
    build_s = time.perf_counter() - t0
    stats = metrics.ExtenderMetrics(acct)
    extender = app.Extender(acct, None, None, stats, policy)  # type: ignore[arg-type]  # no bind here
    names = sorted(acct.slots)
    pods = [pod_obj(f"q{i}", rng.choice(SIZES_GIB), 2 if rng.random() < 0.1 else 1) for i in range(cycles)]
    real, echo = serve(extender), serve(EchoApp())
    try:
        prof = cProfile.Profile() if profile else None
        if prof:
            prof.enable()
        measured = best_of(repeat, real.url, names, pods)
        if prof:
            prof.disable()
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(30)
            print(buf.getvalue())
        baseline = best_of(repeat, echo.url, names, pods[: max(20, cycles // 2)])
    finally:
        real.close()
        echo.close()
    with acct.lock:
        used = int(acct.state.used.sum())
        cap = int(acct.state.capacity.sum())
    return {"nodes": nodes, "gpus": nodes * 8, "pods_placed": len(acct.pods), "memory_used_pct": round(100 * used / cap, 1),
            "build_s": round(build_s, 2), "policy": policy.value, "extender": measured, "baseline_echo": baseline}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer cycles")
    ap.add_argument("--profile", action="store_true", help="cProfile the 5,000-node run (client and server)")
    ap.add_argument("--policy", default="fgd", choices=[p.value for p in Policy])
    ap.add_argument("--repeat", type=int, default=3, help="runs per size; the fastest is reported (default 3)")
    args = ap.parse_args(argv)
    policy = Policy(args.policy)
    runs = []
    for nodes, cycles in ((500, 100 if args.quick else 400), (5000, 30 if args.quick else 100)):
        r = bench_size(nodes, cycles, policy, args.profile and nodes == 5000, 1 if args.quick else args.repeat)
        runs.append(r)
        e, b = r["extender"], r["baseline_echo"]
        print(f"{nodes:>5} nodes: filter p50 {e['filter']['p50_ms']} ms p99 {e['filter']['p99_ms']} ms | "
              f"prioritize p50 {e['prioritize']['p50_ms']} ms p99 {e['prioritize']['p99_ms']} ms | "
              f"{e['cycles_per_s']} cycles/s ({e['cpu_ms_per_cycle']} CPU ms/cycle) | echo baseline filter p99 {b['filter']['p99_ms']} ms, "
              f"{b['cycles_per_s']} cycles/s", flush=True)
    summary = {}
    for r in runs:
        e, b = r["extender"], r["baseline_echo"]
        summary[f"{r['nodes']}_nodes"] = {
            "filter_p50_ms": e["filter"]["p50_ms"], "filter_p99_ms": e["filter"]["p99_ms"],
            "prioritize_p50_ms": e["prioritize"]["p50_ms"], "prioritize_p99_ms": e["prioritize"]["p99_ms"],
            "cycles_per_s": e["cycles_per_s"], "cpu_ms_per_cycle": e["cpu_ms_per_cycle"],
            "baseline_filter_p99_ms": b["filter"]["p99_ms"], "baseline_cpu_ms_per_cycle": b["cpu_ms_per_cycle"],
            "baseline_cycles_per_s": b["cycles_per_s"]}
    doc = {"benchmark": "extender", "summary": summary, "runs": runs,
           "aims": {"500_nodes_p99_ms": 5, "5000_nodes_p99_ms": 20, "cycles_per_s": 400},
           "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform()},
           "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w", encoding="utf-8") as fh:
        json.dump(doc, fh, indent=2)
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
