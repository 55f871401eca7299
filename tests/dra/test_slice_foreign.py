"""Foreign memory on the DRA path: what no claim of ours holds comes off a shared device's published
capacity, because kube-scheduler's allocator books ``capacity.memory`` and nothing else
(:mod:`vramshare.contract.slice_foreign`; the device plugin's path publishes it in the inventory).

Checked against the API server's validation (``kubernetes_validate`` for the schema, our restatement of
validation.go for the request policy) and the allocator stand-in (consumable capacity as upstream)."""
from __future__ import annotations

import dataclasses
import pathlib

import kubernetes_validate
import pytest
import yaml
from hypothesis import HealthCheck, given, settings, strategies as st

from deviceplugin.dra import slices
from standins import dra_allocator as alloc
from tests.dra.conftest import NODE, dra_config
from tests.dra.test_daemon import devices_of, env, start  # noqa: F401 - the daemon test's fixture
from tests.dra.test_quota_tick_view import running_plugin
from vramshare import foreign
from vramshare.contract import slice_foreign

DRA_DEPLOY = pathlib.Path(__file__).resolve().parents[2] / "deploy" / "daemonset" / "dra"
UID = "0b7e2c4e-1111-2222-3333-444455556666"


def _load(name):
    return [d for d in yaml.safe_load_all((DRA_DEPLOY / name).read_text()) if d]


CLASSES = {c["metadata"]["name"]: c for c in _load("deviceclasses.yaml")}
TEMPLATES = {t["metadata"]["name"]: t for t in _load("examples/claim-templates.yaml")}


def _held(inventory, mib_by_index):
    """``inventory`` with the quota loop's settled figures (MiB per GPU index), as the daemon publishes it."""
    settled = {inventory.gpus[i].uuid: mib for i, mib in mib_by_index.items()}
    return foreign.with_foreign(inventory, foreign.schedulable_foreign(inventory, settled))


def _devices(inventory, config, taints=False):
    return {d["name"]: d for d in slices.desired_devices(inventory, config.names, NODE, taints=taints)}


def _valid(devs, config):
    ok, refused = slices.publishable(list(devs.values()))
    assert refused == []
    for obj in slices.resource_slices(NODE, UID, ok, 3, config.names):
        kubernetes_validate.validate(obj, "1.36", strict=True)


def test_foreign_memory_comes_off_the_capacity_and_is_named_on_the_device(inventory, config):
    gpu = inventory.gpus[0]  # 81,559 MiB, 79 units of 1,024: 663 MiB of slack
    slack = gpu.memory_mib - gpu.units * inventory.unit_mib
    devs = _devices(_held(inventory, {0: slack + 20_000}), config)  # 20,000 MiB past the slack: 20 units
    mem = devs["gpu-0"]["capacity"]["memory"]
    assert mem["value"] == f"{59 * 1024}Mi"
    assert mem["requestPolicy"]["validRange"]["max"] == f"{59 * 1024}Mi"  # one share fits what is left
    assert slice_foreign.decode(devs["gpu-0"]) == 20 * 1024
    assert slice_foreign.ATTRIBUTE not in devs["gpu-2"]["attributes"]  # the other shared GPU: untouched
    _valid(devs, config)
    assert "capacity" in _devices(_held(inventory, {0: slack}), config)["gpu-0"]  # within the slack: nothing
    assert _devices(_held(inventory, {0: slack}), config)["gpu-0"]["capacity"]["memory"]["value"] == f"{79 * 1024}Mi"


def test_one_unit_left_is_one_valid_value_and_none_left_withholds_or_taints(inventory, config):
    gpu = inventory.gpus[0]
    slack = gpu.memory_mib - gpu.units * inventory.unit_mib
    one = _devices(_held(inventory, {0: slack + 78 * 1024}), config)
    assert one["gpu-0"]["capacity"]["memory"] == {"value": "1024Mi", "requestPolicy": {
        "default": "1024Mi", "validValues": ["1024Mi"]}}
    _valid(one, config)
    full = _held(inventory, {0: gpu.memory_mib})
    assert "gpu-0" not in _devices(full, config)  # nothing to offer: withheld, as an unhealthy GPU
    tainted = _devices(full, config, taints=True)["gpu-0"]
    assert tainted["taints"] == [slices.held_outside_taint(config.names)]
    assert tainted["capacity"]["memory"]["value"] == f"{79 * 1024}Mi"  # published whole, the taint stops claims
    _valid(_devices(full, config, taints=True), config)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(settled=st.integers(0, 200_000), credit_units=st.integers(0, 79))
def test_every_figure_publishes_a_device_the_api_server_accepts(inventory, config, settled, credit_units):
    """Whatever the loop settles on, and with a sleep credit beside it: capacity plus the attribute is the
    GPU's bookable memory, one share never exceeds what is left, and the slice validates."""
    gpu = dataclasses.replace(inventory.gpus[0], sleep_credit_mib=credit_units * inventory.unit_mib)
    inv = _held(dataclasses.replace(inventory, gpus=(gpu,) + inventory.gpus[1:]), {0: settled})
    devs = _devices(inv, config)
    bookable = inv.bookable_mib(inv.gpus[0])
    if "gpu-0" not in devs:
        assert inv.booked_foreign_mib(inv.gpus[0]) == bookable
        return
    mem = devs["gpu-0"]["capacity"]["memory"]
    value = int(mem["value"].removesuffix("Mi"))
    assert value + slice_foreign.decode(devs["gpu-0"]) == bookable
    top = mem["requestPolicy"].get("validRange", {}).get("max") or mem["requestPolicy"]["validValues"][-1]
    assert int(top.removesuffix("Mi")) <= min(value, gpu.units * inventory.unit_mib)
    _valid(devs, config)


def test_the_allocator_no_longer_hands_out_memory_that_is_held_outside(inventory, config):
    """The fault this fixes: a stuck or host process holds 70 GiB of GPU 0 and GPU 2 is busy; the allocator
    saw 79 GiB free on GPU 0 and gave a 22 GiB claim memory that is not there."""
    def pool(inv):
        return slices.resource_slices(NODE, None, slices.desired_devices(inv, config.names, NODE, taints=False), 1,
                                      config.names)

    def claim(name):
        return {"metadata": {"name": name, "namespace": "default", "uid": f"uid-{name}"},
                "spec": TEMPLATES["vllm-22gi"]["spec"]["spec"]}

    big = claim("big")  # the other shared GPU is taken: only GPU 0 is left for a 22 GiB claim
    big["spec"] = {"devices": {"requests": [{**big["spec"]["devices"]["requests"][0]}]}}
    big["spec"]["devices"]["requests"][0]["exactly"] = {
        **big["spec"]["devices"]["requests"][0]["exactly"], "capacity": {"requests": {"memory": "140Gi"}}}
    busy = {**big, "status": {"allocation": alloc.allocate(big, NODE, pool(inventory), CLASSES, [])}}
    assert busy["status"]["allocation"]["devices"]["results"][0]["device"] == "gpu-2"
    gpu = inventory.gpus[0]
    slack = gpu.memory_mib - gpu.units * inventory.unit_mib
    assert alloc.allocate(claim("c"), NODE, pool(inventory), CLASSES, [busy]) is not None  # before: it fits
    held = _held(inventory, {0: slack + 70 * 1024})
    assert alloc.allocate(claim("c"), NODE, pool(held), CLASSES, [busy]) is None  # 9 GiB left: refused
    assert alloc.allocate(claim("c"), NODE, pool(_held(inventory, {0: slack + 50 * 1024})), CLASSES,
                          [busy]) is not None  # 29 GiB left: fits


def test_the_daemon_publishes_the_quota_loops_figure_and_withdraws_it(env):  # noqa: F811
    api = env[0]
    with start(env) as daemon:
        assert api.wait_for(lambda a: len(devices_of(a)) == 7, timeout=20)
        inv = daemon.state.snapshot.inventory
        gpu = inv.gpus[0]
        slack = gpu.memory_mib - gpu.units * inv.unit_mib

        def capacity() -> str:
            return devices_of(api)["gpu-0"]["capacity"]["memory"]["value"]

        daemon.on_foreign_settled({gpu.uuid: slack + 3000})  # a host process holds 3,000 MiB past the slack
        assert api.wait_for(lambda a: capacity() == f"{76 * 1024}Mi", timeout=20)
        assert slice_foreign.decode(devices_of(api)["gpu-0"]) == 3 * 1024
        assert daemon.metrics.registry.get_sample_value("vramshare_dra_foreign_memory_mib",
                                                        {"gpu": gpu.uuid}) == 3 * 1024
        daemon.on_foreign_settled({})
        assert api.wait_for(lambda a: capacity() == f"{79 * 1024}Mi", timeout=20)
        assert slice_foreign.ATTRIBUTE not in devices_of(api)["gpu-0"]["attributes"]


def test_the_quota_loop_tells_the_daemon(tmp_path):
    """The running plugin's quota loop (its use replayed) reports its settled figures to the daemon."""
    with running_plugin(dra_config(tmp_path)) as (api, daemon, _scheduler, _kubelet):
        gpu = daemon.state.snapshot.inventory.gpus[2]  # 143,771 MiB, 140 units
        assert daemon._quota_loop is not None
        daemon._quota_loop.on_foreign({gpu.uuid: gpu.memory_mib})  # as the loop calls it: GPU 2 is full
        assert api.wait_for(lambda a: "gpu-2" not in devices_of(a), timeout=20)  # no taints: withheld
        daemon._quota_loop.on_foreign({})
        assert api.wait_for(lambda a: "gpu-2" in devices_of(a), timeout=20)


@pytest.mark.parametrize("junk", [None, {"int": -1}, {"int": True}, {"string": "5"}, {"int": 1 << 41}, "x"])
def test_the_attribute_decodes_strictly(junk):
    assert slice_foreign.decode({"attributes": {slice_foreign.ATTRIBUTE: junk}}) == 0
    assert slice_foreign.decode({"attributes": {slice_foreign.ATTRIBUTE: slice_foreign.encode(4096)}}) == 4096
