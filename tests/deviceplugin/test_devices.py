"""Slicing GPUs into kubelet devices (pure): units per shared GPU, whole GPUs, MIG, NUMA, health, IDs."""
from __future__ import annotations

import pytest

from deviceplugin import devices
from deviceplugin.backend import DiscoveredGpu, DiscoveredMig
from deviceplugin.inventory_file import load
from vramshare import contract
from vramshare.config import Config
from vramshare.inventory import GpuMode, NodeInventory

from .conftest import MEM, MIXED

NAMES = contract.Names()


def test_the_simulated_node_offers_79_units_on_numa_0_and_one_device_per_mig_profile_on_numa_1():
    gpus = load(MIXED)
    per_resource = devices.resource_devices(devices.build_inventory(gpus, Config()), NAMES)
    h100, a100 = gpus
    assert sorted(per_resource) == [MEM, "vramshare.io/mig-1g.10gb", "vramshare.io/mig-2g.20gb",
                                    "vramshare.io/mig-3g.40gb"]
    units = per_resource[MEM]
    assert len(units) == 79  # floor(81559 / 1024)
    assert [d.id for d in units] == [f"{h100.uuid}::{n}" for n in range(79)]
    assert {(d.gpu_uuid, d.numa_node, d.healthy, d.mib) for d in units} == {(h100.uuid, 0, True, 1024)}
    for mig in a100.mig:
        (dev,) = per_resource[NAMES.mig(mig.profile)]
        assert (dev.id, dev.gpu_uuid, dev.numa_node, dev.mib) == (mig.uuid, a100.uuid, 1, mig.memory_mib)


@pytest.mark.parametrize("memory, reserved_driver, reserved_cfg, unit, want", [
    (81559, 0, 0, 1024, 79),
    (81559, 0, 2048, 1024, 77),
    (81559, 663, 0, 1024, 79),
    (81559, 664, 0, 1024, 78),
    (81559, 0, 0, 4096, 19),
], ids=["h100", "config-reserve", "driver-reserve-fits", "driver-reserve-costs-a-unit", "4gib-units"])
def test_units_per_shared_gpu(memory, reserved_driver, reserved_cfg, unit, want):
    gpu = DiscoveredGpu(0, "GPU-a", "H100", memory, reserved_mib=reserved_driver)
    inv = devices.build_inventory([gpu], Config(memory_unit_mib=unit, reserved_mib_per_gpu=reserved_cfg))
    assert inv.gpus[0].units == want
    assert len(devices.resource_devices(inv, NAMES).get(MEM, ())) == want


def test_exclusive_gpus_are_whole_devices_named_by_uuid_and_unknown_numa_stays_empty():
    gpus = [DiscoveredGpu(0, "GPU-a", "H100", 81559, numa_node=None), DiscoveredGpu(1, "GPU-b", "H100", 81559)]
    inv = devices.build_inventory(gpus, Config(gpu_modes={"1": GpuMode.EXCLUSIVE}))
    per_resource = devices.resource_devices(inv, NAMES)
    assert [(d.id, d.numa_node, d.mib) for d in per_resource[NAMES.gpu]] == [("GPU-b", None, 81559)]
    assert {d.gpu_uuid for d in per_resource[MEM]} == {"GPU-a"}
    assert inv.gpus[1].units == 0 and inv.gpus[1].mode is GpuMode.EXCLUSIVE


def test_health_follows_the_gpu_and_each_mig_instance():
    gpu = DiscoveredGpu(0, "GPU-m", "A100", 81920, numa_node=1, mig_enabled=True,
                        mig=(DiscoveredMig("MIG-1", "1g.10gb", 9856), DiscoveredMig("MIG-2", "1g.10gb", 9856)))
    one_bad = devices.resource_devices(devices.build_inventory([gpu], Config(), frozenset({"MIG-2"})), NAMES)
    assert [(d.id, d.healthy) for d in one_bad[NAMES.mig("1g.10gb")]] == [("MIG-1", True), ("MIG-2", False)]
    gpu_bad = devices.build_inventory([gpu], Config(), frozenset({"GPU-m"}))
    assert not gpu_bad.gpus[0].healthy and not any(m.healthy for m in gpu_bad.gpus[0].mig)


def test_inventory_round_trips_through_the_annotation_json():
    inv = devices.build_inventory(load(MIXED), Config())
    assert NodeInventory.from_json(inv.to_json()) == inv


def test_ids_longer_than_63_characters_are_refused():
    long_uuid = "GPU-" + "x" * 58  # 62 characters; "::10" makes 66
    inv = devices.build_inventory([DiscoveredGpu(0, long_uuid, "H100", 81559)], Config())
    with pytest.raises(devices.DeviceIdError, match="at most 63"):
        devices.resource_devices(inv, NAMES)


def test_real_uuids_fit_in_63_characters():
    ids = [d.id for ds in devices.resource_devices(devices.build_inventory(load(MIXED), Config()), NAMES).values()
           for d in ds]
    assert ids and max(map(len, ids)) <= contract.MAX_DEVICE_ID_LEN


def test_socket_names_follow_the_resource():
    assert devices.socket_name(MEM) == "vramshare-gpu-memory.sock"
    assert devices.socket_name("vramshare.io/mig-1g.10gb") == "vramshare-mig-1g.10gb.sock"
