"""One node annotation of ours kept equal to the latest value asked for: merge-patched only when it
changed, from its own thread so a slow API server never delays a health event or an engine's wake,
retried with backoff until it lands. The device plugin keeps ``<domain>/gpu-inventory`` with it
(``deviceplugin.kubelet.kube_adapter.InventoryPublisher``), the DRA plugin ``<domain>/resident-models``
(issue 23): each writes only its own key, under its own field manager."""
from __future__ import annotations

import threading

from kubernetes import client
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError

from vramshare import logs
from vramshare.kube import decode
from vramshare.retry import Backoff

log = logs.get(__name__)

MERGE_PATCH = "application/merge-patch+json"
TIMEOUT_S = 5.0
REMOVED = None  # what :meth:`NodeAnnotationPublisher.remove` asks for: the key gone (a merge patch's null)
_NOTHING = object()  # nothing asked yet


def why(exc: Exception) -> str:
    if isinstance(exc, ApiException):
        return f"HTTP {exc.status} {exc.reason}"
    return type(exc).__name__


class NodeAnnotationPublisher:
    """Keeps the node's annotation ``key`` equal to the latest :meth:`publish`ed text."""

    def __init__(self, api: client.ApiClient, node: str, key: str, field_manager: str) -> None:
        self._v1 = client.CoreV1Api(api)
        self._node = node
        self._key = key
        self._field_manager = field_manager
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._wanted: object = _NOTHING
        self._written: object = _NOTHING
        self.patches = 0

    def publish(self, text: str) -> None:
        with self._lock:
            self._wanted = text
        self._wake.set()

    def remove(self) -> None:
        """Take the key off the node (what an earlier run wrote, now that this run reports nothing)."""
        with self._lock:
            self._wanted = REMOVED
        self._wake.set()

    def run(self, stop: threading.Event) -> None:
        """Body of the publishing thread."""
        backoff = Backoff(0.5, 30.0)
        while not stop.is_set():
            self._wake.wait()
            if stop.is_set():
                return
            self._wake.clear()
            with self._lock:
                wanted = self._wanted
            if wanted is _NOTHING or wanted == self._written:
                continue
            try:
                decode(self._v1.patch_node(self._node, {"metadata": {"annotations": {self._key: wanted}}},
                                           field_manager=self._field_manager,
                                           _content_type=MERGE_PATCH, _preload_content=False,
                                           _request_timeout=TIMEOUT_S))
            except (ApiException, HTTPError) as exc:
                wait = backoff.next()
                log.warning("publish node annotation failed", node=self._node, annotation=self._key,
                            error=why(exc), retry_in_s=round(wait, 2))
                stop.wait(wait)
                self._wake.set()
                continue
            backoff.reset()
            self._written = wanted
            self.patches += 1
            log.info("published node annotation" if wanted is not REMOVED else "removed node annotation",
                     node=self._node, annotation=self._key, bytes=len(wanted) if isinstance(wanted, str) else 0)

    def current(self) -> str | None:
        """The annotation's value on the node now (one GET), what an earlier run left; ``None`` when
        absent or when the API server did not answer (logged)."""
        try:
            node = decode(self._v1.read_node(self._node, _preload_content=False, _request_timeout=TIMEOUT_S))
        except (ApiException, HTTPError, ValueError) as exc:
            log.warning("read node annotation failed", node=self._node, annotation=self._key,
                        error=why(exc) if not isinstance(exc, ValueError) else str(exc))
            return None
        value = ((node.get("metadata") or {}).get("annotations") or {}).get(self._key)
        return value if isinstance(value, str) else None

    def stop(self) -> None:
        self._wake.set()
