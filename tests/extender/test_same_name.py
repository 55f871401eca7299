"""A pod recreated under its name while the extender's watch still lags behind the API (round 12).

The books are keyed by ``namespace/name``. A StatefulSet (or any controller that reuses names) deletes a
pod and creates its successor; kube-scheduler binds the successor at once, and the extender's binder,
reading the pod fresh, books it before its watch has delivered the predecessor's DELETED. On 0fd81fb that
late event freed the successor's booking (``apply_pod`` popped the key without looking at the UID), and a
late MODIFIED of the predecessor moved the successor's memory to the predecessor's GPUs. Found reading
why a recreated pod was missing from the books in a soak run (``bench/bench_soak.py --seed 23``); that run's
harness also distrusted every report, which can drop a pod from full books too, so these tests, not the
soak, are what show the race.

The watch stream is ordered (the API server cannot create the successor before the predecessor is gone),
so only the binder can be ahead of it: an event for another UID than the one a bind booked under the key
is the predecessor's, and books nothing.
"""
from __future__ import annotations

import random

import pytest

from extender import accounting, cluster
from tests.extender import builders as b
from tests.extender.test_accounting import SEC, T0, Clock
from vramshare import contract, departing
from vramshare.config import Config, ExtenderConfig, Policy

G0, G1 = "GPU-n1-0", "GPU-n1-1"


def _acct(clock: Clock) -> accounting.Accounting:
    a = accounting.Accounting(Config(extender=ExtenderConfig(policy=Policy.BINPACK)), clock)
    a.apply_node("ADDED", b.gpu_node("n1", b.a100(), b.a100()))
    return a


def _running(p: dict, gpu: str, mib: int, containers: str = "running", deleting: bool = False) -> dict:
    """``p`` admitted on ``gpu`` (the device plugin's ``allocated`` report) with its containers in
    state ``containers``; ``deleting``: a graceful deletion in progress."""
    obj = b.assigned(p, "n1", [(gpu, mib)], T0, state=contract.STATE_ALLOCATED)
    obj = {**obj, "status": {"phase": "Running", "containerStatuses": [
        {"name": c["name"], "state": {containers: {}}} for c in obj["spec"]["containers"]]}}
    if deleting:
        obj["metadata"] = {**obj["metadata"], "deletionTimestamp": "2026-12-02T12:00:00Z"}
    return obj


def used(acct: accounting.Accounting) -> dict[str, int]:
    return {u.slot.uuid: u.used for u in acct.state.node_usage("n1")}


@pytest.mark.parametrize("same_gpu", [True, False], ids=["same-gpu", "other-gpu"])
def test_the_predecessor_s_late_events_leave_the_successor_booked(same_gpu: bool) -> None:
    clock = Clock()
    acct = _acct(clock)
    old = b.pod("web-0", 20, uid="uid-old")
    acct.apply_pod("ADDED", _running(old, G1, 20480))
    # The API: the kubelet finished old (graceful), the StatefulSet created new; the watch lags.
    new = b.pod("web-0", 20, uid="uid-new")
    gpu = G1 if same_gpu else G0
    acct.reserve("default/web-0", "n1", [(gpu, 20480)], T0 + SEC, uid="uid-new")  # the binder, fresh read
    assert used(acct)[gpu] >= 20480
    acct.apply_pod("MODIFIED", _running(old, G1, 20480, deleting=True))           # the watch catches up
    acct.apply_pod("DELETED", _running(old, G1, 20480, containers="terminated", deleting=True))
    assert used(acct) == {G0: 0, G1: 0, gpu: 20480}, "the successor's booking was lost"
    acct.apply_pod("ADDED", new)
    acct.apply_pod("MODIFIED", b.assigned(new, "n1", [(gpu, 20480)], T0 + SEC))
    assert used(acct) == {G0: 0, G1: 0, gpu: 20480}
    with pytest.raises(cluster.OverCommit):  # and no other pod gets that memory
        acct.reserve("default/other", "n1", [(gpu, 65536)], T0 + 2 * SEC, uid="uid-other")


def test_a_force_deleted_predecessor_keeps_its_gpu_until_its_deletion_says_it_stopped() -> None:
    """Forced: the predecessor vanished from the API with its containers running. Until the watch says
    so, the extender cannot tell a forced deletion from a graceful one, so the predecessor's GPUs stay
    booked: a successor that does not fit beside them waits (kube-scheduler retries the bind)."""
    clock = Clock()
    acct = _acct(clock)
    old = b.pod("web-0", 60, uid="uid-old")
    acct.apply_pod("ADDED", _running(old, G0, 61440))
    with pytest.raises(cluster.OverCommit):
        acct.reserve("default/web-0", "n1", [(G0, 61440)], T0 + SEC, uid="uid-new")
    acct.reserve("default/web-0", "n1", [(G1, 61440)], T0 + SEC, uid="uid-new")
    assert used(acct) == {G0: 61440, G1: 61440}
    acct.apply_pod("DELETED", _running(old, G0, 61440))  # forced: still running, grace 30 s
    assert used(acct) == {G0: 61440, G1: 61440}
    clock.now += (departing.DEFAULT_GRACE_S + departing.DEPARTING_MARGIN_S + 1) * SEC
    acct.expire()
    assert used(acct) == {G0: 0, G1: 61440}


def test_any_interleaving_of_the_lagging_watch_and_the_bind_books_the_successor_exactly() -> None:
    """Property over random orders: the watch delivers the predecessor's events, then the successor's
    (the API's order); the bind happens anywhere after the successor exists and before its own
    assignment event. Afterwards the books hold the successor's memory, once, and nothing of the
    predecessor once its deletion arrived (graceful) or its grace ran out (forced)."""
    rng = random.Random(12)
    for case in range(300):
        clock = Clock()
        acct = _acct(clock)
        old_gpu, new_gpu = rng.choice([G0, G1]), rng.choice([G0, G1])
        forced = rng.random() < 0.3
        old = b.pod("web-0", 20, uid=f"old-{case}")
        new = b.pod("web-0", 20, uid=f"new-{case}")
        acct.apply_pod("ADDED", _running(old, old_gpu, 20480))
        stream = [("MODIFIED", _running(old, old_gpu, 20480, deleting=True))] if not forced else []
        stream.append(("DELETED", _running(old, old_gpu, 20480, deleting=True,
                                           containers="running" if forced else "terminated")))
        stream.append(("ADDED", new))
        at = rng.randint(0, len(stream))  # the bind: before the watch shows any of this, or after
        booked = False
        for i, event in enumerate(stream + [None]):
            if i == at:
                acct.reserve("default/web-0", "n1", [(new_gpu, 20480)], T0 + SEC, uid=new["metadata"]["uid"])
                booked = True
            if event is not None:
                acct.apply_pod(*event)
            if booked:  # from the bind on, at every step: the successor, where the bind put it
                assert list(acct.state.pod_allocations("default/web-0")) == [(new_gpu, 20480)], (case, forced, at, i)
        acct.apply_pod("MODIFIED", b.assigned(new, "n1", [(new_gpu, 20480)], T0 + SEC))
        clock.now += (departing.DEFAULT_GRACE_S + departing.DEPARTING_MARGIN_S + 1) * SEC
        acct.expire()
        want = {G0: 0, G1: 0}
        want[new_gpu] += 20480
        assert used(acct) == want, (case, old_gpu, new_gpu, forced, at)
