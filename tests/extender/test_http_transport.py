"""The extender's HTTP/1.1 transport over real loopback sockets: framing, keep-alive, order, refusals, close.

The server is driven with raw bytes, because what matters is exactly what goes over the wire. The app
behind it is a small routing app with a gate on /bind (its blocking route), so the tests can hold a bind
open and show that filter on another connection does not wait for it.
"""
from __future__ import annotations

import socket
import threading
from typing import Iterator

import orjson
import pytest

from extender import http1
from extender.app import Response
from extender.http_server import ExtenderHTTPServer


class GatedApp:
    """Echoes method, path and body length; /bind and /inspect (the slow routes) wait for ``gate``."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.bind_started = threading.Event()

    def handle(self, method: str, path: str, body: bytes) -> Response:
        if path in ("/bind", "/inspect"):
            self.bind_started.set()
            assert self.gate.wait(10)
        if path == "/boom":
            raise RuntimeError("bug")
        return Response(200, orjson.dumps({"method": method, "path": path, "len": len(body)}))


class Served:
    def __init__(self, **kwargs: object) -> None:
        self.app = GatedApp()
        self.server = ExtenderHTTPServer(self.app, "127.0.0.1", 0, **kwargs)  # type: ignore[arg-type]
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.02})
        self.thread.start()
        self.socks: list[socket.socket] = []

    def connect(self) -> socket.socket:
        sock = socket.create_connection(self.server.server_address, timeout=10)
        self.socks.append(sock)
        return sock

    def stop(self) -> None:
        self.app.gate.set()
        self.server.close()
        self.thread.join(10)
        for sock in self.socks:
            sock.close()


@pytest.fixture
def served() -> Iterator[Served]:
    s = Served()
    yield s
    s.stop()


def post(path: str, body: bytes = b"{}", extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{extra}"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


def read_response(sock: socket.socket, buf: bytearray) -> tuple[int, dict[str, str], bytes]:
    """One response off ``sock`` (``buf`` carries bytes already read past the previous one)."""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed mid-response: {bytes(buf)!r}"
        buf += chunk
    end = buf.index(b"\r\n\r\n")
    lines = bytes(buf[:end]).decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    stop = end + 4 + int(headers.get("content-length", "0"))
    while len(buf) < stop:
        chunk = sock.recv(65536)
        assert chunk
        buf += chunk
    body = bytes(buf[end + 4:stop])
    del buf[:stop]
    return status, headers, body


def closed_by_server(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_keep_alive_serves_many_requests_on_one_connection(served: Served) -> None:
    sock, buf = served.connect(), bytearray()
    for i in range(3):
        sock.sendall(post("/filter", b"x" * i))
        status, headers, body = read_response(sock, buf)
        assert status == 200 and headers["content-type"] == "application/json"
        assert orjson.loads(body) == {"method": "POST", "path": "/filter", "len": i}
        assert "connection" not in headers
    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    assert orjson.loads(read_response(sock, buf)[2])["method"] == "GET"


def test_pipelined_requests_are_answered_in_order_even_behind_a_blocking_one(served: Served) -> None:
    sock, buf = served.connect(), bytearray()
    served.app.gate.set()
    sock.sendall(post("/bind", b"abc") + post("/filter", b"") + b"GET /inspect HTTP/1.1\r\n\r\n")
    paths = [orjson.loads(read_response(sock, buf)[2])["path"] for _ in range(3)]
    assert paths == ["/bind", "/filter", "/inspect"]


@pytest.mark.parametrize("slow", [post("/bind"), b"GET /inspect HTTP/1.1\r\n\r\n"], ids=["bind", "inspect"])
def test_a_slow_route_does_not_stall_filter_on_another_connection(served: Served, slow: bytes) -> None:
    other, scheduler = served.connect(), served.connect()
    other.sendall(slow)
    assert served.app.bind_started.wait(10)
    buf = bytearray()
    scheduler.sendall(post("/filter", b"{}") + b"GET /readyz HTTP/1.1\r\n\r\n")
    assert [read_response(scheduler, buf)[0] for _ in range(2)] == [200, 200]  # while the slow one is held
    served.app.gate.set()
    assert read_response(other, bytearray())[0] == 200


def test_a_body_split_across_writes_is_reassembled(served: Served) -> None:
    sock, buf = served.connect(), bytearray()
    raw = post("/filter", b"y" * 200_000)
    for i in range(0, len(raw), 7_001):
        sock.sendall(raw[i:i + 7_001])
    assert orjson.loads(read_response(sock, buf)[2])["len"] == 200_000


def test_a_large_response_goes_out_whole() -> None:
    class Big:
        def handle(self, method: str, path: str, body: bytes) -> Response:
            return Response(200, b"z" * 5_000_000)

    server = ExtenderHTTPServer(Big(), "127.0.0.1", 0)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02})
    thread.start()
    try:
        with socket.create_connection(server.server_address, timeout=10) as sock:
            sock.sendall(post("/prioritize") + post("/prioritize"))
            buf = bytearray()
            assert [len(read_response(sock, buf)[2]) for _ in range(2)] == [5_000_000, 5_000_000]
    finally:
        server.close()
        thread.join(10)


@pytest.mark.parametrize("raw, status", [
    (b"NONSENSE\r\n\r\n", 400),
    (b"POST /filter HTTP/1.1\r\nContent-Length: 12x\r\n\r\n", 400),
    (b"POST /filter HTTP/1.1\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabcd", 400),
    (b"POST /filter HTTP/1.1\r\nNo colon here\r\n\r\n", 400),
    (b"POST /filter HTTP/1.1\r\nHost : x\r\n\r\n", 400),
    (b"POST /filter HTTP/1.1\r\nA: b\r\n folded\r\n\r\n", 400),
    (b"POST filter HTTP/1.1\r\n\r\n", 400),
    (b"POST /filter HTTP/2.0\r\n\r\n", 505),
    (b"POST /filter HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n", 501),
    (b"POST /filter HTTP/1.1\r\nExpect: magic\r\n\r\n", 417),
    (b"GET / HTTP/1.1\r\n" + b"X: " + b"a" * (http1.MAX_HEAD_BYTES + 10) + b"\r\n\r\n", 431),
], ids=["request-line", "length-not-a-number", "conflicting-lengths", "header-without-colon",
        "space-before-colon", "obsolete-folding", "relative-target", "http2", "chunked", "expect", "huge-head"])
def test_malformed_requests_get_a_reason_and_the_connection_closes(served: Served, raw: bytes, status: int) -> None:
    sock = served.connect()
    sock.sendall(raw)
    got, headers, body = read_response(sock, bytearray())
    assert got == status and headers["connection"] == "close" and body.strip()
    assert headers["content-type"].startswith("text/plain")
    assert closed_by_server(sock)


def test_an_oversized_body_is_refused_before_it_is_sent() -> None:
    s = Served(max_body_bytes=1000)
    try:
        sock = s.connect()
        sock.sendall(b"POST /filter HTTP/1.1\r\nContent-Length: 1001\r\nExpect: 100-continue\r\n\r\n")
        status, headers, body = read_response(sock, bytearray())
        assert status == 413 and b"1001" in body and headers["connection"] == "close"
        assert closed_by_server(sock)
    finally:
        s.stop()


def test_other_methods_get_405_and_the_connection_stays_usable(served: Served) -> None:
    sock, buf = served.connect(), bytearray()
    sock.sendall(b"PUT /filter HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}" + post("/filter"))
    status, headers, _ = read_response(sock, buf)
    assert status == 405 and headers["allow"] == "GET, POST"
    assert read_response(sock, buf)[0] == 200


def test_expect_100_continue_gets_the_interim_answer_first(served: Served) -> None:
    sock, buf = served.connect(), bytearray()
    sock.sendall(b"POST /filter HTTP/1.1\r\nContent-Length: 4\r\nExpect: 100-continue\r\n\r\n")
    assert read_response(sock, buf)[0] == 100
    sock.sendall(b"abcd")
    status, _, body = read_response(sock, buf)
    assert status == 200 and orjson.loads(body)["len"] == 4


@pytest.mark.parametrize("raw", [
    post("/filter", extra="Connection: close\r\n"),
    b"GET /healthz HTTP/1.0\r\n\r\n",
], ids=["connection-close", "http1.0"])
def test_the_server_closes_when_the_client_asks(served: Served, raw: bytes) -> None:
    sock = served.connect()
    sock.sendall(raw)
    status, headers, _ = read_response(sock, bytearray())
    assert status == 200 and headers["connection"] == "close"
    assert closed_by_server(sock)


def test_http10_keep_alive_is_honoured(served: Served) -> None:
    sock, buf = served.connect(), bytearray()
    sock.sendall(b"GET /a HTTP/1.0\r\nConnection: keep-alive\r\n\r\nGET /b HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
    assert [orjson.loads(read_response(sock, buf)[2])["path"] for _ in range(2)] == ["/a", "/b"]


def test_a_handler_bug_is_a_500_and_the_connection_survives(served: Served) -> None:
    sock, buf = served.connect(), bytearray()
    sock.sendall(b"GET /boom HTTP/1.1\r\n\r\n" + post("/filter"))
    status, _, body = read_response(sock, buf)
    assert status == 500 and b"RuntimeError" in body
    assert read_response(sock, buf)[0] == 200


def test_clients_that_vanish_do_not_disturb_the_others(served: Served) -> None:
    half = served.connect()
    half.sendall(b"POST /filter HTTP/1.1\r\nContent-Length: 100\r\n\r\nonly part")
    half.close()
    gone = served.connect()
    gone.sendall(post("/bind"))
    assert served.app.bind_started.wait(10)
    gone.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # reset
    gone.close()
    served.app.gate.set()  # its answer has nowhere to go
    sock = served.connect()
    sock.sendall(post("/filter"))
    assert read_response(sock, bytearray())[0] == 200


def test_idle_and_slow_connections_are_closed() -> None:
    s = Served(idle_timeout_s=0.05, request_timeout_s=0.05)
    try:
        idle, slow = s.connect(), s.connect()
        slow.sendall(b"POST /filter HTTP/1.1\r\nContent-Le")
        assert closed_by_server(idle)
        status, headers, _ = read_response(slow, bytearray())
        assert status == 408 and headers["connection"] == "close"
    finally:
        s.stop()


def test_close_lets_a_request_in_flight_finish_then_closes_everything() -> None:
    s = Served()
    sock, idle = s.connect(), s.connect()
    sock.sendall(post("/bind"))
    assert s.app.bind_started.wait(10)
    closer = threading.Thread(target=s.server.close)
    closer.start()
    assert closed_by_server(idle)
    s.app.gate.set()
    status, headers, _ = read_response(sock, bytearray())
    assert status == 200 and headers["connection"] == "close"
    closer.join(10)
    s.thread.join(10)
    assert not closer.is_alive() and not s.thread.is_alive()
    with pytest.raises(OSError):
        socket.create_connection(s.server.server_address, timeout=1).close()
    s.stop()  # idempotent


def test_close_without_serving_releases_the_socket() -> None:
    server = ExtenderHTTPServer(GatedApp(), "127.0.0.1", 0)
    assert server.url == f"http://127.0.0.1:{server.server_address[1]}"
    server.close()
    server.serve_forever()  # returns at once: already closed
    server.close()


@pytest.mark.skipif(not socket.has_dualstack_ipv6(), reason="no dual-stack IPv6 here")
def test_listening_on_all_ipv6_addresses_serves_ipv4_too() -> None:
    server = ExtenderHTTPServer(GatedApp(), "::", 0)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02})
    thread.start()
    try:
        assert server.url.startswith("http://[::]:")
        for host in ("127.0.0.1", "::1"):
            with socket.create_connection((host, server.server_address[1]), timeout=10) as sock:
                sock.sendall(b"GET /healthz HTTP/1.1\r\n\r\n")
                assert read_response(sock, bytearray())[0] == 200
    finally:
        server.close()
        thread.join(10)
