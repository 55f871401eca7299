"""List + watch of one collection with the API machinery's semantics: the one way every watcher we run
(the node agent's pod cache and slice watch, the extender's node/pod cache and DRA view) follows the API.

What client-go's reflector does (k8s.io/client-go ``tools/cache/reflector.go``, ``ListAndWatch`` and
``watch``/``handleAnyWatch``), kept here:

* **list, then watch** from the list's resourceVersion with ``allowWatchBookmarks``; every event's
  resourceVersion, and every BOOKMARK's (which carries nothing else: its object is an empty one of the
  kind), is where the next watch resumes. A watch the server ends (its ``timeoutSeconds``) resumes from
  there without a list.
* **the watch's timeoutSeconds is random in [min, 2*min]** (``minWatchTimeout``, 5 min) so that a fleet's
  watches do not all reconnect at once; the request carries a read timeout a little past it, so a
  half-open connection (the server gone without a FIN) is noticed instead of waited on for ever.
* **410 Gone relists**: an ERROR event with code 410 (reason ``Expired``, or ``Gone`` from servers
  before 1.18: ``isExpiredError``) or an HTTP 410 means the resourceVersion was compacted away and
  events were missed; only a fresh list is safe.
* **other failures back off with jitter**, then relist: :class:`vramshare.retry.Backoff` as the
  reflector's ``wait.Backoff{800ms, x2, jitter 1.0, cap 30s}``, reset after two minutes without a
  failure (``DelayWithReset``) or a watch the server ended cleanly. A 410 waits one step too (the
  reflector's ``BackoffUntil`` waits between ``ListAndWatch`` runs), as does a watch that ended in
  under a second with no event (``VeryShortWatchError``): no hot loop against a sick server.
* **every list is a consistent read** (no resourceVersion): after a 410 the reflector first tries the
  last version it saw and falls back to this; one request instead of two, never older than the view.
* **a list replaces the view** (``tools/cache/delta_fifo.go`` ``Replace``): whatever the view holds that
  the list lacks was deleted while nobody watched, and the handler is told so
  (``DeletedFinalStateUnknown``), as it is of an object whose name came back with another uid
  (deleted and recreated meanwhile).

The callers say what a list and an event mean: ``on_replace(items, deleted)`` after each list,
``on_event(type, obj)`` for each ADDED / MODIFIED / DELETED. An exception from ``on_event`` is logged
and costs that one object only; one from ``on_replace`` is a failure (back off, list again). Raw JSON
throughout (:func:`vramshare.kube.decode`): no client model class is ever built.
"""
from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

from kubernetes.client.exceptions import ApiException

from vramshare import logs
from vramshare.kube import decode, decode_lines
from vramshare.retry import Backoff

__all__ = ["ListWatch", "Expired", "WatchError", "key_of", "replace", "is_expired", "GONE"]

log = logs.get(__name__)

Obj = Mapping[str, Any]
GONE = 410
MIN_WATCH_TIMEOUT_S = 300.0  # reflector.go defaultMinWatchTimeout
BACKOFF_RESET_S = 120.0  # reflector.go defaultBackoffReset
VERY_SHORT_S = 1.0  # reflector.go handleAnyWatch: under a second with no event is an error


class Expired(Exception):
    """The watch's resourceVersion is too old (410): relist."""


class WatchError(Exception):
    """An ERROR event other than 410: the server's Status."""

    def __init__(self, status: Obj) -> None:
        self.status = dict(status)
        self.code = status.get("code")
        super().__init__(f"watch error {status.get('code')} {status.get('reason', '')}: {status.get('message', '')}")


class VeryShortWatch(Exception):
    """The watch ended in under a second without an event (reflector.go ``VeryShortWatchError``)."""


def is_expired(exc: BaseException) -> bool:
    """A 410 in any of its shapes: our :class:`Expired` (an ERROR event) or the client's HTTP 410."""
    return isinstance(exc, Expired) or (isinstance(exc, ApiException) and exc.status == GONE)


def key_of(obj: Obj) -> str:
    """``namespace/name``, or ``name`` for a cluster-scoped object (client-go ``MetaNamespaceKeyFunc``)."""
    meta = obj.get("metadata") or {}
    ns = meta.get("namespace")
    return f"{ns}/{meta.get('name', '')}" if ns else str(meta.get("name", ""))


def _uid(obj: Obj) -> Any:
    return (obj.get("metadata") or {}).get("uid")


def replace(view: Mapping[str, Obj], items: Iterable[Obj]) -> tuple[dict[str, Obj], list[Obj]]:
    """A fresh list against the view: the new view, and the objects it deleted (the last state known of
    each: gone from the list, or come back under another uid). Pure: ``DeltaFIFO.Replace``'s deletion
    detection."""
    fresh = {key_of(o): o for o in items}
    deleted = [old for k, old in view.items() if k not in fresh or _uid(fresh[k]) != _uid(old)]
    return fresh, deleted


def apply(view: dict[str, Obj], kind: str, obj: Obj) -> None:
    """One watch event into the view."""
    if kind == "DELETED":
        view.pop(key_of(obj), None)
    else:
        view[key_of(obj)] = obj


@dataclass
class _Stream:
    """The resourceVersion to resume from and what the last watch did."""

    rv: str
    events: int = 0


class ListWatch:
    """One collection, listed and watched until stopped; :meth:`run` is a thread's body.

    ``lister(**kwargs)`` is the client's list method of the collection with its selectors bound (the
    same call lists and, with ``watch=True``, watches); this class adds ``_preload_content=False``, the
    resourceVersion, bookmarks and the timeouts.
    """

    def __init__(self, what: str, lister: Callable[..., Any], *,
                 on_replace: Callable[[list[Obj], list[Obj]], None] | None = None,
                 on_event: Callable[[str, Obj], None] | None = None,
                 on_failure: Callable[[BaseException], bool] | None = None,
                 before_list: Callable[[], None] | None = None,
                 min_watch_timeout_s: float = MIN_WATCH_TIMEOUT_S, request_timeout_s: float = 10.0,
                 backoff: Backoff | None = None, rng: random.Random | None = None) -> None:
        self.what = what
        self._lister = lister
        self._on_replace = on_replace
        self._on_event = on_event
        self._on_failure = on_failure
        self._before_list = before_list
        self.min_watch_timeout_s = min_watch_timeout_s
        self.request_timeout_s = request_timeout_s
        self._rng = rng or random.Random()
        self._backoff = backoff or Backoff(0.8, 30.0, jitter=1.0, rng=self._rng)
        self._last_failure = float("-inf")
        self.view: dict[str, Obj] = {}  # what the handlers were told, by key_of
        self.resource_version = ""  # where the next watch starts: the last list's, event's or bookmark's
        self.lists = 0  # lists made (the first and every relist)
        self.synced = threading.Event()  # set after the first list was handled
        self._stopping = threading.Event()
        self._open: Any = None

    # -- the thread --------------------------------------------------------------------------------------
    def run(self, stop: threading.Event | None = None) -> None:
        """List, then watch, until ``stop`` is set or :meth:`stop` is called. Returns early only when
        ``on_failure`` says a failure is final (e.g. no RBAC to list)."""
        stop = stop or self._stopping
        rv: str | None = None
        while not self._stopped(stop):
            try:
                if rv is None:
                    rv = self._list()
                rv = self._watch(rv)
            except Exception as exc:  # noqa: BLE001 - 410, a broken stream, an outage: back off, relist
                if self._stopped(stop):
                    return
                if self._on_failure is not None and not self._on_failure(exc):
                    return
                rv = None
                delay = self._delay()
                if is_expired(exc):
                    log.info("watch expired, relisting", watch=self.what, error=str(exc), retry_seconds=round(delay, 3))
                else:
                    log.warning("watch broken, relisting", watch=self.what, error=f"{type(exc).__name__}: {exc}",
                                retry_seconds=round(delay, 3))
                self._sleep(stop, delay)

    def stop(self) -> None:
        """End :meth:`run` now: the open watch is shut, so nothing waits for the server's timeout."""
        self._stopping.set()  # a watch opened after this line sees it and ends at once
        resp = self._open
        if resp is not None:
            _shut(resp)

    def watch_timeout_s(self) -> int:
        """reflector.go: ``timeoutSeconds`` random in [minWatchTimeout, 2*minWatchTimeout]."""
        lo = self.min_watch_timeout_s
        return max(1, int(lo + self._rng.random() * lo))

    # -- one list, one watch ------------------------------------------------------------------------------
    def _stopped(self, stop: threading.Event) -> bool:
        return stop.is_set() or self._stopping.is_set()

    def _sleep(self, stop: threading.Event, seconds: float) -> None:
        """Wait ``seconds`` or until either stop signal."""
        end = time.monotonic() + seconds
        while not self._stopped(stop) and (left := end - time.monotonic()) > 0:
            stop.wait(min(left, 0.1))  # short slices: stop() sets the other signal

    def _delay(self) -> float:
        now = time.monotonic()
        if now - self._last_failure > BACKOFF_RESET_S:
            self._backoff.reset()
        self._last_failure = now
        return self._backoff.next()

    def _list(self) -> str:
        if self._before_list is not None:
            self._before_list()
        doc = decode(self._lister(_preload_content=False, _request_timeout=self.request_timeout_s))
        items = list(doc.get("items") or ())
        view, deleted = replace(self.view, items)
        if self._on_replace is not None:
            self._on_replace(items, deleted)
        self.view = view
        self.lists += 1
        self.resource_version = str((doc.get("metadata") or {}).get("resourceVersion", ""))
        self.synced.set()
        log.debug("listed", watch=self.what, count=len(items), deleted=len(deleted), resource_version=self.resource_version)
        return self.resource_version

    def _watch(self, rv: str) -> str:
        """Apply events until the server ends the stream; the resourceVersion to resume from."""
        timeout = self.watch_timeout_s()
        started = time.monotonic()
        stream = _Stream(rv)
        resp = self._lister(watch=True, resource_version=rv, allow_watch_bookmarks=True, timeout_seconds=timeout,
                            _preload_content=False,
                            _request_timeout=(self.request_timeout_s, timeout + self.request_timeout_s))
        self._open = resp
        try:
            if self._stopping.is_set():  # stop() ran while the request was on its way
                _shut(resp)
                resp.close()  # and its socket closed now, not left to the garbage collector
                resp.release_conn()
                return rv
            for event in decode_lines(resp):
                self._handle(event, stream)
        finally:
            self._open = None
        if stream.events == 0 and time.monotonic() - started < VERY_SHORT_S and not self._stopping.is_set():
            raise VeryShortWatch(f"{self.what} ended at once without an event")
        if not self._stopping.is_set():
            self._backoff.reset()  # a watch the server ended on time: it is healthy
        self.resource_version = stream.rv
        return stream.rv

    def _handle(self, event: Mapping[str, Any], stream: _Stream) -> None:
        kind, obj = str(event.get("type")), event.get("object") or {}
        if kind == "ERROR":
            if obj.get("code") == GONE or obj.get("reason") in ("Expired", "Gone"):
                raise Expired(str(obj.get("message", "")))
            raise WatchError(obj)
        stream.events += 1
        stream.rv = self.resource_version = str((obj.get("metadata") or {}).get("resourceVersion") or stream.rv)
        if kind == "BOOKMARK":
            return
        apply(self.view, kind, obj)
        if self._on_event is None:
            return
        try:
            self._on_event(kind, obj)
        except Exception:  # noqa: BLE001 - one bad object must not cost the others
            log.error("event not applied", watch=self.what, type=kind, object=key_of(obj), exc_info=True)


def _shut(resp: Any) -> None:
    try:
        resp.shutdown()
    except Exception:  # noqa: BLE001 - already closed
        pass
