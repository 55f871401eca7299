"""The quota loop's two Kubernetes adapters: who the tenants are, and the quota annotation mirror.

Tenants come from the pods on this node that the device plugin marked ``allocation-state:
allocated``: their ``<domain>/assignment`` says which GPUs and how many MiB each container was given
(parsed by the contract's one codec, :mod:`vramshare.contract.assignment`).
A pod's vLLM metrics endpoint is found the usual way, from ``prometheus.io/port`` (and optional
``prometheus.io/path``, ``prometheus.io/scheme``) plus the pod IP. The mirror writes
``<domain>/quota-mib`` = ``{container: [{"uuid", "mib"}]}`` (the assignment's shape, with the current
limits and each container's warmth) so ``kubectl`` shows what each container may use now; the
file stays the contract. ``ApiOverLimitActor`` reports (event + ``<domain>/over-limit``) or evicts a
container that stayed above its limit where nothing fences.
"""
from __future__ import annotations

import datetime
import json
from typing import Any, Iterable, Mapping

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from deviceplugin.quota.classes import PodMeta
from deviceplugin.quota.model import Claim, Tenant, TenantKey
from deviceplugin.quota.overlimit import Breach
from vramshare import contract, logs
from vramshare.contract import assignment, over_limit, quota_mib
from vramshare.contract.assignment import AssignmentError
from vramshare.config import OverLimitAction

log = logs.get("vramshare.quota.kube")
MERGE_PATCH = "application/merge-patch+json"
TIMEOUT_S = 5.0
_DONE_PHASES = {"Succeeded", "Failed"}


def _metrics_url(pod: Mapping[str, Any]) -> str | None:
    ann = (pod.get("metadata") or {}).get("annotations") or {}
    port, ip = ann.get("prometheus.io/port"), (pod.get("status") or {}).get("podIP")
    if not port or not ip or ann.get("prometheus.io/scrape", "true") == "false":
        return None
    path = ann.get("prometheus.io/path", "/metrics")
    return f"{ann.get('prometheus.io/scheme', 'http')}://{ip}:{port}/{path.lstrip('/')}"


def _container_ids(pod: Mapping[str, Any]) -> dict[str, str]:
    """Container name -> runtime ID without its scheme (``containerd://abc`` -> ``abc``)."""
    out = {}
    for st in (pod.get("status") or {}).get("containerStatuses") or []:
        cid = st.get("containerID") or ""
        if st.get("name") and cid:
            out[st["name"]] = cid.split("://", 1)[-1]
    return out


def pod_meta(pod: Mapping[str, Any], names: contract.Names) -> PodMeta:
    """What quota-class selection reads from a pod: namespace, labels, priorityClassName and the
    ``<domain>/quota-class`` annotation."""
    meta = pod.get("metadata") or {}
    labels = {str(k): str(v) for k, v in (meta.get("labels") or {}).items()}
    return PodMeta.of(meta.get("namespace", ""), labels, (pod.get("spec") or {}).get("priorityClassName"),
                      (meta.get("annotations") or {}).get(names.quota_class))


def tenants_from_pods(pods: Iterable[Mapping[str, Any]], names: contract.Names) -> list[Tenant]:
    """Every container holding our memory, from raw pod JSON. A pod with a bad assignment is logged
    and skipped (its quotas stay as they are), never a reason to drop the other pods."""
    out: list[Tenant] = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        ann = meta.get("annotations") or {}
        if ann.get(names.allocation_state) != contract.STATE_ALLOCATED:
            continue
        if (pod.get("status") or {}).get("phase") in _DONE_PHASES:
            continue
        ns, name, uid = meta.get("namespace", ""), meta.get("name", ""), meta.get("uid", "")
        text = ann.get(names.assignment)
        try:
            assigned = dict(sorted(assignment.parse(text).items())) if text else {}
        except AssignmentError as exc:
            log.warning("pod assignment unreadable, its quotas are left alone", pod=f"{ns}/{name}", error=str(exc))
            continue
        url, cids, meta = _metrics_url(pod), _container_ids(pod), pod_meta(pod, names)
        for c, gpus in assigned.items():
            out.append(Tenant(key=TenantKey(ns, name, c, pod_uid=uid),
                              gpus=tuple((g.uuid, g.mib) for g in gpus), metrics_url=url,
                              container_ids=frozenset([cids[c]]) if c in cids else frozenset(), meta=meta))
    return out


def pending_from_pods(pods: Iterable[Mapping[str, Any]], names: contract.Names) -> list[Claim]:
    """Containers promised memory here that are not tenants yet (issue 19): pods bound to the node
    (the listing is by ``spec.nodeName``) with an assignment but not reported ``allocated``; the
    extender counted them at their request when it bound them, so the quota loop does too."""
    out: list[Claim] = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        ann = meta.get("annotations") or {}
        text = ann.get(names.assignment)
        if not text or ann.get(names.allocation_state) == contract.STATE_ALLOCATED:
            continue
        if (pod.get("status") or {}).get("phase") in _DONE_PHASES:
            continue
        where = f"{meta.get('namespace', '')}/{meta.get('name', '')}"
        try:
            for c, gpus in sorted(assignment.parse(text).items()):
                out.append(Claim(f"{where}/{c}", tuple((g.uuid, g.mib) for g in gpus)))
        except AssignmentError as exc:
            log.warning("pending pod's assignment unreadable, not counted", pod=where, error=str(exc))
    return out


class ApiTenantSource:
    """:class:`loop.TenantSource` over the API server: the pods bound to one node."""

    def __init__(self, v1: client.CoreV1Api, node: str, names: contract.Names) -> None:
        self._v1, self._node, self._names = v1, node, names
        self._pending: list[Claim] = []

    def list_tenants(self) -> list[Tenant]:
        # raw JSON (no model objects): the pod dicts are what the device plugin's parsers read
        resp: Any = self._v1.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={self._node}",
                                                         _preload_content=False, _request_timeout=TIMEOUT_S)
        pods = json.loads(resp.data).get("items") or []
        self._pending = pending_from_pods(pods, self._names)
        return tenants_from_pods(pods, self._names)

    def list_pending(self) -> list[Claim]:
        """The pending claims of the latest :meth:`list_tenants` (one listing serves both)."""
        return list(self._pending)


class ApiQuotaMirror:
    """:class:`loop.QuotaMirror`: merge-patches ``<domain>/quota-mib`` on the pod."""

    def __init__(self, v1: client.CoreV1Api, names: contract.Names) -> None:
        self._v1, self._names = v1, names

    def mirror(self, key: TenantKey, quotas: Mapping[str, Mapping[str, int]],
               states: Mapping[str, str] | None = None,
               details: Mapping[str, Mapping[str, Mapping[str, object]]] | None = None) -> None:
        value = quota_mib.encode(quotas, states, details)
        body = {"metadata": {"annotations": {self._names.quota_mib: value}}}
        try:
            self._v1.patch_namespaced_pod(key.pod, key.namespace, body, _content_type=MERGE_PATCH,
                                          _preload_content=False, _request_timeout=TIMEOUT_S)
        except ApiException as exc:
            if exc.status == 404:  # the pod went away between the listing and now: nothing to mirror
                log.info("pod vanished, quota not mirrored", pod=f"{key.namespace}/{key.pod}")
                return
            raise


class ApiOverLimitActor:
    """:class:`loop.OverLimitActor`: a Warning event and the ``<domain>/over-limit`` annotation on the
    pod, and with ``evict`` an eviction through the Eviction API (so PodDisruptionBudgets hold).
    Only ever called for a container the loop measured above its limit past the grace period."""

    def __init__(self, v1: client.CoreV1Api, names: contract.Names, node: str) -> None:
        self._v1, self._names, self._node = v1, names, node

    def act(self, breach: Breach, action: OverLimitAction) -> None:
        key = breach.key
        note = breach.message() + (": evicting the pod" if action is OverLimitAction.EVICT else "")
        value = over_limit.encode(over_limit.OverLimit(key.container, breach.gpu_uuid, breach.used_mib,
                                                       breach.limit_mib, round(breach.seconds)))
        try:
            self._v1.patch_namespaced_pod(key.pod, key.namespace,
                                          {"metadata": {"annotations": {self._names.over_limit: value}}},
                                          field_manager=contract.FIELD_MANAGER_DEVICE_PLUGIN, _content_type=MERGE_PATCH,
                                          _preload_content=False, _request_timeout=TIMEOUT_S)
        except ApiException as exc:
            if exc.status == 404:
                log.info("pod vanished before the over-limit report", pod=f"{key.namespace}/{key.pod}")
                return
            raise
        self._event(key, "GpuMemoryOverLimit", note)
        if action is OverLimitAction.EVICT:
            body = {"apiVersion": "policy/v1", "kind": "Eviction",
                    "metadata": {"name": key.pod, "namespace": key.namespace},
                    "deleteOptions": {"preconditions": {"uid": key.pod_uid}} if key.pod_uid else {}}
            self._v1.create_namespaced_pod_eviction(key.pod, key.namespace, body, _preload_content=False,
                                                    _request_timeout=TIMEOUT_S)
            log.warning("pod evicted: GPU memory above its limit", pod=f"{key.namespace}/{key.pod}",
                        container=key.container, gpu=breach.gpu_uuid, used_mib=breach.used_mib,
                        limit_mib=breach.limit_mib)

    def _event(self, key: TenantKey, reason: str, message: str) -> None:
        now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        body = {"apiVersion": "v1", "kind": "Event", "type": "Warning", "reason": reason, "message": message,
                "metadata": {"generateName": f"{key.pod}.", "namespace": key.namespace},
                "involvedObject": {"kind": "Pod", "name": key.pod, "namespace": key.namespace, "uid": key.pod_uid,
                                   "apiVersion": "v1"},
                "source": {"component": "vramshare-quota", "host": self._node},
                "firstTimestamp": now, "lastTimestamp": now, "count": 1}
        self._v1.create_namespaced_event(key.namespace, body, _preload_content=False, _request_timeout=TIMEOUT_S)
