"""The quota loop's tenants on the DRA path: the prepared claims of this node, with no API call per tick.

Each prepared claim reserved by one pod is a tenant: key (namespace, pod, ``claim-<name>``, pod UID),
its GPUs and granted MiB from the preparer's checkpoint (this process's own view: which claim, which
pod reserved it, which devices and MiB). What only the pod says, its vLLM metrics URL, the runtime
IDs of its containers (so NVML's per-process memory is attributed to it) and its quota-class
metadata, comes from this node's watch-fed pod cache (:class:`deviceplugin.pod_cache.NodePodCache`),
as on the kubelet path (``quota.kube.NodeTenantSource``, issue 21). The loop then writes
``<quotaHostDir>/<pod-uid>/claim-<name>/quota.json``, the directory the claim's CDI spec mounts, and
floors, ceilings, rebalancing and enforcement apply unchanged. A claim with devices here that is no
tenant (being prepared, its pod not in the cache yet, or shared) is a pending claim at its grant, so the
loop never lends it (:func:`pending_from_claims`, issue 19).
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping

from deviceplugin.dra.checkpoint import PREPARED, PreparedClaim
from deviceplugin.dra.preparer import tenant_container
from deviceplugin.quota.kube import container_ids, metrics_url, pod_meta, running_pods_by_uid
from deviceplugin.quota.model import Claim, Tenant, TenantKey
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


def pending_from_claims(claims: Iterable[PreparedClaim], tenants: Iterable[Tenant]) -> list[Claim]:
    """Pure: memory this node promised to claims that are not quota tenants (issue 19: lent memory is
    never promised twice), each at what it was granted: a claim being prepared, one whose pod the cache
    does not show yet or shows departed (its containers may run until the kubelet unprepares it), one
    several pods share. The kubelet path counts the same gap from the extender's assignment
    (``quota.kube.pending_from_pods``); here the preparer's own checkpoint says it."""
    owned = {(t.key.namespace, t.key.container) for t in tenants}
    return [Claim(f"{c.namespace}/{c.name}", tuple(sorted(c.gpus.items())), c.quota_dir)
            for c in sorted(claims, key=lambda c: (c.namespace, c.name))
            if c.gpus and (c.namespace, tenant_container(c.name)) not in owned]


class PodCacheNotSynced(RuntimeError):
    """The pod cache has not listed yet: every claim would look departed, so the tick is skipped."""


class ClaimTenantSource:
    """:class:`deviceplugin.quota.loop.TenantSource` over the preparer's checkpoint (``prepared``) and the
    node's pod cache (``pods``, ``synced``): reads no API server."""

    def __init__(self, prepared: Callable[[], Mapping[str, PreparedClaim]],
                 pods: Callable[[], Iterable[Mapping[str, Any]]], synced: Callable[[], bool],
                 names: contract.Names | None = None) -> None:
        self._prepared, self._pods, self._synced, self._names = prepared, pods, synced, names
        self._pending: list[Claim] = []

    def list_tenants(self) -> list[Tenant]:
        if not self._synced():  # the loop logs this and keeps the last quotas
            raise PodCacheNotSynced("this node's pod cache has not listed yet")
        claims = list(self._prepared().values())
        tenants = tenants_from_claims(claims, self._pods(), self._names)
        self._pending = pending_from_claims(claims, tenants)
        return tenants

    def list_pending(self) -> list[Claim]:
        """The claims of the latest :meth:`list_tenants` that are no tenant (one look serves both)."""
        return list(self._pending)
