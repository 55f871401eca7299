"""The device plugin's two writes to the API server, over the official ``kubernetes`` client.

1. :class:`PodPatcher`: the reconciler's patch of a pod's ``assignment`` and ``allocation-state``
   (what the kubelet actually handed out), a merge patch carrying the resourceVersion the plan was
   made from, so it never overwrites a change it did not see (a conflict waits for the next round).
   Nothing on the kubelet's Allocate path calls the API server.
2. :class:`InventoryPublisher`: the node annotation ``<domain>/gpu-inventory``, merge-patched only
   when it changed, from its own thread, retried with backoff until it lands (the shared
   :class:`deviceplugin.node_annotation.NodeAnnotationPublisher`).
"""
from __future__ import annotations

from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError

from deviceplugin.kubelet.reconcile import Patch
from deviceplugin.node_annotation import MERGE_PATCH, NodeAnnotationPublisher, why  # noqa: F401 - bench imports MERGE_PATCH
from vramshare import contract, logs
from vramshare.kube import decode

log = logs.get(__name__)

APPLY_PATCH = "application/apply-patch+yaml"
TIMEOUT_S = 5.0


class DirectoryError(Exception):
    """The API server did not answer or refused; the message says which call."""


class Conflict(DirectoryError):
    """The pod changed since it was read (resourceVersion mismatch)."""


class Gone(DirectoryError):
    """The pod no longer exists."""


class PodPatcher:
    """Writes a reconcile :class:`~deviceplugin.kubelet.reconcile.Patch`; returns the patched pod JSON."""

    def __init__(self, api: client.ApiClient, names: contract.Names) -> None:
        self._v1 = client.CoreV1Api(api)
        self._names = names

    def apply(self, patch: Patch) -> dict[str, Any]:
        """Server-side apply with ``force`` under the device plugin's field manager: the plugin owns both
        annotations afterwards even where someone else wrote an equal value first (a merge patch of an
        unchanged value moves no ownership), so the extender believes this report (issue 18)."""
        pod = patch.pod
        meta: dict[str, Any] = {"name": pod.name, "namespace": pod.namespace,
                                "annotations": {self._names.assignment: patch.assignment,
                                                self._names.allocation_state: patch.state}}
        if pod.resource_version:
            meta["resourceVersion"] = pod.resource_version  # a re-created pod has another: 409
        try:
            resp: Any = self._v1.patch_namespaced_pod(pod.name, pod.namespace,
                                                      {"apiVersion": "v1", "kind": "Pod", "metadata": meta},
                                                      field_manager=contract.FIELD_MANAGER_DEVICE_PLUGIN, force=True,
                                                      _content_type=APPLY_PATCH, _preload_content=False,
                                                      _request_timeout=TIMEOUT_S)
            return dict(decode(resp))
        except ApiException as exc:
            kind = {409: Conflict, 404: Gone}.get(exc.status or 0, DirectoryError)
            raise kind(f"patch pod {pod.key}: {why(exc)}") from exc
        except (HTTPError, ValueError) as exc:
            raise DirectoryError(f"patch pod {pod.key}: {why(exc)}") from exc


    def uid_of(self, namespace: str, name: str) -> str | None:
        """The UID the API server has for ``namespace/name`` now (``None``: no such pod); one GET, made
        only when the reconciler is about to tie a new allocation to a pod (PodResources names pods,
        not UIDs, and the pod cache may be behind a delete and re-create)."""
        try:
            resp: Any = self._v1.read_namespaced_pod(name, namespace, _preload_content=False,
                                                     _request_timeout=TIMEOUT_S)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise DirectoryError(f"get pod {namespace}/{name}: {why(exc)}") from exc
        except (HTTPError, ValueError) as exc:
            raise DirectoryError(f"get pod {namespace}/{name}: {why(exc)}") from exc
        return str((decode(resp).get("metadata") or {}).get("uid") or "") or None


class InventoryPublisher(NodeAnnotationPublisher):
    """Keeps the node's inventory annotation equal to the latest :meth:`publish`ed JSON."""

    def __init__(self, api: client.ApiClient, node: str, names: contract.Names) -> None:
        super().__init__(api, node, names.inventory, contract.FIELD_MANAGER_DEVICE_PLUGIN)
