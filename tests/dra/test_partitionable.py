"""Dynamic MIG on the DRA path (issue 24): partitionable devices as the API server takes them, and the
stand-in allocator honouring their counters as upstream's structured allocator does."""
from __future__ import annotations

import copy

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from deviceplugin.dra import slices, validation
from standins import dra_allocator as alloc
from standins.demo_dra import device_classes
from tests.dra.conftest import NODE, dra_config
from vramshare import mig

CLASSES = {c["metadata"]["name"]: c for c in device_classes()}
A100 = mig.MODELS["A100-SXM4-80GB"]  # the demo node's GPU 3, in MIG mode


@pytest.fixture
def dyn_config(tmp_path):
    return dra_config(tmp_path, dynamic_mig=("all",))


@pytest.fixture
def dynamic(inventory, dyn_config):
    return slices.dynamic_models(inventory, dyn_config.dra_partitions)


def _pool(inventory, config, dynamic, foreign=None, generation=1):
    devices = slices.desired_devices(inventory, config.names, NODE, taints=False, dynamic=dynamic, foreign=foreign)
    sets = slices.counter_sets(inventory, dynamic)
    ok, refused = slices.publishable(devices, sets)
    assert refused == []
    return slices.resource_slices(NODE, None, ok, generation, config.names, sets)


def _partitions(pool):
    return [d for s in pool for d in s["spec"].get("devices") or () if d.get("consumesCounters")]


# -- what is published --------------------------------------------------------------------------------
def test_every_profile_at_every_placement_with_the_gpus_counters(inventory, dyn_config, dynamic):
    pool = _pool(inventory, dyn_config, dynamic)
    parts = _partitions(pool)
    want = {(p.name, s) for p in A100.profiles for s in p.starts}
    got = {(d["attributes"]["profile"]["string"], d["attributes"]["placementStart"]["int"]) for d in parts}
    assert got == want and len(parts) == len(want) == 25
    # NVIDIA's names (mig.go ToCanonicalName) and counters (partitions.go)
    names = {d["name"] for d in parts}
    assert {"gpu-3-mig-7g80gb-0-0", "gpu-3-mig-3g40gb-9-4", "gpu-3-mig-1g10gb-me-20-6"} <= names
    three = next(d for d in parts if d["name"] == "gpu-3-mig-3g40gb-9-4")
    assert three["consumesCounters"] == [{"counterSet": "gpu-3-counter-set", "counters": {
        "memory-slice-4": {"value": "1"}, "memory-slice-5": {"value": "1"}, "memory-slice-6": {"value": "1"},
        "memory-slice-7": {"value": "1"}, "compute-slices": {"value": "3"}}}]
    # counter sets in a slice of their own, first; every slice valid as the API server checks it
    assert pool[0]["spec"] == {**pool[0]["spec"], "sharedCounters": [slices.counter_set(
        next(g for g in inventory.gpus if g.index == 3), A100)]} and "devices" not in pool[0]["spec"]
    assert all(validation.validate_resource_slice(s) == [] for s in pool)
    assert {s["spec"]["pool"]["resourceSliceCount"] for s in pool} == {len(pool)}
    # the static instances of that GPU are not published beside its partitions (they would double it)
    assert not any(d["name"].startswith("gpu-3-mig-") and not d.get("consumesCounters")
                   for s in pool for d in s["spec"].get("devices") or ())


def test_without_consent_or_support_todays_devices_only(inventory, config, tmp_path):
    """No dynamicMig.gpus (or partitionableDevices: off): the MIG GPU's existing instances, no counters."""
    assert slices.dynamic_models(inventory, config.dra_partitions) == {}
    off = dra_config(tmp_path, dynamic_mig=("all",), partitionable_devices="off")
    assert slices.dynamic_models(inventory, off.dra_partitions) == {}
    pool = _pool(inventory, config, {})
    assert _partitions(pool) == [] and all("sharedCounters" not in s["spec"] for s in pool)


def test_placements_an_admins_instance_takes_are_withheld(inventory, dyn_config, dynamic):
    uuid = next(iter(dynamic))
    pool = _pool(inventory, dyn_config, dynamic, foreign={uuid: [mig.Placed(4, "3g.40gb")]})
    got = {(d["attributes"]["profile"]["string"], d["attributes"]["placementStart"]["int"]) for d in _partitions(pool)}
    assert ("7g.80gb", 0) not in got and ("2g.20gb", 4) not in got and ("1g.10gb", 5) not in got
    assert ("4g.40gb", 0) in got and ("1g.10gb", 3) in got and ("3g.40gb", 0) in got


# -- the validation port ----------------------------------------------------------------------------
def _slice(spec):
    return {"metadata": {"name": "s"}, "spec": {"driver": "gpu.vramshare.io", "nodeName": NODE,
                                                "pool": {"name": NODE, "generation": 1, "resourceSliceCount": 1},
                                                **spec}}


def _set(name, n=1):
    return {"name": name, "counters": {f"c{i}": {"value": "1"} for i in range(n)}}


def test_counter_limits_and_shapes_as_validation_go():
    ok = validation.validate_resource_slice
    assert ok(_slice({"sharedCounters": [_set(f"s{i}") for i in range(8)]})) == []
    assert ok(_slice({"sharedCounters": [_set(f"s{i}") for i in range(9)]})) == [
        "spec.sharedCounters: Too many: 9: must have at most 8 items"]
    assert ok(_slice({"sharedCounters": [_set("s", 33)]})) == [
        "spec.sharedCounters[0].counters: Too many: 33: must have at most 32 items"]
    assert ok(_slice({"sharedCounters": [_set("s"), _set("s")]})) == ['spec.sharedCounters[1]: Duplicate value: "s"']
    assert ok(_slice({"sharedCounters": [{"name": "s", "counters": {}}]})) == [
        "spec.sharedCounters[0].counters: Required value"]
    assert ok(_slice({"sharedCounters": [{"name": "S_1", "counters": {"c": {"value": "1"}}}]}))[0].startswith(
        'spec.sharedCounters[0].name: Invalid value: "S_1"')
    dev = {"name": "d", "consumesCounters": [{"counterSet": f"s{i}", "counters": {"c": {"value": "1"}}}
                                             for i in range(3)]}
    assert ok(_slice({"devices": [dev]})) == ["spec.devices[0].consumesCounters: Too many: 3: must have at most 2 items"]
    assert ok(_slice({"devices": [], "sharedCounters": [_set("s")]})) == [
        'spec: Invalid value: "": only one of `sharedCounters` or `devices` is allowed']
    # 64 devices once any consumes counters (ResourceSliceMaxDevicesWithAdvancedFeatures)
    many = [{"name": f"d{i}", "consumesCounters": [{"counterSet": "s", "counters": {"c0": {"value": "1"}}}]}
            for i in range(65)]
    assert ok(_slice({"devices": many})) == ["spec.devices: Too many: 65: must have at most 64 items"]


def test_pool_checks_and_the_disabled_gate():
    counters = _slice({"sharedCounters": [_set("s")]})
    dev = _slice({"devices": [{"name": "d", "consumesCounters": [{"counterSet": "t", "counters": {"c0": {"value": "1"}}}]}]})
    assert validation.pool_counter_errors([counters, dev]) == ["counter set t not found"]
    dev["spec"]["devices"][0]["consumesCounters"][0] = {"counterSet": "s", "counters": {"zz": {"value": "1"}}}
    assert validation.pool_counter_errors([counters, dev]) == ["counter zz not found in counter set s"]
    assert validation.pool_counter_errors([counters, copy.deepcopy(counters)]) == ["duplicate counter set name s"]
    # strategy.go: without the gate the fields go, silently, unless the stored object used them
    new = copy.deepcopy(dev)
    validation.drop_disabled_partitionable_fields(new, None, enabled=False)
    assert "consumesCounters" not in new["spec"]["devices"][0]
    kept = copy.deepcopy(dev)
    validation.drop_disabled_partitionable_fields(kept, dev, enabled=False)
    assert kept == dev


# -- the allocator stand-in: counters ------------------------------------------------------------------
def _claim(profile: str, n: int) -> dict:
    driver = "gpu.vramshare.io"
    return {"metadata": {"name": f"c{n}", "namespace": "default", "uid": f"uid-{n}"},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                "deviceClassName": "mig.vramshare.io",
                "selectors": [{"cel": {"expression": f'device.attributes["{driver}"].profile == "{profile}"'}}]}}]}}}


def _layout(allocated, by_name):
    return [mig.Placed(by_name[r["device"]]["attributes"]["placementStart"]["int"],
                       by_name[r["device"]]["attributes"]["profile"]["string"])
            for c in allocated for r in c["status"]["allocation"]["devices"]["results"] if r["device"] in by_name]


def _counters_used(allocated, by_name):
    used: dict[str, int] = {}
    for c in allocated:
        for r in c["status"]["allocation"]["devices"]["results"]:
            for cs in by_name.get(r["device"], {}).get("consumesCounters") or ():
                for k, v in cs["counters"].items():
                    used[k] = used.get(k, 0) + int(v["value"])
    return used


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=st.lists(st.tuples(st.sampled_from([p.name for p in A100.profiles]), st.booleans(),
                                st.integers(0, 20)), min_size=1, max_size=25))
def test_counters_are_never_exceeded_in_any_order(inventory, dyn_config, dynamic, steps):
    """Claims of random profiles arrive (and some leave) in random order: the allocator never hands
    out a set of partitions that passes a counter, and refuses only when the GPU's geometry has no
    room for the profile (it is exactly NVML's rule, mig.check_layout / mig.free_starts)."""
    pool = _pool(inventory, dyn_config, dynamic)
    by_name = {d["name"]: d for d in _partitions(pool)}
    capacity = {k: int(v["value"]) for k, v in pool[0]["spec"]["sharedCounters"][0]["counters"].items()}
    held: list[dict] = []
    for n, (profile, leave, which) in enumerate(steps):
        if leave and held:
            held.pop(which % len(held))
            continue
        before = _layout(held, by_name)
        got = alloc.allocate(_claim(profile, n), NODE, pool, CLASSES, held)
        if got is None:
            assert mig.free_starts(A100, before, profile) == [], (profile, before)
            continue
        held.append({**_claim(profile, n), "status": {"allocation": got}})
        layout = _layout(held, by_name)
        assert mig.check_layout(A100, layout) == []
        assert all(used <= capacity[k] for k, used in _counters_used(held, by_name).items())


def test_first_fit_takes_the_highest_start_first(inventory, dyn_config, dynamic):
    pool = _pool(inventory, dyn_config, dynamic)
    got = alloc.allocate(_claim("1g.10gb", 0), NODE, pool, CLASSES, [])
    assert got["devices"]["results"][0]["device"] == "gpu-3-mig-1g10gb-19-6"


def test_without_the_gate_partitions_are_never_allocated(inventory, dyn_config, dynamic):
    pool = _pool(inventory, dyn_config, dynamic)
    assert alloc.allocate(_claim("3g.40gb", 0), NODE, pool, CLASSES, [], partitionable=False) is None
    assert alloc.allocate(_claim("3g.40gb", 0), NODE, pool, CLASSES, []) is not None


def test_an_over_consumed_counter_blocks_the_whole_pool(inventory, dyn_config, dynamic):
    """checkAvailableCounters compares every counter of the pool, not only the device's own."""
    pool = _pool(inventory, dyn_config, dynamic)
    # two allocated claims on overlapping placements (a stale view): memory-slice-0 is at -1
    stale = [{**_claim("1g.10gb", i), "status": {"allocation": {"devices": {"results": [
        {"request": "gpu", "driver": "gpu.vramshare.io", "pool": NODE, "device": d}]}}}}
        for i, d in enumerate(("gpu-3-mig-1g10gb-19-0", "gpu-3-mig-1g20gb-15-0"))]
    assert alloc.allocate(_claim("1g.10gb", 9), NODE, pool, CLASSES, stale) is None


def test_an_invalid_pool_allocates_nothing(inventory, dyn_config, dynamic):
    pool = _pool(inventory, dyn_config, dynamic)
    del pool[0]["spec"]["sharedCounters"][0]["counters"]["compute-slices"]
    assert alloc.allocate(_claim("3g.40gb", 0), NODE, pool, CLASSES, []) is None
