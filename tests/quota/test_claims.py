"""Issue 19: the claims of containers that are not tenants yet (pods bound here, not yet allocated;
quota files no tenant owns), each counted once. The node-level tests are in test_node_soundness.py."""
from __future__ import annotations

import json

from deviceplugin.quota.claims import merge_claims, unowned_quota_files
from deviceplugin.quota.kube import pending_from_pods
from deviceplugin.quota.model import Claim
from deviceplugin.quota.writer import GpuQuota, QuotaFile, write_quota
from tests.quota.node_sim import NAMES
from vramshare import contract


def _pod(name, state, assignment, phase="Running"):
    return {"metadata": {"name": name, "namespace": "llm", "uid": f"uid-{name}",
                         "annotations": {NAMES.allocation_state: state, NAMES.assignment: json.dumps(assignment)}},
            "status": {"phase": phase}}


def test_pending_pods_are_the_bound_ones_not_yet_allocated():
    pods = [_pod("new", contract.STATE_ASSUMED, {"vllm": [{"uuid": "GPU-0", "mib": 39936}]}),
            _pod("running", contract.STATE_ALLOCATED, {"vllm": [{"uuid": "GPU-0", "mib": 40960}]}),
            _pod("done", contract.STATE_ASSUMED, {"vllm": [{"uuid": "GPU-0", "mib": 1}]}, phase="Failed"),
            {"metadata": {"name": "plain", "namespace": "llm", "annotations": {}}}]
    assert pending_from_pods(pods, NAMES) == [Claim("llm/new/vllm", (("GPU-0", 39936),))]


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
