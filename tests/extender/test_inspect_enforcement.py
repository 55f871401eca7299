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
