"""Inventory -> ResourceSlices: device shapes, health withdrawal, pool generation, schema validity."""
from __future__ import annotations

import dataclasses

import kubernetes_validate
import pytest
from hypothesis import given, settings, strategies as st
from kubernetes.utils import parse_quantity

from deviceplugin import devices
from deviceplugin.backend import DiscoveredGpu
from deviceplugin.dra import slices
from tests.dra.conftest import NODE, dra_config
from vramshare.inventory import GpuMode

MiB = 1024 * 1024


def _by_name(devs):
    return {d["name"]: d for d in devs}


def test_shared_gpu_is_one_device_with_consumable_memory(inventory, config):
    devs = _by_name(slices.desired_devices(inventory, config.names, NODE, taints=False))
    gpu0 = devs["gpu-0"]
    assert gpu0["allowMultipleAllocations"] is True
    mem = gpu0["capacity"]["memory"]
    total = inventory.capacity_mib(inventory.gpus[0])
    assert mem == {"value": f"{total}Mi", "requestPolicy": {
        "default": "1024Mi", "validRange": {"min": "1024Mi", "max": f"{total}Mi", "step": "1024Mi"}}}
    attrs = gpu0["attributes"]
    assert attrs["uuid"] == {"string": inventory.gpus[0].uuid} and attrs["mode"] == {"string": "shared"}
    assert attrs["model"] == {"string": inventory.gpus[0].model}
    assert attrs["numaNode"] == attrs["resource.kubernetes.io/numaNode"] == {"int": 0}
    assert attrs["node"] == {"string": NODE}


def test_exclusive_gpu_is_an_ordinary_device_and_mig_instances_are_devices(inventory, config):
    devs = _by_name(slices.desired_devices(inventory, config.names, NODE, taints=False))
    gpu1 = devs["gpu-1"]
    assert "allowMultipleAllocations" not in gpu1 and "requestPolicy" not in gpu1["capacity"]["memory"]
    assert gpu1["attributes"]["mode"] == {"string": "exclusive"}
    migs = [d for n, d in devs.items() if "-mig-" in n]
    a100 = inventory.gpus[3]
    assert a100.mode is GpuMode.MIG and len(migs) == len(a100.mig) == 4
    assert sorted(d["attributes"]["profile"]["string"] for d in migs) == sorted(m.profile for m in a100.mig)
    assert {d["attributes"]["uuid"]["string"] for d in migs} == {m.uuid for m in a100.mig}
    for d in migs:
        assert d["attributes"]["parentUUID"] == {"string": a100.uuid} and "allowMultipleAllocations" not in d


def test_request_policy_is_consistent_as_the_api_server_requires(inventory, config):
    """Semantic rules the schema cannot check (resource/v1 validation): default in range, max <= value."""
    for d in slices.desired_devices(inventory, config.names, NODE, taints=False):
        mem = d["capacity"]["memory"]
        policy = mem.get("requestPolicy")
        if not policy:
            continue
        rng = policy["validRange"]
        value, low, high, step = (parse_quantity(x) for x in (mem["value"], rng["min"], rng["max"], rng["step"]))
        default = parse_quantity(policy["default"])
        assert low <= default <= high <= value and (default - low) % step == 0 and (high - low) % step == 0


def test_unhealthy_devices_are_removed_or_tainted(discovered, config):
    sick = devices.build_inventory(discovered, config, {discovered[0].uuid, discovered[3].mig[0].uuid}, dra=True)
    removed = _by_name(slices.desired_devices(sick, config.names, NODE, taints=False))
    assert "gpu-0" not in removed and "gpu-2" in removed
    assert not any(d["attributes"].get("uuid", {}).get("string") == discovered[3].mig[0].uuid for d in removed.values())
    tainted = _by_name(slices.desired_devices(sick, config.names, NODE, taints=True))
    assert tainted["gpu-0"]["taints"] == [{"key": "gpu.vramshare.io/unhealthy", "value": "true",
                                           "effect": "NoSchedule"}]
    assert "taints" not in tainted["gpu-2"]


def test_refused_gpus_are_never_published(inventory, config):
    devs = slices.desired_devices(inventory, config.names, NODE, taints=False,
                                  refused=frozenset({inventory.gpus[0].uuid}))
    assert "gpu-0" not in _by_name(devs) and "gpu-2" in _by_name(devs)


@pytest.mark.parametrize("version", ["1.36", "1.37"])
@pytest.mark.parametrize("taints", [False, True])
def test_published_slices_validate_strictly(discovered, config, version, taints):
    sick = devices.build_inventory(discovered, config, {discovered[0].uuid}, dra=True)
    devs = slices.desired_devices(sick, config.names, NODE, taints=taints)
    for obj in slices.resource_slices(NODE, "0b7e2c4e-1111-2222-3333-444455556666", devs, 7, config.names):
        kubernetes_validate.validate(obj, version, strict=True)


def test_big_pools_split_into_slices_of_at_most_128_or_64_with_taints(tmp_path):
    config = dra_config(tmp_path)
    many = [DiscoveredGpu(index=i, uuid=f"GPU-{i:04d}", model="X", memory_mib=8192) for i in range(200)]
    inv = devices.build_inventory(many, config, dra=True)
    devs = slices.desired_devices(inv, config.names, NODE, taints=False)
    objs = slices.resource_slices(NODE, None, devs, 3, config.names)
    assert [len(o["spec"]["devices"]) for o in objs] == [128, 72]
    assert {o["spec"]["pool"]["resourceSliceCount"] for o in objs} == {2}
    sick = devices.build_inventory(many, config, {"GPU-0000"}, dra=True)
    objs = slices.resource_slices(NODE, None, slices.desired_devices(sick, config.names, NODE, taints=True), 3,
                                  config.names)
    assert [len(o["spec"]["devices"]) for o in objs] == [64, 64, 64, 8]


def test_an_empty_pool_is_still_published():
    from vramshare import contract
    [obj] = slices.resource_slices(NODE, None, [], 1, contract.Names())
    assert "devices" not in obj["spec"] and obj["spec"]["pool"] == {"name": NODE, "generation": 1,
                                                                       "resourceSliceCount": 1}


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.booleans()), max_size=20))
def test_generation_grows_exactly_when_devices_change(tmp_path_factory, flips):
    tmp = tmp_path_factory.mktemp("gen")
    config = dra_config(tmp)
    from deviceplugin.simulated_backend import SimulatedBackend
    discovered = SimulatedBackend.demo().discover()
    unhealthy: set[str] = set()
    generation, published = 0, None
    for index, healthy in flips:
        uuid = discovered[index].uuid
        unhealthy = unhealthy - {uuid} if healthy else unhealthy | {uuid}
        devs = slices.desired_devices(devices.build_inventory(discovered, config, unhealthy, dra=True), config.names,
                                      NODE, taints=False)
        new = slices.next_generation(generation, published, devs)
        assert new == (generation if published == devs else generation + 1)
        generation, published = new, devs


def test_the_device_plugin_and_dra_never_hold_the_same_gpu(discovered, tmp_path):
    config = dra_config(tmp_path, gpus=("0", discovered[2].uuid))
    dp = devices.build_inventory(discovered, config)
    dra = devices.build_inventory(discovered, config, dra=True)
    assert {g.index for g in dra.gpus} == {0, 2} and {g.index for g in dp.gpus} == {1, 3}
    none = dataclasses.replace(config, dra=dataclasses.replace(config.dra, gpus=()))
    assert devices.build_inventory(discovered, none, dra=True).gpus == ()
    assert len(devices.build_inventory(discovered, none).gpus) == 4


def test_a_shared_gpus_sleep_credit_is_published_in_its_capacity_never_in_one_share(inventory, config):
    """Issue 23 item 5 on DRA: the sleeping claims of overcommit classes lend their GPU a credit
    (``node_state.with_credits``); the allocator books consumed memory against ``capacity.memory``, so
    the device offers its units plus the credit (what the extender books a device-plugin GPU against),
    while one share stays within the GPU's own units. The slice stays valid (max <= value)."""
    gpu = inventory.gpus[0]
    credited = dataclasses.replace(inventory, gpus=(dataclasses.replace(gpu, sleep_credit_mib=20 * 1024),)
                                   + inventory.gpus[1:])
    mem = _by_name(slices.desired_devices(credited, config.names, NODE, taints=False))["gpu-0"]["capacity"]["memory"]
    units = inventory.capacity_mib(gpu)
    assert mem["value"] == f"{units + 20 * 1024}Mi" and mem["requestPolicy"]["validRange"]["max"] == f"{units}Mi"
    devs = slices.desired_devices(credited, config.names, NODE, taints=False)
    for obj in slices.resource_slices(NODE, "0b7e2c4e-1111-2222-3333-444455556666", devs, 7, config.names):
        kubernetes_validate.validate(obj, "1.36", strict=True)
