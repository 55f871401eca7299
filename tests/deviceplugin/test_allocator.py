"""The allocator against hand-written PodDirectory/HeldDevices stand-ins (our own interfaces): a lagging
pod cache is backed by a fresh list, a unit still held by a live container is refused, and a unit the
kubelet has freed is granted again."""
from __future__ import annotations

import json
import os

import pytest

from deviceplugin.allocation import Refusal, RefusalKind
from deviceplugin.allocator import Allocator
from deviceplugin.backend import DiscoveredGpu
from deviceplugin.inventory_file import load
from deviceplugin.metrics import PluginMetrics
from deviceplugin.node_state import NodeState
from deviceplugin.quota_files import QuotaFiles
from vramshare import contract
from vramshare.config import Config

from .conftest import MEM, MIXED

NAMES = contract.Names()
H100, _ = load(MIXED)


class LaggingDirectory:
    """A cache that has not seen any pod yet; a fresh read returns the real ones."""

    cached = True

    def __init__(self, pods: list[dict]) -> None:
        self.pods = pods
        self.fresh_reads = 0
        self.states: list[tuple[str, str]] = []

    def pending_pods(self, fresh: bool = False) -> list[dict]:
        self.fresh_reads += fresh
        return list(self.pods) if fresh else []

    def set_allocation_state(self, pod, state):
        self.states.append((pod.key, state))
        return {}


class Kubelet:
    def __init__(self) -> None:
        self.holders: dict[str, tuple[str, str, str]] = {}

    def held(self) -> dict[str, tuple[str, str, str]]:
        return dict(self.holders)


def pod(name: str, units: int) -> dict:
    return {"metadata": {"name": name, "namespace": "default", "uid": f"uid-{name}", "annotations": {
                NAMES.assignment: json.dumps({"c": [{"uuid": H100.uuid, "mib": units * 1024}]}),
                NAMES.assume_time: "5", NAMES.allocation_state: contract.STATE_ASSUMED}},
            "spec": {"nodeName": "gpu-1", "containers": [{"name": "c", "resources": {"limits": {MEM: str(units)}}}]},
            "status": {"phase": "Pending"}}


@pytest.fixture
def make(short_dir):
    def build(directory=None, kubelet=None) -> Allocator:
        config = Config(quota_host_dir=os.path.join(short_dir, "q"))
        return Allocator(NodeState(load(MIXED), config), QuotaFiles(config.quota_host_dir, config.quota),
                         PluginMetrics(), "gpu-1", directory, kubelet)
    return build


def ids(n: int, start: int = 0) -> list[str]:
    return [contract.unit_device_id(H100.uuid, i) for i in range(start, start + n)]


def test_a_lagging_cache_is_backed_by_a_fresh_list(make):
    directory = LaggingDirectory([pod("p", 2)])
    spec = make(directory).allocate(MEM, ids(2))
    assert directory.fresh_reads == 1
    assert directory.states == [("default/p", contract.STATE_ALLOCATED)]
    assert spec.mounts[-1][1].endswith(os.path.join("uid-p", "c"))


def test_a_unit_held_by_a_live_container_is_refused(make):
    kubelet = Kubelet()
    allocator = make(kubelet=kubelet)
    allocator.allocate(MEM, ids(2))
    kubelet.holders = {i: ("default/a", "c", MEM) for i in ids(2)}
    with pytest.raises(Refusal, match="still held by default/a container c") as err:
        allocator.allocate(MEM, ids(1, start=1))
    assert err.value.kind is RefusalKind.PRECONDITION


def test_a_unit_the_kubelet_freed_is_granted_again(make):
    kubelet = Kubelet()
    allocator = make(kubelet=kubelet)
    allocator.allocate(MEM, ids(2))  # that pod has ended: the kubelet lists nothing
    assert allocator.allocate(MEM, ids(2)).envs["NVIDIA_VISIBLE_DEVICES"] == H100.uuid


def test_recovery_reads_what_the_kubelet_holds(make):
    kubelet = Kubelet()
    kubelet.holders = {i: ("default/p", "c", MEM) for i in ids(2)}
    directory = LaggingDirectory([pod("p", 2)])
    allocator = make(directory, kubelet)
    assert allocator.recover() == 2
    with pytest.raises(Refusal, match="still held"):
        allocator.allocate(MEM, ids(2))
    # container c of p was served before the restart: it is not matched a second time
    spec = allocator.allocate(MEM, ids(2, start=2))
    assert directory.states == [] and "_unmatched" in spec.mounts[-1][1]


def test_a_gpu_count_pod_gets_every_assigned_gpu(short_dir):
    gpus = [DiscoveredGpu(0, "GPU-a", "H100", 81559, numa_node=0), DiscoveredGpu(1, "GPU-b", "H100", 81559, numa_node=1)]
    config = Config(quota_host_dir=os.path.join(short_dir, "q"))
    split = {"metadata": {"name": "tp2", "namespace": "default", "uid": "uid-tp2", "annotations": {
                 NAMES.assignment: json.dumps({"c": [{"uuid": "GPU-a", "mib": 2048}, {"uuid": "GPU-b", "mib": 2048}]}),
                 NAMES.assume_time: "5", NAMES.allocation_state: contract.STATE_ASSUMED, NAMES.gpu_count: "2"}},
             "spec": {"nodeName": "gpu-1", "containers": [{"name": "c", "resources": {"limits": {MEM: "4"}}}]},
             "status": {"phase": "Pending"}}
    directory = LaggingDirectory([split])
    allocator = Allocator(NodeState(gpus, config), QuotaFiles(config.quota_host_dir, config.quota), PluginMetrics(),
                          "gpu-1", directory)
    preferred = allocator.preferred(MEM, [contract.unit_device_id(g, i) for g in ("GPU-a", "GPU-b") for i in range(8)],
                                    [], 4)
    assert sorted(preferred) == ["GPU-a::0", "GPU-a::1", "GPU-b::0", "GPU-b::1"]
    spec = allocator.allocate(MEM, preferred)
    assert spec.envs["NVIDIA_VISIBLE_DEVICES"] == "GPU-a,GPU-b"
    assert spec.envs["VRAMSHARE_MEMORY_LIMIT_MIB"] == "2048"
    with open(os.path.join(short_dir, "q", "uid-tp2", "c", "quota.json"), encoding="utf-8") as fh:
        assert [g["uuid"] for g in json.load(fh)["gpus"]] == ["GPU-a", "GPU-b"]
    assert directory.states == [("default/tp2", contract.STATE_ALLOCATED)]
