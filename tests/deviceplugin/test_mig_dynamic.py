"""Dynamic MIG on the node (deviceplugin/mig_dynamic.py over deviceplugin/mig_nvml.py) against the fake
NVML's dynamic-MIG calls: idempotent per plan, serialized per GPU, never disturbing a used instance, and
with a crash injected after every NVML call that changes something, no leaked or doubled instance."""
from __future__ import annotations

import threading

import pytest

from deviceplugin.mig_dynamic import DynamicMig, MigError, MigPlan
from deviceplugin.mig_nvml import NvmlMig
from tests.fixtures.fake_nvml_mig import H100_MIG, Crash, MigFakeNvml

GPU = H100_MIG.uuid
EFFECTS = ("nvmlDeviceCreateGpuInstanceWithPlacement", "nvmlGpuInstanceCreateComputeInstance",
           "nvmlComputeInstanceDestroy", "nvmlGpuInstanceDestroy")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _node(fake: MigFakeNvml, clock: Clock, grace: float = 30.0) -> DynamicMig:
    """A fresh plugin process: it knows nothing but what NVML shows."""
    fake.nvmlInit()
    handle = fake.nvmlDeviceGetHandleByIndex(0)
    return DynamicMig(NvmlMig(fake), {GPU: (handle, H100_MIG.name, H100_MIG.total_mib)}, grace_seconds=grace,
                      clock=clock)


def _layout(fake: MigFakeNvml) -> list[tuple[str, int, int]]:
    """(profile name, start, compute instances) of every GPU instance, from the fake's own state."""
    return sorted((fake.table[gi.profile_index][4].removeprefix("MIG "), gi.start, len(gi.cis))
                  for gi in fake.instances[0].values())


def test_profiles_and_placements_read_from_nvml() -> None:
    fake = MigFakeNvml()
    node = _node(fake, Clock())
    assert node.creatable(GPU)["3g.40gb"] == [0, 4]
    assert node.creatable(GPU)["1g.10gb"] == [0, 1, 2, 3, 4, 5, 6]
    node.ensure(MigPlan(GPU, "4g.40gb", 0))
    left = node.creatable(GPU)
    assert left["3g.40gb"] == [4] and left["7g.80gb"] == [] and left["4g.40gb"] == []


def test_a_plan_is_made_once_and_adopted_after() -> None:
    fake = MigFakeNvml()
    node = _node(fake, Clock())
    plan = MigPlan(GPU, "3g.40gb", 4)
    first = node.ensure(plan)
    again = node.ensure(plan)
    restarted = _node(fake, Clock()).ensure(plan)
    assert not first.adopted and again.adopted and restarted.adopted
    assert first.mig_uuid == again.mig_uuid == restarted.mig_uuid != ""
    assert fake.created == 1 and _layout(fake) == [("3g.40gb", 4, 1)]


def test_taken_or_illegal_placements_fail_with_the_reason() -> None:
    fake = MigFakeNvml()
    node = _node(fake, Clock())
    node.ensure(MigPlan(GPU, "3g.40gb", 4))
    with pytest.raises(MigError, match=r"slots 4-7 are held by 3g.40gb"):
        node.ensure(MigPlan(GPU, "2g.20gb", 4))
    with pytest.raises(MigError, match=r"cannot start at 1 \(legal: \[0, 2, 4\]\)"):
        node.ensure(MigPlan(GPU, "2g.20gb", 1))
    with pytest.raises(MigError, match="offers no profile 3g.20gb"):
        node.ensure(MigPlan(GPU, "3g.20gb", 0))
    with pytest.raises(MigError, match="not a dynamic-MIG GPU"):
        node.ensure(MigPlan("GPU-other", "3g.40gb", 0))
    assert _layout(fake) == [("3g.40gb", 4, 1)]


def test_unheld_instances_go_after_the_grace_and_used_ones_never() -> None:
    fake = MigFakeNvml()
    clock = Clock()
    node = _node(fake, clock, grace=30)
    a, b = MigPlan(GPU, "3g.40gb", 0), MigPlan(GPU, "1g.10gb", 4)
    node.ensure(a)
    busy = node.ensure(b)
    fake.busy.add(busy.mig_uuid)
    assert node.reap(held=[]) == []            # unheld from now on
    clock.now = 29
    assert node.reap(held=[]) == []            # still within the grace
    clock.now = 31
    assert node.reap(held=[]) == [a]           # b has processes: left alone
    assert _layout(fake) == [("1g.10gb", 4, 1)]
    fake.busy.clear()
    assert node.reap(held=[b]) == []           # held again: its clock restarts
    clock.now = 100
    assert node.reap(held=[b]) == []
    assert node.reap(held=[]) == []
    clock.now = 131
    assert node.reap(held=[]) == [b] and _layout(fake) == []


def test_one_gpu_is_serialized() -> None:
    """Many plans at once on one GPU: every legal one made exactly once, NVML never sees two creates
    interleaved (the fake would refuse an overlapping placement rather than double it)."""
    fake = MigFakeNvml()
    node = _node(fake, Clock())
    plans = [MigPlan(GPU, "1g.10gb", s) for s in range(7)] * 3
    errors: list[BaseException] = []

    def make(plan: MigPlan) -> None:
        try:
            node.ensure(plan)
        except BaseException as exc:  # noqa: BLE001 - collected for the assertion
            errors.append(exc)

    threads = [threading.Thread(target=make, args=(p,)) for p in plans]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and fake.created == 7
    assert _layout(fake) == [("1g.10gb", s, 1) for s in range(7)]


def _steps(clock: Clock) -> list:
    """Make two plans, release the first, reap after the grace, make a third in its place. Each step is
    what a caller retries after a crash (the kubelet its Allocate, the reaper its next round)."""
    a, b, c = MigPlan(GPU, "3g.40gb", 0), MigPlan(GPU, "2g.20gb", 4), MigPlan(GPU, "1g.20gb", 0)

    def later(node: DynamicMig) -> None:
        clock.now += 31
    return [lambda n: n.ensure(a), lambda n: n.ensure(b), lambda n: n.reap(held=[b]), later,
            lambda n: n.reap(held=[b]), lambda n: n.ensure(c), lambda n: n.reap(held=[b, c]), later,
            lambda n: n.reap(held=[b, c])]


# every NVML call of the scenario that changes the GPU: three creates of each kind, one removal of each
CRASH_POINTS = [(EFFECTS[0], n) for n in (1, 2, 3)] + [(EFFECTS[1], n) for n in (1, 2, 3)] + \
    [(EFFECTS[2], 1), (EFFECTS[3], 1)]


@pytest.mark.parametrize("function,n", CRASH_POINTS)
def test_a_crash_after_any_change_leaks_or_doubles_nothing(function: str, n: int) -> None:
    """Kill the plugin right after the n-th call of ``function`` took effect; a new process redoes the
    scenario from the start (the kubelet retries Allocate, the reaper runs again): the end state is the
    one without a crash."""
    fake, clock = MigFakeNvml(), Clock()
    fake.crash_after(function, n)
    steps = _steps(clock)
    node, crashed, i = _node(fake, clock), False, 0
    while i < len(steps):
        try:
            steps[i](node)
            i += 1
        except Crash:
            crashed = True
            node = _node(fake, clock)  # a new process: it knows only what NVML shows; step i is retried
    assert crashed
    assert _layout(fake) == [("1g.20gb", 0, 1), ("2g.20gb", 4, 1)]


def test_the_nvml_backend_reads_placements_and_serves_the_node_path() -> None:
    """Issue 24: the NVML backend reports each instance's placement start, so a GPU the admin allows
    gets dynamicMig in the inventory, and the daemon's MigNode makes plans through the same NVML calls."""
    import dataclasses

    from deviceplugin.kubelet.mig_node import MigNode
    from deviceplugin.node_state import NodeState
    from deviceplugin.nvml_backend import NvmlBackend
    from prometheus_client import CollectorRegistry
    from vramshare import mig_plan
    from vramshare.config import Config, DynamicMigConfig

    fake = MigFakeNvml()
    backend = NvmlBackend(nvml=fake, sysfs_root="/nonexistent")
    _node(fake, Clock()).ensure(MigPlan(GPU, "3g.40gb", 0))  # the admin's instance
    [gpu] = backend.discover()
    assert [(m.profile, m.start) for m in gpu.mig] == [("3g.40gb", 0)]
    config = dataclasses.replace(Config(), dynamic_mig=DynamicMigConfig(gpus=("all",)))
    state = NodeState(backend.discover(), config)
    assert state.snapshot.inventory.gpus[0].dynamic_mig.instances == (("3g.40gb", 0),)
    node = MigNode.build(backend, state, CollectorRegistry())
    assert node is not None
    made = node.make(mig_plan.encode(mig_plan.MigPlacement(GPU, "2g.20gb", 4)))
    assert made.startswith("MIG-") and _layout(fake) == [("2g.20gb", 4, 1), ("3g.40gb", 0, 1)]
    assert ("2g.20gb", 4) in state.snapshot.inventory.gpus[0].dynamic_mig.instances  # rediscovered
    assert MigNode.build(backend, NodeState(backend.discover(), Config()), CollectorRegistry()) is None
