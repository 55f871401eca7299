"""The allocator: the GPU follows the device IDs. Allocate reads no pod (a pod source that fails does not
matter), names its quota directory after the allocation, refuses bad IDs with a reason; the extender's
plan, from the pod source, only steers GetPreferredAllocation."""
from __future__ import annotations

import json
import os

import pytest

from deviceplugin.allocation import Refusal, RefusalKind
from deviceplugin.backend import DiscoveredGpu
from deviceplugin.inventory_file import load
from deviceplugin.kubelet.allocator import Allocator
from deviceplugin.metrics import PluginMetrics
from deviceplugin.node_state import NodeState
from deviceplugin.quota import writer
from deviceplugin.quota_files import QuotaFiles, allocation_key
from vramshare import contract
from vramshare.config import Config

from .conftest import MEM, MIXED

NAMES = contract.Names()
H100, A100 = load(MIXED)
TWO = [DiscoveredGpu(0, "GPU-a", "H100", 81559, numa_node=0), DiscoveredGpu(1, "GPU-b", "H100", 81559, numa_node=1)]


class Pods:
    """A pod source (our own interface); ``broken`` makes every read fail, like an API outage would."""

    def __init__(self, pods: list[dict] | None = None, broken: bool = False) -> None:
        self._pods, self.broken, self.reads = pods or [], broken, 0

    def pods(self) -> list[dict]:
        self.reads += 1
        if self.broken:
            raise AssertionError("Allocate must not read pods")
        return list(self._pods)


def assumed(name: str, units: int, gpus: tuple[str, ...]) -> dict:
    ann = {NAMES.assignment: json.dumps({"c": [{"uuid": g, "mib": units * 1024 // len(gpus)} for g in gpus]}),
           NAMES.assume_time: "5", NAMES.allocation_state: contract.STATE_ASSUMED}
    if len(gpus) > 1:
        ann[NAMES.gpu_count] = str(len(gpus))
    managed = [{"manager": contract.FIELD_MANAGER_EXTENDER, "operation": "Update", "apiVersion": "v1",
                "fieldsType": "FieldsV1", "fieldsV1": {"f:metadata": {"f:annotations": {f"f:{k}": {} for k in ann}}}}]
    return {"metadata": {"name": name, "namespace": "default", "uid": f"uid-{name}", "annotations": ann,
                         "managedFields": managed},
            "spec": {"nodeName": "gpu-1", "containers": [{"name": "c", "resources": {"limits": {MEM: str(units)}}}]},
            "status": {"phase": "Pending"}}


@pytest.fixture
def make(short_dir):
    def build(pods: Pods | None = None, gpus=None) -> Allocator:
        config = Config(quota_host_dir=os.path.join(short_dir, "q"))
        return Allocator(NodeState(gpus or load(MIXED), config), QuotaFiles(config.quota_host_dir, config.quota),
                         PluginMetrics(), "gpu-1", pods)
    return build


def ids(n: int, start: int = 0, gpu: str = H100.uuid) -> list[str]:
    return [contract.unit_device_id(gpu, i) for i in range(start, start + n)]


def test_allocate_grants_the_gpu_its_ids_name_and_reads_no_pod(make, short_dir):
    pods = Pods([assumed("p", 2, ("GPU-elsewhere",))], broken=True)
    spec = make(pods).allocate(MEM, ids(2))
    assert pods.reads == 0
    assert spec.envs["NVIDIA_VISIBLE_DEVICES"] == spec.envs["VRAMSHARE_GPU_UUIDS"] == H100.uuid
    assert spec.envs["VRAMSHARE_MEMORY_LIMIT_MIB"] == "2048"
    [(path, host, ro)] = spec.mounts
    assert (path, ro) == (contract.CONTAINER_QUOTA_DIR, True)
    assert host == os.path.join(short_dir, "q", "_alloc", allocation_key(ids(2)))
    assert writer.read_quota(host).limits() == {H100.uuid: 2048}


def test_the_quota_directory_is_keyed_by_the_allocation(make):
    allocator = make()
    first = allocator.allocate(MEM, ids(2)).mounts[0][1]
    assert allocator.allocate(MEM, ids(2)[::-1]).mounts[0][1] == first  # the same IDs: a re-Allocate
    assert allocator.allocate(MEM, ids(2, start=2)).mounts[0][1] != first


def test_a_repeated_allocate_of_the_same_ids_rewrites_the_grant(make):
    allocator = make()
    host = allocator.allocate(MEM, ids(2)).mounts[0][1]
    writer.write_quota(host, writer.QuotaFile(gpus=(writer.GpuQuota(H100.uuid, 512, 256, 1024),)))  # an old tenant's
    allocator.allocate(MEM, ids(2))
    quota = writer.read_quota(host)
    assert quota.limits() == {H100.uuid: 2048} and quota.generation == 3


def test_units_on_two_gpus_give_both_gpus_with_each_ones_mib(make):
    spec = make(gpus=TWO).allocate(MEM, ["GPU-a::0", "GPU-a::1", "GPU-a::2", "GPU-b::0"])
    assert spec.envs["NVIDIA_VISIBLE_DEVICES"] == "GPU-a,GPU-b"
    assert spec.envs["VRAMSHARE_MEMORY_LIMIT_MIB"] == "3072,1024"


def test_mig_and_whole_gpu_ids_are_their_own_device(make):
    spec = make().allocate("vramshare.io/mig-2g.20gb", [A100.mig[1].uuid])
    assert spec.envs["NVIDIA_VISIBLE_DEVICES"] == A100.mig[1].uuid
    assert spec.envs["VRAMSHARE_MEMORY_LIMIT_MIB"] == str(A100.mig[1].memory_mib)


@pytest.mark.parametrize("resource, device_ids, kind, message", [
    (MEM, ["GPU-nope::0"], RefusalKind.INVALID, "is not a vramshare.io/gpu-memory device of this node"),
    (MEM, [f"{H100.uuid}::0", f"{H100.uuid}::0"], RefusalKind.INVALID, "more than once"),
    (MEM, [], RefusalKind.INVALID, "named no devices"),
    ("vramshare.io/mig-1g.10gb", ["MIG-of-2g"], RefusalKind.INVALID, "belongs to vramshare.io/mig-2g.20gb"),
], ids=["unknown", "duplicate", "empty", "mixed-resources"])
def test_bad_ids_are_refused_with_a_reason(make, resource, device_ids, kind, message):
    device_ids = [A100.mig[1].uuid if i == "MIG-of-2g" else i for i in device_ids]
    with pytest.raises(Refusal, match=message) as err:
        make().allocate(resource, device_ids)
    assert err.value.kind is kind


def test_an_unhealthy_gpu_is_refused(make):
    from deviceplugin.backend import HealthEvent
    allocator = make()
    allocator._state.on_health(HealthEvent(H100.uuid, healthy=False, reason="xid 79"))  # noqa: SLF001 - set up
    with pytest.raises(Refusal, match="is unhealthy") as err:
        allocator.allocate(MEM, ids(1))
    assert err.value.kind is RefusalKind.PRECONDITION


def test_an_unwritable_quota_root_is_a_refusal_not_a_grant(short_dir):
    root = os.path.join(short_dir, "ro")
    os.makedirs(root)
    open(os.path.join(root, "_alloc"), "w").close()  # a file where the directory must go
    config = Config(quota_host_dir=root)
    allocator = Allocator(NodeState(load(MIXED), config), QuotaFiles(root, config.quota), PluginMetrics())
    with pytest.raises(Refusal, match="cannot write quota file") as err:
        allocator.allocate(MEM, ids(1))
    assert err.value.kind is RefusalKind.PRECONDITION


def test_the_plan_of_the_single_assumed_pod_steers_the_preference(make):
    allocator = make(Pods([assumed("tp2", 4, ("GPU-a", "GPU-b"))]), gpus=TWO)
    available = [contract.unit_device_id(g, i) for g in ("GPU-a", "GPU-b") for i in range(8)]
    preferred = allocator.preferred(MEM, available, [], 4)
    assert sorted(preferred) == ["GPU-a::0", "GPU-a::1", "GPU-b::0", "GPU-b::1"]
    spec = allocator.allocate(MEM, preferred)
    assert spec.envs["NVIDIA_VISIBLE_DEVICES"] == "GPU-a,GPU-b" and spec.envs["VRAMSHARE_MEMORY_LIMIT_MIB"] == "2048"


def test_two_assumed_pods_of_one_size_with_different_plans_get_best_fit_not_a_guess(make):
    available = [contract.unit_device_id("GPU-a", i) for i in range(8)] + \
                [contract.unit_device_id("GPU-b", i) for i in range(4)]
    one = make(Pods([assumed("x", 4, ("GPU-a",))]), gpus=TWO)
    assert {i.split("::")[0] for i in one.preferred(MEM, available, [], 4)} == {"GPU-a"}  # steered
    both = make(Pods([assumed("x", 4, ("GPU-a",)), assumed("y", 4, ("GPU-a", "GPU-b"))]), gpus=TWO)
    assert {i.split("::")[0] for i in both.preferred(MEM, available, [], 4)} == {"GPU-b"}  # best fit
    assert make(gpus=TWO).preferred(MEM, available, [], 4) == both.preferred(MEM, available, [], 4)


def test_two_assumed_pods_of_one_size_on_one_plan_are_steered_to_it(make):
    """The extender's narrower hold assumes same-size pods together only on the same GPUs."""
    available = [contract.unit_device_id("GPU-a", i) for i in range(8)] + \
                [contract.unit_device_id("GPU-b", i) for i in range(4)]
    both = make(Pods([assumed("x", 4, ("GPU-a",)), assumed("y", 4, ("GPU-a",))]), gpus=TWO)
    assert {i.split("::")[0] for i in both.preferred(MEM, available, [], 4)} == {"GPU-a"}


def test_must_include_is_kept_and_the_size_is_exact(make):
    allocator = make(Pods([assumed("p", 4, ("GPU-b",))]), gpus=TWO)
    available = [contract.unit_device_id(g, i) for g in ("GPU-a", "GPU-b") for i in range(8)]
    got = allocator.preferred(MEM, available, ["GPU-a::5"], 4)
    assert len(got) == 4 and got[0] == "GPU-a::5"
    assert sorted(i for i in got if i.startswith("GPU-b")) == ["GPU-b::0", "GPU-b::1", "GPU-b::2"]
