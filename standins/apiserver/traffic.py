"""What the double saw and what it should break: the request log and injected faults.

Tests assert on traffic ("the filter path made no API call", "exactly one Binding") and make chosen
requests fail ("the next Binding gets a 500") without a mock of any of our own code.
"""
from __future__ import annotations

import re
import threading
from dataclasses import dataclass, field

from .errors import ApiError


@dataclass(frozen=True)
class RequestRecord:
    """One request as it arrived: verb, path (no query), query string, the answered status code."""

    verb: str
    path: str
    query: str
    status: int


class RequestLog:
    """Thread-safe, append-only request log with counting by verb and path pattern."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._records: list[RequestRecord] = []

    def add(self, record: RequestRecord) -> None:
        with self._lock:
            self._records.append(record)

    def records(self, verb: str | None = None, path: str | None = None) -> list[RequestRecord]:
        """Records whose verb equals ``verb`` and whose path matches regex ``path`` (search), if given."""
        pattern = re.compile(path) if path else None
        with self._lock:
            return [r for r in self._records
                    if (verb is None or r.verb == verb.upper()) and (pattern is None or pattern.search(r.path))]

    def count(self, verb: str | None = None, path: str | None = None) -> int:
        return len(self.records(verb, path))

    def clear(self) -> None:
        with self._lock:
            self._records.clear()


@dataclass
class Fault:
    """Fail the next ``times`` requests whose verb and path match with ``code``.

    ``after_commit``: the request takes effect and only the answer is lost, as when a response times
    out; the caller's retry then meets the state its first attempt created.
    """

    verb: str
    path: re.Pattern[str]
    code: int
    reason: str
    message: str
    times: int
    after_commit: bool = False
    hits: int = field(default=0)

    def error(self) -> ApiError:
        return ApiError(self.code, self.reason, self.message)


_REASONS = {400: "BadRequest", 403: "Forbidden", 404: "NotFound", 409: "Conflict", 410: "Gone",
            422: "Invalid", 429: "TooManyRequests", 500: "InternalError", 503: "ServiceUnavailable",
            504: "Timeout"}


class FaultPlan:
    """Injected faults, consumed first-match in the order they were added."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._faults: list[Fault] = []

    def add(self, verb: str, path: str, code: int = 500, times: int = 1, reason: str | None = None,
            message: str | None = None, after_commit: bool = False) -> Fault:
        fault = Fault(verb.upper(), re.compile(path), code, reason or _REASONS.get(code, "InternalError"),
                      message or f"injected fault ({code})", times, after_commit)
        with self._lock:
            self._faults.append(fault)
        return fault

    def take(self, verb: str, path: str) -> Fault | None:
        """The pending fault that matches this request, if any (and use it up once)."""
        with self._lock:
            for fault in self._faults:
                if fault.hits < fault.times and fault.verb in (verb, "*") and fault.path.search(path):
                    fault.hits += 1
                    return fault
            return None

    def clear(self) -> None:
        with self._lock:
            self._faults.clear()
