"""HTTP/1.1 transport for :class:`extender.app.Extender`: one selectors loop, bytes in, bytes out.

Why not ``http.server``: kube-scheduler serialises scheduling cycles, so every microsecond the transport
spends on a filter or prioritize call is taken from cluster-wide scheduling throughput. The stdlib
server parses headers with the email package, reads through buffered file objects and answers in
several writes: about 95 us of CPU per request, against about 25 us here (measured with the transport
alone, the former ``transport_only`` of bench/bench_extender.py). Here one thread owns every socket: it parses the few headers that matter
(:mod:`extender.http1`), calls ``app.handle`` inline for the routes on the scheduling path (POST
/filter, /prioritize: pure CPU, about a millisecond) and the probes (GET /healthz, /readyz), and
answers with one ``send``.

Everything else runs on a small thread pool and its answer is handed back to the loop: POST /bind
blocks on the Kubernetes API, and GET /inspect (about a second for 5,000 nodes) and /metrics (~20 ms)
are slow enough to stall a filter, so neither a slow API server nor a scrape holds up scheduling.
A connection processes one request at a time, so pipelined requests are answered in order.

Malformed requests get a 4xx/5xx with a plain-text reason and the connection is closed (where a body
ends is no longer known); oversized bodies get 413, methods other than GET/POST 405. Idle keep-alive
connections and requests that trickle in too slowly are closed by a sweep. :meth:`close` stops
accepting, lets requests in flight finish (bounded by ``grace_s``), then closes every socket.

Hostile callers (issue 11). With ``tls`` (:mod:`extender.tls`) every connection is TLS and asks for a
client certificate; only the ``public`` routes (the probes) answer a connection without a verified
one, every other route is refused with 403 right after the request head, before any body is read.
``routes`` limits what a listener serves at all (the metrics listener: /metrics, the probes and the
read-only /inspect; ``/x/*`` admits every ``/x/<name>``).
Memory is bounded whatever a caller sends: a body larger than ``max_body_bytes`` is refused with 413
from its declared ``Content-Length`` alone (its bytes are never read), the bodies being buffered at
once share ``max_buffered_bytes`` (503 beyond), and a request head is read at most
:data:`extender.http1.MAX_HEAD_BYTES` at a time.

Unauthenticated callers reserve nothing (issue 18): a GET never takes a body (413 from its head, the
probes and /metrics included), and a connection without a verified client certificate that declares
a body is refused with 403 before anything is charged, so only authenticated connections draw on the
body budget. The scheduling verbs (:data:`VERBS`) have a share of their own,
``scheduler_share_bytes``, which they use once the shared budget is full: whatever holds the shared
budget, kube-scheduler's calls (one filter/prioritize/preempt at a time, plus small binds) get in.
When a verb is refused even so, /readyz answers 503 for ``request_timeout_s`` with the reason, so
the refusal shows on the endpoint and the Service can route around the replica. Connections: at most ``max_connections``, of which
``reserve`` only for authenticated ones; when the unauthenticated ones are at their limit, the oldest
idle one is closed to admit the new one, so a flood of idle or slow connections can neither lock the
scheduler out nor pin the table. Every request must arrive whole (and every TLS handshake finish)
within ``request_timeout_s`` of its first byte (slowloris): 408 and close otherwise.
"""
from __future__ import annotations

import selectors
import socket
import ssl
import sys
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from extender import http1
from extender.app import Response
from extender.tls import ClientCertificate, Reloader
from vramshare import logs

__all__ = ["ExtenderHTTPServer", "Handler"]

log = logs.get("vramshare.extender.http")

TEXT = "text/plain; charset=utf-8"
RECV_BYTES = 256 * 1024
# kube-scheduler's largest body is a filter/prioritize/preempt call: the pod (at most 1.5 MiB, etcd's
# default --max-request-bytes) plus, with nodeCacheCapable, node names only (5,000 nodes of ~20
# characters is ~115 KB; even 253-character names are 1.3 MB) or preemption victims (pod UIDs per
# node). 4 MiB covers the worst of these; a 59 MiB body is refused from its head.
MAX_BODY_BYTES = 4 * 1024 * 1024
MAX_BUFFERED_BYTES = 64 * 1024 * 1024  # bodies being received at once, all connections together
# Routes the probes need; the only ones a TLS connection without a client certificate may call.
PROBES = frozenset({("GET", "/healthz"), ("GET", "/readyz")})
# Answered on the loop thread: fast, pure CPU, never an API call. Everything else goes to the workers.
# kube-scheduler's calls: they may use the scheduler's own share of the body budget.
VERBS = frozenset({("POST", "/filter"), ("POST", "/prioritize"), ("POST", "/bind"), ("POST", "/preempt")})
# Serves two bodies of MAX_BODY_BYTES: kube-scheduler runs one scheduling cycle at a time (filter,
# prioritize or preempt) and its binds are a few hundred bytes each.
SCHEDULER_SHARE_BYTES = 2 * MAX_BODY_BYTES
#: GIL switch interval while serving (Python's default is 5 ms): see :meth:`ExtenderHTTPServer.serve_forever`.
SWITCH_INTERVAL_S = 0.0005
INLINE = frozenset({("POST", "/filter"), ("POST", "/prioritize"), ("GET", "/healthz"), ("GET", "/readyz")})
_WAKE = object()  # selector key data of the wake-up socket; the listener's is None


class Handler(Protocol):
    """What the server serves: :class:`extender.app.Extender`, or the benchmark's echo baseline."""

    def handle(self, method: str, path: str, body: bytes) -> Response: ...


class _Conn:
    """One client connection's state; touched only by the loop thread."""

    __slots__ = ("sock", "peer", "buf", "head", "body_at", "out", "busy", "close_after", "closed",
                 "events", "since", "handshaking", "authenticated", "reserved", "share", "linger", "draining",
                 "leaf", "refused_cert", "presented")

    def __init__(self, sock: socket.socket, peer: object, handshaking: bool = False) -> None:
        self.sock = sock
        self.peer = peer
        self.buf = bytearray()
        self.head: http1.RequestHead | None = None  # parsed head of a request whose body is incomplete
        self.body_at = 0
        self.out: memoryview | None = None  # unsent tail of the current response
        self.busy = False  # a request of this connection is on the worker pool
        self.close_after = False  # close once ``out`` is flushed
        self.closed = False
        self.events = 0  # what the selector watches for this socket (0: unregistered)
        self.since = time.monotonic()  # start of the current phase, for the timeouts
        self.handshaking = handshaking  # TLS handshake not finished yet
        self.authenticated = False  # presented a client certificate the client CA verifies
        self.reserved = 0  # bytes of the body being received, counted in the shared budget
        self.share = False  # ``reserved`` is drawn from the scheduler's own share, not the shared budget
        self.linger = False  # after the answer, discard what the client still sends before closing
        self.draining = False  # refused and answered: discarding, then close
        self.leaf = b""  # the verified client certificate (DER), re-checked when the client CA rotates
        self.refused_cert = ""  # why a verified certificate does not authenticate (no clientAuth EKU)
        self.presented: ClientCertificate | None = None  # the certificate that authenticated it


class ExtenderHTTPServer:
    """Serve ``app`` on ``host:port`` (0 = ephemeral); run :meth:`serve_forever` on a thread of your own."""

    def __init__(self, app: Handler, host: str, port: int, *, workers: int = 8,
                 max_body_bytes: int = MAX_BODY_BYTES, max_buffered_bytes: int = MAX_BUFFERED_BYTES,
                 idle_timeout_s: float = 120.0, request_timeout_s: float = 10.0, grace_s: float = 5.0,
                 max_connections: int = 1024, reserve: int = 64, tls: Reloader | None = None,
                 scheduler_share_bytes: int = SCHEDULER_SHARE_BYTES, tls_check_s: float = 10.0,
                 public: frozenset[tuple[str, str]] = PROBES,
                 routes: frozenset[tuple[str, str]] | None = None) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.max_buffered_bytes = max_buffered_bytes
        self.scheduler_share_bytes = scheduler_share_bytes
        # How often the TLS files are re-read; a connection authenticated under a client CA that a
        # reload removed is closed then, so within this bound (plus the poll interval).
        self.tls_check_s = tls_check_s
        self.idle_timeout_s = idle_timeout_s  # Go's transport drops idle connections after 90 s
        # A whole request (or TLS handshake, or response) must move by then; kube-scheduler's
        # httpTimeout is 5 s, so a request still arriving after 10 s has no caller left.
        self.request_timeout_s = request_timeout_s
        self.grace_s = grace_s
        self.max_connections = max_connections
        self.reserve = min(reserve, max_connections - 1) if tls is not None else 0
        self.tls = tls
        self.public = public  # routes a connection without a verified client certificate may call
        self.routes = routes  # None: every route of the app
        self._buffered = 0  # bytes reserved in the shared budget
        self._share_used = 0  # bytes reserved in the scheduler's share
        self._refusing_until = 0.0  # /readyz answers 503 until then: a scheduler call was refused
        self._refused_why = ""
        self._unauth: OrderedDict[_Conn, None] = OrderedDict()  # in accept order, for eviction
        self._next_tls_check = 0.0
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        dual = host == "::" and socket.has_dualstack_ipv6()  # "[::]:port" also serves IPv4 clients
        self._listener = socket.create_server((host, port), family=family, backlog=128, dualstack_ipv6=dual)
        self._listener.setblocking(False)
        self.server_address: tuple[str, int] = self._listener.getsockname()[:2]
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="extender-http-worker")
        self._done: deque[tuple[_Conn, http1.RequestHead, Response]] = deque()
        self._conns: set[_Conn] = set()
        self._state = threading.Lock()
        self._stopping = False
        self._running = False
        self._released = False
        self._exited = threading.Event()

    @property
    def url(self) -> str:
        host, port = self.server_address
        scheme = "https" if self.tls is not None else "http"
        return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"

    # -- lifecycle ---------------------------------------------------------------------------------
    def serve_forever(self, poll_interval: float = 0.5) -> None:
        """Run the loop until :meth:`close`; ``poll_interval`` bounds how late the timeout sweep runs.

        Also shortens the process's GIL switch interval to :data:`SWITCH_INTERVAL_S`: this thread answers
        the verbs inline and gives the GIL up at every socket call (a TLS write of a 5,000-node answer,
        epoll); with Python's default 5 ms it waited that long to get it back whenever a bind worker,
        the watch or the warmer was computing (bench_extender, real mix: ~4 ms per TLS write)."""
        with self._state:
            if self._stopping or self._running:
                return
            self._running = True
        if sys.getswitchinterval() > SWITCH_INTERVAL_S:
            sys.setswitchinterval(SWITCH_INTERVAL_S)
        try:
            self._sel.register(self._listener, selectors.EVENT_READ, None)
            self._sel.register(self._wake_r, selectors.EVENT_READ, _WAKE)
            self._loop(max(0.01, min(poll_interval, 1.0)))
            self._drain()
        finally:
            self._release()
            self._exited.set()

    def close(self) -> None:
        """Stop accepting, finish requests in flight (up to ``grace_s``), close every socket, join workers."""
        with self._state:
            self._stopping = True
            running = self._running
        self._wake()
        if running:
            self._exited.wait()
        else:
            self._release()

    def _release(self) -> None:
        with self._state:
            if self._released:
                return
            self._released = True
        for conn in list(self._conns):
            self._drop(conn)
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._sel.close()
        for sock in (self._listener, self._wake_r, self._wake_w):
            sock.close()

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except OSError:  # buffer full (a wake-up is pending anyway) or already closed
            pass

    # -- the loop ----------------------------------------------------------------------------------
    def _loop(self, tick: float) -> None:
        next_sweep = time.monotonic() + tick
        while not self._stopping:
            for key, _ in self._sel.select(tick):
                data = key.data
                if data is None:
                    self._accept()
                elif data is _WAKE:
                    self._collect()
                else:
                    try:
                        self._on_event(data)
                    except Exception:  # noqa: BLE001 - a bug on one connection must not end the server
                        log.error("connection failed", peer=str(data.peer), exc_info=True)
                        self._drop(data)
            now = time.monotonic()
            if now >= next_sweep:
                self._sweep(now)
                next_sweep = now + tick

    def _drain(self) -> None:
        """After :meth:`close`: no new connections or requests; let answers in flight go out."""
        self._sel.unregister(self._listener)
        self._listener.close()
        for conn in list(self._conns):
            if not conn.busy and conn.out is None:
                self._drop(conn)
            else:
                conn.close_after = True
        deadline = time.monotonic() + self.grace_s
        while self._conns and time.monotonic() < deadline:
            for key, _ in self._sel.select(0.05):
                if key.data is _WAKE:
                    self._collect()
                elif key.data is not None:
                    self._on_event(key.data)

    def _accept(self) -> None:
        for _ in range(64):
            try:
                sock, peer = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # EMFILE and friends: try again on the next readiness
                log.warning("accept failed", error=str(exc))
                return
            if not self._room_for_one(peer):
                sock.close()
                continue
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.tls is not None:
                try:
                    sock = self.tls.context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
                except (OSError, ValueError) as exc:
                    log.warning("tls wrap failed", peer=str(peer), error=str(exc))
                    sock.close()
                    continue
            conn = _Conn(sock, peer, handshaking=self.tls is not None)
            self._conns.add(conn)
            self._unauth[conn] = None
            self._watch(conn, selectors.EVENT_READ)

    def _room_for_one(self, peer: object) -> bool:
        """Make room for a new (not yet authenticated) connection, evicting the oldest idle one if needed.

        Unauthenticated connections may hold ``max_connections - reserve`` slots; the reserve is only
        for connections that proved a client certificate (the scheduler), so a flood never locks it
        out. Evicting the oldest idle one (never one whose request is being answered) keeps a new
        caller's chance even while the flood holds every unauthenticated slot.
        """
        if len(self._unauth) < self.max_connections - self.reserve and len(self._conns) < self.max_connections:
            return True
        for old in self._unauth:
            if not old.busy and old.out is None:
                log.warning("connection evicted: too many unauthenticated connections", peer=str(old.peer),
                            limit=self.max_connections - self.reserve)
                self._drop(old)
                return len(self._conns) < self.max_connections
        log.warning("connection refused: too many open", peer=str(peer), limit=self.max_connections)
        return False

    def _watch(self, conn: _Conn, events: int) -> None:
        if events == conn.events or conn.closed:
            return
        if conn.events == 0:
            self._sel.register(conn.sock, events, conn)
        elif events == 0:
            self._sel.unregister(conn.sock)
        else:
            self._sel.modify(conn.sock, events, conn)
        conn.events = events

    def _drop(self, conn: _Conn) -> None:
        if conn.closed:
            return
        self._watch(conn, 0)
        conn.closed = True
        self._conns.discard(conn)
        self._unauth.pop(conn, None)
        self._release_body(conn)
        conn.sock.close()

    def _release_body(self, conn: _Conn) -> None:
        if conn.share:
            self._share_used -= conn.reserved
        else:
            self._buffered -= conn.reserved
        conn.reserved, conn.share = 0, False

    def _sweep(self, now: float) -> None:
        if self.tls is not None and now >= self._next_tls_check:
            self._next_tls_check = now + self.tls_check_s
            if self.tls.check():
                self._recheck_clients()
            for conn in self._conns:  # still presented: kept in the callers' memory (tls.PresentedCertificates)
                if conn.presented is not None and not conn.closed:
                    self.tls.presented.seen(conn.presented, now)
        for conn in list(self._conns):
            if conn.busy:
                continue
            age = now - conn.since
            if conn.draining:
                if age > min(1.0, self.request_timeout_s):
                    self._drop(conn)
            elif conn.handshaking:
                if age > self.request_timeout_s:
                    log.warning("tls handshake not finished in time", peer=str(conn.peer))
                    self._drop(conn)
            elif conn.out is not None or conn.buf:
                if age > self.request_timeout_s:
                    if conn.out is None:
                        self._fail(conn, 408, "request not received in time")
                    else:
                        self._drop(conn)
            elif age > self.idle_timeout_s:
                self._drop(conn)

    def _recheck_clients(self) -> None:
        """After a reload: close every connection whose client certificate no client CA in force issued
        (one busy with a request closes after its answer)."""
        assert self.tls is not None
        for conn in list(self._conns):
            if not conn.authenticated or self.tls.still_trusted(conn.leaf):
                continue
            log.warning("connection closed: its client CA was rotated out", peer=str(conn.peer))
            if conn.busy or conn.out is not None:
                conn.close_after = True
            else:
                self._drop(conn)

    # -- per connection ----------------------------------------------------------------------------
    def _on_event(self, conn: _Conn) -> None:
        if conn.closed:  # dropped earlier in the same batch of events
            return
        if conn.draining:
            self._discard(conn)
            return
        if conn.handshaking and not self._handshake(conn):
            return
        if conn.out is not None:
            self._flush(conn)
            if conn.out is None and not conn.closed:
                self._resume(conn)
            return
        self._read(conn)

    def _resume(self, conn: _Conn) -> None:
        """After an answer went out: serve what is buffered, including what TLS already decrypted
        (that raises no readiness event, so waiting for one would stall a pipelined request)."""
        self._process(conn)
        if (self.tls is not None and not (conn.closed or conn.busy or conn.out is not None or conn.draining)
                and conn.sock.pending()):  # type: ignore[attr-defined]
            self._read(conn)

    def _read(self, conn: _Conn) -> None:
        while True:
            # A head is read at most MAX_HEAD_BYTES at a time, so an idle or hostile connection
            # buffers little; a body (its size already checked) in large reads.
            want = RECV_BYTES if conn.head is not None else max(1024, http1.MAX_HEAD_BYTES + 4 - len(conn.buf))
            try:
                data = conn.sock.recv(want)
            except (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
                return
            except OSError:
                self._drop(conn)
                return
            if not data:  # the client closed (or half-closed) its side: nothing more to answer
                self._drop(conn)
                return
            if not conn.buf:
                conn.since = time.monotonic()
            conn.buf += data
            self._process(conn)
            # TLS decrypts a record at a time: what is already decrypted raises no readiness event.
            if (conn.closed or conn.busy or conn.out is not None or self.tls is None
                    or not conn.sock.pending()):  # type: ignore[attr-defined]
                return

    def _discard(self, conn: _Conn) -> None:
        """Read and drop what a refused client still sends, so closing does not reset the connection
        before it has read our answer (a close with unread data sends RST, which discards the 4xx)."""
        try:
            data = conn.sock.recv(RECV_BYTES)
        except (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(conn)

    def _handshake(self, conn: _Conn) -> bool:
        """Advance a TLS handshake; True once it is done (then the connection reads requests)."""
        sock: ssl.SSLSocket = conn.sock  # type: ignore[assignment]
        try:
            sock.do_handshake()
        except ssl.SSLWantReadError:
            self._watch(conn, selectors.EVENT_READ)
            return False
        except ssl.SSLWantWriteError:
            self._watch(conn, selectors.EVENT_WRITE)
            return False
        except (ssl.SSLError, OSError) as exc:  # no TLS, an untrusted client certificate, a reset
            log.warning("tls handshake refused", peer=str(conn.peer), error=str(exc))
            self._drop(conn)
            return False
        conn.handshaking = False
        conn.since = time.monotonic()
        if sock.getpeercert():  # non-empty only when the client CA verified the client's chain
            leaf = sock.getpeercert(binary_form=True) or b""
            try:
                conn.presented = ClientCertificate.read(leaf)
            except ValueError as exc:
                conn.refused_cert = str(exc)
                log.warning("client certificate does not authenticate", peer=str(conn.peer), reason=str(exc))
            else:
                conn.authenticated, conn.leaf = True, leaf
                self._unauth.pop(conn, None)
                assert self.tls is not None
                self.tls.presented.seen(conn.presented, conn.since)
        self._watch(conn, selectors.EVENT_READ)
        return True

    def _process(self, conn: _Conn) -> None:
        """Answer every complete request in the buffer, in order, until one must wait."""
        while not conn.closed and not conn.busy and conn.out is None and conn.buf:
            head = conn.head
            if head is None:
                end = conn.buf.find(b"\r\n\r\n", 0, http1.MAX_HEAD_BYTES + 4)
                if end < 0:
                    if len(conn.buf) >= http1.MAX_HEAD_BYTES + 4:
                        self._fail(conn, 431, f"request head larger than {http1.MAX_HEAD_BYTES} bytes")
                    return
                try:
                    head = http1.parse_head(bytes(conn.buf[:end]))
                except http1.HttpError as exc:
                    self._fail(conn, exc.status, exc.message)
                    return
                refusal = self._refusal(conn, head)
                if refusal is not None:
                    self._fail(conn, *refusal)
                    return
                conn.head, conn.body_at = head, end + 4
                self._charge(conn, head)
                if head.expect_continue and len(conn.buf) < conn.body_at + head.content_length:
                    self._send(conn, b"HTTP/1.1 100 Continue\r\n\r\n", interim=True)
                    if conn.out is not None:
                        return
            stop = conn.body_at + head.content_length
            if len(conn.buf) < stop:
                return
            body = bytes(conn.buf[conn.body_at:stop])
            del conn.buf[:stop]
            conn.head = None
            self._release_body(conn)
            conn.since = time.monotonic()
            self._dispatch(conn, head, body)

    def _refusal(self, conn: _Conn, head: http1.RequestHead) -> tuple[int, str] | None:
        """Why a request is refused from its head alone (before any of its body is read), or None."""
        key = (head.method, _route(head.target))
        if self.routes is not None and key not in self.routes and \
                (head.method, key[1].rsplit("/", 1)[0] + "/*") not in self.routes:  # "/inspect/*": one node
            return 404, f"no route {head.method} {_route(head.target)} on this port"
        if head.method == "GET" and head.content_length:
            return 413, f"GET {key[1]} takes no body (Content-Length {head.content_length})"
        if self.tls is not None and not conn.authenticated and (key not in self.public or head.content_length):
            return 403, ("a client certificate signed by the extender's client CA, with the clientAuth extended "
                         "key usage, is required (kube-scheduler: extenders[].tlsConfig certFile/keyFile)"
                         + (f": {conn.refused_cert}" if conn.refused_cert else ""))
        if head.content_length > self.max_body_bytes:
            return 413, f"body of {head.content_length} bytes exceeds the limit of {self.max_body_bytes}"
        if self._fits(key, head.content_length) is None:
            why = (f"too many request bodies in flight ({self._buffered} bytes buffered, limit "
                   f"{self.max_buffered_bytes}; scheduler share {self._share_used} of "
                   f"{self.scheduler_share_bytes}): retry")
            if key in VERBS:  # the scheduler itself is turned away: say so on /readyz
                self._refusing_until = time.monotonic() + self.request_timeout_s
                self._refused_why = f"refusing work: {why}"
            return 503, why
        return None

    def _fits(self, key: tuple[str, str], size: int) -> bool | None:
        """Where a body of ``size`` is charged: False the shared budget, True the scheduler's share,
        None nowhere (refuse). Only the verbs may use the share, and only once the budget is full."""
        if self._buffered + size <= self.max_buffered_bytes:
            return False
        if key in VERBS and self._share_used + size <= self.scheduler_share_bytes:
            return True
        return None

    def _charge(self, conn: _Conn, head: http1.RequestHead) -> None:
        """Reserve the declared body (checked by :meth:`_refusal`, so it fits) for an authenticated caller."""
        share = self._fits((head.method, _route(head.target)), head.content_length)
        conn.reserved, conn.share = head.content_length, bool(share)
        if conn.share:
            self._share_used += head.content_length
        else:
            self._buffered += head.content_length

    def _readyz_refusal(self) -> Response | None:
        """/readyz's answer while scheduler calls are being refused (the app knows nothing of it)."""
        if time.monotonic() < self._refusing_until:
            return Response(503, (self._refused_why + "\n").encode(), TEXT)
        return None

    def _dispatch(self, conn: _Conn, head: http1.RequestHead, body: bytes) -> None:
        key = (head.method, _route(head.target))
        if key == ("GET", "/readyz") and (refused := self._readyz_refusal()) is not None:
            self._respond(conn, head, refused)
        elif key in INLINE:
            self._respond(conn, head, self._call(head, body))
        elif head.method in ("GET", "POST"):
            conn.busy = True
            self._watch(conn, 0)  # read nothing more from it until this answer is out: keeps order
            self._pool.submit(self._work, conn, head, body)
        else:
            self._respond(conn, head, Response(405, f"method {head.method} not allowed\n".encode(), TEXT),
                          extra=b"Allow: GET, POST\r\n")

    def _call(self, head: http1.RequestHead, body: bytes) -> Response:
        try:
            return self.app.handle(head.method, head.target, body)
        except Exception as exc:  # noqa: BLE001 - the app answers errors itself; this is a bug, not a verb
            log.error("handler raised", method=head.method, path=head.target, exc_info=True)
            return Response(500, f"internal error: {type(exc).__name__}\n".encode(), TEXT)

    def _work(self, conn: _Conn, head: http1.RequestHead, body: bytes) -> None:
        """On a worker thread: run the blocking route, hand the answer back to the loop."""
        self._done.append((conn, head, self._call(head, body)))
        self._wake()

    def _collect(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass
        while self._done:
            conn, head, resp = self._done.popleft()
            conn.busy = False
            if conn.closed:  # the client went away while its bind ran: the answer has nowhere to go
                continue
            conn.since = time.monotonic()
            self._respond(conn, head, resp)
            if conn.out is None and not conn.closed:
                self._watch(conn, selectors.EVENT_READ)
                self._resume(conn)

    def _respond(self, conn: _Conn, head: http1.RequestHead, resp: Response, extra: bytes = b"") -> None:
        keep = head.keep_alive and not self._stopping and not conn.close_after
        body = resp.body
        self._send(conn, http1.response_head(resp.status, resp.content_type, len(body), keep, extra) + body,
                   close=not keep)

    def _fail(self, conn: _Conn, status: int, message: str) -> None:
        """Answer a request we cannot frame, then close: the rest of the stream cannot be trusted."""
        log.warning("bad http request", peer=str(conn.peer), status=status, reason=message)
        body = (message + "\n").encode()
        conn.buf.clear()
        conn.head = None
        self._release_body(conn)
        self._send(conn, http1.response_head(status, TEXT, len(body), False) + body, close=True, linger=True)

    def _send(self, conn: _Conn, data: bytes, close: bool = False, interim: bool = False,
              linger: bool = False) -> None:
        if close:
            conn.close_after = True
        if linger:
            conn.linger = True
        conn.out = memoryview(data)
        self._flush(conn)
        if conn.out is not None and not interim:
            conn.since = time.monotonic()

    def _flush(self, conn: _Conn) -> None:
        out = conn.out
        assert out is not None
        try:
            sent = conn.sock.send(out)
        except (BlockingIOError, InterruptedError, ssl.SSLWantWriteError, ssl.SSLWantReadError):
            sent = 0
        except OSError:  # reset by the client
            self._drop(conn)
            return
        if sent < len(out):
            conn.out = out[sent:]
            self._watch(conn, selectors.EVENT_WRITE)  # and read nothing until it is out: backpressure
            return
        conn.out = None
        if conn.close_after and conn.linger and not conn.draining and not self._stopping:
            self._linger(conn)
        elif conn.close_after:
            self._drop(conn)
        elif not conn.busy:
            self._watch(conn, selectors.EVENT_READ)


    def _linger(self, conn: _Conn) -> None:
        try:
            conn.sock.shutdown(socket.SHUT_WR)  # the answer is complete: the client sees EOF after it
        except OSError:
            self._drop(conn)
            return
        conn.draining = True
        conn.since = time.monotonic()
        self._watch(conn, selectors.EVENT_READ)


def _route(target: str) -> str:
    """The path as :meth:`extender.app.Extender.handle` routes it (no query, no trailing slash)."""
    return target.split("?", 1)[0].rstrip("/") or "/"
