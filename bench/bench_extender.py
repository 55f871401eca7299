"""Extender latency over HTTP on loopback, the way kube-scheduler calls it (nodeCacheCapable: NodeNames).

For 500 and 5,000 nodes of 8 GPUs, populated with a realistic mix of used memory, one keep-alive
connection runs scheduling cycles back to back: POST /filter with every node name, then POST
/prioritize with the nodes that fit (kube-scheduler serialises cycles, so this is its throughput
bound). The server runs in its own (forked) process, as it would next to kube-scheduler, and the client
is a lean raw-socket keep-alive client with pre-encoded filter bodies, so the client is not what is
measured. Reported per server: p50/p99 per verb and cycles per second, from the fastest of
``--repeat`` interleaved runs (on a shared machine other work only ever adds time), plus the server process's CPU
milliseconds per cycle (what a cycle costs the extender on an idle core, whatever else the machine runs)
and the client's. Baselines, in the same run on the same machine:

* ``echo``: the same server only parses the request and echoes every name back: the difference is the
  placement work, the echo itself the protocol and JSON overhead;
* ``transport_only``: a server that answers ``[]`` to a filter-sized body: the transport's own cost;
* ``--server stdlib``: the previous transport (``http.server``, bench/stdlib_server.py).

    python bench/bench_extender.py                         # 500 and 5,000 nodes, lean and stdlib
    python bench/bench_extender.py --quick --server lean   # fewer cycles, one server
    python bench/bench_extender.py --profile               # also cProfile filter/prioritize (5,000, no HTTP)
    python bench/bench_extender.py --baseline HEAD~3       # also serve that commit's extender, interleaved

``--baseline REV`` extracts ``git archive REV`` to a temporary folder and serves its extender from a
subprocess populated the same way (same seed): old and new code answer the same requests in the same
run, interleaved, so a busy machine slows both alike and the ratio is what to quote.

Aims: p99 < 5 ms per verb at 500 and 5,000 nodes; >= 515 cycles/s at 500, >= 300 at 5,000.
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import io
import json
import logging
import multiprocessing as mp
import os
import platform
import pstats
import random
import socket
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any, Iterator

import numpy as np
import orjson

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.stdlib_server import StdlibServer  # noqa: E402
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
                # Running pods: the device plugin has reported their GPUs (allocated), so they hold
                # no same-size hold on their node (only pods being bound do, for about a second).
                pod["metadata"]["annotations"].update({NAMES.assignment: orjson.dumps(asg).decode(),
                                                       NAMES.assume_time: "1",
                                                       NAMES.allocation_state: "allocated"})
                pod["metadata"]["managedFields"] = [  # written by the device plugin (issue 18: trusted)
                    {"manager": contract.FIELD_MANAGER_DEVICE_PLUGIN, "operation": "Apply", "apiVersion": "v1",
                     "fieldsType": "FieldsV1", "fieldsV1": {"f:metadata": {"f:annotations": {
                         f"f:{NAMES.assignment}": {}, f"f:{NAMES.allocation_state}": {}}}}}]
                pod["spec"]["nodeName"] = name
                acct.apply_pod("ADDED", pod)  # also feeds FGD's workload window
                used += gib * 1024
    return acct


#: Pause between starting the servers and the first cycle: the pods were created a moment before
#: kube-scheduler asks about them, and the extender's warmer uses that moment as it would live.
SETTLE_S = 2.0


def observe_pending(acct: accounting.Accounting, pods: list[dict[str, Any]]) -> None:
    """The pods about to be scheduled exist: the extender's watch has reported them (ADDED, pending)."""
    for pod in pods:
        acct.apply_pod("ADDED", {**pod, "status": {"phase": "Pending"}})


class EchoApp:
    """The baseline: parse the request, answer every name as fitting (or a flat score)."""

    def handle(self, method: str, path: str, body: bytes) -> app.Response:
        args = wire.decode_extender_args(body)
        if path == "/filter":
            return app.Response(200, wire.encode_filter_result(wire.FilterResult(passed=list(args.names)), args))
        return app.Response(200, wire.encode_host_priorities([(n, 0) for n in args.names]))


class NullApp:
    """The transport alone: reads the body, answers ``[]``; what a request costs before any JSON."""

    def handle(self, method: str, path: str, body: bytes) -> app.Response:
        return app.Response(200, b"[]")


SERVERS = {"lean": http_server.ExtenderHTTPServer, "stdlib": StdlibServer}


def _serve_child(kind: str, handler: Any, ctl: Connection) -> None:
    """In the forked server process: serve, answer CPU-time queries, stop on request. The extender's
    background warmer runs as in production (``extender.cache``): it precomputes placement tables."""
    gc.collect()  # as extender.main does once the cache is in: the long-lived heap leaves the collector's
    gc.freeze()   # reach, so a full collection (tens of ms at 5,000 nodes) never lands in a request
    server = SERVERS[kind](handler, "127.0.0.1", 0)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
    thread.start()
    acct = getattr(handler, "acct", None)
    if acct is not None and hasattr(acct, "warm_loop"):
        threading.Thread(target=acct.warm_loop, args=(threading.Event(),), daemon=True).start()
    ctl.send(server.url)
    while ctl.recv() == "cpu":
        ctl.send(time.process_time())
    server.close()
    thread.join()
    ctl.send("stopped")


class ServerProcess:
    """A server of ``kind`` for ``handler`` in a forked process (its own GIL, like a real extender)."""

    def __init__(self, kind: str, handler: Any) -> None:
        self._ctl, child = mp.Pipe()
        self._proc = mp.get_context("fork").Process(target=_serve_child, args=(kind, handler, child), daemon=True)
        self._proc.start()
        child.close()
        host, port = self._ctl.recv().removeprefix("http://").split(":")
        self.address = (host, int(port))

    def cpu_s(self) -> float:
        self._ctl.send("cpu")
        return float(self._ctl.recv())

    def stop(self) -> None:
        self._ctl.send("stop")
        self._ctl.recv()
        self._proc.join(10)
        self._ctl.close()


_BASELINE_CHILD = r"""
import logging, random, sys, threading, time
sys.path.insert(0, sys.argv[1])
from bench import bench_extender as be
from extender import app, http_server, metrics
from vramshare.config import Policy
logging.getLogger().setLevel(logging.WARNING)
nodes, policy, cycles = int(sys.argv[2]), Policy(sys.argv[3]), int(sys.argv[4])
rng = random.Random(nodes)
acct = be.populate(nodes, rng, policy)
pods = [be.pod_obj(f"q{i}", rng.choice(be.SIZES_GIB), 2 if rng.random() < 0.1 else 1) for i in range(cycles)]
for pod in pods:  # as observe_pending does in the new bench
    acct.apply_pod("ADDED", {**pod, "status": {"phase": "Pending"}})
import gc
gc.collect()  # as extender.main does (and _serve_child)
gc.freeze()
ext = app.Extender(acct, None, None, metrics.ExtenderMetrics(acct), policy)
server = http_server.ExtenderHTTPServer(ext, "127.0.0.1", 0)
threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True).start()
print(server.url, flush=True)
for line in sys.stdin:
    if line.strip() != "cpu":
        break
    print(time.process_time(), flush=True)
server.close()
"""


class BaselineProcess:
    """The extender of another commit (a ``git archive`` in ``tree``), populated like ours, in a subprocess."""

    def __init__(self, tree: str, nodes: int, policy: Policy, cycles: int) -> None:
        import subprocess

        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        self._proc = subprocess.Popen([sys.executable, "-c", _BASELINE_CHILD, tree, str(nodes), policy.value, str(cycles)],
                                      cwd=tree, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self._proc.stdout is not None and self._proc.stdin is not None
        host, port = self._proc.stdout.readline().strip().removeprefix("http://").split(":")
        self.address = (host, int(port))

    def cpu_s(self) -> float:
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._proc.stdin.write("cpu\n")
        self._proc.stdin.flush()
        return float(self._proc.stdout.readline())

    def stop(self) -> None:
        assert self._proc.stdin is not None
        self._proc.stdin.close()
        self._proc.wait(30)


def baseline_tree(rev: str, into: str) -> str:
    """``git archive rev`` extracted under ``into``; returns the folder."""
    import subprocess
    import tarfile

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    data = subprocess.run(["git", "-C", root, "archive", "--format=tar", rev], check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(into, filter="data")
    return into


@contextlib.contextmanager
def server_process(kind: str, handler: Any) -> Iterator[ServerProcess]:
    proc = ServerProcess(kind, handler)
    try:
        yield proc
    finally:
        proc.stop()


class RawClient:
    """A minimal HTTP/1.1 keep-alive client: one ``sendall`` per request, Content-Length framing only.

    ``http.client`` costs about as much CPU per request as a lean server does; with it the client,
    not the server, would bound the measured throughput.
    """

    def __init__(self, address: tuple[str, int]) -> None:
        self.sock = socket.create_connection(address, timeout=30)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = bytearray()

    def post(self, path: bytes, body: bytes) -> tuple[float, bytes]:
        start = time.perf_counter()
        self.sock.sendall(b"POST %s HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
                          b"Content-Length: %d\r\n\r\n%s" % (path, len(body), body))
        buf = self.buf
        while (end := buf.find(b"\r\n\r\n")) < 0:
            buf += self._recv()
        head = bytes(buf[:end]).lower()
        if not head.startswith(b"http/1.1 200"):
            raise RuntimeError(f"server answered {head[:40]!r}")
        at = head.index(b"\r\ncontent-length:") + 17
        eol = head.find(b"\r\n", at)
        stop = end + 4 + int(head[at:eol if eol >= 0 else len(head)])
        while len(buf) < stop:
            buf += self._recv()
        data = bytes(buf[end + 4:stop])
        del buf[:stop]
        return time.perf_counter() - start, data

    def _recv(self) -> bytes:
        chunk = self.sock.recv(1 << 20)
        if not chunk:
            raise ConnectionError("server closed the connection")
        return chunk

    def close(self) -> None:
        self.sock.close()


def run_cycles(server: ServerProcess, names: list[str], pods: list[dict[str, Any]]) -> dict[str, Any]:
    filter_bodies = [orjson.dumps({"Pod": pod, "Nodes": None, "NodeNames": names}) for pod in pods]
    client = RawClient(server.address)
    lat: dict[str, list[float]] = {"filter": [], "prioritize": []}
    fitting_counts = []
    try:
        client.post(b"/filter", filter_bodies[0])  # warm-up
        cpu0, wall0, ccpu0 = server.cpu_s(), time.perf_counter(), time.process_time()
        for pod, body in zip(pods, filter_bodies):
            dt, raw = client.post(b"/filter", body)
            lat["filter"].append(dt)
            fitting = orjson.loads(raw)["NodeNames"]
            fitting_counts.append(len(fitting))
            if len(fitting) > 1:  # kube-scheduler skips prioritize with one feasible node
                dt, _ = client.post(b"/prioritize", orjson.dumps({"Pod": pod, "Nodes": None, "NodeNames": fitting}))
                lat["prioritize"].append(dt)
        wall, ccpu = time.perf_counter() - wall0, time.process_time() - ccpu0
        cpu = server.cpu_s() - cpu0
    finally:
        client.close()
    out: dict[str, Any] = {"cycles": len(pods), "cycles_per_s": round(len(pods) / wall, 1),
                           "server_cpu_ms_per_cycle": round(cpu / len(pods) * 1000, 3),
                           "client_cpu_ms_per_cycle": round(ccpu / len(pods) * 1000, 3),
                           "mean_fitting_nodes": round(float(np.mean(fitting_counts)), 1)}
    for verb, xs in lat.items():
        if xs:
            arr = np.array(xs) * 1000
            out[verb] = {"p50_ms": round(float(np.percentile(arr, 50)), 3),
                         "p99_ms": round(float(np.percentile(arr, 99)), 3),
                         "max_ms": round(float(arr.max()), 3), "n": len(xs)}
    return out


def transport_cost(server: ServerProcess, body: bytes, requests: int) -> dict[str, Any]:
    """Server CPU microseconds and requests/s for bare requests carrying ``body`` (a filter's size)."""
    client = RawClient(server.address)
    try:
        client.post(b"/filter", body)
        cpu0, wall0 = server.cpu_s(), time.perf_counter()
        for _ in range(requests):
            client.post(b"/filter", body)
        wall, cpu = time.perf_counter() - wall0, server.cpu_s() - cpu0
    finally:
        client.close()
    return {"requests": requests, "body_bytes": len(body), "server_cpu_us_per_request": round(cpu / requests * 1e6, 1),
            "requests_per_s": round(requests / wall)}


def best_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The fastest run (a shared machine only ever adds time), with every run's figures and their median."""
    best = max(runs, key=lambda r: r["cycles_per_s"])
    return {**best, "median_cycles_per_s": float(np.median([r["cycles_per_s"] for r in runs])),
            "min_server_cpu_ms_per_cycle": min(r["server_cpu_ms_per_cycle"] for r in runs),
            "repeats": [{"cycles_per_s": r["cycles_per_s"], "filter_p99_ms": r["filter"]["p99_ms"],
                         "prioritize_p99_ms": r.get("prioritize", {}).get("p99_ms"),
                         "server_cpu_ms_per_cycle": r["server_cpu_ms_per_cycle"]} for r in runs]}


def profile_core(extender: app.Extender, names: list[str], pods: list[dict[str, Any]]) -> None:
    """cProfile ``Extender.handle`` for filter + prioritize without HTTP: where placement spends its time."""
    bodies = [orjson.dumps({"Pod": pod, "Nodes": None, "NodeNames": names}) for pod in pods]
    prof = cProfile.Profile()
    prof.enable()
    for pod, body in zip(pods, bodies):
        fitting = orjson.loads(extender.handle("POST", "/filter", body).body)["NodeNames"]
        if len(fitting) > 1:
            extender.handle("POST", "/prioritize", orjson.dumps({"Pod": pod, "Nodes": None, "NodeNames": fitting}))
    prof.disable()
    for key in ("tottime", "cumulative"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(25)
        print(buf.getvalue())


def bench_size(nodes: int, cycles: int, policy: Policy, profile: bool, repeat: int,
               kinds: list[str], baseline: str | None = None) -> dict[str, Any]:
    rng = random.Random(nodes)
    t0 = time.perf_counter()
    acct = populate(nodes, rng, policy)
    build_s = time.perf_counter() - t0
    stats = metrics.ExtenderMetrics(acct)
    extender = app.Extender(acct, None, None, stats, policy)  # type: ignore[arg-type]  # no bind here
    names = sorted(acct.slots)
    pods = [pod_obj(f"q{i}", rng.choice(SIZES_GIB), 2 if rng.random() < 0.1 else 1) for i in range(cycles)]
    observe_pending(acct, pods)
    if profile:
        profile_core(extender, names, pods)
    # Every server runs at once and the runs interleave (A B A B ...), so a burst of other work on a
    # shared machine hits every server alike instead of deciding the comparison.
    echo_pods = pods[: max(20, cycles // 2)]
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    with contextlib.ExitStack() as stack:
        procs: dict[tuple[str, str], Any] = {
            (kind, role): stack.enter_context(server_process(kind, extender if role == "extender" else EchoApp()))
            for kind in kinds for role in ("extender", "baseline_echo")}
        if baseline:
            old = BaselineProcess(baseline, nodes, policy, cycles)
            stack.callback(old.stop)
            procs[("lean", "baseline_commit")] = old
        time.sleep(SETTLE_S)
        for _ in range(repeat):
            for (kind, role), srv in procs.items():
                runs.setdefault((kind, role), []).append(
                    run_cycles(srv, names, echo_pods if role == "baseline_echo" else pods))
        body = orjson.dumps({"Pod": pods[0], "Nodes": None, "NodeNames": names})
        bare = {kind: stack.enter_context(server_process(kind, NullApp())) for kind in kinds}
        costs: dict[str, list[dict[str, Any]]] = {}
        for _ in range(repeat):
            for kind, srv in bare.items():
                costs.setdefault(kind, []).append(transport_cost(srv, body, 500))
    servers = {kind: {**{role: best_of(runs[(kind, role)]) for role in ("extender", "baseline_echo", "baseline_commit")
                         if (kind, role) in runs},
                      "transport_only": min(costs[kind], key=lambda c: c["server_cpu_us_per_request"])}
               for kind in kinds}
    with acct.lock:
        used = int(acct.state.used.sum())
        cap = int(acct.state.capacity.sum())
    return {"nodes": nodes, "gpus": nodes * 8, "pods_placed": len(acct.pods), "memory_used_pct": round(100 * used / cap, 1),
            "build_s": round(build_s, 2), "policy": policy.value, "servers": servers}


def summarise(r: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for kind, s in r["servers"].items():
        e, b = s["extender"], s["baseline_echo"]
        out[kind] = {
            "filter_p50_ms": e["filter"]["p50_ms"], "filter_p99_ms": e["filter"]["p99_ms"],
            "prioritize_p50_ms": e["prioritize"]["p50_ms"], "prioritize_p99_ms": e["prioritize"]["p99_ms"],
            "cycles_per_s": e["cycles_per_s"], "median_cycles_per_s": e["median_cycles_per_s"],
            "server_cpu_ms_per_cycle": e["server_cpu_ms_per_cycle"],
            "min_server_cpu_ms_per_cycle": e["min_server_cpu_ms_per_cycle"],
            "client_cpu_ms_per_cycle": e["client_cpu_ms_per_cycle"],
            "echo_filter_p99_ms": b["filter"]["p99_ms"], "echo_server_cpu_ms_per_cycle": b["server_cpu_ms_per_cycle"],
            "echo_min_server_cpu_ms_per_cycle": b["min_server_cpu_ms_per_cycle"],
            "echo_cycles_per_s": b["cycles_per_s"],
            "transport_server_cpu_us_per_request": s["transport_only"]["server_cpu_us_per_request"]}
        old = s.get("baseline_commit")
        if old:
            out[kind].update({
                "baseline_commit_cycles_per_s": old["cycles_per_s"],
                "baseline_commit_filter_p99_ms": old["filter"]["p99_ms"],
                "baseline_commit_prioritize_p99_ms": old["prioritize"]["p99_ms"],
                "baseline_commit_server_cpu_ms_per_cycle": old["min_server_cpu_ms_per_cycle"],
                "speedup_cycles_per_s": round(e["cycles_per_s"] / old["cycles_per_s"], 2),
                "speedup_server_cpu": round(old["min_server_cpu_ms_per_cycle"] / e["min_server_cpu_ms_per_cycle"], 2)})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer cycles, one run each")
    ap.add_argument("--profile", action="store_true", help="cProfile filter + prioritize at 5,000 nodes, no HTTP")
    ap.add_argument("--policy", default="fgd", choices=[p.value for p in Policy])
    ap.add_argument("--repeat", type=int, default=3, help="runs per size; the fastest is reported (default 3)")
    ap.add_argument("--server", action="append", choices=sorted(SERVERS),
                    help="server(s) to measure (default: lean and stdlib)")
    ap.add_argument("--sizes", default="500,5000", help="comma-separated node counts (default 500,5000)")
    ap.add_argument("--baseline", metavar="REV", help="also serve this commit's extender, interleaved (lean only)")
    ap.add_argument("--cycles", type=int, help="cycles per run (default 400 at <= 1,000 nodes, else 100)")
    args = ap.parse_args(argv)
    logging.getLogger().setLevel(logging.WARNING)
    policy = Policy(args.policy)
    kinds = args.server or ["lean", "stdlib"]
    runs = []
    tmp = contextlib.ExitStack()
    tree = None
    if args.baseline:
        import tempfile

        tree = baseline_tree(args.baseline, tmp.enter_context(tempfile.TemporaryDirectory(prefix="bench-baseline-")))
    for nodes in (int(n) for n in args.sizes.split(",")):
        cycles = args.cycles or ((100 if args.quick else 400) if nodes <= 1000 else (30 if args.quick else 100))
        r = bench_size(nodes, cycles, policy, args.profile and nodes >= 5000, 1 if args.quick else args.repeat, kinds,
                       tree)
        if args.baseline:
            r["baseline_commit"] = args.baseline
        runs.append(r)
        for kind, s in summarise(r).items():
            print(f"{nodes:>5} nodes {kind:>6}: filter p50 {s['filter_p50_ms']} p99 {s['filter_p99_ms']} ms | "
                  f"prioritize p50 {s['prioritize_p50_ms']} p99 {s['prioritize_p99_ms']} ms | "
                  f"{s['cycles_per_s']} cycles/s, server {s['server_cpu_ms_per_cycle']} CPU ms/cycle "
                  f"(min {s['min_server_cpu_ms_per_cycle']}) "
                  f"(client {s['client_cpu_ms_per_cycle']}) | echo: filter p99 {s['echo_filter_p99_ms']} ms, "
                  f"{s['echo_cycles_per_s']} cycles/s, server CPU ms/cycle {s['echo_server_cpu_ms_per_cycle']} "
                  f"(min {s['echo_min_server_cpu_ms_per_cycle']}) | transport alone "
                  f"{s['transport_server_cpu_us_per_request']} CPU us/request"
                  + (f" | baseline {args.baseline}: {s['baseline_commit_cycles_per_s']} cycles/s, p99 "
                     f"{s['baseline_commit_filter_p99_ms']} / {s['baseline_commit_prioritize_p99_ms']} ms, "
                     f"x{s['speedup_cycles_per_s']} cycles/s, x{s['speedup_server_cpu']} server CPU"
                     if 'baseline_commit_cycles_per_s' in s else ""),
                  flush=True)
    tmp.close()
    doc = {"benchmark": "extender", "summary": {f"{r['nodes']}_nodes": summarise(r) for r in runs}, "runs": runs,
           "aims": {"500_nodes_p99_ms": 5, "5000_nodes_p99_ms": 5, "500_nodes_cycles_per_s": 515,
                    "5000_nodes_cycles_per_s": 300},
           "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform(),
                       "loadavg_1m": round(os.getloadavg()[0], 2)},
           "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w", encoding="utf-8") as fh:
        json.dump(doc, fh, indent=2)
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
