"""Upgrade and version skew (issue 11): a device plugin one release older or newer than the extender,
and a reinstall over the annotations a `kubectl delete -k` leaves behind.

The inventory annotation is versioned (v1) and evolves additively: an older plugin may not publish
``units`` (derived from memoryMiB / unitMiB, never read as 0 = a full GPU), a newer one may add keys
(ignored). A new major version is refused with a reason, not misread.
"""
from __future__ import annotations

import json
import urllib.request
from typing import Any

import orjson
import pytest

from extender import main, translate
from standins.apiserver import ApiServerDouble
from tests.deviceplugin.conftest import (backend, config, kubelet, short_dir,  # noqa: F401 - fixtures
                                         start_plugin)
from tests.extender import builders as b
from vramshare import contract, kube
from vramshare.inventory import GpuMode, InventoryError, NodeInventory, inventory_from_dict

N = contract.Names()
GiB = 1024


def current(name: str = "n1") -> dict[str, Any]:
    return json.loads(b.node_inventory(name, b.a100(), b.l4(), b.a100(mig=(("3g.40gb", 40192),))).to_json())


def previous(name: str = "n1") -> dict[str, Any]:
    """As an older plugin wrote it: no version, no units, no health or NUMA keys."""
    doc = current(name)
    del doc["version"]
    for g in doc["gpus"]:
        for key in ("units", "healthy", "numaNode"):
            g.pop(key, None)
    return doc


def nxt(name: str = "n1") -> dict[str, Any]:
    """As a newer plugin might write it: same v1 keys plus ones this release does not know."""
    doc = current(name)
    doc["driverVersion"] = "575.51"
    doc["topology"] = {"nvlink": [[0, 1]]}
    for g in doc["gpus"]:
        g["memoryBandwidthGBs"] = 2039
        g["slices"] = {"kind": "units", "count": g["units"]}
        for m in g["mig"]:
            m["placement"] = {"start": 0, "size": 4}
    return doc


def test_a_missing_units_is_derived_never_zero() -> None:
    old = inventory_from_dict(previous())
    new = inventory_from_dict(current())
    assert [g.units for g in old.gpus] == [g.units for g in new.gpus] == [80, 22, 0]
    assert old.gpus[0].mode is GpuMode.SHARED and old.capacity_mib(old.gpus[0]) == 80 * GiB


def test_a_newer_writers_extra_keys_are_ignored() -> None:
    assert inventory_from_dict(nxt()) == inventory_from_dict(current())


@pytest.mark.parametrize("mutate, where", [
    (lambda d: d.update(version="v2"), "inventory.version"),
    (lambda d: d["gpus"][0].update(units=1e30), "inventory.gpus[0].units"),
    (lambda d: d["gpus"][0].update(units=81), "inventory.gpus[0].units"),
    (lambda d: d["gpus"][0].update(units=-1), "inventory.gpus[0].units"),
    (lambda d: d["gpus"][0].update(memoryMiB=True), "inventory.gpus[0].memoryMiB"),
    (lambda d: d["gpus"][0].update(healthy="false"), "inventory.gpus[0].healthy"),
    (lambda d: d.update(unitMiB=0), "inventory.unitMiB"),
    (lambda d: d["gpus"][2]["mig"][0].update(memoryMiB=2**60), "inventory.gpus[2].mig[0].memoryMiB"),
])
def test_values_no_gpu_can_have_are_refused_with_the_field(mutate: Any, where: str) -> None:
    doc = current()
    mutate(doc)
    with pytest.raises(InventoryError) as err:
        inventory_from_dict(doc)
    assert str(err.value).startswith(where)


def _filter(url: str, pod: dict[str, Any], nodes: list[str]) -> dict[str, Any]:
    body = orjson.dumps({"Pod": pod, "NodeNames": nodes})
    req = urllib.request.Request(url + "/filter", data=body, method="POST")
    with urllib.request.urlopen(req, timeout=5) as resp:
        return orjson.loads(resp.read())


def test_the_extender_schedules_on_older_and_newer_plugins_nodes() -> None:
    with ApiServerDouble() as api:
        for name, doc in (("old", previous("old")), ("cur", current("cur")), ("new", nxt("new"))):
            node = b.gpu_node(name, b.a100())
            node["metadata"]["annotations"][N.inventory] = json.dumps(doc)
            api.create_node(node)
        with main.start_for_url(api.url) as ext:
            assert ext.wait_ready(10)
            out = _filter(ext.url, b.pod("big", 70), ["old", "cur", "new"])
            assert sorted(out["NodeNames"]) == ["cur", "new", "old"], out
            # Same capacities as the current shape: nothing lost (a 0-unit GPU) or invented.
            caps = {n: [s.capacity for s in translate.node_slots(api.get_node(n), N) or []]
                    for n in ("old", "cur", "new")}
            assert caps["old"] == caps["cur"] == caps["new"] and caps["cur"][0] == 80 * GiB


def test_reinstall_over_stale_annotations(start_plugin: Any) -> None:  # noqa: F811
    """`kubectl delete -k` removes the daemons but not what they wrote: the node's inventory annotation
    and the running pods' assignment annotations. A reinstall must neither be blocked by them nor lose
    the running pods' memory: the plugin overwrites the stale inventory (even an unreadable one) and
    the new extender accounts the running pods from their annotations."""
    with ApiServerDouble() as api:
        stale = {"version": "v1", "unitMiB": 512, "gpus": [{"index": 0, "uuid": "GPU-gone", "model": "old",
                                                             "memoryMiB": 1024}]}
        api.create_node({"metadata": {"name": "gpu-1", "annotations": {N.inventory: json.dumps(stale)}}})
        api.create_node({"metadata": {"name": "gpu-2", "annotations": {N.inventory: "{not json"}}})
        client = kube.api_client_for(api.url)
        try:
            start_plugin(api=client, node="gpu-1")
            start_plugin(api=client, node="gpu-2")

            def published(node: str) -> NodeInventory | None:
                text = (api.get_node(node)["metadata"].get("annotations") or {}).get(N.inventory, "")
                try:
                    inv = NodeInventory.from_json(text)
                except InventoryError:
                    return None
                return inv if inv.unit_mib == 1024 else None

            assert api.wait_for(lambda _: published("gpu-1") is not None and published("gpu-2") is not None,
                                timeout=20)
            inv = published("gpu-1")
            assert inv is not None
            shared = next(g for g in inv.gpus if g.mode is GpuMode.SHARED)
            # A pod of the previous install, still running on the shared GPU with its annotations.
            running = b.assigned(b.pod("survivor", 30), "gpu-1", [(shared.uuid, 30 * GiB)], 1, state="allocated")
            running["status"] = {"phase": "Running"}
            api.create_pod(running)
            with main.start_for_url(api.url) as ext:
                assert ext.wait_ready(10)
                with urllib.request.urlopen(ext.url + "/inspect/gpu-1", timeout=5) as resp:
                    doc = orjson.loads(resp.read())
                gpu = next(g for g in doc["gpus"] if g["uuid"] == shared.uuid)
                assert gpu["usedMiB"] == 30 * GiB and gpu["totalMiB"] == shared.units * GiB
                fits = shared.units - 30
                out = _filter(ext.url, b.pod("next", fits), ["gpu-1", "gpu-2"])
                assert "gpu-1" in out["NodeNames"]
                out = _filter(ext.url, b.pod("too-big", fits + 1), ["gpu-1"])
                assert out["NodeNames"] in ([], None)
        finally:
            client.close()
