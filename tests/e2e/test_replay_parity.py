"""A trace replayed through the real wire places every pod where the simulator places it.

The API server stand-in holds the nodes (inventory annotation, ``status.allocatable``), the extender runs
as in production (list + watch, HTTP verbs, binder), and the stand-in scheduler does kube-scheduler's
cycle for the profile (in-tree Fit, the extender's filter and 0..10 x weight, the default scores,
bind). ``vramshare simulate --as-scheduler`` calls the same placement functions in process with the same
inputs: the placements must be identical, pod for pod, including the pods that fit nowhere and the
pods asking no GPU. Fails before host parity: the extender ignored CPU, memory and CPU-only pods.
"""
from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

from bench.bench_replay import through_wire
from extender.simulation.arrival import arrivals
from extender.simulation.kube_model import Profile
from extender.simulation.replay import replay_as_scheduler
from extender.simulation.trace import TraceNode, TracePod
from extender.workload import typical_workload

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEPLOYED = Profile.from_yaml(os.path.join(ROOT, "deploy", "daemonset", "scheduler-config.yaml"))


def synthetic(seed: int, nodes: int = 24, pods: int = 400) -> tuple[list[TraceNode], list[TracePod]]:
    """Nodes like openb's (2, 4 or 8 GPUs of several models, CPU sized per GPU) and tasks like its:
    shares of one GPU, whole multi-GPU tasks, model constraints, CPU-only tasks, one without memory."""
    rng = np.random.default_rng(seed)
    out_nodes = []
    for i in range(nodes):
        gpus = int(rng.choice([2, 4, 8]))
        model = str(rng.choice(["T4", "G2", "V100M32"]))
        out_nodes.append(TraceNode(f"node-{i:03d}", gpus * 12000, gpus * 48 * 1024, gpus, model))
    out_pods = []
    for j in range(pods):
        kind = rng.random()
        cpu = int(rng.choice([1000, 2000, 4000, 8000, 16000]))
        mem = 0 if j == 7 else int(rng.choice([2, 4, 8, 16, 32])) * 1024
        if kind < 0.12:
            out_pods.append(TracePod(f"cpu-{j}", cpu, mem, 0, 0))
        elif kind < 0.75:
            spec = ("T4",) if rng.random() < 0.1 else ()
            out_pods.append(TracePod(f"share-{j}", cpu, mem, 1, int(rng.choice([100, 250, 300, 500, 700, 1000])), spec))
        else:
            out_pods.append(TracePod(f"multi-{j}", cpu, mem, int(rng.choice([1, 2, 4, 8])), 1000))
    return out_nodes, out_pods


@pytest.mark.parametrize("seed, profile", [
    (1, DEPLOYED),
    # An extender managing cpu would be asked to bind CPU-only pods, which /bind refuses (it binds only
    # pods asking a vramshare resource): such a profile is not deployable, so it is not replayed.
    (2, dataclasses.replace(DEPLOYED, extender_weight=30)),
    (3, dataclasses.replace(DEPLOYED, fit_strategy="MostAllocated")),
], ids=["deployed-profile", "extender-weight-30", "most-allocated"])
def test_wire_and_simulator_place_every_pod_alike(seed: int, profile: Profile) -> None:
    nodes, pods = synthetic(seed)
    seq = arrivals(pods, nodes, "share", seed, order="trace")
    typical = typical_workload(p.shape("share") for p in pods)
    wire: list[tuple[str, str]] = []
    sim: list[tuple[str, str]] = []
    through_wire(nodes, seq, "share", "fgd", profile, seed, typical, wire)
    replay_as_scheduler(nodes, seq, "fgd", "share", seed, typical, profile, sim)
    assert len(wire) == len(sim) == len(seq)
    assert [w for w in zip(wire, sim) if w[0] != w[1]] == []
    placed = [node for _, node in sim]
    assert sum(1 for n in placed if n) > len(seq) // 3  # the run says something:
    assert any(not n for n in placed)  # the cluster fills up,
    assert any(name.startswith("cpu-") and node for name, node in sim)  # CPU-only pods are placed
