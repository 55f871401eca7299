"""Serving one watch: which changes a watcher sees, and when its stream ends.

A filtered watch sees an object *enter* its selector as ADDED and *leave* it as DELETED, as on a
real server; the extender's "unbound pods" watch relies on a Binding looking like a DELETED.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Iterator

from .errors import ApiError
from .resources import ResourceType
from .selectors import Selector
from .store import Change, Store

Event = dict[str, Any]

DISCONNECT: Event = {"type": "DISCONNECT"}  # sentinel, never sent: the stream is cut without a final chunk


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

    def __init__(self, store: Store) -> None:
        self._store = store
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
        with cond:
            self.open += 1
            cond.notify_all()
        try:
            yield from self._stream(req)
        finally:
            with cond:
                self.open -= 1
                cond.notify_all()

    def _stream(self, req: WatchRequest) -> Iterator[Event]:
        store, cond = self._store, self._store.changed
        deadline = None if req.timeout_s is None else time.monotonic() + req.timeout_s
        with cond:
            epoch, bookmark_epoch = self._epoch, self._bookmark_epoch
            if req.resource_version is None:  # no version: the current state first, as ADDED events
                items, cursor = store.list_objects(req.rtype, req.namespace, req.selector)
                initial = [{"type": "ADDED", "object": obj} for obj in items]
            else:
                cursor, initial = req.resource_version, []
        yield from initial
        first = True  # the first pass answers at once: replay, or 410 for a compacted resourceVersion
        while True:
            with cond:
                def woken() -> bool:
                    return (self.stopping or self._epoch != epoch or self._bookmark_epoch != bookmark_epoch
                            or store.resource_version > cursor or _remaining(deadline) == 0.0)
                if not first:
                    cond.wait_for(woken, timeout=_remaining(deadline))
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
            expired = _remaining(deadline) == 0.0
            if req.bookmarks and (wants_bookmark or expired):
                yield {"type": "BOOKMARK", "object": {"kind": req.rtype.kind, "apiVersion": req.rtype.api_version,
                                                      "metadata": {"resourceVersion": str(cursor)}}}
            if expired:
                return
        if cut:
            yield DISCONNECT  # the handler cuts the socket instead of ending the stream cleanly


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
