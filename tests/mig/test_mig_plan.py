"""The dynamic-MIG plan codec (vramshare/mig_plan.py): one encode, one parse, strict and bounded."""
from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vramshare import contract, mig, mig_plan
from vramshare.mig_plan import MigPlacement, PlanError

UUID = "GPU-5e6f7081-92a3-44b5-86d7-e8f90a1b2c34"  # NVML's form: GPU- and 36 characters
PLACEMENTS = [(m, p) for m in mig.MODELS.values() for p in mig.all_placements(m)]


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(PLACEMENTS), st.uuids())
def test_every_placement_of_every_table_round_trips_within_the_kubelet_limit(pair, u):
    _model, placed = pair
    plan = MigPlacement(f"GPU-{u}", placed.profile, placed.start)
    text = mig_plan.encode(plan)
    assert mig_plan.parse(text) == plan
    assert len(text) <= contract.MAX_DEVICE_ID_LEN
    with pytest.raises(ValueError):  # never mistaken for a memory-unit ID
        contract.parse_unit_device_id(text)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=80))
def test_parse_accepts_only_what_encode_writes(text):
    try:
        plan = mig_plan.parse(text)
    except PlanError:
        return
    assert mig_plan.encode(plan) == text


@pytest.mark.parametrize("bad", [
    UUID, f"{UUID}::3", "MIG-1234", f"{UUID}::mig-3g.40gb", f"{UUID}::mig-3g.40gb@8", f"{UUID}::mig-3g.40gb@-1",
    f"{UUID}::mig-3g.40gb@04", f"{UUID}::mig-9g.40gb@0", f"{UUID}::mig-3g.40@0", f"::mig-3g.40gb@0",
    f"GPU_x::mig-3g.40gb@0", f"{'G' * 49}::mig-1g.5gb@0", f"{UUID}::mig-3g.40gb@٣", None, 7,
])
def test_what_is_not_a_plan_is_refused_with_the_form(bad):
    with pytest.raises(PlanError):
        mig_plan.parse(bad)
    if isinstance(bad, str):
        assert mig_plan.try_parse(bad) is None


def test_encode_refuses_a_plan_parse_would_refuse():
    with pytest.raises(PlanError):
        mig_plan.encode(MigPlacement(UUID, "3g.40gb", 9))


# -- the inventory's dynamicMig section (v1, additive) -------------------------------------------------
def _inventory(dyn: object) -> str:
    import json
    return json.dumps({"version": "v1", "unitMiB": 1024, "gpus": [
        {"index": 0, "uuid": UUID, "model": "NVIDIA H100 80GB HBM3", "memoryMiB": 81559, "mode": "mig",
         "mig": [], **({"dynamicMig": dyn} if dyn is not None else {})}]})


def test_dynamic_mig_round_trips_and_an_old_inventory_reads_as_static():
    from vramshare.inventory import NodeInventory
    doc = {"table": "H100-SXM5-80GB", "instances": [{"profile": "3g.40gb", "start": 0}],
           "free": {"1g.10gb": [4, 5, 6], "7g.80gb": []}}
    inv = NodeInventory.from_json(_inventory(doc))
    assert NodeInventory.from_json(inv.to_json()) == inv
    d = inv.gpus[0].dynamic_mig
    assert d is not None and d.instances == (("3g.40gb", 0),) and dict(d.free)["1g.10gb"] == (4, 5, 6)
    assert NodeInventory.from_json(_inventory(None)).gpus[0].dynamic_mig is None


@pytest.mark.parametrize("bad, where", [
    ("x", "dynamicMig: expected an object"),
    ({"instances": []}, "missing key 'table'"),
    ({"table": "H100-SXM5-80GB", "instances": [{"profile": "3g.40gb", "start": 8}]}, "start: 8 is outside"),
    ({"table": "H100-SXM5-80GB", "instances": [{"profile": "1g.10gb", "start": 0}] * 9}, "at most 8"),
    ({"table": "H100-SXM5-80GB", "free": {"1g.10gb": [0, True]}}, "free.1g.10gb"),
    ({"table": "H100-SXM5-80GB", "free": [1]}, "free: expected an object"),
])
def test_a_bad_dynamic_mig_section_is_refused_naming_the_field(bad, where):
    from vramshare.inventory import InventoryError, NodeInventory
    with pytest.raises(InventoryError, match=re.escape(where)):
        NodeInventory.from_json(_inventory(bad))
