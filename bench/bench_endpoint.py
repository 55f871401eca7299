"""The extender's endpoint under the attacks of issue 11, against the starting code's server in the same
process (its source is loaded from git as the baseline, when git and the commit are there).

* ``oversized``: a filter body of 59 MiB (kube-scheduler's real ones: ~115 KB of names at 5,000 nodes,
  4 MiB limit). Time until the client has its answer, and the server's peak Python allocation
  (tracemalloc) while it arrives. The baseline read it whole (limit 64 MiB) and then decoded it.
* ``flood``: 1,100 idle TCP connections (more than max_connections = 1,024), then the scheduler's
  calls over mutual TLS on fresh connections: how many are answered, and their latency.
* ``transport``: a 115 KB names-only filter body on one keep-alive connection, echoed: microseconds per
  request, plain HTTP and TLS, and the baseline server (plain).

    python bench/bench_endpoint.py            # writes bench/results/endpoint.json
"""
from __future__ import annotations

import importlib.util
import json
import os
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from extender import wire  # noqa: E402
from extender.app import Response  # noqa: E402
from extender.http_server import ExtenderHTTPServer  # noqa: E402
from extender.tls import Reloader, TlsFiles  # noqa: E402
from tests.fixtures.certs import make_pki  # noqa: E402

BASELINE_COMMIT = "b53af7f"  # main before issue 11
NAMES = [f"gpu-node-{i:05d}" for i in range(5000)]
FILTER_BODY = json.dumps({"Pod": {"metadata": {"name": "p", "namespace": "default"}, "spec": {}},
                          "NodeNames": NAMES}).encode()


class Decode:
    """Decodes the body as the filter verb does (the memory the issue measured comes from this)."""

    def handle(self, method: str, path: str, body: bytes) -> Response:
        try:
            n = len(wire.decode_extender_args(body).names)
        except wire.WireError as exc:
            return Response(200, json.dumps({"Error": str(exc)}).encode())
        return Response(200, b'{"n": %d}' % n)


def _baseline_server() -> Any | None:
    try:
        src = subprocess.run(["git", "show", f"{BASELINE_COMMIT}:extender/http_server.py"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    path = Path(tempfile.mkdtemp()) / "baseline_http_server.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("baseline_http_server", path)
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod.ExtenderHTTPServer


def _serve(cls: Any, **kw: Any) -> tuple[Any, threading.Thread]:
    server = cls(Decode(), "127.0.0.1", 0, **kw)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    return server, thread


def _read_response(sock: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    length = next((int(l.split(b":")[1]) for l in head.split(b"\r\n") if l.lower().startswith(b"content-length")), 0)
    while len(rest) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        rest += chunk
    return head.split(b"\r\n")[0]


def oversized(cls: Any, **kw: Any) -> dict[str, Any]:
    size = 59 * 1024 * 1024
    names = json.dumps(["n" * 20] * (size // 23))
    body = (b'{"Pod":{"metadata":{"name":"p"}},"NodeNames":' + names.encode() + b"}")[:size]
    body = body[:-1] + b"}" if len(body) == size else body
    server, thread = _serve(cls, **kw)
    tracemalloc.start()
    start = time.perf_counter()
    status = b""
    try:
        with socket.create_connection(server.server_address, timeout=120) as sock:
            sock.sendall(b"POST /filter HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body))
            view = memoryview(body)
            sent = 0
            sock.settimeout(0.0)
            while sent < len(view) and not status:
                try:
                    sent += sock.send(view[sent:sent + 1 << 20])
                except BlockingIOError:
                    time.sleep(0.0005)
                except OSError:
                    break
                try:
                    peek = sock.recv(1, socket.MSG_PEEK)
                    if peek:
                        break  # the server answered before the body was in
                except BlockingIOError:
                    pass
            sock.settimeout(120)
            try:
                status = _read_response(sock)
            except OSError as exc:
                status = f"connection {type(exc).__name__}".encode()
        elapsed = time.perf_counter() - start
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        server.close()
        thread.join(30)
    return {"answer": status.decode(errors="replace"), "seconds": round(elapsed, 4),
            "body_bytes_sent_before_answer": sent, "server_peak_alloc_mib": round(peak / 2**20, 2)}


def flood(pki: Any) -> dict[str, Any]:
    tls = Reloader(TlsFiles(str(pki.server_cert), str(pki.server_key), str(pki.ca)))
    server, thread = _serve(ExtenderHTTPServer, tls=tls)
    ctx = ssl.create_default_context(cafile=str(pki.ca))
    ctx.load_cert_chain(str(pki.client_cert), str(pki.client_key))
    idle: list[socket.socket] = []
    try:
        for _ in range(1100):
            idle.append(socket.create_connection(server.server_address, timeout=10))
        time.sleep(0.5)
        lat, answered = [], 0
        for _ in range(100):
            t0 = time.perf_counter()
            try:
                with ctx.wrap_socket(socket.create_connection(server.server_address, timeout=10),
                                     server_hostname="127.0.0.1") as s:
                    s.sendall(b"POST /filter HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % len(FILTER_BODY) + FILTER_BODY)
                    if _read_response(s).startswith(b"HTTP/1.1 200"):
                        answered += 1
            except OSError:
                pass
            lat.append((time.perf_counter() - t0) * 1000)
        open_conns = len(server._conns)  # noqa: SLF001
    finally:
        for s in idle:
            s.close()
        server.close()
        thread.join(30)
    lat.sort()
    return {"idle_connections_opened": 1100, "max_connections": server.max_connections, "reserve": server.reserve,
            "scheduler_calls": 100, "answered": answered, "p50_ms": round(statistics.median(lat), 2),
            "p99_ms": round(lat[98], 2), "connections_held_by_server": open_conns}


def transport(cls: Any, pki: Any | None, n: int = 1500, **kw: Any) -> dict[str, Any]:
    if pki is not None:
        kw["tls"] = Reloader(TlsFiles(str(pki.server_cert), str(pki.server_key), str(pki.ca)))
    server, thread = _serve(cls, **kw)
    raw = socket.create_connection(server.server_address, timeout=10)
    if pki is not None:
        ctx = ssl.create_default_context(cafile=str(pki.ca))
        ctx.load_cert_chain(str(pki.client_cert), str(pki.client_key))
        raw = ctx.wrap_socket(raw, server_hostname="127.0.0.1")
    req = b"POST /filter HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % len(FILTER_BODY) + FILTER_BODY
    times = []
    try:
        for _ in range(n):
            t0 = time.perf_counter()
            raw.sendall(req)
            assert _read_response(raw).startswith(b"HTTP/1.1 200")
            times.append(time.perf_counter() - t0)
    finally:
        raw.close()
        server.close()
        thread.join(30)
    times.sort()
    return {"requests": n, "body_bytes": len(FILTER_BODY), "p50_us": round(times[n // 2] * 1e6),
            "p99_us": round(times[int(n * 0.99)] * 1e6)}


def main() -> int:
    base = _baseline_server()
    out: dict[str, Any] = {"note": "loopback, one process; the machine was shared with other work (figures are upper bounds)",
                           "body_limit_bytes": 4 * 1024 * 1024, "filter_body_bytes_5000_names": len(FILTER_BODY)}
    with tempfile.TemporaryDirectory() as tmp:
        pki = make_pki(Path(tmp))
        out["oversized"] = {"new": oversized(ExtenderHTTPServer)}
        if base is not None:
            out["oversized"]["baseline_64MiB_limit"] = oversized(base)
        out["flood"] = flood(pki)
        out["transport"] = {"plain": transport(ExtenderHTTPServer, None), "tls": transport(ExtenderHTTPServer, pki)}
        if base is not None:
            out["transport"]["baseline_plain"] = transport(base, None)
    os.makedirs(ROOT / "bench" / "results", exist_ok=True)
    (ROOT / "bench" / "results" / "endpoint.json").write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
