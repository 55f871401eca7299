"""The quota loop's Kubernetes adapters: who the tenants are, and the quota annotation mirror.

Tenants are the containers the device plugin's reconciler found holding their devices, read in-process
(:class:`NodeTenantSource`; issue 21: the tick makes no API call): which GPUs and how many MiB each
holds. The pods themselves come from the node's watch-fed pod cache, for what only a pod says; pods
bound here with an assignment vramshare wrote that are not tenants yet are pending claims (parsed by
the contract's one codec, :mod:`vramshare.contract.assignment`). A pod's vLLM metrics endpoint is found the usual way, from ``prometheus.io/port`` (and optional
``prometheus.io/path``, ``prometheus.io/scheme``) plus the pod IP. The mirror writes
``<domain>/quota-mib`` = ``{container: [{"uuid", "mib"}]}`` (the assignment's shape, with the current
limits and each container's warmth) so ``kubectl`` shows what each container may use now; the
file stays the contract. ``ApiOverLimitActor`` reports (event + ``<domain>/over-limit``) or evicts a
container that stayed above its limit where nothing fences.
"""
from __future__ import annotations

import datetime
import json
from typing import AbstractSet, Any, Callable, Iterable, Mapping, Protocol

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from deviceplugin.quota.classes import PodMeta
from deviceplugin.quota.model import Claim, Tenant, TenantKey
from deviceplugin.quota.overlimit import Breach
from vramshare import contract, logs, managed
from vramshare.contract import assignment, over_limit, quota_mib
from vramshare.contract.assignment import AssignmentError
from vramshare.config import OverLimitAction

log = logs.get("vramshare.quota.kube")
MERGE_PATCH = "application/merge-patch+json"
TIMEOUT_S = 5.0
DONE_PHASES = {"Succeeded", "Failed"}


def metrics_url(pod: Mapping[str, Any]) -> str | None:
    ann = (pod.get("metadata") or {}).get("annotations") or {}
    port, ip = ann.get("prometheus.io/port"), (pod.get("status") or {}).get("podIP")
    if not port or not ip or ann.get("prometheus.io/scrape", "true") == "false":
        return None
    path = ann.get("prometheus.io/path", "/metrics")
    return f"{ann.get('prometheus.io/scheme', 'http')}://{ip}:{port}/{path.lstrip('/')}"


def container_ids(pod: Mapping[str, Any]) -> dict[str, str]:
    """Container name -> runtime ID without its scheme (``containerd://abc`` -> ``abc``), init containers
    (sidecars among them) too: the kubelet reports those in ``initContainerStatuses`` (``kubelet_pods.go``
    ``generateAPIPodStatus``, from ``pod.Spec.InitContainers``), and a sidecar naming a DRA claim holds
    its devices beside the app."""
    out = {}
    status = pod.get("status") or {}
    for st in (status.get("initContainerStatuses") or []) + (status.get("containerStatuses") or []):
        cid = st.get("containerID") or ""
        if st.get("name") and cid:
            out[st["name"]] = cid.split("://", 1)[-1]
    return out


def pod_meta(pod: Mapping[str, Any], names: contract.Names) -> PodMeta:
    """What quota-class selection reads from a pod: namespace, labels, priorityClassName and the
    ``<domain>/quota-class`` annotation; and its ``<domain>/model`` (the resident model when the engine
    names none that parses)."""
    meta = pod.get("metadata") or {}
    labels = {str(k): str(v) for k, v in (meta.get("labels") or {}).items()}
    annotations = meta.get("annotations") or {}
    return PodMeta.of(meta.get("namespace", ""), labels, (pod.get("spec") or {}).get("priorityClassName"),
                      annotations.get(names.quota_class), annotations.get(names.model))


def _believed_assignment(pod: Mapping[str, Any], names: contract.Names) -> bool:
    """Whether vramshare wrote the pod's ``assignment`` (managedFields: the extender at bind, the device
    plugin's reconciler after admission): the issue-18 trust rule the extender applies
    (``extender/accounting.py _distrust``). Anyone else's (``kubectl annotate``) reserves nothing."""
    owners = managed.annotation_owners(pod, (names.assignment,))[names.assignment]
    return bool(owners & {contract.FIELD_MANAGER_DEVICE_PLUGIN, contract.FIELD_MANAGER_EXTENDER})


def pending_from_pods(pods: Iterable[Mapping[str, Any]], names: contract.Names,
                      tenants: AbstractSet[str] = frozenset(), said: set[str] | None = None) -> list[Claim]:
    """Containers promised memory here that are not tenants yet (issue 19): pods bound to the node
    (the cache holds this node's pods only) with an assignment vramshare wrote, whose UID is not in
    ``tenants``; the extender counted them at their request when it bound them, so the quota loop
    does too. ``allocation-state`` is not read at all: who holds its devices is the reconciler's
    in-process view (a forged ``allocated`` neither makes a tenant nor hides a claim). A refusal is
    logged once per pod UID in ``said`` (every time without it)."""
    out: list[Claim] = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        text = (meta.get("annotations") or {}).get(names.assignment)
        if not text or meta.get("uid", "") in tenants or (pod.get("status") or {}).get("phase") in DONE_PHASES:
            continue
        where = f"{meta.get('namespace', '')}/{meta.get('name', '')}"
        if not _believed_assignment(pod, names):
            if said is None or meta.get("uid", "") not in said:
                log.warning("pending pod's assignment not written by vramshare (managedFields), not counted",
                            pod=where)
                if said is not None:
                    said.add(meta.get("uid", ""))
            continue
        try:
            for c, gpus in sorted(assignment.parse(text).items()):
                out.append(Claim(f"{where}/{c}", tuple((g.uuid, g.mib) for g in gpus)))
        except AssignmentError as exc:
            log.warning("pending pod's assignment unreadable, not counted", pod=where, error=str(exc))
    return out


class HeldContainer(Protocol):
    """What the reconciler's view says of one container (``deviceplugin.kubelet.reconcile.Holding``)."""

    @property
    def owner(self) -> Any: ...  # uid, namespace, pod, container

    @property
    def gpus(self) -> tuple[Any, ...]: ...  # (uuid, mib) as ``AssignedGpu``


def running_pods_by_uid(pods: Iterable[Mapping[str, Any]]) -> dict[str, Mapping[str, Any]]:
    """The pods that can still hold a tenant, by UID: a holding or claim whose pod is missing here
    (deleted) or done has departed, whatever PodResources or the checkpoint still say."""
    return {str((p.get("metadata") or {}).get("uid") or ""): p for p in pods
            if (p.get("status") or {}).get("phase") not in DONE_PHASES}


def tenants_from_holdings(holdings: Iterable[HeldContainer], pods: Iterable[Mapping[str, Any]],
                          names: contract.Names) -> list[Tenant]:
    """Pure: the containers the reconciler found holding their devices, joined with their pods (by UID)
    for what only the pod says: metrics URL, runtime IDs, quota-class metadata. A container whose pod is
    gone from the cache (deleted) or done is no tenant: it departed, even while PodResources lists it."""
    running = running_pods_by_uid(pods)
    out: list[Tenant] = []
    for h in holdings:
        o = h.owner
        pod = running.get(o.uid)
        if pod is None:
            continue
        cids = container_ids(pod)
        out.append(Tenant(key=TenantKey(o.namespace, o.pod, o.container, pod_uid=o.uid),
                          gpus=tuple((g.uuid, g.mib) for g in h.gpus), metrics_url=metrics_url(pod),
                          container_ids=frozenset([cids[o.container]]) if o.container in cids else frozenset(),
                          meta=pod_meta(pod, names)))
    return out


class NodeTenantSource:
    """:class:`loop.TenantSource` of the node agent, with no API call in a tick (issue 21): tenants are
    the device plugin's reconciler view (``Reconciler.holdings``, in-process), the pods' metadata comes
    from the node's watch-fed pod cache (``NodePodCache.pods``), and so do the pending claims."""

    def __init__(self, holdings: Callable[[], Iterable[HeldContainer]],
                 pods: Callable[[], Iterable[Mapping[str, Any]]], names: contract.Names) -> None:
        self._holdings, self._pods, self._names = holdings, pods, names
        self._pending: list[Claim] = []
        self._said: set[str] = set()  # pods whose untrusted assignment was logged

    def list_tenants(self) -> list[Tenant]:
        pods = list(self._pods())
        tenants = tenants_from_holdings(self._holdings(), pods, self._names)
        self._pending = pending_from_pods(pods, self._names, {t.key.pod_uid for t in tenants}, self._said)
        self._said &= {str((p.get("metadata") or {}).get("uid") or "") for p in pods}
        return tenants

    def list_pending(self) -> list[Claim]:
        """The pending claims of the latest :meth:`list_tenants` (one look at the cache serves both)."""
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


HINT_IGNORED = "VramshareHintIgnored"  # the event reason of an ignored hint annotation (model, quota-class)


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

    def hint_ignored(self, key: TenantKey, annotation: str, why: str) -> None:
        """:class:`loop.HintReporter`: a Warning event ``VramshareHintIgnored`` on the pod, where its owner
        looks (``kubectl describe pod``), naming the annotation and why nothing uses it."""
        self._event(key, HINT_IGNORED, f"annotation {self._names.domain}/{annotation} ignored: {why}")

    def _event(self, key: TenantKey, reason: str, message: str) -> None:
        now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        body = {"apiVersion": "v1", "kind": "Event", "type": "Warning", "reason": reason, "message": message,
                "metadata": {"generateName": f"{key.pod}.", "namespace": key.namespace},
                "involvedObject": {"kind": "Pod", "name": key.pod, "namespace": key.namespace, "uid": key.pod_uid,
                                   "apiVersion": "v1"},
                "source": {"component": "vramshare-quota", "host": self._node},
                "firstTimestamp": now, "lastTimestamp": now, "count": 1}
        self._v1.create_namespaced_event(key.namespace, body, _preload_content=False, _request_timeout=TIMEOUT_S)
