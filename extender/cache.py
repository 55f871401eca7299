"""List + watch of nodes and pods into the accounting, so filter and prioritize never call the API.

One thread per resource, each a :class:`vramshare.watch.ListWatch` (client-go's reflector semantics: a
list replaces the view, a watch the server ends resumes from the last resourceVersion, bookmarks
included; a ``410 Gone`` or a broken stream relists after a jittered backoff). Nodes are listed before
pods at start-up so a pod's GPUs are known when its assignment is read; :attr:`ready` is set once both
initial lists are in (``/readyz``). A third thread expires assumed pods that never bind.
"""
from __future__ import annotations

import threading
from typing import Any, Mapping

from extender import accounting, apicalls, metrics
from vramshare import logs
from vramshare.retry import Backoff
from vramshare.watch import ListWatch

__all__ = ["Cache"]

log = logs.get("vramshare.extender.cache")
RESOURCES = ("nodes", "pods")


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
        self.ready = threading.Event()
        self._stop = threading.Event()
        self._list_started: dict[str, int] = {}
        self.watches: dict[str, ListWatch] = {
            r: kube.list_watch(r, on_replace=lambda items, deleted, r=r: self._replaced(r, items, deleted),
                               on_event=acct.apply_node if r == "nodes" else acct.apply_pod,
                               on_failure=lambda exc, r=r: self._failed(r),
                               before_list=lambda r=r: self._list_started.__setitem__(r, acct.clock()),
                               min_watch_timeout_s=watch_timeout_s,
                               backoff=Backoff(backoff_s, max_backoff_s, jitter=1.0))
            for r in RESOURCES}
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
        for w in self.watches.values():
            w.stop()
        for t in self._threads:
            t.join(timeout=10)

    def _run(self, resource: str) -> None:
        if resource == "pods":  # pods name GPUs: know the nodes first
            while not self.watches["nodes"].synced.wait(0.1):
                if self._stop.is_set():
                    return
        self.watches[resource].run(self._stop)

    def _replaced(self, resource: str, items: list[Mapping[str, Any]], deleted: list[Mapping[str, Any]]) -> None:
        """A fresh list: the accounting's whole truth (it drops what the list lacks, ``deleted``)."""
        if resource == "nodes":
            self.acct.replace_nodes(items)
        else:
            self.acct.replace_pods(items, self._list_started[resource])
        log.info("listed", resource=resource, count=len(items), deleted=len(deleted))
        others = [w.synced.is_set() for r, w in self.watches.items() if r != resource]
        if all(others) and not self.ready.is_set():
            self.ready.set()
            log.info("cache ready", nodes=len(self.acct.slots), pods=len(self.acct.pods))

    def _failed(self, resource: str) -> bool:
        self.stats.resyncs.labels(resource).inc()
        return True

    def _expire_loop(self) -> None:
        while not self._stop.wait(self.expiry_interval_s):
            try:
                self.acct.expire()
            except Exception:  # noqa: BLE001 - never let the sweeper die
                log.error("expiry sweep failed", exc_info=True)
