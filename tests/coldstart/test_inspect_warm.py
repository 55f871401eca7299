"""``vramshare inspect`` shows the warm tier (issue 23): engines asleep or awake per GPU and the model
files a node caches (from its inventory), and per tenant the engine's state, what it lends and its last
wake (from the quota loop's mirror)."""
from __future__ import annotations

import json
from types import SimpleNamespace

from extender import inspection
from vramshare import contract
from vramshare.inventory import EngineState, ResidentModel

NAMES = contract.Names()


def test_mirror_and_models_reach_the_table():
    mirror = json.dumps({"server": [{"uuid": "GPU-0", "mib": 2048, "state": "warm", "class": "default", "req": 20480,
                                     "floor": 0, "used": 1000, "why": "shrink", "sleep": "sleeping", "lent": 18432,
                                     "wakeS": 1.25}]})
    acct = SimpleNamespace(pods={"llm/a": {"metadata": {"annotations": {NAMES.quota_mib: mirror}}}})
    tenants = inspection._tenants(inspection._mirrors(acct, NAMES))
    assert tenants["GPU-0"][0]["sleep"] == "sleeping" and tenants["GPU-0"][0]["lentMiB"] == 18432
    files, engines = inspection._models((ResidentModel("org/m", "r1", 16 << 30, (("GPU-0", EngineState.SLEEPING),)),))
    assert files == [{"model": "org/m@r1", "bytes": 16 << 30}]
    doc = {"nodes": [{"name": "n1", "totalMiB": 81920, "usedMiB": 20480, "freeMiB": 61440, "models": files,
                      "gpus": [{"index": 0, "model": "H100", "kind": "shared", "healthy": True, "totalMiB": 81920,
                                "usedMiB": 20480, "freeMiB": 61440, "pods": [{"pod": "llm/a", "mib": 20480}],
                                "tenants": tenants["GPU-0"], "engines": engines["GPU-0"]}]}]}
    table = inspection.format_table(doc)
    assert "engines: org/m@r1 sleeping" in table
    assert "warm (sleeping, lent 18.0, last wake 1.25s)" in table
    assert "n1: model files cached: org/m@r1 (16.0 GiB)" in table


def test_tenants_without_a_warm_tier_look_as_before():
    mirror = json.dumps({"server": [{"uuid": "GPU-0", "mib": 2048, "state": "hot"}]})
    acct = SimpleNamespace(pods={"llm/a": {"metadata": {"annotations": {NAMES.quota_mib: mirror}}}})
    t = inspection._tenants(inspection._mirrors(acct, NAMES))["GPU-0"][0]
    assert "sleep" not in t and inspection._state(t) == "hot"
