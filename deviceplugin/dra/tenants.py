"""The quota loop's tenants on the DRA path: the prepared claims of this node, with no API call per tick.

Each prepared claim reserved by one pod is a tenant: key (namespace, pod, ``claim-<name>``, pod UID),
its GPUs and granted MiB from the preparer's checkpoint (this process's own view: which claim, which
pod reserved it, which devices and MiB). What only the pod says, its vLLM metrics URL, the runtime
IDs of its containers (so NVML's per-process memory is attributed to it) and its quota-class
metadata, comes from this node's watch-fed pod cache (:class:`deviceplugin.pod_cache.NodePodCache`),
as on the kubelet path (``quota.kube.NodeTenantSource``, issue 21). The loop then writes
``<quotaHostDir>/<pod-uid>/claim-<name>/quota.json``, the directory the claim's CDI spec mounts, and
floors, ceilings, rebalancing and enforcement apply unchanged.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping

from deviceplugin.dra.checkpoint import PREPARED, PreparedClaim
from deviceplugin.dra.preparer import tenant_container
from deviceplugin.quota.kube import container_ids, metrics_url, pod_meta, running_pods_by_uid
from deviceplugin.quota.model import Tenant, TenantKey
from vramshare import contract


def tenants_from_claims(claims: Iterable[PreparedClaim], pods: Iterable[Mapping[str, Any]],
                        names: contract.Names | None = None) -> list[Tenant]:
    """Pure: prepared claims joined with this node's pods (by UID) -> tenants. A claim shared by several
    pods is left alone; a claim whose pod is gone from the pods (deleted) or done has departed and is no
    tenant, even while the kubelet has not unprepared it yet. The pod's metadata (labels,
    priorityClassName, quota-class annotation) picks its quota class."""
    names = names or contract.Names(contract.DEFAULT_DOMAIN)
    running = running_pods_by_uid(pods)
    out = []
    for c in sorted(claims, key=lambda c: (c.namespace, c.name)):
        if c.state != PREPARED or len(c.pod_uids) != 1 or not c.gpus:
            continue
        uid = c.pod_uids[0]
        pod = running.get(uid)
        if pod is None:
            continue
        pod_name = c.pod_names[0] if c.pod_names else str((pod.get("metadata") or {}).get("name") or "")
        out.append(Tenant(key=TenantKey(c.namespace, pod_name, tenant_container(c.name), pod_uid=uid),
                          gpus=tuple(sorted(c.gpus.items())), metrics_url=metrics_url(pod),
                          container_ids=frozenset(container_ids(pod).values()), meta=pod_meta(pod, names)))
    return out


class PodCacheNotSynced(RuntimeError):
    """The pod cache has not listed yet: every claim would look departed, so the tick is skipped."""


class ClaimTenantSource:
    """:class:`deviceplugin.quota.loop.TenantSource` over the preparer's checkpoint (``prepared``) and the
    node's pod cache (``pods``, ``synced``): reads no API server."""

    def __init__(self, prepared: Callable[[], Mapping[str, PreparedClaim]],
                 pods: Callable[[], Iterable[Mapping[str, Any]]], synced: Callable[[], bool],
                 names: contract.Names | None = None) -> None:
        self._prepared, self._pods, self._synced, self._names = prepared, pods, synced, names

    def list_tenants(self) -> list[Tenant]:
        if not self._synced():  # the loop logs this and keeps the last quotas
            raise PodCacheNotSynced("this node's pod cache has not listed yet")
        return tenants_from_claims(self._prepared().values(), self._pods(), self._names)
