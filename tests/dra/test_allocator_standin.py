"""The stand-in DRA allocator against upstream's consumable-capacity rules and our DeviceClasses/templates."""
from __future__ import annotations

import pathlib

import pytest
import yaml
from hypothesis import HealthCheck, given, settings, strategies as st
from kubernetes.utils import parse_quantity

from deviceplugin.dra import slices
from standins import dra_allocator as alloc
from tests.dra.conftest import NODE

DRA_DEPLOY = pathlib.Path(__file__).resolve().parents[2] / "deploy" / "daemonset" / "dra"
Gi, Mi = 1024 ** 3, 1024 ** 2


def _load(name):
    return [d for d in yaml.safe_load_all((DRA_DEPLOY / name).read_text()) if d]


CLASSES = {c["metadata"]["name"]: c for c in _load("deviceclasses.yaml")}
TEMPLATES = {t["metadata"]["name"]: t for t in _load("examples/claim-templates.yaml")}


def _claim(template: str, name: str = "c") -> dict:
    return {"metadata": {"name": name, "namespace": "default", "uid": f"uid-{name}"},
            "spec": TEMPLATES[template]["spec"]["spec"]}


def _allocated(claim: dict, allocation: dict) -> dict:
    return {**claim, "status": {"allocation": allocation}}


@pytest.fixture
def pool(inventory, config):
    return slices.resource_slices(NODE, None, slices.desired_devices(inventory, config.names, NODE, taints=False), 1,
                                  config.names)


# upstream consumable_capacity_test.go cases, restated: policy {default 1Gi, min 1Gi, step 1Gi, max 80Gi}
CAP = {"value": "80Gi", "requestPolicy": {"default": "1Gi", "validRange": {"min": "1Gi", "max": "80Gi", "step": "1Gi"}}}


@pytest.mark.parametrize("requested, consumed", [
    (None, 1 * Gi),  # no request: the default
    (512 * Mi, 1 * Gi),  # below min: min
    (22 * Gi, 22 * Gi),  # on the grid
    (22 * Gi + 1, 23 * Gi),  # rounds up to the next step from min
    (80 * Gi, 80 * Gi),
])
def test_consumed_capacity_rounds_like_round_up_range(requested, consumed):
    assert alloc.consumed_capacity(requested, CAP) == consumed
    assert not alloc.violates_policy(consumed, CAP)


def test_policy_violations_and_no_policy():
    assert alloc.violates_policy(81 * Gi, CAP)  # above max
    assert alloc.violates_policy(1 * Gi + 1, CAP)  # off the grid
    assert alloc.consumed_capacity(None, {"value": "10Gi"}) == 10 * Gi  # no policy, no request: everything
    assert alloc.consumed_capacity(3, {"value": "10Gi"}) == 3


def test_device_classes_select_by_mode_and_driver(pool):
    devs = [d for s in pool for d in s["spec"]["devices"]]
    pick = {name: sorted(d["name"] for d in devs
                         if all(alloc.cel_eval(sel["cel"]["expression"], d, "gpu.vramshare.io")
                                for sel in cls["spec"]["selectors"]))
            for name, cls in CLASSES.items()}
    assert pick["gpu-memory.vramshare.io"] == ["gpu-0", "gpu-2"]
    assert pick["gpu.vramshare.io"] == ["gpu-1"]
    assert len(pick["mig.vramshare.io"]) == 4
    other = {"name": "x", "attributes": {"mode": {"string": "shared"}}}
    assert not alloc.cel_eval(CLASSES["gpu-memory.vramshare.io"]["spec"]["selectors"][0]["cel"]["expression"],
                              other, "gpu.example.com")  # another driver: && short-circuits, no error


def test_cel_outside_the_subset_is_refused_clearly():
    with pytest.raises(alloc.AllocationError, match="stand-in subset"):
        alloc.cel_eval('device.attributes["x"].y.matches("a.*")', {"name": "d"}, "d")


def test_22gi_template_consumes_22gi_of_one_shared_gpu(pool):
    a = alloc.allocate(_claim("vllm-22gi"), NODE, pool, CLASSES, [], new_share_id=lambda: "share-1")
    [r] = a["devices"]["results"]
    assert r["device"] in ("gpu-0", "gpu-2") and r["shareID"] == "share-1"
    assert r["consumedCapacity"] == {"memory": "22Gi"} and r["driver"] == "gpu.vramshare.io" and r["pool"] == NODE
    assert a["nodeSelector"]["nodeSelectorTerms"][0]["matchFields"][0]["values"] == [NODE]


def test_tp2_template_takes_two_distinct_gpus(pool):
    a = alloc.allocate(_claim("vllm-tp2-48gi"), NODE, pool, CLASSES, [])
    results = a["devices"]["results"]
    assert sorted(r["device"] for r in results) == ["gpu-0", "gpu-2"]
    assert {r["consumedCapacity"]["memory"] for r in results} == {"48Gi"}
    # with 40 GiB already used on gpu-0 there is no second GPU with 48 GiB left
    busy = _allocated(_claim("vllm-22gi", "busy"), {"devices": {"results": [
        {"request": "gpu", "driver": "gpu.vramshare.io", "pool": NODE, "device": "gpu-0", "shareID": "s",
         "consumedCapacity": {"memory": "40Gi"}}]}})
    assert alloc.allocate(_claim("vllm-tp2-48gi"), NODE, pool, CLASSES, [busy]) is None


def test_mig_template_takes_a_1g_10gb_instance_once(pool):
    first = alloc.allocate(_claim("mig-1g-10gb", "a"), NODE, pool, CLASSES, [])
    [r] = first["devices"]["results"]
    assert "shareID" not in r and "-mig-" in r["device"]
    second = alloc.allocate(_claim("mig-1g-10gb", "b"), NODE, pool, CLASSES, [_allocated(_claim("mig-1g-10gb", "a"),
                                                                                          first)])
    assert second["devices"]["results"][0]["device"] != r["device"]
    held = [_allocated(_claim("mig-1g-10gb", "a"), first), _allocated(_claim("mig-1g-10gb", "b"), second)]
    assert alloc.allocate(_claim("mig-1g-10gb", "c"), NODE, pool, CLASSES, held) is None  # only two 1g.10gb


def test_incomplete_or_tainted_pools_are_skipped(pool, inventory, config):
    half = [dict(pool[0], spec={**pool[0]["spec"], "pool": {**pool[0]["spec"]["pool"], "resourceSliceCount": 2}})]
    assert alloc.complete_pools(half, NODE) == []
    tainted = slices.resource_slices(NODE, None, [dict(d, taints=[slices.unhealthy_taint(config.names)])
                                                  for d in pool[0]["spec"]["devices"]], 1, config.names)
    assert alloc.complete_pools(tainted, NODE) == []


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.integers(1, 100), min_size=1, max_size=30))
def test_shares_never_exceed_a_gpus_capacity(inventory, config, sizes_gib):  # fixtures are read-only here
    pool = slices.resource_slices(NODE, None, slices.desired_devices(inventory, config.names, NODE, taints=False), 1,
                                  config.names)
    held = []
    for i, gib in enumerate(sizes_gib):
        spec = {"devices": {"requests": [{"name": "gpu", "exactly": {
            "deviceClassName": "gpu-memory.vramshare.io", "capacity": {"requests": {"memory": f"{gib}Gi"}}}}]}}
        claim = {"metadata": {"name": f"c{i}", "namespace": "d", "uid": f"u{i}"}, "spec": spec}
        a = alloc.allocate(claim, NODE, pool, CLASSES, held)
        if a is not None:
            held.append(_allocated(claim, a))
    _, used = alloc.in_use(held)
    caps = {d["name"]: parse_quantity(d["capacity"]["memory"]["value"]) for s in pool for d in s["spec"]["devices"]}
    for (_, _, device), amount in used.items():
        assert amount <= caps[device]
    for gib in sizes_gib:  # a refused size really fits on no shared GPU now
        fits_somewhere = any(caps[d] - used.get(("gpu.vramshare.io", NODE, d), 0) >= gib * Gi
                             for d in ("gpu-0", "gpu-2"))
        spec = {"devices": {"requests": [{"name": "gpu", "exactly": {
            "deviceClassName": "gpu-memory.vramshare.io", "capacity": {"requests": {"memory": f"{gib}Gi"}}}}]}}
        probe = {"metadata": {"name": "probe", "namespace": "d", "uid": "p"}, "spec": spec}
        assert (alloc.allocate(probe, NODE, pool, CLASSES, held) is not None) == fits_somewhere
