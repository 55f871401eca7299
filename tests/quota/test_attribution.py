"""Joining usage samples to tenants: most specific identity first, the rest is foreign."""
from __future__ import annotations

from deviceplugin.quota.attribution import attribute
from deviceplugin.quota.model import Tenant, TenantKey
from deviceplugin.quota.telemetry import UsageSample

A = TenantKey("llm", "chat", "vllm", pod_uid="uid-chat")
B = TenantKey("llm", "chat", "sidecar", pod_uid="uid-chat")
C = TenantKey("llm", "embed", "vllm", pod_uid="uid-embed")
TENANTS = [Tenant(A, (("GPU-0", 20480),), container_ids=frozenset({"cid-a"})),
           Tenant(B, (("GPU-0", 4096),)),
           Tenant(C, (("GPU-0", 10240), ("GPU-1", 10240)))]


def test_container_id_beats_pod_uid():
    got = attribute([UsageSample("GPU-0", 1000, pod_uid="uid-chat", container_id="cid-a")], TENANTS)
    assert got.used == {(A, "GPU-0"): 1000}


def test_pod_uid_alone_is_split_between_the_pods_containers_on_that_gpu():
    got = attribute([UsageSample("GPU-0", 1001, pod_uid="uid-chat")], TENANTS)
    assert got.used == {(B, "GPU-0"): 501, (A, "GPU-0"): 500}


def test_dcgm_names_and_per_gpu_sums():
    got = attribute([UsageSample("GPU-0", 300, namespace="llm", pod="embed", container="vllm"),
                     UsageSample("GPU-1", 700, namespace="llm", pod="embed", container="vllm"),
                     UsageSample("GPU-1", 50, pod_uid="uid-embed", pid=7)], TENANTS)
    assert got.used == {(C, "GPU-0"): 300, (C, "GPU-1"): 750}
    assert got.foreign == {}


def test_unknown_pods_and_host_processes_are_foreign_per_gpu():
    got = attribute([UsageSample("GPU-0", 800, pod_uid="uid-stranger"), UsageSample("GPU-0", 200),
                     UsageSample("GPU-1", 64, pod_uid="uid-chat")], TENANTS)  # chat has nothing on GPU-1
    assert got.used == {}
    assert got.foreign == {"GPU-0": 1000, "GPU-1": 64}


def test_a_shared_claim_s_processes_are_its_own_within_its_grant():
    """A DRA claim several pods share is no tenant; the loop counts it at its grant. Its containers'
    processes (NVML: by container ID) were foreign on top, the claim counted twice (drahunt fault 8 on the
    cooperative and NVML paths): within its grant they are the claim's, beyond it foreign."""
    from deviceplugin.quota.model import Claim
    shared = Claim("llm/shared", (("GPU-0", 8192),), container_ids=frozenset({"cid-x", "cid-y"}), sharers=2)
    samples = [UsageSample("GPU-0", 5000, pod_uid="uid-x", container_id="cid-x"),
               UsageSample("GPU-0", 4000, pod_uid="uid-y", container_id="cid-y"),
               UsageSample("GPU-0", 1000, pod_uid="uid-chat", container_id="cid-a"),
               UsageSample("GPU-0", 300, pid=9)]  # a host process
    got = attribute(samples, TENANTS, [shared])
    assert got.used == {(A, "GPU-0"): 1000}
    assert got.claimed == {"GPU-0": 8192} and got.foreign == {"GPU-0": 300 + 9000 - 8192}
    assert attribute(samples, TENANTS).foreign == {"GPU-0": 9300}  # no claims given: as before


def test_a_claim_s_processes_are_its_own_by_the_pod_uids_it_was_reserved_for():
    """A prepared DRA claim that is no tenant and whose containers the loop does not know (its pod not in
    the pod cache yet, or deleted while the kubelet has not unprepared it) is counted at its grant; NVML's
    processes of its pod (the cgroup names the pod's UID, and a container ID nobody listed) were foreign on
    top, the claim counted twice. The pods it was reserved for name its processes: within its grant they
    are the claim's, beyond it foreign."""
    from deviceplugin.quota.model import Claim
    pending = Claim("llm/new", (("GPU-0", 8192),), pod_uids=frozenset({"uid-new"}))
    samples = [UsageSample("GPU-0", 6000, pod_uid="uid-new", container_id="cid-unlisted"),
               UsageSample("GPU-0", 3000, pod_uid="uid-new", container_id="cid-other"),
               UsageSample("GPU-1", 500, pod_uid="uid-new"),  # the claim has nothing on GPU-1
               UsageSample("GPU-0", 1000, pod_uid="uid-chat", container_id="cid-a")]
    got = attribute(samples, TENANTS, [pending])
    assert got.used == {(A, "GPU-0"): 1000}
    assert got.claimed == {"GPU-0": 8192} and got.foreign == {"GPU-0": 6000 + 3000 - 8192, "GPU-1": 500}


def test_a_claim_s_container_is_the_claim_s_even_in_a_tenant_s_pod():
    """A pod with a claim of its own (a tenant) and a claim it shares with another pod (no tenant; its
    containers known): a process of the shared claim's container was matched by its pod's UID to the
    tenant before its container ID was looked up among the claims, so the tenant's use read the shared
    claim's memory, which the loop also counted at the shared claim's grant. A container ID is the most
    specific identity, whoever owns it."""
    from deviceplugin.quota.model import Claim
    shared = Claim("llm/shared", (("GPU-0", 8192),), container_ids=frozenset({"cid-s"}),
                   pod_uids=frozenset({"uid-chat", "uid-peer"}))
    got = attribute([UsageSample("GPU-0", 5000, pod_uid="uid-chat", container_id="cid-s"),
                     UsageSample("GPU-0", 1000, pod_uid="uid-chat", container_id="cid-a")], TENANTS, [shared])
    assert got.used == {(A, "GPU-0"): 1000}
    assert got.claimed == {"GPU-0": 5000} and got.foreign == {}


def test_a_pod_uid_alone_is_split_between_the_pod_s_tenants_and_claims():
    """Nothing finer known (the pod cache does not show the container's ID yet): a pod UID that tenants
    and claims both name is split evenly between them on that GPU, as between a pod's tenants."""
    from deviceplugin.quota.model import Claim
    shared = Claim("llm/shared", (("GPU-0", 300),), pod_uids=frozenset({"uid-chat"}))
    got = attribute([UsageSample("GPU-0", 1500, pod_uid="uid-chat", container_id="cid-new")], TENANTS, [shared])
    assert got.used == {(B, "GPU-0"): 500, (A, "GPU-0"): 500}
    assert got.claimed == {"GPU-0": 300} and got.foreign == {"GPU-0": 200}
