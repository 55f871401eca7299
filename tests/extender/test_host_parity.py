"""The live extender sees a node's CPU and memory as kube-scheduler does, and uses it as the simulator does.

Each test here fails on the extender before host tracking: it ignored ``status.allocatable``, the
CPU/memory of the pods bound to a node (GPU or not, init containers and sidecars counted as the kubelet
counts them), and FGD's stranding term was zero live.
"""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from extender import accounting, placement, translate, verbs, wire
from extender.cluster import ClusterState, Demand, HostDemand, Slot
from vramshare.config import Config, Policy
from tests.extender import builders as b

GIB = 1024


def with_host(node: dict, cpu: str, memory: str) -> dict:
    node["status"]["allocatable"].update({"cpu": cpu, "memory": memory})
    return node


def cpu_pod(name: str, node: str, cpu: str, memory: str, **extra: object) -> dict:
    p = b.pod(name, node=node)
    p["spec"]["containers"][0]["resources"] = {"requests": {"cpu": cpu, "memory": memory}}
    p["spec"].update(extra)
    return p


@pytest.fixture
def acct() -> accounting.Accounting:
    a = accounting.Accounting(Config())
    a.apply_node("ADDED", with_host(b.gpu_node("n1", b.a100(), b.a100()), "16", "64Gi"))
    a.apply_node("ADDED", with_host(b.gpu_node("n2", b.a100(), b.a100()), "16", "64Gi"))
    return a


def host_free(a: accounting.Accounting, node: str) -> tuple[int, int]:
    row = a.state.row(node)
    return int(a.state.cpu_free()[row]), int(a.state.mem_free()[row])


def test_allocatable_cpu_and_memory_are_tracked(acct: accounting.Accounting) -> None:
    assert host_free(acct, "n1") == (16000, 64 * 1024)


def test_pods_asking_no_gpu_use_the_cpu_of_their_node(acct: accounting.Accounting) -> None:
    acct.apply_pod("ADDED", cpu_pod("web", "", "4", "8Gi"))  # pending: uses nothing yet
    assert host_free(acct, "n1") == (16000, 64 * 1024)
    acct.apply_pod("MODIFIED", cpu_pod("web", "n1", "4", "8Gi"))
    assert host_free(acct, "n1") == (12000, 56 * 1024)
    acct.apply_pod("DELETED", cpu_pod("web", "n1", "4", "8Gi"))
    assert host_free(acct, "n1") == (16000, 64 * 1024)


def test_init_containers_and_sidecars_count_as_the_kubelet_counts_them(acct: accounting.Accounting) -> None:
    p = cpu_pod("job", "n1", "1", "1Gi", initContainers=[
        {"name": "sidecar", "restartPolicy": "Always", "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}}},
        {"name": "setup", "resources": {"requests": {"cpu": "6", "memory": "1Gi"}}}],
        overhead={"cpu": "250m"})
    acct.apply_pod("ADDED", p)
    # max(app 1 + sidecar 0.5, setup 6 + sidecar 0.5) + overhead 0.25 = 6.75 CPUs; memory max(2, 2) GiB
    assert host_free(acct, "n1") == (16000 - 6750, 62 * 1024)


def test_gpu_pods_charge_their_cpu_too(acct: accounting.Accounting) -> None:
    p = b.assigned(b.pod("llm", 8), "n1", [(b.uuid_of("n1", 0), 8 * GIB)], 1)
    p["spec"]["containers"][0]["resources"]["requests"] = {"cpu": "3", "memory": "10Gi"}
    acct.apply_pod("ADDED", p)
    assert host_free(acct, "n1") == (13000, 54 * 1024)


def test_a_node_that_returns_is_charged_again(acct: accounting.Accounting) -> None:
    acct.apply_pod("ADDED", cpu_pod("web", "n1", "4", "8Gi"))
    acct.apply_node("DELETED", b.gpu_node("n1", b.a100(), b.a100()))
    acct.apply_node("ADDED", with_host(b.gpu_node("n1", b.a100(), b.a100()), "16", "64Gi"))
    assert host_free(acct, "n1") == (12000, 56 * 1024)


def test_relist_drops_vanished_cpu_pods(acct: accounting.Accounting) -> None:
    acct.apply_pod("ADDED", cpu_pod("web", "n1", "4", "8Gi"))
    acct.replace_pods([], started_ns=0)
    assert host_free(acct, "n1") == (16000, 64 * 1024)


def test_allocatable_change_is_not_a_heartbeat(acct: accounting.Accounting) -> None:
    acct.apply_node("MODIFIED", with_host(b.gpu_node("n1", b.a100(), b.a100()), "8", "64Gi"))
    assert host_free(acct, "n1") == (8000, 64 * 1024)


def test_bad_allocatable_keeps_the_last_good(acct: accounting.Accounting) -> None:
    acct.apply_node("MODIFIED", with_host(b.gpu_node("n1", b.a100(), b.a100()), "lots", "64Gi"))
    assert host_free(acct, "n1") == (16000, 64 * 1024)


def test_filter_refuses_a_node_without_the_cpu(acct: accounting.Accounting) -> None:
    acct.apply_pod("ADDED", cpu_pod("hog", "n1", "15", "1Gi"))
    p = b.pod("llm", 8)
    p["spec"]["containers"][0]["resources"]["requests"] = {"cpu": "2"}
    args = wire.decode_extender_args(b"{}" if False else __import__("orjson").dumps(
        {"Pod": p, "Nodes": None, "NodeNames": ["n1", "n2"]}))
    result = verbs.filter_pod(acct.view(Policy.FGD), args)
    assert result.passed == ["n2"]
    assert "cpu" in result.failed["n1"]


def test_live_fgd_counts_gpus_stranded_behind_cpu(acct: accounting.Accounting) -> None:
    """Same free GPU on both nodes; n2's CPU is nearly gone by a pod asking no GPU, so the GPU pod's
    CPU there would strand n2's idle GPUs: fgd prefers n1 live as in the simulator. Before, the CPU pod
    was invisible and the term zero: a tie, which the name order gives to n2."""
    for i in range(200):  # the target workload: 8 GiB pods with 4 CPUs each
        acct.state.observe([Demand(8 * GIB)], HostDemand(4000, 8 * GIB))
    acct.apply_pod("ADDED", cpu_pod("hog", "n2", "12", "1Gi"))
    p = b.pod("llm", 8)
    p["spec"]["containers"][0]["resources"]["requests"] = {"cpu": "4", "memory": "8Gi"}
    host = translate.pod_host(p)
    scores = dict(placement.score_nodes(acct.state, [Demand(8 * GIB)], ["n1", "n2"], "fgd", host))
    assert scores["n1"] == 10 and scores["n2"] < 10


def _state(raws: int) -> ClusterState:
    st_ = ClusterState(gpus_per_node=1)
    for i in range(raws):
        st_.set_node(f"n{i}", [Slot(f"g{i}", "m", capacity=1000, index=0)])
    return st_


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 999), min_size=2, max_size=12))
def test_the_single_10_goes_to_the_best_raw_score(used: list[int]) -> None:
    """binpack's raw score orders nodes by free GPU exactly; the one 10 must go to a node with the
    highest raw score (before: any node within a twentieth of the range, first by name hash)."""
    st_ = _state(len(used))
    for i, u in enumerate(used):
        if u:
            st_.add_pod(f"p{i}", f"n{i}", [(f"g{i}", u)])
    names = [f"n{i}" for i in range(len(used))]
    scores = dict(placement.score_nodes(st_, [Demand(1)], names, "binpack"))
    assert sum(1 for s in scores.values() if s == 10) == 1
    top = next(n for n, s in scores.items() if s == 10)
    assert used[names.index(top)] == max(used)
