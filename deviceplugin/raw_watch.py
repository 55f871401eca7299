"""List + watch of one collection as raw JSON (no client models), for the node agent's watchers.

The API machinery's semantics: list, then watch from the list's resourceVersion with bookmarks; a
watch the server ends resumes from the last resourceVersion; a ``410 Gone`` or a broken stream
relists (a 410 at once, a failure after a jittered backoff). Subclasses say what a list and an event
mean (:meth:`on_list`, :meth:`on_event`) and whether a failure ends the watch (:meth:`keep_going`).
"""
from __future__ import annotations

import json
import threading
from typing import Any, Mapping

from kubernetes.watch.watch import iter_resp_lines

from vramshare import logs
from vramshare.retry import Backoff

log = logs.get(__name__)

GONE = 410


class Gone(Exception):
    """The watch's resourceVersion is too old (410): relist."""


class RawWatch:
    what = "watch"  # for the log line
    wait_after_gone = False  # a 410 relists at once unless a subclass never relists back to back

    def __init__(self, watch_timeout_s: int, request_timeout_s: float | None = None) -> None:
        self._watch_timeout = watch_timeout_s
        self._request_timeout = request_timeout_s
        self._stopping = threading.Event()
        self._open: Any = None

    # -- what a subclass says ---------------------------------------------------------------------------
    def list_call(self, **kwargs: Any) -> Any:
        """The client's list method for the collection, with its selectors and ``kwargs`` (a list, or
        with ``watch=True`` a watch; always ``_preload_content=False``)."""
        raise NotImplementedError

    def on_list(self, doc: Mapping[str, Any]) -> None:
        """A fresh list: the whole truth now."""

    def on_event(self, kind: str, obj: Mapping[str, Any]) -> None:
        """One ADDED / MODIFIED / DELETED event (bookmarks are not passed on)."""

    def keep_going(self, exc: Exception) -> bool:
        """False ends the thread (e.g. no RBAC for the watch); the default relists after any failure."""
        return True

    # -- the thread --------------------------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        """Body of the watch thread: list, then watch, until ``stop`` (or :meth:`stop`)."""
        rv: str | None = None
        backoff = Backoff(0.2, 5.0)
        while not stop.is_set() and not self._stopping.is_set():
            try:
                if rv is None:
                    rv = self._relist()
                rv = self._watch(rv)
                backoff.reset()
            except Exception as exc:  # noqa: BLE001 - 410, a broken stream or an outage: relist
                if stop.is_set() or self._stopping.is_set() or not self.keep_going(exc):
                    return
                log.warning(f"{self.what} broken, relisting", error=f"{type(exc).__name__}: {exc}")
                rv = None
                if self.wait_after_gone or not isinstance(exc, Gone):
                    stop.wait(backoff.next())

    def stop(self) -> None:
        self._stopping.set()  # a watch opened after this line sees it and ends at once
        resp = self._open
        if resp is not None:
            try:
                resp.shutdown()
            except Exception:  # noqa: BLE001 - already closed
                pass

    def _timeouts(self, read_s: float | None) -> dict[str, Any]:
        if self._request_timeout is None:
            return {}
        return {"_request_timeout": self._request_timeout if read_s is None else (self._request_timeout, read_s)}

    def _relist(self) -> str:
        resp = self.list_call(_preload_content=False, **self._timeouts(None))
        try:
            doc = json.loads(resp.data)
        finally:
            resp.release_conn()
        self.on_list(doc)
        return str((doc.get("metadata") or {}).get("resourceVersion", ""))

    def _watch(self, rv: str) -> str:
        read_s = None if self._request_timeout is None else self._watch_timeout + self._request_timeout
        resp: Any = self.list_call(watch=True, resource_version=rv, allow_watch_bookmarks=True,
                               timeout_seconds=self._watch_timeout, _preload_content=False, **self._timeouts(read_s))
        self._open = resp
        try:
            if self._stopping.is_set():  # stop() ran while the request was on its way
                return rv
            for line in iter_resp_lines(resp):
                if not line:
                    continue
                event = json.loads(line)
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    if obj.get("code") == GONE:
                        raise Gone(obj.get("message", ""))
                    raise RuntimeError(f"watch error {obj.get('code')}: {obj.get('message', '')}")
                rv = str((obj.get("metadata") or {}).get("resourceVersion", rv))
                if kind != "BOOKMARK":
                    self.on_event(str(kind), obj)
        finally:
            self._open = None
            resp.close()
            resp.release_conn()
        return rv
