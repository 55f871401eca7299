"""Reading the openb CSVs and building the paper's 130% arrival sequence."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from extender.cluster import Demand
from extender.simulation.arrival import arrivals, gpu_capacity
from extender.simulation.trace import GPU_MIB, load_nodes, load_pods

OPENB = Path(__file__).resolve().parents[3] / "shared" / "traces" / "openb"


def test_nodes_and_pods_load_in_both_views(trace: tuple[str, str]) -> None:
    nodes, pods = load_nodes(trace[0]), load_pods(trace[1])
    assert [n.name for n in nodes] == ["node-a", "node-b"]
    assert [s.capacity for s in nodes[0].slots("share")] == [1000, 1000]
    assert [s.capacity for s in nodes[0].slots("memory")] == [GPU_MIB["G2"]] * 2
    assert pods[0].demands("share") == (Demand(400),)
    assert pods[0].demands("memory") == (Demand(round(0.4 * 16384)),)
    assert pods[3].demands("share") == () and pods[3].host.cpu_milli == 2000
    assert pods[4].demands("share") == (Demand(1000, 2, "shared", ("T4",)),)
    assert pods[4].gpu_request("share") == 2000


def test_missing_gpu_spec_column_means_no_model_constraint(tmp_path: Path) -> None:
    path = tmp_path / "p.csv"
    path.write_text("name,cpu_milli,memory_mib,num_gpu,gpu_milli\np,1000,100,1,500\n")
    assert load_pods(str(path))[0].demands("share") == (Demand(500),)


def test_arrivals_are_inflated_to_130_percent_of_gpu_capacity(trace: tuple[str, str]) -> None:
    nodes, pods = load_nodes(trace[0]), load_pods(trace[1])[:4]  # at most one GPU each
    seq = arrivals(pods, nodes, "share", seed=1)
    target = 1.3 * gpu_capacity(nodes, "share")
    total = sum(p.gpu_request("share") for p in seq)
    assert target - 1000 < total <= target and len(seq) > len(pods)
    assert sorted(p.name for p in seq[: len(pods)]) == sorted(p.name for p in pods)  # originals first
    assert all("-tuned-" in p.name for p in seq[len(pods):])
    assert [p.name for p in arrivals(pods, nodes, "share", seed=1)] == [p.name for p in seq]


def test_arrivals_are_pruned_when_the_trace_asks_too_much(trace: tuple[str, str]) -> None:
    nodes, pods = load_nodes(trace[0]), load_pods(trace[1])
    seq = arrivals(pods * 3, nodes, "share", seed=3)
    assert sum(p.gpu_request("share") for p in seq) <= 1.3 * gpu_capacity(nodes, "share") < sum(
        p.gpu_request("share") for p in pods * 3)


def test_trace_order_is_kept_when_asked(trace: tuple[str, str]) -> None:
    nodes, pods = load_nodes(trace[0]), load_pods(trace[1])
    seq = arrivals(pods, nodes, "share", seed=5, order="trace")
    assert [p.name for p in seq[: len(pods)]] == [p.name for p in pods]
    with pytest.raises(ValueError, match="order"):
        arrivals(pods, nodes, "share", seed=5, order="sorted")


@pytest.mark.skipif(not os.path.exists(OPENB / "openb_node_list_gpu_node.csv"), reason="openb trace not present")
def test_the_real_openb_cluster_has_the_papers_size() -> None:
    nodes = load_nodes(str(OPENB / "openb_node_list_gpu_node.csv"))
    assert len(nodes) == 1213 and sum(n.gpus for n in nodes) == 6212
    pods = load_pods(str(OPENB / "openb_pod_list_default.csv"))
    assert len(pods) == 8152 and sum(1 for p in pods if p.num_gpu == 0) == 1088
