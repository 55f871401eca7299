"""Extender failover: two replicas with leader election, the leader killed (SIGKILL) mid-stream.

Two ``vramshare extender --leader-elect`` processes against the API server stand-in; a stand-in for
kube-scheduler sends each pod's filter, prioritize and bind through a "Service" that picks a live
replica at random (a connection refused goes to the other, as kube-proxy does once the dead endpoint
is gone). After ``--kill-after-s`` the leader (the Lease's holder) gets SIGKILL; the standby takes
the Lease when it expires (15 s, client-go's default) and goes on. Reported (bench/results/failover.json):

* ``gap_s``: the longest time without a successful bind around the kill (the scheduling gap);
* ``gpus_over_capacity``: GPUs whose bound pods' assignments sum above the GPU (must be 0);
* binds before and after the kill, binds a standby handed to the leader, bind errors.

    python bench/bench_failover.py             # 32 nodes x 4 GPUs, kill the leader after 8 s, 90 s at most
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import orjson
import urllib3

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.bench_soak import node_obj, pod_obj  # noqa: E402
from bench.soak_harness import N, ExtenderProcess, bind_body  # noqa: E402
from standins.apiserver import LEASES, ApiServerDouble  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "failover.json")
NS = "vramshare-system"


class Replica(ExtenderProcess):
    """An extender process that takes part in the election under its own name."""

    def __init__(self, api_url: str, name: str) -> None:
        super().__init__(api_url, "version: v1\nextender:\n  policy: fgd\n")
        self.name = name
        self.cmd += ["--leader-elect", "--advertise-url", self.url]

    def start(self) -> None:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", ""),
               "POD_NAME": self.name, "POD_NAMESPACE": NS}
        self.proc = subprocess.Popen(self.cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def _call(http: urllib3.PoolManager, replicas: list[Replica], verb: str, body: dict, rng: random.Random) -> Any:
    """One call through the "Service": a random live replica; refused connections go to the other."""
    order = sorted(replicas, key=lambda _: rng.random())
    last: Exception | None = None
    for r in order:
        try:
            resp = http.request("POST", f"{r.url}/{verb}", body=orjson.dumps(body),
                                headers={"Content-Type": "application/json"})
            if resp.status == 200:
                return orjson.loads(resp.data)
            last = RuntimeError(f"HTTP {resp.status}")
        except urllib3.exceptions.HTTPError as exc:
            last = exc
    raise RuntimeError(f"no replica answered: {last}")


def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    http = urllib3.PoolManager(retries=False, timeout=urllib3.Timeout(connect=0.5, read=6))
    with ApiServerDouble() as api:
        capacity: dict[str, int] = {}
        nodes = [f"node-{i:02d}" for i in range(args.nodes)]
        for name in nodes:
            api.create_node(node_obj(name, "NVIDIA A100-SXM4-80GB", 81920, 4))
            for g in range(4):
                capacity[f"GPU-{name}-{g}"] = 80 * 1024  # units_for(81920, 0, 1024) x 1024
        replicas = [Replica(api.url, "extender-a"), Replica(api.url, "extender-b")]
        for r in replicas:
            r.start()
        try:
            assert all(r.wait_ready(60) for r in replicas), "replicas did not start"
            deadline = time.monotonic() + 30
            while not api.objects(LEASES, NS) and time.monotonic() < deadline:
                time.sleep(0.1)
            binds: list[float] = []
            errors: dict[str, int] = {}
            killed_at: float | None = None
            killed: str | None = None
            t0 = time.monotonic()
            i = 0
            while time.monotonic() - t0 < args.max_seconds and len(binds) < args.pods:
                if killed_at is None and time.monotonic() - t0 >= args.kill_after_s:
                    holder = api.objects(LEASES, NS)[0]["spec"]["holderIdentity"]
                    victim = next(r for r in replicas if r.name == holder)
                    victim.proc.send_signal(signal.SIGKILL)
                    victim.proc.wait(10)
                    killed_at, killed = time.monotonic(), holder
                live = [r for r in replicas if r.alive()]
                pod = api.create_pod(pod_obj(f"p{i:05d}", rng.choice([4, 8, 16, 24]), 1))
                i += 1
                while time.monotonic() - t0 < args.max_seconds:
                    try:
                        f = _call(http, live, "filter", {"Pod": pod, "Nodes": None, "NodeNames": nodes}, rng)
                        if f.get("Error") or not f.get("NodeNames"):
                            raise RuntimeError(f.get("Error") or "no node fits")
                        fitting = f["NodeNames"]
                        scores = _call(http, live, "prioritize", {"Pod": pod, "Nodes": None, "NodeNames": fitting}, rng)
                        best = max(scores, key=lambda s: s["Score"])["Host"] if scores else fitting[0]
                        b = _call(http, live, "bind", bind_body(pod, best), rng)
                        if b.get("Error"):
                            raise RuntimeError(b["Error"])
                        binds.append(time.monotonic())
                        break
                    except RuntimeError as exc:
                        kind = str(exc).split(":")[0][:60]
                        errors[kind] = errors.get(kind, 0) + 1
                        time.sleep(0.2)  # kube-scheduler's backoff, shortened
            used: dict[str, int] = {}
            for p in api.pods():
                text = (p["metadata"].get("annotations") or {}).get(N.assignment)
                if p["spec"].get("nodeName") and text:
                    for entries in orjson.loads(text).values():
                        for e in entries:
                            used[e["uuid"]] = used.get(e["uuid"], 0) + int(e["mib"])
            over = sorted(g for g, mib in used.items() if mib > capacity.get(g, 0))
            around = [b for b in binds if killed_at is not None and b >= killed_at]
            gap = (around[0] - max([b for b in binds if b < killed_at] or [killed_at])) if around else None
            forwarded = 0
            for r in replicas:
                if r.alive():
                    try:
                        text = http.request("GET", f"{r.url}/metrics").data.decode()
                        forwarded += sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                                         if line.startswith("vramshare_extender_requests_total") and 'outcome="forwarded"' in line)
                    except urllib3.exceptions.HTTPError:
                        pass
        finally:
            for r in replicas:
                r.kill()
    return {"summary": {"gap_s": None if gap is None else round(gap, 2), "gpus_over_capacity": len(over),
                        "pods_bound": len(binds)},
            "nodes": args.nodes, "pods_bound": len(binds), "killed": killed,
            "kill_after_s": args.kill_after_s, "lease_duration_s": 15,
            "binds_before_kill": len(binds) - len(around), "binds_after_kill": len(around),
            "gap_s": None if gap is None else round(gap, 2), "gpus_over_capacity": len(over),
            "verbs_forwarded_by_the_surviving_replica_before_it_led": forwarded, "errors": errors}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=32)
    ap.add_argument("--pods", type=int, default=400)
    ap.add_argument("--kill-after-s", type=float, default=8.0)
    ap.add_argument("--max-seconds", type=float, default=90.0)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--out", default=RESULTS)
    ap.add_argument("--quick", action="store_true", help="16 nodes, 200 pods (bench/run_all.py --quick)")
    args = ap.parse_args(argv)
    if args.quick:
        args.nodes, args.pods = 16, 200
    result = run(args)
    print(json.dumps(result, indent=2))
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump(result, fh, indent=2)
    return 0 if result["gpus_over_capacity"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
