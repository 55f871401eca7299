"""List + watch of nodes and pods into the accounting, so filter and prioritize never call the API.

One thread per resource: list (apply all, note the resourceVersion), then watch from there. A watch that
ends cleanly (the server's timeout) resumes from the last resourceVersion seen (bookmarks included); a
``410 Gone`` or a broken stream relists, because events may have been missed. Nodes are listed before
pods at start-up so a pod's GPUs are known when its assignment is read; :attr:`ready` is set once both
initial lists are in (``/readyz``). A third thread expires assumed pods that never bind.
"""
from __future__ import annotations

import threading
from typing import Any

from extender import accounting, apicalls, metrics
from vramshare import logs
from vramshare.retry import Backoff

__all__ = ["Cache", "Gone"]

log = logs.get("vramshare.extender.cache")
RESOURCES = ("nodes", "pods")


class Gone(Exception):
    """The watch's resourceVersion is too old (410): only a fresh list is safe."""


class Cache:
    def __init__(self, acct: accounting.Accounting, kube: apicalls.Kube, stats: metrics.ExtenderMetrics,
                 *, watch_timeout_s: int = 300, expiry_interval_s: float | None = None,
                 backoff_s: float = 0.2, max_backoff_s: float = 5.0) -> None:
        self.acct = acct
        self.kube = kube
        self.stats = stats
        self.watch_timeout_s = watch_timeout_s
        timeout = acct.config.extender.assume_timeout_seconds
        self.expiry_interval_s = expiry_interval_s or min(5.0, max(0.05, timeout / 4))
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self.ready = threading.Event()
        self._stop = threading.Event()
        self._listed = {r: threading.Event() for r in RESOURCES}
        self._open: dict[str, Any] = {}
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        self._threads = [threading.Thread(target=self._run, args=(r,), name=f"extender-watch-{r}", daemon=True)
                         for r in RESOURCES]
        self._threads.append(threading.Thread(target=self._expire_loop, name="extender-expiry", daemon=True))
        self._threads.append(threading.Thread(target=self.acct.warm_loop, args=(self._stop,), name="extender-warm",
                                              daemon=True))
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        """Stop all threads now: open watch streams are shut, so nothing waits for a server timeout."""
        self._stop.set()
        for resp in list(self._open.values()):
            try:
                resp.shutdown()
            except Exception:  # noqa: BLE001 - already closed is fine
                pass
        for t in self._threads:
            t.join(timeout=10)

    # -- list -------------------------------------------------------------------------------------
    def _relist(self, resource: str) -> str:
        started = self.acct.clock()
        data = self.kube.list(resource)
        items = data.get("items") or []
        if resource == "nodes":
            self.acct.replace_nodes(items)
        else:
            self.acct.replace_pods(items, started)
        log.info("listed", resource=resource, count=len(items))
        return str((data.get("metadata") or {}).get("resourceVersion", ""))

    def _run(self, resource: str) -> None:
        if resource == "pods":  # pods name GPUs: know the nodes first
            while not self._listed["nodes"].wait(0.1):
                if self._stop.is_set():
                    return
        rv: str | None = None
        delay = Backoff(self.backoff_s, self.max_backoff_s)
        while not self._stop.is_set():
            try:
                if rv is None:
                    rv = self._relist(resource)
                    self._listed[resource].set()
                    if all(e.is_set() for e in self._listed.values()) and not self.ready.is_set():
                        self.ready.set()
                        log.info("cache ready", nodes=len(self.acct.slots), pods=len(self.acct.pods))
                rv = self._watch(resource, rv)
                delay.reset()
            except Gone:
                log.info("watch expired, relisting", resource=resource)
                self.stats.resyncs.labels(resource).inc()
                rv = None
            except Exception as exc:  # noqa: BLE001 - a broken stream or an API outage: back off, relist
                if self._stop.is_set():
                    return
                gone = isinstance(exc, apicalls.ApiException) and exc.status == apicalls.GONE
                log.warning("watch broken, relisting", resource=resource, error=f"{type(exc).__name__}: {exc}")
                self.stats.resyncs.labels(resource).inc()
                rv = None
                if not gone:
                    self._stop.wait(delay.next())

    # -- watch ------------------------------------------------------------------------------------
    def _watch(self, resource: str, rv: str) -> str:
        """Apply events until the stream ends; returns the resourceVersion to resume from."""
        apply = self.acct.apply_node if resource == "nodes" else self.acct.apply_pod
        try:
            for event in self.kube.watch(resource, rv, self.watch_timeout_s,
                                         on_open=lambda resp: self._open.__setitem__(resource, resp)):
                kind, obj = str(event.get("type")), event.get("object") or {}
                if kind == "ERROR":
                    if obj.get("code") == apicalls.GONE:
                        raise Gone(obj.get("message", ""))
                    raise RuntimeError(f"watch error: {obj.get('code')} {obj.get('message', '')}")
                rv = str((obj.get("metadata") or {}).get("resourceVersion", rv))
                if kind != "BOOKMARK":
                    try:
                        apply(kind, obj)
                    except Exception:  # noqa: BLE001 - one bad object must not cost the others
                        log.error("event not applied", resource=resource, type=kind,
                                  name=(obj.get("metadata") or {}).get("name", "?"), exc_info=True)
        finally:
            self._open.pop(resource, None)
        return rv

    def _expire_loop(self) -> None:
        while not self._stop.wait(self.expiry_interval_s):
            try:
                self.acct.expire()
            except Exception:  # noqa: BLE001 - never let the sweeper die
                log.error("expiry sweep failed", exc_info=True)
