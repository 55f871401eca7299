"""Serving one watch: which changes a watcher sees, and when its stream ends.

A filtered watch sees an object *enter* its selector as ADDED and *leave* it as DELETED, as on a
real server; the extender's "unbound pods" watch relies on a Binding looking like a DELETED.

When a stream ends and what BOOKMARKs it carries, as the real server's (k8s.io/apiserver):

* ``timeoutSeconds`` ends the stream cleanly (the final chunk, no event); without it (or with 0) the
  server picks ``minRequestTimeout * (1 + rand)`` (``pkg/endpoints/handlers/get.go`` ``handleWatch``;
  ``--min-request-timeout`` defaults to 1800 s), so no watch lasts for ever.
* with ``allowWatchBookmarks`` the watch cache sends a BOOKMARK roughly every minute and one 2 s before
  the deadline, whichever comes first, and none once that moment has passed
  (``pkg/storage/cacher/cache_watcher.go`` ``nextBookmarkTime``): a watch of 2 s or less gets none,
  and a stream's end carries none.
* a resourceVersion the server has not reached blocks up to 3 s (``watch_cache.go`` ``blockTimeout``),
  then is one ERROR event, a 504 ``Timeout`` with cause ``ResourceVersionTooLarge`` (an etcd restored
  from a backup, a client that watched another server).
* a resourceVersion older than the history is one ERROR event, a ``Status`` with code 410 and reason
  ``Expired``, "too old resource version: <rv> (<oldest-1>)" (``watch_cache_history.go``, sent by
  ``cacher.go`` ``newErrWatcher`` after a 200).
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Any, Iterator

from . import errors
from .errors import ApiError
from .resources import ResourceType
from .selectors import Selector
from .store import Change, Store

Event = dict[str, Any]

DISCONNECT: Event = {"type": "DISCONNECT"}  # sentinel, never sent: the stream is cut without a final chunk
MIN_REQUEST_TIMEOUT_S = 1800.0  # kube-apiserver --min-request-timeout
BOOKMARK_FREQUENCY_S = 60.0  # cacher.go defaultBookmarkFrequency
PRE_TIMEOUT_S = 2.0  # cache_watcher.go nextBookmarkTime: "2s before the deadline"
BLOCK_TIMEOUT_S = 3.0  # watch_cache.go blockTimeout: how long a watch waits for a resourceVersion to come


@dataclass(frozen=True)
class WatchRequest:
    rtype: ResourceType
    namespace: str | None
    selector: Selector
    resource_version: int | None  # None: start with the current state as ADDED events
    timeout_s: float | None
    bookmarks: bool


class WatchHub:
    """Counts open watches and ends them on request (``drop_all``) or when the server stops."""

    def __init__(self, store: Store, *, min_request_timeout_s: float = MIN_REQUEST_TIMEOUT_S,
                 bookmark_frequency_s: float = BOOKMARK_FREQUENCY_S) -> None:
        self._store = store
        self.min_request_timeout_s = min_request_timeout_s
        self.bookmark_frequency_s = bookmark_frequency_s
        self._epoch = 0
        self._bookmark_epoch = 0
        self._abrupt = False
        self.open = 0
        self.stopping = False

    def drop_all(self, abrupt: bool = False) -> None:
        """End every open watch: cleanly (final chunk) or ``abrupt``ly (socket cut, like a network failure)."""
        with self._store.changed:
            self._epoch += 1
            self._abrupt = abrupt
            self._store.changed.notify_all()

    def bookmark_all(self) -> None:
        with self._store.changed:
            self._bookmark_epoch += 1
            self._store.changed.notify_all()

    def stop(self) -> None:
        with self._store.changed:
            self.stopping = True
            self._store.changed.notify_all()

    def resume(self) -> None:
        """Accept watches again (the server was restarted)."""
        with self._store.changed:
            self.stopping = False

    def events(self, req: WatchRequest) -> Iterator[Event]:
        """Yield watch events until the timeout, a drop, or the server stopping; 410 as an ERROR event."""
        cond = self._store.changed
        with cond:  # counted open and the drop epoch read at once: a drop after wait_for_watches ends it
            self.open += 1
            epochs = self._epoch, self._bookmark_epoch
            cond.notify_all()
        try:
            yield from self._stream(req, *epochs)
        finally:
            with cond:
                self.open -= 1
                cond.notify_all()

    def _stream(self, req: WatchRequest, epoch: int, bookmark_epoch: int) -> Iterator[Event]:
        store, cond = self._store, self._store.changed
        timeout = req.timeout_s or self.min_request_timeout_s * (1.0 + random.random())  # get.go handleWatch
        deadline = time.monotonic() + timeout
        next_bookmark = self._next_bookmark(deadline) if req.bookmarks else None
        with cond:
            if req.resource_version is None:  # no version: the current state first, as ADDED events
                items, cursor = store.list_objects(req.rtype, req.namespace, req.selector)
                initial = [{"type": "ADDED", "object": obj} for obj in items]
            else:
                cursor, initial = req.resource_version, []
                rv = req.resource_version
                if not cond.wait_for(lambda: store.resource_version >= rv or self.stopping, timeout=BLOCK_TIMEOUT_S):
                    initial = [{"type": "ERROR", "object": errors.too_large_resource_version(
                        rv, store.resource_version).status_body()}]
        yield from initial
        if initial and initial[0]["type"] == "ERROR":
            return
        first = True  # the first pass answers at once: replay, or 410 for a compacted resourceVersion
        while True:
            with cond:
                def woken() -> bool:
                    return (self.stopping or self._epoch != epoch or self._bookmark_epoch != bookmark_epoch
                            or store.resource_version > cursor or _remaining(deadline) == 0.0
                            or _remaining(next_bookmark) == 0.0)
                if not first:
                    waits = [w for w in (_remaining(deadline), _remaining(next_bookmark)) if w is not None]
                    cond.wait_for(woken, timeout=min(waits))
                first = False
                ended = self.stopping or self._epoch != epoch
                cut = self._epoch != epoch and self._abrupt
                if ended:
                    break
                try:
                    changes, gone = store.changes_after(cursor), None
                except ApiError as error:
                    changes, gone = [], error
                cursor = store.resource_version
                wants_bookmark = self._bookmark_epoch != bookmark_epoch
                bookmark_epoch = self._bookmark_epoch
            if gone is not None:
                yield {"type": "ERROR", "object": gone.status_body()}
                return
            for change in changes:
                event = _as_seen_by(req, change)
                if event is not None:
                    yield event
            if _remaining(deadline) == 0.0:
                return  # the handler ends the stream cleanly: no event, no bookmark
            due = next_bookmark is not None and _remaining(next_bookmark) == 0.0
            if req.bookmarks and (wants_bookmark or due):
                yield {"type": "BOOKMARK", "object": {"kind": req.rtype.kind, "apiVersion": req.rtype.api_version,
                                                      "metadata": {"resourceVersion": str(cursor)}}}
            if due:
                next_bookmark = self._next_bookmark(deadline)
        if cut:
            yield DISCONNECT  # the handler cuts the socket instead of ending the stream cleanly

    def _next_bookmark(self, deadline: float) -> float | None:
        """cache_watcher.go ``nextBookmarkTime``: a minute from now or 2 s before the deadline, whichever
        is first; ``None`` once that moment has passed."""
        now = time.monotonic()
        at = min(now + self.bookmark_frequency_s, deadline - PRE_TIMEOUT_S)
        return None if at < now else at


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _as_seen_by(req: WatchRequest, change: Change) -> Event | None:
    if change.rtype != req.rtype:
        return None
    if req.namespace is not None and change.obj["metadata"].get("namespace") != req.namespace:
        return None
    now_in = change.type != "DELETED" and req.selector.matches(change.obj)
    was_in = change.old is not None and req.selector.matches(change.old)
    if now_in and was_in:
        kind = change.type
    elif now_in:
        kind = "ADDED"
    elif was_in:
        kind = "DELETED"
    else:
        return None
    return {"type": kind, "object": change.obj}
