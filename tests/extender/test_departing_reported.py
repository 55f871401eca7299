"""A node's report of its deleted pods that may still run (the inventory's ``departing`` section) books
their GPUs in an extender that never saw the deletion (extender/accounting.py ``_book_reported``).

Found by the soak with forced same-name recreations and an extender kill every 4 s (seed 57, 60% forced):
the extender's own departing booking is in memory, so a restart inside a pod's grace lost it and planned
the recreated pod onto GPUs the kubelet still ran the old one on (4 GPUs over capacity by plan, 8 steering
misses, 17 admission failures).
"""
from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings, strategies as st

from extender import accounting, cluster
from tests.extender import builders as b
from tests.extender.test_accounting import SEC, T0, Clock
from vramshare import contract
from vramshare.config import Config, ExtenderConfig, Policy
from vramshare.departing import DepartingPod

GPU = "GPU-n1-0"


def _node(*departing: DepartingPod) -> dict:
    inv = dataclasses.replace(b.node_inventory("n1", b.l4()), departing=departing)
    return b.gpu_node("n1", b.l4(), annotation=inv.to_json())


def _acct(clock: Clock, *departing: DepartingPod) -> accounting.Accounting:
    a = accounting.Accounting(Config(extender=ExtenderConfig(policy=Policy.BINPACK)), clock)
    a.apply_node("ADDED", _node(*departing))
    return a


def used(acct: accounting.Accounting) -> int:
    return acct.state.node_usage("n1")[0].used


def _running(grace: int) -> dict:
    """The pod ``default/p`` running on the GPU, reported allocated, with its termination grace."""
    p = b.assigned(b.pod("p", 20, uid="uid-old"), "n1", [(GPU, 20480)], T0, state=contract.STATE_ALLOCATED)
    return {**p, "spec": {**p["spec"], "terminationGracePeriodSeconds": grace},
            "status": {"phase": "Running", "containerStatuses": [{"name": "c0", "state": {"running": {}}}]}}


def _booked_until(acct: accounting.Accounting, clock: Clock, end_s: int) -> None:
    """The GPU stays booked a second before T0 + ``end_s`` and is free a second after."""
    clock.now = T0 + (end_s - 1) * SEC
    acct.expire()
    assert used(acct) == 20480
    clock.now = T0 + (end_s + 1) * SEC
    acct.expire()
    assert used(acct) == 0


def _gone(uid: str = "uid-old", seconds: int = 20, mib: int = 20480) -> DepartingPod:
    return DepartingPod("default/p", uid, T0 // SEC + seconds, ((GPU, mib),))


def test_a_restarted_extender_books_what_the_node_reports_until_its_end() -> None:
    clock = Clock()
    acct = _acct(clock, _gone(seconds=20))      # a fresh extender: it saw no deletion
    assert used(acct) == 20480
    with pytest.raises(cluster.OverCommit):      # the recreated pod cannot be planned onto it
        acct.reserve("default/p", "n1", [(GPU, 20480)], T0, uid="uid-new")
    clock.now += 19 * SEC
    acct.expire()
    assert used(acct) == 20480
    clock.now += 2 * SEC
    acct.expire()
    assert used(acct) == 0
    acct.apply_node("MODIFIED", _node(_gone(seconds=20)))  # the node's stale report books nothing again
    assert used(acct) == 0


def test_a_report_that_already_ended_books_nothing() -> None:
    assert used(_acct(Clock(), _gone(seconds=0))) == 0


def test_a_pod_the_watch_still_shows_is_booked_once_and_its_deletion_keeps_it() -> None:
    """The node's watch may deliver the deletion before the extender's: the pod stays booked as itself, not
    twice; its forced deletion then keeps it by the extender's own rule."""
    clock = Clock()
    acct = _acct(clock)
    p = b.assigned(b.pod("p", 20, uid="uid-old"), "n1", [(GPU, 20480)], T0, state=contract.STATE_ALLOCATED)
    p = {**p, "status": {"phase": "Running", "containerStatuses": [{"name": "c0", "state": {"running": {}}}]}}
    acct.apply_pod("ADDED", p)
    acct.apply_node("MODIFIED", _node(_gone(seconds=35)))
    assert used(acct) == 20480
    acct.apply_pod("DELETED", p)
    assert used(acct) == 20480
    clock.now += 36 * SEC
    acct.expire()
    assert used(acct) == 0


def test_a_deletion_seen_after_the_report_is_not_booked_twice() -> None:
    """An extender restarted after the deletion lists neither the pod nor its event; one that is only behind
    sees the report, then the pod's DELETED (its ``allocated`` report from before): one booking, the later end."""
    clock = Clock()
    acct = _acct(clock, _gone(seconds=10))
    p = b.assigned(b.pod("p", 20, uid="uid-old"), "n1", [(GPU, 20480)], T0, state=contract.STATE_ALLOCATED)
    acct.apply_pod("DELETED", {**p, "status": {"phase": "Running"}})
    assert used(acct) == 20480
    clock.now += 11 * SEC
    acct.expire()
    assert used(acct) == 0


def test_a_pod_deleted_while_the_watch_was_away_is_booked_at_the_relist() -> None:
    """The watch broke, the pod was force deleted, the relist lacks it: the relist frees the live booking and
    the node's report, read while the pod was still listed, books it under its own key."""
    clock = Clock()
    acct = _acct(clock)
    p = b.assigned(b.pod("p", 20, uid="uid-old"), "n1", [(GPU, 20480)], T0, state=contract.STATE_ALLOCATED)
    acct.apply_pod("ADDED", p)
    acct.apply_node("MODIFIED", _node(_gone(seconds=30)))
    clock.now += SEC
    acct.replace_pods([], clock())
    assert used(acct) == 20480
    with pytest.raises(cluster.OverCommit):
        acct.reserve("default/p", "n1", [(GPU, 20480)], clock(), uid="uid-new")


def test_a_malformed_report_keeps_the_node_s_last_good_inventory() -> None:
    clock = Clock()
    acct = _acct(clock)
    inv = b.node_inventory("n1", b.l4()).to_json()
    for bad in ('[{"pod": "default/p", "uid": "u", "until": 1, "gpus": [{"uuid": "", "mib": 1}]}]',
                '[{"pod": "p", "uid": "u", "until": 1, "gpus": [{"uuid": "GPU-n1-0", "mib": 1}]}]',
                '[{"pod": "default/p", "uid": "u", "until": 1, "gpus": [{"uuid": "GPU-n1-0", "mib": 0}]}]',
                '{"pod": "default/p"}'):
        acct.apply_node("MODIFIED", b.gpu_node("n1", b.l4(), annotation=inv[:-1] + f',"departing":{bad}}}'))
        assert [s.uuid for s in acct.slots["n1"]] == [GPU] and used(acct) == 0


def test_our_own_booking_lasts_until_the_node_s_end_when_that_is_later() -> None:
    """Found by the soak (seed 59, forced recreations, kills every 4 s: one GPU over capacity in the books). The
    node sees a deletion a little after the extender; had the extender freed the GPU at its own end and planned
    another pod there, a successor restarted before the node's end would book the departing pod on top."""
    clock = Clock()
    acct = _acct(clock)
    p = _running(grace=2)
    acct.apply_pod("ADDED", p)
    acct.apply_pod("DELETED", p)                 # our end: T0 + 7 s
    acct.apply_node("MODIFIED", _node(_gone(seconds=9)))  # the node's: T0 + 9 s
    clock.now += 8 * SEC
    acct.expire()
    assert used(acct) == 20480
    with pytest.raises(cluster.OverCommit):
        acct.reserve("default/q", "n1", [(GPU, 20480)], clock(), uid="uid-q")
    clock.now += 2 * SEC
    acct.expire()
    assert used(acct) == 0


def test_a_deletion_after_the_node_s_report_also_lasts_until_the_node_s_end() -> None:
    """The other order of the same two ends: the node's report comes while the watch still shows the pod
    (booked as itself), then the deletion books it by our own rule, until the node's end where later."""
    clock = Clock()
    acct = _acct(clock)
    p = _running(grace=2)
    acct.apply_pod("ADDED", p)
    acct.apply_node("MODIFIED", _node(_gone(seconds=9)))
    acct.apply_pod("DELETED", p)                 # our end: T0 + 7 s; the node's: T0 + 9 s
    _booked_until(acct, clock, 9)


# -- every order of the same events --------------------------------------------------------------------
_ACTIONS = st.lists(st.sampled_from(["delete_seen", "node_reports", "restart", "tick", "tick", "relist", "node_again"]),
                    max_size=30)


@settings(max_examples=300, deadline=None)
@given(actions=_ACTIONS, node_lag_s=st.integers(0, 2), grace=st.integers(0, 5))
def test_a_force_deleted_pod_stays_booked_once_in_every_order_until_its_grace_ends(actions, node_lag_s, grace):
    """A pod on the GPU is force deleted at T0 while its containers may run until T0 + grace. In any order of
    the extender seeing the deletion, the node publishing its report (``node_lag_s`` later than the deletion,
    as its watch delivers), extender restarts (a fresh process that lists nodes and pods: the pod is gone),
    relists and time passing: whenever the extender has seen the deletion or the node's report, or still
    sees the pod, the GPU holds the pod's memory exactly once until its grace has passed; once every end has
    passed, nothing stays booked. (A restart, or a relist, before the node's report lands sees nothing.)"""
    clock = Clock()
    p = _running(grace)
    report = _gone(seconds=node_lag_s + grace + 5)
    acct, published, covered, seen_delete = _acct(clock), False, True, False
    acct.apply_pod("ADDED", p)
    for action in actions:
        if action == "delete_seen" and not seen_delete and covered:  # the watch of this process delivers it
            acct.apply_pod("DELETED", p)
            seen_delete = True
        elif action == "node_reports" and clock() >= T0 + node_lag_s * SEC:
            published = True
            acct.apply_node("MODIFIED", _node(report))
            covered = True
        elif action == "node_again" and published:  # a heartbeat, or another change of the inventory
            acct.apply_node("MODIFIED", _node(report))
        elif action == "restart":
            acct = _acct(clock, *((report,) if published else ()))
            acct.replace_pods([], clock())
            covered, seen_delete = published, True  # the new process never sees the pod nor its deletion
        elif action == "relist":  # the watch broke: a list, which lacks the pod
            acct.replace_pods([], clock())
            if not seen_delete:  # gone at resync: only the node's report (if read) keeps it
                covered, seen_delete = published, True
        elif action == "tick":
            clock.now += SEC
            acct.expire()
        if covered and clock() < T0 + grace * SEC:
            assert used(acct) == 20480, (action, clock() - T0)
        assert used(acct) in (0, 20480)
    if seen_delete:  # every end: ours counts from when this process saw the deletion, the node's from its lag
        clock.now = max(clock.now, T0 + node_lag_s * SEC) + (grace + 7) * SEC
        acct.expire()
        assert used(acct) == 0
