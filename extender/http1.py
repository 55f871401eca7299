"""HTTP/1.1 message framing for the extender's server: parse one request head, format one response head.

Pure functions over bytes so the event loop in :mod:`extender.http_server` stays about sockets only, and
so the framing rules can be tested without a socket. Only what kube-scheduler (Go net/http) and probes
send is understood: origin-form targets, ``Content-Length`` bodies, ``Connection``, ``Expect:
100-continue``. Anything else is refused with a precise status rather than guessed at, because a guess
about where a body ends desynchronises a keep-alive connection (request smuggling).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from email.utils import formatdate
from http import HTTPStatus

__all__ = ["HttpError", "RequestHead", "parse_head", "response_head", "MAX_HEAD_BYTES", "MAX_HEADERS"]

MAX_HEAD_BYTES = 64 * 1024  # request line + headers; Go sends a few hundred bytes
MAX_HEADERS = 100
_METHOD_CHARS = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZ")


class HttpError(Exception):
    """A request the server answers with ``status`` and then closes the connection (framing is lost)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(slots=True)
class RequestHead:
    method: str
    target: str
    content_length: int
    keep_alive: bool
    expect_continue: bool


def parse_head(raw: bytes) -> RequestHead:
    """Parse a request line and headers (``raw`` excludes the blank line); raise :class:`HttpError`."""
    lines = raw.split(b"\r\n")
    if len(lines) - 1 > MAX_HEADERS:
        raise HttpError(431, f"more than {MAX_HEADERS} header fields")
    parts = lines[0].split(b" ")
    if len(parts) != 3 or not parts[0] or not _METHOD_CHARS.issuperset(parts[0]):
        raise HttpError(400, "malformed request line")
    method, target, version = parts
    if version == b"HTTP/1.1":
        keep_alive = True
    elif version == b"HTTP/1.0":
        keep_alive = False
    elif version.startswith(b"HTTP/"):
        raise HttpError(505, "only HTTP/1.0 and HTTP/1.1 are served")
    else:
        raise HttpError(400, "malformed request line")
    if not target.startswith(b"/"):
        raise HttpError(400, "request target must be an absolute path")
    length: int | None = None
    expect_continue = False
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep or not name or name != name.strip() or line[:1] in (b" ", b"\t"):
            raise HttpError(400, "malformed header line")
        key = name.lower()
        if key == b"content-length":
            value = value.strip()
            if not value.isdigit() or (length is not None and int(value) != length):
                raise HttpError(400, "invalid Content-Length")
            length = int(value)
        elif key == b"transfer-encoding":
            raise HttpError(501, "Transfer-Encoding is not supported: send the body with Content-Length")
        elif key == b"connection":
            tokens = {t.strip().lower() for t in value.split(b",")}
            if b"close" in tokens:
                keep_alive = False
            elif b"keep-alive" in tokens:
                keep_alive = True
        elif key == b"expect":
            if value.strip().lower() != b"100-continue":
                raise HttpError(417, "only 'Expect: 100-continue' is supported")
            expect_continue = True
    return RequestHead(method.decode("ascii"), target.decode("latin-1"), length or 0, keep_alive,
                       expect_continue)


class _Date:
    """The ``Date`` header, formatted at most once a second (formatting costs more than the rest)."""

    def __init__(self) -> None:
        self._second = -1
        self._value = b""

    def __call__(self) -> bytes:
        now = int(time.time())
        if now != self._second:
            self._second, self._value = now, formatdate(now, usegmt=True).encode("ascii")
        return self._value


_date = _Date()
_prefixes: dict[tuple[int, str], bytes] = {}


def response_head(status: int, content_type: str, length: int, keep_alive: bool,
                  extra: bytes = b"") -> bytes:
    """Status line and headers of a response with a ``length``-byte body; ``extra`` is raw header lines."""
    prefix = _prefixes.get((status, content_type))
    if prefix is None:
        try:
            phrase = HTTPStatus(status).phrase
        except ValueError:
            phrase = "Status"
        prefix = f"HTTP/1.1 {status} {phrase}\r\nContent-Type: {content_type}\r\n".encode("latin-1")
        if len(_prefixes) < 256:
            _prefixes[(status, content_type)] = prefix
    conn = b"" if keep_alive else b"Connection: close\r\n"
    return b"%sDate: %s\r\nContent-Length: %d\r\n%s%s\r\n" % (prefix, _date(), length, conn, extra)
