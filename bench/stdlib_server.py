"""The extender's previous transport (``http.server.ThreadingHTTPServer``), kept as a benchmark baseline.

bench_extender.py ``--server stdlib`` served through this until issue 21 (the bench now measures whole
scheduling cycles against a baseline commit; the transport alone is bench_endpoint.py's). Not used by the
extender itself, nor by any bench now: kept for a comparison run by hand.
"""
from __future__ import annotations

import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["StdlibServer"]


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True
    server: "StdlibServer"

    def _serve(self, method: str) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        resp = self.server.app.handle(method, self.path, self.rfile.read(length) if length > 0 else b"")
        self.send_response(resp.status)
        self.send_header("Content-Type", resp.content_type)
        self.send_header("Content-Length", str(len(resp.body)))
        self.end_headers()
        self.wfile.write(resp.body)

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        self._serve("POST")

    def do_GET(self) -> None:  # noqa: N802
        self._serve("GET")

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        pass


class StdlibServer(ThreadingHTTPServer):
    daemon_threads = False
    block_on_close = True

    def __init__(self, app: Any, host: str, port: int) -> None:
        self.app = app
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        super().__init__((host, port), _Handler)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        with self._conns_lock:
            self._conns.add(request)
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._conns_lock:
                self._conns.discard(request)

    def close(self) -> None:
        self.shutdown()
        with self._conns_lock:
            for conn in self._conns:
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        self.server_close()

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host!s}:{port}"
