"""This node's pods, kept by list + watch: what steering and the reconciler read, never an API call.

GetPreferredAllocation reads the extender's plans from here and the reconciler the pods' UIDs,
resourceVersions and annotations; neither waits on the API server, so an outage only makes the view
older (steering then falls back to best fit, the reconciler's patches wait). The reconciler's own
patches are written through, so the next round starts from the resourceVersion it produced. A watch
that ends resumes from the last resourceVersion; a ``410 Gone`` or a broken stream relists.
"""
from __future__ import annotations

import json
import threading
from typing import Any, Mapping

from kubernetes import client
from kubernetes.watch.watch import iter_resp_lines

from deviceplugin.kube_adapter import TIMEOUT_S, read_json
from vramshare import contract, logs
from vramshare.retry import Backoff

log = logs.get(__name__)

GONE = 410


def _rv(pod: Mapping[str, Any]) -> int:
    """resourceVersion as a number for ordering our own writes against watch events (0 if opaque)."""
    try:
        return int((pod.get("metadata") or {}).get("resourceVersion") or 0)
    except ValueError:
        return 0


class _Gone(Exception):
    pass


class NodePodCache:
    """:class:`deviceplugin.allocator.PodSource` over a watch of the pods bound to one node."""

    def __init__(self, api: client.ApiClient, node: str, names: contract.Names, watch_timeout_s: int = 300) -> None:
        self._v1 = client.CoreV1Api(api)
        self._selector = f"spec.nodeName={node}"
        self._watch_timeout = watch_timeout_s
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._pods: dict[str, Mapping[str, Any]] = {}  # uid -> pod JSON
        self._open: Any = None
        self.synced = threading.Event()

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

    # -- the watch thread ----------------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        """Body of the ``pod-watch`` thread: list, then watch, until ``stop``."""
        rv: str | None = None
        delay = Backoff(0.2, 5.0)
        while not stop.is_set():
            try:
                if rv is None:
                    rv = self._relist()
                rv = self._watch(rv)
                delay.reset()
            except Exception as exc:  # noqa: BLE001 - 410, a broken stream or an outage: relist
                if stop.is_set():
                    return
                log.warning("pod watch broken, relisting", error=f"{type(exc).__name__}: {exc}")
                rv = None
                if not isinstance(exc, _Gone):
                    stop.wait(delay.next())

    def stop(self) -> None:
        self._stopping.set()  # a watch opened after this line sees it and ends at once
        resp = self._open
        if resp is not None:
            try:
                resp.shutdown()
            except Exception:  # noqa: BLE001 - already closed
                pass

    def _relist(self) -> str:
        resp: Any = self._v1.list_pod_for_all_namespaces(field_selector=self._selector, _preload_content=False,
                                                         _request_timeout=TIMEOUT_S)
        data = read_json(resp)
        with self._lock:
            self._pods = {p["metadata"]["uid"]: p for p in data.get("items") or []}
        self.synced.set()
        return str((data.get("metadata") or {}).get("resourceVersion", ""))

    def _watch(self, rv: str) -> str:
        resp: Any = self._v1.list_pod_for_all_namespaces(
            field_selector=self._selector, watch=True, resource_version=rv, allow_watch_bookmarks=True,
            timeout_seconds=self._watch_timeout, _preload_content=False,
            _request_timeout=(TIMEOUT_S, self._watch_timeout + TIMEOUT_S))
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
                        raise _Gone(obj.get("message", ""))
                    raise RuntimeError(f"watch error {obj.get('code')}: {obj.get('message', '')}")
                rv = str((obj.get("metadata") or {}).get("resourceVersion", rv))
                if kind != "BOOKMARK":
                    self._apply(str(kind), obj)
        finally:
            self._open = None
            resp.close()
            resp.release_conn()
        return rv

    def _apply(self, kind: str, pod: Mapping[str, Any]) -> None:
        uid = (pod.get("metadata") or {}).get("uid")
        if not uid:
            return
        with self._lock:
            if kind == "DELETED":
                self._pods.pop(uid, None)
            else:
                self._pods[uid] = pod
