"""The extender's only door to the API server: list+watch, get, patch and bind, as plain JSON dicts.

We go through the official ``kubernetes`` client (auth, TLS, in-cluster config) but ask it for the raw
response (``_preload_content=False``, decoded by :func:`vramshare.kube.decode`): the cache needs plain
dicts anyway (the placement core and ``podspec`` read Kubernetes JSON), and building model objects for
thousands of nodes and pods would cost far more than the scheduling itself. Lists and watches are
:class:`vramshare.watch.ListWatch`'s (:meth:`Kube.list_watch`). Errors stay the client's
``ApiException`` with ``.status`` (409 conflict, 410 gone, 404 not found) for callers to branch on.
"""
from __future__ import annotations

from typing import Any, Callable

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from vramshare import contract
from vramshare.kube import decode
from vramshare.watch import ListWatch

__all__ = ["ApiException", "Kube", "GONE", "CONFLICT", "NOT_FOUND"]

Obj = dict[str, Any]
GONE, CONFLICT, NOT_FOUND = 410, 409, 404
MERGE_PATCH = "application/merge-patch+json"


def _read(resp: Any) -> Obj:
    return decode(resp)  # type: ignore[no-any-return]


class Kube:
    """Thin, typed wrapper over ``CoreV1Api`` returning dicts; one per extender process."""

    def __init__(self, api: client.ApiClient, request_timeout: float = 10.0) -> None:
        self.core = client.CoreV1Api(api)
        # resource.k8s.io/v1 (DRA) exists in clients >= 34 only; the project allows older ones
        self.resource = client.ResourceV1Api(api) if hasattr(client, "ResourceV1Api") else None
        self.timeout = request_timeout

    # -- list + watch (the cache, the DRA watch) --------------------------------------------
    def _lister(self, plural: str) -> Callable[..., Any]:
        """The list call of ``plural`` (all namespaces), raw: no model class is ever built (their names
        change between client versions: 37.x calls ResourceClaim ``ResourceV1ResourceClaim``), so no
        version breaks it. With ``watch=True`` the same call watches."""
        if plural == "nodes":
            return lambda **kw: self.core.list_node(**kw)
        if plural == "pods":
            return lambda **kw: self.core.list_pod_for_all_namespaces(**kw)
        if plural in ("resourceslices", "resourceclaims"):
            if self.resource is None:
                def missing(**kw: Any) -> Any:
                    raise ApiException(status=NOT_FOUND, reason="this kubernetes client has no resource.k8s.io/v1")
                return missing
            if plural == "resourceslices":
                return lambda **kw: self.resource.list_resource_slice(**kw)  # type: ignore[union-attr]
            return lambda **kw: self.resource.list_resource_claim_for_all_namespaces(**kw)  # type: ignore[union-attr]
        raise ValueError(f"no list call for {plural!r}")

    def list_watch(self, plural: str, **options: Any) -> ListWatch:
        """A :class:`vramshare.watch.ListWatch` of ``nodes``, ``pods``, ``resourceslices`` or
        ``resourceclaims`` (``options``: its handlers, timeouts and backoff)."""
        options.setdefault("request_timeout_s", self.timeout)
        return ListWatch(f"{plural} watch", self._lister(plural), **options)

    # -- the binder ---------------------------------------------------------------------------
    def get_pod(self, namespace: str, name: str) -> Obj:
        return _read(self.core.read_namespaced_pod(name, namespace, _preload_content=False,
                                                   _request_timeout=self.timeout))

    def patch_pod_annotations(self, namespace: str, name: str, resource_version: str,
                              annotations: dict[str, str]) -> Obj:
        """Merge-patch annotations, guarded by ``resourceVersion`` (409 when the pod changed meanwhile)."""
        body = {"metadata": {"resourceVersion": resource_version, "annotations": annotations}}
        return _read(self.core.patch_namespaced_pod(name, namespace, body, _content_type=MERGE_PATCH,
                                                    field_manager=contract.FIELD_MANAGER_EXTENDER,
                                                    _preload_content=False, _request_timeout=self.timeout))

    def bind_pod(self, namespace: str, name: str, uid: str, node: str) -> None:
        """POST ``pods/<name>/binding``: what makes the kubelet of ``node`` run the pod."""
        meta: Obj = {"name": name, "namespace": namespace}
        if uid:
            meta["uid"] = uid
        body = {"apiVersion": "v1", "kind": "Binding", "metadata": meta,
                "target": {"apiVersion": "v1", "kind": "Node", "name": node}}
        resp = self.core.create_namespaced_pod_binding(name, namespace, body,  # type: ignore[arg-type]
                                                       _preload_content=False,
                                                       _request_timeout=self.timeout)
        _read(resp)  # drain the Status body, or the pooled connection would start with it
