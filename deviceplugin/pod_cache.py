"""This node's pods, kept by list + watch: what the node plugins read, never an API call.

Shared by both node plugins: the kubelet plugin's steering and reconciler, and the DRA plugin's quota
tenants (a claim's pod: metrics URL, container IDs, quota-class metadata). GetPreferredAllocation
reads the extender's plans from here and the reconciler the pods' UIDs, resourceVersions and
annotations; neither waits on the API server, so an outage only makes the view older (steering then falls back to best fit, the reconciler's patches wait). The reconciler's own
patches are written through, so the next round starts from the resourceVersion it produced. The
watching is :class:`vramshare.watch.ListWatch`'s (a list replaces the view, 410 relists, bookmarks,
backoff with jitter).
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Mapping

from kubernetes import client

from vramshare import contract, logs
from vramshare.kube import decode
from vramshare.retry import Backoff
from vramshare.watch import ListWatch

log = logs.get(__name__)
TIMEOUT_S = 5.0  # connect and read timeout of the list (a watch reads for its timeoutSeconds more)


def _rv(pod: Mapping[str, Any]) -> int:
    """resourceVersion as a number for ordering our own writes against watch events (0 if opaque)."""
    try:
        return int((pod.get("metadata") or {}).get("resourceVersion") or 0)
    except ValueError:
        return 0


class NodePodCache:
    """:class:`deviceplugin.kubelet.allocator.PodSource` (and the DRA quota tenants' pods) over a watch of the pods bound to one node."""

    def __init__(self, api: client.ApiClient, node: str, names: contract.Names, watch_timeout_s: int = 300,
                 retry_max_s: float = 5.0) -> None:
        v1 = client.CoreV1Api(api)
        selector = f"spec.nodeName={node}"
        self._lock = threading.Lock()
        self._pods: dict[str, Mapping[str, Any]] = {}  # uid -> pod JSON
        self._lister = lambda **kw: v1.list_pod_for_all_namespaces(field_selector=selector, **kw)
        self.refreshes = 0
        # told of every pod that left: the DELETED event's object, or the last seen one of a pod a relist
        # lacks (the node's departing pods, vramshare.departing); called outside the cache's lock
        self.on_deleted: Callable[[Mapping[str, Any]], None] | None = None
        # told before each list (the first and every relist) is requested, and with its pods once it was
        # applied: a caller learns what left while nobody watched, even pods the view never held
        self.before_list: Callable[[], None] | None = None
        self.on_listed: Callable[[list[Mapping[str, Any]]], None] | None = None
        self.watch = ListWatch("pod watch", self._lister, before_list=self._before_list,
                               on_replace=self._replace, on_event=self._apply, min_watch_timeout_s=watch_timeout_s,
                               request_timeout_s=TIMEOUT_S,
                               backoff=Backoff(min(0.2, retry_max_s), retry_max_s, jitter=1.0))
        self.synced = self.watch.synced

    def run(self, stop: threading.Event) -> None:
        """Body of the ``pod-watch`` thread."""
        self.watch.run(stop)

    def stop(self) -> None:
        self.watch.stop()

    # -- PodSource ---------------------------------------------------------------------------------
    def pods(self) -> list[Mapping[str, Any]]:
        """Every pod bound to this node as last seen; empty before the first list."""
        with self._lock:
            return list(self._pods.values())

    def written(self, pod: Mapping[str, Any]) -> None:
        """A pod we just patched: seen at once, not only when its watch event arrives (unless the
        watch already brought a newer version)."""
        uid = (pod.get("metadata") or {}).get("uid")
        with self._lock:
            seen = self._pods.get(uid) if uid else None
            if seen is not None and _rv(seen) > _rv(pod):
                return
        self._apply("MODIFIED", pod)

    def refresh(self) -> bool:
        """Read the node's pods now, for a caller that found none of the pod it serves: the kubelet admits a
        pod as soon as its own watch shows it bound, and ours may lag (a busy API server, a broken watch
        retrying). Each pod read is taken unless the watch already brought a newer version; nothing is
        dropped (the watch's relist decides deletions). False when the API server did not answer."""
        try:
            doc = decode(self._lister(_preload_content=False, _request_timeout=TIMEOUT_S))
        except Exception as exc:  # noqa: BLE001 - the caller refuses with its own reason, as without a refresh
            log.warning("pod refresh failed", error=f"{type(exc).__name__}: {exc}")
            return False
        for pod in doc.get("items") or ():
            self.written(pod)
        self.refreshes += 1
        return True

    # -- the watch (the ``pod-watch`` thread runs :meth:`ListWatch.run`) --------------------------------
    def _before_list(self) -> None:
        if self.before_list is not None:
            self.before_list()

    def _replace(self, items: list[Mapping[str, Any]], deleted: list[Mapping[str, Any]]) -> None:
        """A list is the whole truth: pods it lacks (``deleted``) went while the watch was down."""
        with self._lock:
            self._pods = {p["metadata"]["uid"]: p for p in items}
        for pod in deleted:
            self._deleted(pod)
        if self.on_listed is not None:
            try:
                self.on_listed(items)
            except Exception:  # noqa: BLE001 - a listener's fault must not stop the watch
                log.error("pod list listener failed", exc_info=True)

    def _apply(self, kind: str, pod: Mapping[str, Any]) -> None:
        uid = (pod.get("metadata") or {}).get("uid")
        if not uid:
            return
        with self._lock:
            if kind == "DELETED":
                self._pods.pop(uid, None)
            else:
                self._pods[uid] = pod
        if kind == "DELETED":
            self._deleted(pod)

    def _deleted(self, pod: Mapping[str, Any]) -> None:
        if self.on_deleted is None:
            return
        try:
            self.on_deleted(pod)
        except Exception:  # noqa: BLE001 - a listener's fault must not stop the watch
            log.error("pod deletion listener failed", pod=(pod.get("metadata") or {}).get("name"), exc_info=True)
