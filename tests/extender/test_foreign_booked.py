"""A node's report of memory no pod of ours holds (the inventory's ``gpus[].foreignMiB``) is booked: the
extender books that memory as used beside the pods (vramshare/foreign.py), and plans it again in
full once the node reports it gone.

Before, a process that outlived its pod's grace (or a host process) held memory the extender still
offered: it planned a pod there, and the node's quota loop, which takes foreign memory off what it
divides, then fenced that GPU's tenants below their requests.
"""
from __future__ import annotations

import pytest

from extender import accounting, cluster, inspection, verbs, wire
from tests.extender import builders as b
from tests.extender.test_actual import T0, Clock
from vramshare.config import Config, ExtenderConfig, Policy
from vramshare.foreign import with_foreign

GPU = "GPU-n1-0"
UNIT = 1024


def _node(foreign_mib: int) -> dict:
    inv = with_foreign(b.node_inventory("n1", b.l4()), {GPU: foreign_mib} if foreign_mib else {})
    return b.gpu_node("n1", b.l4(), annotation=inv.to_json())


def _acct(foreign_mib: int) -> accounting.Accounting:
    a = accounting.Accounting(Config(extender=ExtenderConfig(policy=Policy.BINPACK)), Clock())
    a.apply_node("ADDED", _node(foreign_mib))
    return a


def _filter(acct: accounting.Accounting, gib: int) -> wire.FilterResult:
    return verbs.filter_pod(acct.view(Policy.BINPACK), wire.ExtenderArgs(pod=b.pod("p", gib), node_names=["n1"]))


def test_a_pod_that_fits_the_units_but_not_beside_the_foreign_memory_is_filtered_out() -> None:
    # an L4 offers 22 units of 1 GiB; 6 GiB is held by a process no pod of ours owns
    acct = _acct(6 * UNIT)
    assert _filter(acct, 16).passed == ["n1"]
    refused = _filter(acct, 17)
    assert refused.passed == [] and "n1" in (refused.failed or {})  # ordinary: the memory may come back
    with pytest.raises(cluster.OverCommit):
        acct.reserve("default/p", "n1", [(GPU, 17 * UNIT)], T0)


def test_memory_reported_gone_is_planned_again() -> None:
    acct = _acct(6 * UNIT)
    assert _filter(acct, 17).passed == []
    acct.apply_node("MODIFIED", _node(0))
    assert _filter(acct, 22).passed == ["n1"]


def test_inspect_shows_the_memory_held_outside_our_pods() -> None:
    acct = _acct(6 * UNIT)
    doc = inspection.render(acct, "n1")
    assert doc is not None
    gpu = doc["gpus"][0]
    assert (gpu["totalMiB"], gpu["usedMiB"], gpu["foreignMiB"]) == (22 * UNIT, 6 * UNIT, 6 * UNIT)
    assert "6.0 of USED held outside our pods" in inspection.format_table(doc)


def test_a_new_report_replaces_the_foreign_memory_and_keeps_the_pods_bookings() -> None:
    acct = _acct(0)
    acct.reserve("default/p", "n1", [(GPU, 4 * UNIT)], T0)
    for foreign, used in [(6, 10), (2, 6), (0, 4), (22, 26)]:  # 26: over capacity, as the GPU really is
        acct.apply_node("MODIFIED", _node(foreign * UNIT))
        assert acct.state.node_usage("n1")[0].used == used * UNIT
    acct.apply_node("MODIFIED", _node(0))
    acct.release("default/p", T0)  # its bind failed: the booking goes
    assert acct.state.node_usage("n1")[0].used == 0


def test_a_pod_the_watch_shows_assumed_is_still_booked_where_foreign_memory_appeared_since() -> None:
    """A restarted extender relists: the node reports foreign memory that came after the pod was planned.
    The pod's booking is a decision already made (kube-scheduler bound it), so it is recorded, over
    capacity as the GPU really is, never dropped as unaccounted."""
    acct = _acct(6 * UNIT)
    p = b.assigned(b.pod("p", 20), "n1", [(GPU, 20 * UNIT)], T0)
    acct.apply_pod("ADDED", p)
    assert acct.unaccounted == {}
    assert acct.state.node_usage("n1")[0].used == 26 * UNIT
    assert _filter(acct, 1).passed == []
