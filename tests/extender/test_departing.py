"""A force-deleted pod's GPUs stay booked while its kubelet may still run it (extender/accounting.py).

``kubectl delete --grace-period=0 --force`` removes the API object at once; the kubelet still stops the
containers over the pod's termination grace and holds its devices meanwhile. The soak with forced
same-name recreations found GPUs planned twice without this rule (6 GPUs over capacity in the books).
"""
from __future__ import annotations

import pytest

from extender import accounting, cluster
from vramshare import contract, departing
from vramshare.config import Config, ExtenderConfig, Policy
from tests.extender import builders as b
from tests.extender.test_accounting import SEC, T0, Clock

def _acct(clock: Clock) -> accounting.Accounting:
    a = accounting.Accounting(Config(extender=ExtenderConfig(policy=Policy.BINPACK)), clock)
    a.apply_node("ADDED", b.gpu_node("n1", b.l4()))
    return a


def _running(p: dict, grace: int | None = None, state: str = "running") -> dict:
    obj = b.assigned(p, "n1", [("GPU-n1-0", 20480)], T0, state=contract.STATE_ALLOCATED)
    obj = {**obj, "status": {"phase": "Running", "containerStatuses": [
        {"name": c["name"], "state": {state: {}}} for c in obj["spec"]["containers"]]}}
    if grace is not None:
        obj["spec"] = {**obj["spec"], "terminationGracePeriodSeconds": grace}
    return obj


def used(acct: accounting.Accounting) -> int:
    return acct.state.node_usage("n1")[0].used


def test_a_force_deleted_running_pod_keeps_its_gpu_for_its_grace() -> None:
    clock = Clock()
    acct = _acct(clock)
    p = _running(b.pod("p", 20), grace=10)
    acct.apply_pod("ADDED", p)
    acct.apply_pod("DELETED", p)                 # the API forgot it; its containers still run
    assert used(acct) == 20480
    try:                                         # a recreated pod of the same name cannot take it twice
        acct.reserve("default/p", "n1", [("GPU-n1-0", 20480)], T0)
        raise AssertionError("the GPU was booked twice")
    except cluster.OverCommit:
        pass
    clock.now += (10 + departing.DEPARTING_MARGIN_S - 1) * SEC
    acct.expire()
    assert used(acct) == 20480
    clock.now += 2 * SEC
    acct.expire()
    assert used(acct) == 0


def test_a_pod_the_kubelet_finished_frees_at_once() -> None:
    clock = Clock()
    acct = _acct(clock)
    p = _running(b.pod("p", 20))
    acct.apply_pod("ADDED", p)
    acct.apply_pod("DELETED", _running(b.pod("p", 20), state="terminated"))
    assert used(acct) == 0


def test_an_unbound_pod_frees_at_once() -> None:
    clock = Clock()
    acct = _acct(clock)
    p = b.assigned(b.pod("p", 20), "", [("GPU-n1-0", 20480)], T0)  # assumed, never bound: no kubelet saw it
    acct.apply_pod("ADDED", p)
    acct.apply_pod("DELETED", {**p, "status": {"containerStatuses": [{"name": "c", "state": {"waiting": {}}}]}})
    assert used(acct) == 0


@pytest.mark.parametrize("state", ["none", "waiting", "running"])
def test_a_force_deleted_pod_the_kubelet_runs_keeps_its_gpu_before_the_device_plugin_reports_it(state: str) -> None:
    """Found by the soak with forced same-name recreations and no extender kills (seed 57, 60% forced: 7
    GPUs over capacity in the books, 11 steering misses): the kubelet takes a pod's devices at admission,
    before it reports any container (``none``), then reports them waiting and running, all before the
    device plugin's ``allocated`` report reaches the pod; a force delete in between freed the plan at once,
    and the recreated pod was planned onto devices the kubelet still held."""
    clock = Clock()
    acct = _acct(clock)
    p = b.assigned(b.pod("p", 20), "n1", [("GPU-n1-0", 20480)], T0)  # assumed: the report has not come
    if state != "none":
        p = {**p, "status": {"phase": "Pending" if state == "waiting" else "Running",
                             "containerStatuses": [{"name": "c0", "state": {state: {}}}]}}
    acct.apply_pod("ADDED", p)
    acct.apply_pod("DELETED", p)
    assert used(acct) == 20480
    with pytest.raises(cluster.OverCommit):      # the recreated pod cannot be planned onto it
        acct.reserve("default/p", "n1", [("GPU-n1-0", 20480)], T0)
    clock.now += (departing.DEFAULT_GRACE_S + departing.DEPARTING_MARGIN_S + 1) * SEC
    acct.expire()
    assert used(acct) == 0


def test_a_pod_superseded_before_its_report_keeps_its_gpu_while_the_kubelet_runs_it() -> None:
    """The same, when the bind of the recreated pod comes before the watch delivers the old one's deletion
    (:meth:`Accounting._supersede`): the old pod, running but not reported allocated, keeps its GPU until its
    deletion shows its containers stopped."""
    clock = Clock()
    acct = _acct(clock)
    old = b.assigned(b.pod("p", 20), "n1", [("GPU-n1-0", 20480)], T0)
    old = {**old, "metadata": {**old["metadata"], "uid": "uid-old"},
           "status": {"phase": "Running", "containerStatuses": [{"name": "c0", "state": {"running": {}}}]}}
    acct.apply_pod("ADDED", old)
    with pytest.raises(cluster.OverCommit):      # the successor's bind: the old pod still holds the GPU
        acct.reserve("default/p", "n1", [("GPU-n1-0", 20480)], T0 + SEC, uid="uid-new")
    assert used(acct) == 20480
    stopped = {**old, "status": {"phase": "Running", "containerStatuses": [{"name": "c0", "state": {"terminated": {}}}]}}
    acct.apply_pod("DELETED", stopped)           # the kubelet finished it: its GPU goes
    assert used(acct) == 0
    acct.reserve("default/p", "n1", [("GPU-n1-0", 20480)], T0 + 2 * SEC, uid="uid-new")
    assert used(acct) == 20480


def test_grace_is_bounded_and_defaults_like_the_api_server() -> None:
    assert departing.grace_seconds({"spec": {}}) == departing.DEFAULT_GRACE_S == 30
    assert departing.grace_seconds({"spec": {"terminationGracePeriodSeconds": 10**12}}) == departing.MAX_GRACE_S
    assert departing.grace_seconds({"spec": {"terminationGracePeriodSeconds": -5}}) == 0
    assert departing.grace_seconds({"spec": {"terminationGracePeriodSeconds": "30"}}) == 30
    assert not departing.may_still_run({"status": {"phase": "Succeeded", "containerStatuses": [
        {"name": "c", "state": {"running": {}}}]}})


def test_a_departing_pod_goes_with_its_node() -> None:
    clock = Clock()
    acct = _acct(clock)
    p = _running(b.pod("p", 20))
    acct.apply_pod("ADDED", p)
    acct.apply_pod("DELETED", p)
    acct.apply_node("DELETED", b.gpu_node("n1", b.l4()))
    acct.apply_node("ADDED", b.gpu_node("n1", b.l4()))
    assert used(acct) == 0


def test_a_pod_force_deleted_after_its_gpu_left_the_inventory_is_freed_without_error() -> None:
    """Found by the memo property once bound pods without statuses count as departing: the GPU a pod was
    reported on is gone from its node's inventory (fallen off the bus, a smaller node), then the pod is force
    deleted while it may still run. Booking its departing GPUs raised ``OverCommit`` (GPU not on the node)
    out of the watch handler, and the pod itself was never released. It holds nothing now: its GPU is gone."""
    clock = Clock()
    acct = _acct(clock)
    acct.apply_node("MODIFIED", b.gpu_node("n1", b.l4(), b.l4()))
    p = b.assigned(b.pod("p", 20), "n1", [("GPU-n1-1", 20480)], T0, state=contract.STATE_ALLOCATED)
    p = {**p, "status": {"phase": "Running", "containerStatuses": [{"name": "c0", "state": {"running": {}}}]}}
    acct.apply_pod("ADDED", p)
    acct.apply_node("MODIFIED", b.gpu_node("n1", b.l4()))  # GPU-n1-1 is gone
    acct.apply_pod("DELETED", p)
    assert "default/p" not in acct.pods and not acct.state.has_pod("default/p")
    assert used(acct) == 0
