"""The device plugin's two conversations with the API server, over the official ``kubernetes`` client.

1. :class:`ApiPodDirectory`: at Allocate, the pending pods bound to this node (read as raw JSON
   dicts, the form :mod:`vramshare.podspec` reads), and the ``allocation-state`` write, a merge
   patch carrying the pod's resourceVersion so it never overwrites a change it did not see.
2. :class:`InventoryPublisher`: the node annotation ``<domain>/gpu-inventory``, merge-patched only
   when it changed, from its own thread so a slow API server never delays a health event, retried
   with backoff until it lands.
"""
from __future__ import annotations

import json
import threading
from typing import Any, Mapping

from kubernetes import client
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError

from deviceplugin.allocator import Conflict, DirectoryError
from deviceplugin.handshake import PodRef
from vramshare import contract, logs

log = logs.get(__name__)

MERGE_PATCH = "application/merge-patch+json"
TIMEOUT_S = 5.0


def read_json(resp: Any) -> dict[str, Any]:
    """The body of a ``_preload_content=False`` call (the raw JSON, not the client's models)."""
    return dict(json.loads(resp.data))


def _why(exc: Exception) -> str:
    if isinstance(exc, ApiException):
        return f"HTTP {exc.status} {exc.reason}"
    return type(exc).__name__


class ApiPodDirectory:
    """:class:`deviceplugin.allocator.PodDirectory` for one node: every read is a list call."""

    cached = False

    def __init__(self, api: client.ApiClient, node: str, names: contract.Names) -> None:
        self._v1 = client.CoreV1Api(api)
        self._node = node
        self._names = names

    def pending_pods(self, fresh: bool = False) -> list[Mapping[str, Any]]:
        """Always fresh: one list call (``fresh`` is for caching directories)."""
        try:
            resp: Any = self._v1.list_pod_for_all_namespaces(
                field_selector=f"spec.nodeName={self._node},status.phase=Pending",
                _preload_content=False, _request_timeout=TIMEOUT_S)
            return list(read_json(resp).get("items") or [])
        except (ApiException, HTTPError, ValueError) as exc:
            raise DirectoryError(f"list pods on node {self._node}: {_why(exc)}") from exc

    def set_allocation_state(self, pod: PodRef, state: str) -> dict[str, Any]:
        """Patch ``allocation-state``; on a resourceVersion conflict re-read once and retry if still ours.
        Returns the patched pod."""
        rv = pod.resource_version
        for attempt in (1, 2):
            body: dict[str, Any] = {"metadata": {"annotations": {self._names.allocation_state: state}}}
            if rv:
                body["metadata"]["resourceVersion"] = rv
            try:
                resp: Any = self._v1.patch_namespaced_pod(pod.name, pod.namespace, body, _content_type=MERGE_PATCH,
                                                     _preload_content=False, _request_timeout=TIMEOUT_S)
                return read_json(resp)
            except ApiException as exc:
                if exc.status != 409 or attempt == 2:
                    raise (Conflict if exc.status == 409 else DirectoryError)(
                        f"patch pod {pod.key}: {_why(exc)}") from exc
            except (HTTPError, ValueError) as exc:
                raise DirectoryError(f"patch pod {pod.key}: {_why(exc)}") from exc
            rv = self._current_version(pod)
        raise AssertionError("unreachable")

    def _current_version(self, pod: PodRef) -> str:
        try:
            resp: Any = self._v1.read_namespaced_pod(pod.name, pod.namespace, _preload_content=False,
                                                _request_timeout=TIMEOUT_S)
            meta = read_json(resp).get("metadata") or {}
        except (ApiException, HTTPError, ValueError) as exc:
            raise DirectoryError(f"read pod {pod.key}: {_why(exc)}") from exc
        if meta.get("uid") != pod.uid or (meta.get("annotations") or {}).get(
                self._names.allocation_state) != contract.STATE_ASSUMED:
            raise Conflict(f"pod {pod.key} changed while being allocated (no longer assumed)")
        return str(meta.get("resourceVersion") or "")


class InventoryPublisher:
    """Keeps the node's inventory annotation equal to the latest :meth:`publish`ed JSON."""

    def __init__(self, api: client.ApiClient, node: str, names: contract.Names) -> None:
        self._v1 = client.CoreV1Api(api)
        self._node = node
        self._key = names.inventory
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._wanted: str | None = None
        self._written: str | None = None
        self.patches = 0

    def publish(self, inventory_json: str) -> None:
        with self._lock:
            self._wanted = inventory_json
        self._wake.set()

    def run(self, stop: threading.Event) -> None:
        """Body of the ``inventory-publisher`` thread."""
        backoff = 0.5
        while not stop.is_set():
            self._wake.wait()
            if stop.is_set():
                return
            self._wake.clear()
            with self._lock:
                wanted = self._wanted
            if wanted is None or wanted == self._written:
                continue
            try:
                self._v1.patch_node(self._node, {"metadata": {"annotations": {self._key: wanted}}},
                                    _content_type=MERGE_PATCH, _preload_content=False, _request_timeout=TIMEOUT_S)
            except (ApiException, HTTPError) as exc:
                log.warning("publish inventory failed", node=self._node, error=_why(exc), retry_in_s=backoff)
                stop.wait(backoff)
                backoff = min(backoff * 2, 30.0)
                self._wake.set()
                continue
            backoff = 0.5
            self._written = wanted
            self.patches += 1
            log.info("published inventory", node=self._node, annotation=self._key, bytes=len(wanted))

    def stop(self) -> None:
        self._wake.set()
