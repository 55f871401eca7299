"""Structured logs: one line per event, ``event key=value ...`` (or JSON), naming the pod and GPU.

Every daemon logs through :func:`get`; the event name says what happened, the fields say to what.
"""
from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any


class _Formatter(logging.Formatter):
    def __init__(self, as_json: bool) -> None:
        super().__init__()
        self.as_json = as_json

    def format(self, record: logging.LogRecord) -> str:
        fields: dict[str, Any] = getattr(record, "fields", {})
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"
        if self.as_json:
            doc = {"ts": ts, "level": record.levelname.lower(), "logger": record.name,
                   "event": record.getMessage(), **fields}
            if record.exc_info:
                doc["exc"] = self.formatException(record.exc_info)
            return json.dumps(doc, default=str)
        kv = " ".join(f"{k}={_quote(v)}" for k, v in fields.items())
        line = f"{ts} {record.levelname:<5} {record.name}: {record.getMessage()}" + (f" {kv}" if kv else "")
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def _quote(v: Any) -> str:
    s = str(v)
    return json.dumps(s) if (not s or any(c in s for c in ' ="')) else s


class Logger:
    """A thin wrapper: ``log.info("allocated", pod="ns/name", gpu="GPU-..", mib=20480)``."""

    def __init__(self, name: str) -> None:
        self._log = logging.getLogger(name)

    def debug(self, event: str, **fields: Any) -> None:
        self._log.debug(event, extra={"fields": fields})

    def info(self, event: str, **fields: Any) -> None:
        self._log.info(event, extra={"fields": fields})

    def warning(self, event: str, **fields: Any) -> None:
        self._log.warning(event, extra={"fields": fields})

    def error(self, event: str, exc_info: bool = False, **fields: Any) -> None:
        self._log.error(event, exc_info=exc_info, extra={"fields": fields})


def get(name: str) -> Logger:
    return Logger(name)


class _Stderr(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to ``sys.stderr`` as it is when a record comes, so a command run in-process after
    stderr was swapped (a test's capture, since closed) never writes to a dead stream."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


def handler(as_json: bool = False) -> logging.Handler:
    """A stderr handler with this module's format (fields kept)."""
    out = _Stderr(sys.stderr)
    out.setFormatter(_Formatter(as_json))
    return out


def setup(level: str = "info", as_json: bool = False) -> None:
    """Configure the root logger once, from the CLI."""
    handler_ = handler(as_json)
    root = logging.getLogger()
    root.handlers[:] = [handler_]
    root.setLevel(level.upper())
