"""Tenants from pod JSON, and the quota annotation mirror against a recording CoreV1Api double."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from kubernetes.client.exceptions import ApiException

from deviceplugin.quota.kube import ApiQuotaMirror, ApiTenantSource, tenants_from_pods
from deviceplugin.quota.model import Tenant, TenantKey
from vramshare import contract

NAMES = contract.Names()


def pod(name, state="allocated", assignment=None, phase="Running", **ann):
    annotations = {NAMES.allocation_state: state, **ann}
    if assignment is not None:
        annotations[NAMES.assignment] = assignment if isinstance(assignment, str) else json.dumps(assignment)
    return {"metadata": {"name": name, "namespace": "llm", "uid": f"uid-{name}", "annotations": annotations},
            "status": {"phase": phase, "podIP": "10.1.2.3",
                       "containerStatuses": [{"name": "vllm", "containerID": "containerd://" + "c" * 64}]}}


def test_tenants_from_allocated_pods_only():
    pods = [pod("chat", assignment={"vllm": [{"uuid": "GPU-0", "mib": 20480}, {"uuid": "GPU-1", "mib": 20480}],
                                    "sidecar": [{"uuid": "GPU-0", "mib": 1024}]},
                **{"prometheus.io/port": "8000"}),
            pod("waiting", state="assumed", assignment={"vllm": [{"uuid": "GPU-0", "mib": 1024}]}),
            pod("finished", phase="Succeeded", assignment={"vllm": [{"uuid": "GPU-0", "mib": 1024}]}),
            pod("broken", assignment="{not json"),
            pod("plain", assignment={"vllm": [{"uuid": "GPU-1", "mib": 8192}]}, **{"prometheus.io/port": "9",
                                                                                      "prometheus.io/scrape": "false"})]
    got = tenants_from_pods(pods, NAMES)
    assert got == [
        Tenant(TenantKey("llm", "chat", "sidecar", "uid-chat"), (("GPU-0", 1024),), "http://10.1.2.3:8000/metrics"),
        Tenant(TenantKey("llm", "chat", "vllm", "uid-chat"), (("GPU-0", 20480), ("GPU-1", 20480)),
               "http://10.1.2.3:8000/metrics", frozenset({"c" * 64})),
        Tenant(TenantKey("llm", "plain", "vllm", "uid-plain"), (("GPU-1", 8192),), None, frozenset({"c" * 64})),
    ]


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


def test_tenant_source_lists_the_nodes_pods():
    v1 = CoreV1([pod("chat", assignment={"vllm": [{"uuid": "GPU-0", "mib": 4096}]})])
    got = ApiTenantSource(v1, "gpu-node-1", NAMES).list_tenants()
    assert [t.key.pod for t in got] == ["chat"]
    assert v1.selectors == ["spec.nodeName=gpu-node-1"]


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
