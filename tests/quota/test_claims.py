"""Issue 19: the claims of containers that are not tenants yet (pods bound here, not yet allocated;
quota files no tenant owns), each counted once. The node-level tests are in test_node_soundness.py."""
from __future__ import annotations

import json

from deviceplugin.quota.claims import merge_claims, unowned_quota_files
from deviceplugin.quota.kube import pending_from_pods
from deviceplugin.quota.loop import LoopSettings, QuotaLoop
from deviceplugin.quota.model import Claim, PolicyParams, Tenant, TenantKey
from deviceplugin.quota.telemetry import UsageSample, VllmSample
from deviceplugin.quota.writer import GpuQuota, QuotaFile, write_quota
from tests.extender.builders import managed_entry
from tests.quota.node_sim import NAMES
from vramshare import contract


def _pod(name, state, assignment, phase="Running", manager=contract.FIELD_MANAGER_EXTENDER):
    return {"metadata": {"name": name, "namespace": "llm", "uid": f"uid-{name}",
                         "annotations": {NAMES.allocation_state: state, NAMES.assignment: json.dumps(assignment)},
                         "managedFields": [managed_entry(manager, "Update", NAMES.assignment, NAMES.allocation_state)]},
            "status": {"phase": phase}}


def test_pending_pods_are_the_bound_ones_that_are_not_tenants():
    pods = [_pod("new", contract.STATE_ASSUMED, {"vllm": [{"uuid": "GPU-0", "mib": 39936}]}),
            _pod("running", contract.STATE_ALLOCATED, {"vllm": [{"uuid": "GPU-0", "mib": 40960}]},
                 manager=contract.FIELD_MANAGER_DEVICE_PLUGIN),
            _pod("done", contract.STATE_ASSUMED, {"vllm": [{"uuid": "GPU-0", "mib": 1}]}, phase="Failed"),
            {"metadata": {"name": "plain", "namespace": "llm", "annotations": {}}}]
    assert pending_from_pods(pods, NAMES, {"uid-running"}) == [Claim("llm/new/vllm", (("GPU-0", 39936),))]


def test_only_an_assignment_vramshare_wrote_is_a_claim_and_allocated_is_never_read():
    """Issue 19 leftover (issue-18 trust rule): ``kubectl annotate`` reserves nothing, and a forged
    ``allocated`` neither hides the extender's reservation nor makes a tenant (tenants are the
    reconciler's view)."""
    forged = _pod("forged", contract.STATE_ASSUMED, {"vllm": [{"uuid": "GPU-0", "mib": 30720}]}, manager="kubectl")
    reserved = _pod("bound", contract.STATE_ASSUMED, {"vllm": [{"uuid": "GPU-0", "mib": 8192}]})
    reserved["metadata"]["annotations"][NAMES.allocation_state] = contract.STATE_ALLOCATED
    reserved["metadata"]["managedFields"].append(managed_entry("kubectl", "Update", NAMES.allocation_state))
    assert pending_from_pods([forged, reserved], NAMES) == [Claim("llm/bound/vllm", (("GPU-0", 8192),))]


def test_an_unowned_quota_file_counts_once_even_when_its_pod_is_pending(tmp_path):
    root = str(tmp_path)
    for key, mib in (("k1", 39936), ("k2", 8192), ("k3", 4096)):
        write_quota(tmp_path / "_alloc" / key, QuotaFile(gpus=(GpuQuota("GPU-0", mib, 0, mib),)))
    (tmp_path / "uid-a").mkdir()
    (tmp_path / "uid-a" / "vllm").symlink_to("../_alloc/k3")  # a tenant owns k3
    files = unowned_quota_files(root, [str(tmp_path / "uid-a" / "vllm")])
    assert sorted(c.gpus for c in files) == [(("GPU-0", 8192),), (("GPU-0", 39936),)]
    pending = [Claim("llm/new/vllm", (("GPU-0", 39936),))]  # the same container before it is allocated
    assert sorted(c.gpus for c in merge_claims(pending, files)) == [(("GPU-0", 8192),), (("GPU-0", 39936),)]


class _Node:
    name = "one"

    def __init__(self, demand_bytes):
        self.demand_bytes = demand_bytes

    def list_tenants(self):
        return [Tenant(TenantKey("llm", "a", "vllm", "uid-a"), (("GPU-0", 20000),), "http://a:8000/metrics"),
                Tenant(TenantKey("llm", "b", "vllm", "uid-b"), (("GPU-0", 20000),), "http://b:8000/metrics")]

    def read_usage(self):
        return [UsageSample("GPU-0", 12000, pod_uid="uid-a"), UsageSample("GPU-0", 2000, pod_uid="uid-b")]

    def read_signals(self, url):
        demand = self.demand_bytes if "//a:" in url else None
        return VllmSample(release_mode="unmap", kv_held_bytes=float(10000 << 20), kv_demand_bytes=demand)


def test_exported_kv_demand_is_the_policys_demand(tmp_path):
    """vramshare_vllm_kv_demand_bytes (SIGNALS.md): a's engine holds 10,000 MiB of KV and would hold
    25,000 unfenced, so a wants 12,000 - 10,000 + 25,000 = 27,000 MiB, beyond its request."""
    for demand, grows in ((float(25000 << 20), True), (None, False)):
        node = _Node(demand)
        root = tmp_path / str(grows)
        loop = QuotaLoop(node, lambda: {"GPU-0": 40000}, [node], PolicyParams(), str(root), signals=node,
                         settings=LoopSettings(params=PolicyParams(), startup_ticks=0))
        a = next(d for d in loop.run_once().decisions if d.key.pod == "a")
        assert (a.limit_mib >= 27000) is grows, a.reason
