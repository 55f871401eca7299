"""Allocation choices (pure): request validation, preferred IDs (best fit on one GPU), container spec."""
from __future__ import annotations

import pytest

from deviceplugin import allocation
from deviceplugin.allocation import GpuShare, Refusal, RefusalKind
from deviceplugin.devices import PluginDevice
from vramshare import contract
from vramshare.config import Config, DeviceListStrategy, EnforcementConfig
from vramshare.inventory import EnforcementMode


def units(gpu: str, n: int, start: int = 0) -> list[str]:
    return [contract.unit_device_id(gpu, i) for i in range(start, start + n)]


def gpu_map(*id_lists: list[str]) -> dict[str, str]:
    return {i: contract.parse_unit_device_id(i)[0] for ids in id_lists for i in ids}


# -- preferred -------------------------------------------------------------------------------------
def test_best_fit_picks_the_gpu_with_least_left_over():
    a, b, c = units("GPU-a", 10), units("GPU-b", 5), units("GPU-c", 3)
    got = allocation.preferred(a + b + c, [], 4, gpu_map(a, b, c))
    assert got == b[:4]  # b leaves 1; a would leave 6; c cannot hold 4


def test_must_include_is_kept_and_the_rest_grows_on_its_gpu():
    a, b = units("GPU-a", 10), units("GPU-b", 4)
    got = allocation.preferred(a + b, [a[7]], 3, gpu_map(a, b))
    assert got[0] == a[7] and len(got) == 3 and {i.split("::")[0] for i in got} == {"GPU-a"}


def test_the_assigned_gpu_wins_over_best_fit():
    a, b = units("GPU-a", 10), units("GPU-b", 4)
    assert allocation.preferred(a + b, [], 4, gpu_map(a, b), targets={"GPU-a": 4}) == a[:4]


def test_a_split_assignment_takes_units_on_each_gpu():
    a, b, c = units("GPU-a", 8), units("GPU-b", 8), units("GPU-c", 8)
    got = allocation.preferred(a + b + c, [], 4, gpu_map(a, b, c), targets={"GPU-a": 2, "GPU-c": 2})
    assert got == a[:2] + c[:2]


def test_when_no_gpu_fits_alone_the_fullest_goes_first_then_best_fit():
    a, b, c = units("GPU-a", 3), units("GPU-b", 5), units("GPU-c", 2)
    got = allocation.preferred(a + b + c, [], 7, gpu_map(a, b, c))
    assert got == b + c  # 5 on b, then the 2 left fit c exactly


@pytest.mark.parametrize("size", [0, 1, 5, 13])
def test_exactly_the_requested_number_and_no_duplicates(size):
    a, b = units("GPU-a", 8), units("GPU-b", 5)
    got = allocation.preferred(a + b, [], size, gpu_map(a, b))
    assert len(got) == size == len(set(got)) and set(got) <= set(a + b)


def test_asking_for_more_than_available_is_refused():
    with pytest.raises(Refusal) as err:
        allocation.preferred(units("GPU-a", 2), [], 3, {})
    assert err.value.kind is RefusalKind.INVALID


def test_whole_devices_without_a_gpu_map_are_their_own_group():
    assert allocation.preferred(["MIG-1", "MIG-2"], ["MIG-2"], 1, {}) == ["MIG-2"]


# -- validate_request --------------------------------------------------------------------------------
DEVS = {d.id: d for d in [PluginDevice("GPU-a::0", "GPU-a", 0, True, 1024),
                          PluginDevice("GPU-a::1", "GPU-a", 0, True, 1024),
                          PluginDevice("GPU-b::0", "GPU-b", 1, False, 1024)]}


@pytest.mark.parametrize("ids, kind, message", [
    ([], RefusalKind.INVALID, "named no devices"),
    (["GPU-a::0", "GPU-a::0"], RefusalKind.INVALID, "more than once"),
    (["GPU-z::0"], RefusalKind.INVALID, "is not a vramshare.io/gpu-memory device of this node"),
    (["MIG-1"], RefusalKind.INVALID, "belongs to vramshare.io/mig-1g.10gb"),
    (["GPU-a::0", "GPU-b::0"], RefusalKind.PRECONDITION, "GPU-b::0 is unhealthy"),
], ids=["empty", "duplicate", "unknown", "wrong-resource", "unhealthy"])
def test_bad_requests_are_refused_with_a_reason(ids, kind, message):
    with pytest.raises(Refusal, match=message) as err:
        allocation.validate_request(ids, "vramshare.io/gpu-memory", DEVS, {"MIG-1": "vramshare.io/mig-1g.10gb"})
    assert err.value.kind is kind


def test_units_add_up_per_gpu():
    devs = [DEVS["GPU-a::0"], DEVS["GPU-a::1"]]
    assert allocation.shares_of(devs, units=True) == (GpuShare("GPU-a", 2048),)
    assert allocation.shares_of(devs, units=False) == (GpuShare("GPU-a::0", 1024), GpuShare("GPU-a::1", 1024))


# -- container_spec ----------------------------------------------------------------------------------
def test_envvar_strategy_with_quota_mount():
    spec = allocation.container_spec([GpuShare("GPU-a", 20480)], Config(), "/q/uid/c")
    assert spec.envs == {
        "NVIDIA_VISIBLE_DEVICES": "GPU-a", "VRAMSHARE_GPU_UUIDS": "GPU-a", "VRAMSHARE_MEMORY_LIMIT_MIB": "20480",
        "VRAMSHARE_QUOTA_FILE": "/var/run/vramshare/quota.json"}
    assert spec.mounts == (("/var/run/vramshare", "/q/uid/c", True),)
    assert spec.cdi_devices == ()


def test_two_gpus_with_mps_enforcement():
    mps = Config(enforcement=EnforcementConfig(resolved=EnforcementMode.MPS))
    spec = allocation.container_spec([GpuShare("GPU-a", 8192), GpuShare("GPU-b", 8192)], mps, None)
    assert spec.envs["NVIDIA_VISIBLE_DEVICES"] == "GPU-a,GPU-b"
    assert spec.envs["VRAMSHARE_MEMORY_LIMIT_MIB"] == "8192"
    assert spec.envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=8192M,1=8192M"
    assert spec.envs["CUDA_MPS_PIPE_DIRECTORY"] == "/mps/pipe"
    assert ("/mps/pipe", "/run/nvidia/mps/nvidia.com/gpu/pipe", False) in spec.mounts
    assert ("/dev/shm", "/run/nvidia/mps/shm", False) in spec.mounts
    assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" not in allocation.container_spec(
        [GpuShare("GPU-a", 1)], Config(), None).envs


def test_uneven_shares_list_one_limit_per_gpu():
    spec = allocation.container_spec([GpuShare("GPU-a", 3072), GpuShare("GPU-b", 1024)], Config(), None)
    assert spec.envs["VRAMSHARE_MEMORY_LIMIT_MIB"] == "3072,1024"


def test_cdi_and_volume_mount_strategies():
    cdi = allocation.container_spec([GpuShare("GPU-a", 1024)],
                                    Config(device_list_strategy=DeviceListStrategy.CDI_CRI), None)
    assert cdi.cdi_devices == ("nvidia.com/gpu=GPU-a",) and "NVIDIA_VISIBLE_DEVICES" not in cdi.envs
    vol = allocation.container_spec([GpuShare("GPU-a", 1024)],
                                    Config(device_list_strategy=DeviceListStrategy.VOLUME_MOUNTS), None)
    assert vol.envs["NVIDIA_VISIBLE_DEVICES"] == "/var/run/nvidia-container-devices"
    assert vol.mounts == (("/var/run/nvidia-container-devices/GPU-a", "/dev/null", True),)
