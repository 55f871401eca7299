"""Tenants from the reconciler's view and the pod cache, and the quota annotation mirror against a recording CoreV1Api double."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from kubernetes.client.exceptions import ApiException

from deviceplugin.assignment import AssignedGpu
from deviceplugin.kubelet.reconcile import Holding, Owner
from deviceplugin.quota.kube import ApiQuotaMirror, NodeTenantSource, tenants_from_holdings
from deviceplugin.quota.model import Claim, Tenant, TenantKey
from tests.extender.builders import managed_entry
from vramshare import contract

NAMES = contract.Names()


def pod(name, state="allocated", assignment=None, phase="Running", managed=(), **ann):
    annotations = {NAMES.allocation_state: state, **ann}
    if assignment is not None:
        annotations[NAMES.assignment] = assignment if isinstance(assignment, str) else json.dumps(assignment)
    return {"metadata": {"name": name, "namespace": "llm", "uid": f"uid-{name}", "annotations": annotations,
                         "managedFields": list(managed)},
            "status": {"phase": phase, "podIP": "10.1.2.3",
                       "containerStatuses": [{"name": "vllm", "containerID": "containerd://" + "c" * 64}]}}


def holding(name, container, *gpus):
    return Holding(Owner(f"uid-{name}", "llm", name, container), tuple(AssignedGpu(u, m) for u, m in gpus))


def test_tenants_are_the_reconcilers_holdings_joined_with_their_pods():
    """Issue 21: who holds what is the reconciler's in-process view; the pod (from the cache) says only
    what the pod alone knows. A holding whose pod is done or gone from the cache departed."""
    pods = [pod("chat", assignment={"vllm": [{"uuid": "GPU-0", "mib": 1}]}, **{"prometheus.io/port": "8000"}),
            pod("finished", phase="Succeeded"),
            pod("plain", **{"prometheus.io/port": "9", "prometheus.io/scrape": "false"})]
    held = [holding("chat", "sidecar", ("GPU-0", 1024)), holding("chat", "vllm", ("GPU-0", 20480), ("GPU-1", 20480)),
            holding("finished", "vllm", ("GPU-0", 1024)), holding("deleted", "vllm", ("GPU-0", 1024)),
            holding("plain", "vllm", ("GPU-1", 8192))]
    got = tenants_from_holdings(held, pods, NAMES)
    assert got == [  # the annotation's "mib": 1 is not read: the reconciler's view says 20480
        Tenant(TenantKey("llm", "chat", "sidecar", "uid-chat"), (("GPU-0", 1024),), "http://10.1.2.3:8000/metrics"),
        Tenant(TenantKey("llm", "chat", "vllm", "uid-chat"), (("GPU-0", 20480), ("GPU-1", 20480)),
               "http://10.1.2.3:8000/metrics", frozenset({"c" * 64})),
        Tenant(TenantKey("llm", "plain", "vllm", "uid-plain"), (("GPU-1", 8192),), None, frozenset({"c" * 64})),
    ]


def test_node_tenant_source_reads_no_api_and_counts_the_others_as_pending():
    ours = [managed_entry(contract.FIELD_MANAGER_EXTENDER, "Update", NAMES.assignment, NAMES.allocation_state)]
    pods = [pod("chat", state="assumed", assignment={"vllm": [{"uuid": "GPU-0", "mib": 4096}]}, managed=ours),
            pod("new", state="assumed", assignment={"vllm": [{"uuid": "GPU-0", "mib": 2048}]}, managed=ours)]
    source = NodeTenantSource(lambda: [holding("chat", "vllm", ("GPU-0", 4096))], lambda: pods, NAMES)
    assert [t.key.pod for t in source.list_tenants()] == ["chat"]
    assert source.list_pending() == [Claim("llm/new/vllm", (("GPU-0", 2048),))]


class CoreV1:
    """Records calls the way kubernetes.client.CoreV1Api receives them."""

    def __init__(self, pods=(), patch_status=None):
        self.pods, self.patch_status, self.patches, self.selectors = list(pods), patch_status, [], []

    def list_pod_for_all_namespaces(self, field_selector, **kw):
        self.selectors.append(field_selector)
        return SimpleNamespace(data=json.dumps({"items": self.pods}).encode())

    def patch_namespaced_pod(self, name, namespace, body, **kw):
        if self.patch_status:
            raise ApiException(status=self.patch_status, reason="boom")
        self.patches.append((namespace, name, body, kw["_content_type"]))


def test_mirror_merge_patches_the_quota_annotation():
    v1 = CoreV1()
    ApiQuotaMirror(v1, NAMES).mirror(TenantKey("llm", "chat", "vllm", "uid-chat"),
                                     {"vllm": {"GPU-1": 9000, "GPU-0": 8000}})
    (ns, name, body, ctype), = v1.patches
    assert (ns, name, ctype) == ("llm", "chat", "application/merge-patch+json")
    assert json.loads(body["metadata"]["annotations"]["vramshare.io/quota-mib"]) == {
        "vllm": [{"uuid": "GPU-0", "mib": 8000}, {"uuid": "GPU-1", "mib": 9000}]}


def test_mirror_tolerates_a_vanished_pod_but_reports_other_errors():
    key = TenantKey("llm", "gone", "vllm", "uid-gone")
    ApiQuotaMirror(CoreV1(patch_status=404), NAMES).mirror(key, {"vllm": {"GPU-0": 1}})
    with pytest.raises(ApiException):
        ApiQuotaMirror(CoreV1(patch_status=500), NAMES).mirror(key, {"vllm": {"GPU-0": 1}})
