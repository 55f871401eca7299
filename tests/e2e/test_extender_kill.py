"""kill -9 of the extender while kube-scheduler keeps calling (issue 8, attack 4).

The extender runs as its own process (``vramshare extender``) against the API server double; callers
keep filtering and binding through the kills; each restart finds the API slow to list pods (the window
in which the old code answered from empty books). Ground truth at the end is the pods' assignment
annotations in the API: no GPU may be given out beyond its capacity.
"""
from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import orjson
import pytest
import urllib3

from standins.apiserver import ApiServerDouble
from tests.extender import builders as b

N = b.NAMES
L4_MIB = 22528


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kubeconfig(tmp: Path, url: str) -> Path:
    path = tmp / "kubeconfig"
    path.write_text(f"""apiVersion: v1
kind: Config
clusters: [{{name: double, cluster: {{server: "{url}"}}}}]
users: [{{name: nobody, user: {{}}}}]
contexts: [{{name: double, context: {{cluster: double, user: nobody}}}}]
current-context: double
""")
    return path


class Extender:
    """``vramshare extender`` as a child process on a fixed port, killed with SIGKILL."""

    def __init__(self, tmp: Path, url: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cfg = tmp / "config.yaml"
        cfg.write_text("version: v1\nextender:\n  policy: binpack\n  holdTimeoutSeconds: 1\n")
        self.cmd = [sys.executable, "-c", "import sys; from vramshare_cli.main import main; sys.exit(main())",
                    "extender", "--listen", f"127.0.0.1:{self.port}", "--kubeconfig", str(kubeconfig(tmp, url)),
                    "--config", str(cfg)]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = {**os.environ, "PYTHONPATH": os.getcwd()}
        self.proc = subprocess.Popen(self.cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def wait_up(self, http: urllib3.PoolManager, timeout: float = 30) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if http.request("GET", f"{self.url}/healthz", timeout=1).status == 200:
                    return True
            except urllib3.exceptions.HTTPError:
                pass
            time.sleep(0.05)
        return False


@pytest.fixture
def api() -> Iterator[ApiServerDouble]:
    with ApiServerDouble() as double:
        yield double


def caller(ext: Extender, api: ApiServerDouble, nodes: list[str], stop: threading.Event, seed: int,
           counts: dict[str, int]) -> None:
    """kube-scheduler's loop for one pod at a time: filter, bind the first fitting node, retry on errors."""
    rng = random.Random(seed)
    http = urllib3.PoolManager(retries=False, timeout=urllib3.Timeout(connect=0.5, read=5))
    i = 0
    mine: list[str] = []
    while not stop.is_set():
        i += 1
        if len(mine) >= 3:  # keep the cluster busy, not full: pods finish and are deleted
            api.delete_pod("default", mine.pop(0))
        pod = api.create_pod(b.pod(f"s{seed}-{i}", rng.choice([4, 6, 8, 10, 12])))
        for _ in range(20):
            if stop.is_set():
                return
            try:
                out = orjson.loads(http.request("POST", f"{ext.url}/filter", body=orjson.dumps(
                    {"Pod": pod, "NodeNames": nodes})).data)
                if out["Error"] or not out["NodeNames"]:
                    counts["refused"] += 1
                    time.sleep(0.02)
                    continue
                meta = pod["metadata"]
                res = orjson.loads(http.request("POST", f"{ext.url}/bind", body=orjson.dumps(
                    {"PodName": meta["name"], "PodNamespace": "default", "PodUID": meta["uid"],
                     "Node": rng.choice(out["NodeNames"])})).data)
                if not res["Error"]:
                    counts["bound"] += 1
                    mine.append(meta["name"])
                    break
            except (urllib3.exceptions.HTTPError, orjson.JSONDecodeError, KeyError):
                counts["down"] += 1
                time.sleep(0.02)


def test_kill_9_while_callers_keep_calling_never_overcommits(api: ApiServerDouble, tmp_path: Path) -> None:
    nodes = [f"n{i}" for i in range(3)]
    for n in nodes:
        api.create_node(b.gpu_node(n, b.l4(), b.l4()))
    ext = Extender(tmp_path, api.url)
    http = urllib3.PoolManager(retries=False)
    ext.start()
    assert ext.wait_up(http)
    for n in nodes:  # residents: 14 GiB on GPU 0 of every node, bound through the extender
        p = api.create_pod(b.pod(f"resident-{n}", 14))
        for _ in range(200):
            res = http.request("POST", f"{ext.url}/bind", body=orjson.dumps(
                {"PodName": p["metadata"]["name"], "PodNamespace": "default", "PodUID": p["metadata"]["uid"],
                 "Node": n}))
            if not orjson.loads(res.data)["Error"]:
                break
            time.sleep(0.05)
    assert all(api.get_pod("default", f"resident-{n}")["spec"].get("nodeName") == n for n in nodes)
    stop = threading.Event()
    counts = {"bound": 0, "refused": 0, "down": 0}
    threads = [threading.Thread(target=caller, args=(ext, api, nodes, stop, s, counts)) for s in range(3)]
    for t in threads:
        t.start()
    try:
        for _ in range(2):
            target = counts["bound"] + 4
            deadline = time.monotonic() + 60
            while counts["bound"] < target and time.monotonic() < deadline:
                time.sleep(0.05)
            ext.kill()
            # The restarted extender finds the pod list failing for a while: the API is slow to list.
            api.fail_next("GET", r"^/api/v1/pods", code=500, times=4)
            ext.start()
            assert ext.wait_up(http)
        deadline = time.monotonic() + 60
        target = counts["bound"] + 4
        while counts["bound"] < target and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
        if ext.proc is not None:
            ext.kill()
    per_gpu: dict[str, int] = {}
    for p in api.pods():
        for entries in orjson.loads(p["metadata"].get("annotations", {}).get(N.assignment, "{}")).values():
            for e in entries:
                per_gpu[e["uuid"]] = per_gpu.get(e["uuid"], 0) + e["mib"]
    assert counts["bound"] >= 12 and counts["refused"] > 0
    assert {g: m for g, m in per_gpu.items() if m > L4_MIB} == {}, per_gpu
