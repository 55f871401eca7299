"""``vramshare inspect`` shows each node's enforcement mode and each pod's warmth (issue 9), and reads
inventories and pods without them as before."""
from __future__ import annotations

import json
from types import SimpleNamespace

from extender import inspection
from vramshare import contract
from vramshare.inventory import EnforcementMode, NodeInventory

NAMES = contract.Names()


def test_mode_comes_from_the_optional_inventory_field():
    assert inspection._enforcement(NodeInventory(1024, enforcement=EnforcementMode.DRIVER).to_json()) == "driver"
    assert inspection._enforcement(NodeInventory(1024).to_json()) is None
    assert inspection._enforcement("{not json") is None and inspection._enforcement(None) is None


def test_pod_state_comes_from_the_quota_mirror():
    mirror = json.dumps({"server": [{"uuid": "GPU-0", "mib": 9000, "state": "warm"}]})
    acct = SimpleNamespace(pods={"llm/a": {"metadata": {"annotations": {NAMES.quota_mib: mirror}}},
                                 "llm/b": {"metadata": {"annotations": {NAMES.quota_mib: "[broken"}}},
                                 "llm/c": {"metadata": {}}})
    assert inspection._states(acct, NAMES) == {"llm/a": "warm"}


def test_table_shows_both():
    doc = {"nodes": [{"name": "n1", "totalMiB": 20480, "usedMiB": 10240, "freeMiB": 10240, "enforcement": "driver",
                      "gpus": [{"index": 0, "model": "H100", "kind": "shared", "healthy": True, "totalMiB": 20480,
                                "usedMiB": 10240, "freeMiB": 10240,
                                "pods": [{"pod": "llm/a", "mib": 10240, "state": "warm"}]}]}]}
    table = inspection.format_table(doc)
    assert "llm/a (10.0, warm)" in table and "GPU memory enforcement: n1 driver" in table


def test_tenants_show_class_request_floor_limit_use_state_mode_and_reason():
    """Issue 14: per GPU each tenant's class, request, floor, limit, use, state, the node's enforcement
    mode and the reason of its last change, from the quota loop's mirror."""
    mirror = json.dumps({"server": [{"uuid": "GPU-0", "mib": 30720, "state": "hot", "class": "batch", "req": 40960,
                                     "floor": 4096, "used": 30000, "why": "cut -10240: GPU over-committed"}]})
    acct = SimpleNamespace(pods={"llm/a": {"metadata": {"annotations": {NAMES.quota_mib: mirror}}},
                                 "llm/b": {"metadata": {"annotations": {NAMES.quota_mib: json.dumps({"x": [1, {}]})}}}})
    tenants = inspection._tenants(inspection._mirrors(acct, NAMES))
    assert tenants == {"GPU-0": [{"pod": "llm/a", "container": "server", "class": "batch", "requestMiB": 40960,
                                  "floorMiB": 4096, "limitMiB": 30720, "usedMiB": 30000, "state": "hot",
                                  "reason": "cut -10240: GPU over-committed"}]}
    doc = {"nodes": [{"name": "n1", "totalMiB": 81920, "usedMiB": 40960, "freeMiB": 40960, "enforcement": "driver",
                      "gpus": [{"index": 0, "model": "H100", "kind": "shared", "healthy": True, "totalMiB": 81920,
                                "usedMiB": 40960, "freeMiB": 40960, "pods": [{"pod": "llm/a", "mib": 40960}],
                                "tenants": tenants["GPU-0"]}]}]}
    table = inspection.format_table(doc)
    row = next(line for line in table.splitlines() if line.startswith("n1") and "llm/a/server" in line)
    assert row.split()[:11] == ["n1", "0", "llm/a/server", "batch", "40.0", "4.0", "30.0", "29.3", "hot", "driver",
                                "cut"]
    assert "GPU over-committed" in row
