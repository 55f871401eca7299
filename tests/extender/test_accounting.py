"""How node and pod events, and the binder's reservations, become per-GPU usage (no I/O, virtual clock)."""
from __future__ import annotations

import pytest

from extender import accounting, cluster
from vramshare.config import Config, ExtenderConfig
from tests.extender import builders as b

SEC = 1_000_000_000
T0 = 1_700_000_000 * SEC


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> int:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def acct(clock: Clock) -> accounting.Accounting:
    a = accounting.Accounting(Config(extender=ExtenderConfig(assume_timeout_seconds=60)), clock)
    a.apply_node("ADDED", b.gpu_node("n1", b.a100(), b.l4()))
    return a


def used(acct: accounting.Accounting, node: str = "n1") -> list[int]:
    return [u.used for u in acct.state.node_usage(node)]


def holding(name: str, mib: int, node: str = "n1", gpu: int = 0, at: int = T0, bound: bool = True) -> dict:
    return b.assigned(b.pod(name, mib // 1024), node if bound else "", [(b.uuid_of(node, gpu), mib)], at)


def test_inventory_becomes_slots_with_schedulable_capacity(acct: accounting.Accounting) -> None:
    slots = acct.slots["n1"]
    assert [(s.uuid, s.kind, s.capacity) for s in slots] == [
        ("GPU-n1-0", "shared", 80 * 1024), ("GPU-n1-1", "shared", 22 * 1024)]  # whole 1 GiB units only


def test_mig_and_exclusive_gpus_become_their_kinds(acct: accounting.Accounting) -> None:
    acct.apply_node("ADDED", b.gpu_node("n2", b.a100(mode="exclusive"),
                                        b.a100(mig=(("1g.10gb+me", 9856), ("3g.40gb", 40192)))))
    assert [(s.kind, s.capacity, s.index) for s in acct.slots["n2"]] == [
        ("exclusive", 81920, 0), ("mig:1g.10gb.me", 9856, 1), ("mig:3g.40gb", 40192, 1)]


def test_bad_annotation_keeps_the_last_good_inventory(acct: accounting.Accounting) -> None:
    acct.apply_node("MODIFIED", b.gpu_node("n1", annotation="{broken"))
    acct.apply_node("ADDED", b.gpu_node("n3", annotation='{"version":"v1","unitMiB":0,"gpus":[]}'))
    assert len(acct.slots["n1"]) == 2
    assert "n3" not in acct.slots


def test_node_without_inventory_or_deleted_is_forgotten(acct: accounting.Accounting) -> None:
    acct.apply_node("ADDED", b.gpu_node("n2", b.l4()))
    acct.apply_node("MODIFIED", b.plain_node("n2"))
    acct.apply_node("ADDED", b.gpu_node("n3", b.l4()))
    acct.apply_node("DELETED", b.gpu_node("n3", b.l4()))
    assert sorted(acct.slots) == ["n1"] and sorted(acct.state.nodes()) == ["n1"]


def test_assignment_holds_memory_until_deleted(acct: accounting.Accounting) -> None:
    pod = holding("p", 20 * 1024)
    acct.apply_pod("ADDED", pod)
    assert used(acct) == [20480, 0]
    acct.apply_pod("MODIFIED", pod)  # the same again changes nothing
    assert used(acct) == [20480, 0]
    acct.apply_pod("DELETED", b.ended(pod))  # its kubelet ended it
    assert used(acct) == [0, 0] and acct.pods == {}


@pytest.mark.parametrize("phase", ["Succeeded", "Failed"])
def test_finished_pods_free_at_once(acct: accounting.Accounting, phase: str) -> None:
    pod = holding("p", 8 * 1024)
    acct.apply_pod("ADDED", pod)
    acct.apply_pod("MODIFIED", {**pod, "status": {"phase": phase}})
    assert used(acct) == [0, 0]


def test_assumed_pod_is_placed_by_gpu_uuid_before_it_binds(acct: accounting.Accounting) -> None:
    acct.apply_pod("ADDED", holding("p", 4096, gpu=1, bound=False))
    assert used(acct) == [0, 4096]
    assert acct.state.pod_node("default/p") == "n1"


def test_assumed_pod_that_never_binds_expires(acct: accounting.Accounting, clock: Clock) -> None:
    acct.apply_pod("ADDED", holding("late", 4096, bound=False))
    acct.apply_pod("ADDED", holding("bound", 4096, gpu=1))
    clock.now += 59 * SEC
    assert acct.expire() == []
    clock.now += 2 * SEC
    assert acct.expire() == ["default/late"]
    assert used(acct) == [0, 4096]  # the bound one stays however old its assume-time
    acct.apply_pod("MODIFIED", holding("late", 4096, bound=False))  # the watch repeats it: still expired
    assert used(acct) == [0, 4096]


def test_expired_assignment_is_not_counted_after_a_restart(clock: Clock) -> None:
    fresh = accounting.Accounting(Config(extender=ExtenderConfig(assume_timeout_seconds=60)), clock)
    fresh.apply_node("ADDED", b.gpu_node("n1", b.a100()))
    clock.now += 600 * SEC
    fresh.replace_pods([holding("stale", 4096, bound=False)], clock.now)
    assert [u.used for u in fresh.state.node_usage("n1")] == [0]


def test_reservation_survives_older_events_and_release_is_final(acct: accounting.Accounting, clock: Clock) -> None:
    pending = b.pod("p", 20)
    acct.apply_pod("ADDED", pending)
    acct.reserve("default/p", "n1", [(b.uuid_of("n1", 0), 20480)], clock.now)
    acct.apply_pod("MODIFIED", pending)  # an event from before our patch: no assignment yet
    assert used(acct) == [20480, 0]
    older = holding("p", 8192, at=clock.now - SEC, bound=False)
    acct.apply_pod("MODIFIED", older)  # an older assignment never undoes a newer reservation
    assert used(acct) == [20480, 0]
    acct.release("default/p", clock.now)
    assert used(acct) == [0, 0]
    acct.apply_pod("MODIFIED", holding("p", 20480, at=clock.now, bound=False))  # the failed bind's patch
    assert used(acct) == [0, 0]


def test_reserve_refuses_to_overcommit(acct: accounting.Accounting) -> None:
    acct.reserve("default/a", "n1", [(b.uuid_of("n1", 1), 20480)], T0)
    with pytest.raises(cluster.OverCommit):
        acct.reserve("default/b", "n1", [(b.uuid_of("n1", 1), 4096)], T0)
    assert used(acct) == [0, 20480]


def test_pod_seen_before_its_node_is_counted_when_the_node_arrives(acct: accounting.Accounting) -> None:
    acct.apply_pod("ADDED", holding("early", 4096, node="n9"))
    assert "default/early" in acct.unaccounted
    acct.apply_node("ADDED", b.gpu_node("n9", b.l4()))
    assert used(acct, "n9") == [4096] and acct.unaccounted == {}


def test_unreadable_assignment_is_logged_and_ignored(acct: accounting.Accounting) -> None:
    bad = b.pod("p", 4)
    bad["metadata"]["annotations"][acct.names.assignment] = '{"c0": [{"uuid": 3}]}'
    acct.apply_pod("ADDED", bad)
    acct.apply_pod("ADDED", holding("good", 4096))
    assert used(acct) == [4096, 0]


def test_relist_drops_vanished_pods_but_not_newer_reservations(acct: accounting.Accounting, clock: Clock) -> None:
    acct.apply_pod("ADDED", holding("gone", 4096))
    acct.apply_pod("ADDED", holding("kept", 4096, gpu=1))
    list_started = clock.now
    clock.now += SEC
    acct.reserve("default/new", "n1", [(b.uuid_of("n1", 0), 8192)], clock.now)  # bound after the list began
    acct.replace_pods([holding("kept", 4096, gpu=1)], list_started)
    assert used(acct) == [8192, 4096]
    assert sorted(acct.pods) == ["default/kept"]


def test_pods_seen_feed_the_target_workload(acct: accounting.Accounting) -> None:
    acct.apply_pod("ADDED", b.pod("a", 20))
    acct.apply_pod("MODIFIED", b.pod("a", 20))  # once per pod, not per event
    acct.apply_pod("ADDED", b.pod("b", 8, count=2))
    acct.apply_pod("ADDED", b.pod("web"))
    shapes = sorted((s.per_gpu, s.count) for s in acct.state.target_workload().shapes)
    assert shapes == [(4096, 2), (20480, 1)]


def test_inventory_with_a_duplicate_gpu_keeps_the_last_good(acct: accounting.Accounting) -> None:
    inv = b.node_inventory("n1", b.a100(), b.a100())
    text = inv.to_json().replace("GPU-n1-1", "GPU-n1-0")
    acct.apply_node("MODIFIED", b.gpu_node("n1", annotation=text))
    assert [s.uuid for s in acct.slots["n1"]] == ["GPU-n1-0", "GPU-n1-1"]
    assert [s.model for s in acct.slots["n1"]] == ["NVIDIA A100-SXM4-80GB", "NVIDIA L4"]
