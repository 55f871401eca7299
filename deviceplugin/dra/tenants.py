"""The quota loop's tenants on the DRA path: the prepared claims of this node.

Each prepared claim reserved by one pod is a tenant: key (namespace, pod, ``claim-<name>``, pod UID),
its GPUs and granted MiB from the checkpoint, and, from the pod itself (one list of this node's pods
per tick, as the device-plugin path does), its vLLM metrics URL and the runtime IDs of its containers
so NVML's per-process memory is attributed to it. The loop then writes
``<quotaHostDir>/<pod-uid>/claim-<name>/quota.json``, the directory the claim's CDI spec mounts, and
floors, ceilings, rebalancing and enforcement apply unchanged.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping

from kubernetes import client

from deviceplugin.dra.checkpoint import PREPARED, PreparedClaim
from deviceplugin.dra.preparer import tenant_container
from deviceplugin.quota.classes import PodMeta
from deviceplugin.quota.kube import TIMEOUT_S, container_ids, metrics_url, pod_meta
from deviceplugin.quota.model import Tenant, TenantKey
from vramshare import contract
from vramshare.kube import decode


def tenants_from_claims(claims: Iterable[PreparedClaim], pods: Mapping[str, Mapping[str, Any]],
                        names: contract.Names | None = None) -> list[Tenant]:
    """Pure: prepared claims (+ this node's pods by UID) -> tenants; shared claims are left alone.
    The pod's metadata (labels, priorityClassName, quota-class annotation) picks its quota class."""
    names = names or contract.Names(contract.DEFAULT_DOMAIN)
    out = []
    for c in sorted(claims, key=lambda c: (c.namespace, c.name)):
        if c.state != PREPARED or len(c.pod_uids) != 1 or not c.gpus:
            continue
        uid = c.pod_uids[0]
        pod = pods.get(uid) or {}
        pod_name = c.pod_names[0] if c.pod_names else (pod.get("metadata") or {}).get("name", "")
        out.append(Tenant(key=TenantKey(c.namespace, pod_name, tenant_container(c.name), pod_uid=uid),
                          gpus=tuple(sorted(c.gpus.items())), metrics_url=metrics_url(pod) if pod else None,
                          container_ids=frozenset(container_ids(pod).values()) if pod else frozenset(),
                          meta=pod_meta(pod, names) if pod else PodMeta(c.namespace)))
    return out


class ClaimTenantSource:
    """:class:`deviceplugin.quota.loop.TenantSource` over the preparer's checkpoint."""

    def __init__(self, prepared: Callable[[], Mapping[str, PreparedClaim]], v1: client.CoreV1Api | None,
                 node: str, names: contract.Names | None = None) -> None:
        self._prepared, self._v1, self._node, self._names = prepared, v1, node, names

    def list_tenants(self) -> list[Tenant]:
        pods: dict[str, Mapping[str, Any]] = {}
        if self._v1 is not None:
            resp: Any = self._v1.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={self._node}",
                                                             _preload_content=False, _request_timeout=TIMEOUT_S)
            items = decode(resp).get("items") or []
            pods = {(p.get("metadata") or {}).get("uid", ""): p for p in items}
        return tenants_from_claims(self._prepared().values(), pods, self._names)
