"""The simulated backend: inventory files (good and bad), health faults, discover failures."""
from __future__ import annotations

import re
import threading

import pytest

from deviceplugin import health, inventory_file
from deviceplugin.backend import BackendError, GpuBackend, HealthEvent
from deviceplugin.simulated_backend import LOST_REASON, SimulatedBackend, demo_inventory_path
from tests.fixtures import INVENTORIES

GPU_UUID = re.compile(r"^GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
MIG_UUID = re.compile(r"^MIG-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
IGNORED = health.DEFAULT_IGNORED_XIDS


def drain(backend: SimulatedBackend, ignored: frozenset[int] = IGNORED) -> list[HealthEvent]:
    """Run watch_health over everything injected so far: close() queues behind the faults."""
    events: list[HealthEvent] = []
    backend.close()
    backend.watch_health(threading.Event(), events.append, ignored)
    return events


@pytest.mark.parametrize("name, models, memory, numa, migs", [
    ("h100", ["NVIDIA H100 80GB HBM3"], [81559], [0], [()]),
    ("h200", ["NVIDIA H200"], [143771], [0], [()]),
    ("a100-mig", ["NVIDIA A100-SXM4-80GB"], [81920], [1], [(("3g.40gb", 40960), ("2g.20gb", 20480),
                                                              ("1g.10gb", 9856))]),
    ("mixed", ["NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB"], [81559, 81920], [0, 1],
     [(), (("3g.40gb", 40960), ("2g.20gb", 20480), ("1g.10gb", 10240))]),
], ids=["h100", "h200", "a100-mig", "mixed"])
def test_fixture_inventories(name, models, memory, numa, migs):
    gpus = SimulatedBackend.from_file(str(INVENTORIES / f"{name}.yaml")).discover()
    assert [g.model for g in gpus] == models
    assert [g.memory_mib for g in gpus] == memory
    assert [g.numa_node for g in gpus] == numa
    assert [g.index for g in gpus] == list(range(len(gpus)))
    assert [tuple((m.profile, m.memory_mib) for m in g.mig) for g in gpus] == migs
    assert [g.mig_enabled for g in gpus] == [bool(m) for m in migs]
    for g in gpus:
        assert GPU_UUID.match(g.uuid), g.uuid
        assert all(MIG_UUID.match(m.uuid) for m in g.mig)


def test_derived_uuids_are_deterministic_and_explicit_ones_kept():
    raw = {"gpus": [{"model": "M", "memoryMiB": 81920, "mig": ["1g.10gb"]},
                    {"model": "M", "memoryMiB": 100, "uuid": "GPU-explicit"}]}
    first, second = SimulatedBackend.from_dict(raw).discover(), SimulatedBackend.from_dict(raw).discover()
    assert first == second
    assert first[0].uuid == inventory_file.derived_gpu_uuid("M", 0) != inventory_file.derived_gpu_uuid("M", 1)
    assert first[1].uuid == "GPU-explicit"
    assert first[0].mig[0].gi == 1 and first[0].mig[0].ci == 0


def test_mig_memory_map_then_explicit_size_then_profile_name():
    raw = {"gpus": [{"model": "A100", "memoryMiB": 81920, "migMemoryMiB": {"3g.40gb": 40192},
                     "mig": ["3g.40gb", {"profile": "2g.20gb", "memoryMiB": 19968}, "1g.10gb"]}]}
    assert [m.memory_mib for m in SimulatedBackend.from_dict(raw).discover()[0].mig] == [40192, 19968, 10240]


def test_demo_inventory_is_packaged_and_valid():
    gpus = SimulatedBackend.demo().discover()
    assert demo_inventory_path().endswith("demo-node.yaml")
    assert {g.model for g in gpus} >= {"NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA A100-SXM4-80GB"}
    assert any(g.mig_enabled for g in gpus) and all(g.numa_node is not None for g in gpus)


def test_is_a_gpu_backend():
    assert isinstance(SimulatedBackend([]), GpuBackend)


GOOD = {"model": "NVIDIA H100 80GB HBM3", "memoryMiB": 81559}


@pytest.mark.parametrize("raw, message", [
    ([], "inventory: expected a mapping"),
    ({"gpu": []}, "inventory.gpu: unknown key"),
    ({"gpus": []}, "gpus: expected a non-empty list"),
    ({"gpus": [GOOD, {"model": "X", "memoryMiB": "80GB"}]}, "gpus[1].memoryMiB: expected an integer"),
    ({"gpus": [{"model": "X", "memoryMiB": True}]}, "gpus[0].memoryMiB: expected an integer"),
    ({"gpus": [{"model": "X"}]}, "gpus[0].memoryMiB: missing"),
    ({"gpus": [{"memoryMiB": 1}]}, "gpus[0].model: missing"),
    ({"gpus": [{**GOOD, "memorySize": 1}]}, "gpus[0].memorySize: unknown key"),
    ({"gpus": [{**GOOD, "numaNode": -1}]}, "gpus[0].numaNode: expected an integer >= 0"),
    ({"gpus": [{**GOOD, "reservedMiB": 81559}]}, "gpus[0].reservedMiB: 81559 is not below"),
    ({"gpus": [{**GOOD, "uuid": "abc"}]}, "gpus[0].uuid: 'abc' does not start with GPU-"),
    ({"gpus": [{**GOOD, "uuid": "GPU-a"}, {**GOOD, "uuid": "GPU-a"}]}, "gpus[1].uuid: GPU-a is already used by gpus[0].uuid"),
    ({"gpus": [{**GOOD, "mig": "3g.40gb"}]}, "gpus[0].mig: expected a list"),
    ({"gpus": [{**GOOD, "mig": ["3g"]}]}, "gpus[0].mig[0].profile: '3g' is not a MIG profile"),
    ({"gpus": [{**GOOD, "mig": [{"profile": "1g.10gb", "size": 1}]}]}, "gpus[0].mig[0].size: unknown key"),
    ({"gpus": [{**GOOD, "mig": [{"profile": "1g.10gb", "uuid": "GPU-x"}]}]}, "gpus[0].mig[0].uuid: 'GPU-x' does not start with MIG-"),
    ({"gpus": [{**GOOD, "mig": ["7g.80gb", "1g.10gb"]}]}, "gpus[0].mig: the instances hold more than memoryMiB"),
    ({"gpus": [{**GOOD, "migMemoryMiB": [1]}]}, "gpus[0].migMemoryMiB: expected a mapping"),
    ({"gpus": [{**GOOD, "migMemoryMiB": {"big": 1}}]}, "gpus[0].migMemoryMiB.big: not a MIG profile"),
    ({"gpus": [{**GOOD, "migMemoryMiB": {"1g.10gb": 0}}]}, "gpus[0].migMemoryMiB.1g.10gb: expected an integer >= 1"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_invalid_inventory_names_the_key(raw, message):
    with pytest.raises(BackendError) as err:
        SimulatedBackend.from_dict(raw)
    assert message in str(err.value)


def test_invalid_file_names_the_file_and_the_key(tmp_path):
    path = tmp_path / "node.yaml"
    path.write_text("gpus:\n  - model: X\n    memoryMiB: lots\n")
    with pytest.raises(inventory_file.InventoryFileError, match=r"node\.yaml: gpus\[0\]\.memoryMiB"):
        SimulatedBackend.from_file(str(path))
    path.write_text("gpus: [\n")
    with pytest.raises(inventory_file.InventoryFileError, match="not valid YAML"):
        SimulatedBackend.from_file(str(path))
    with pytest.raises(inventory_file.InventoryFileError, match="cannot read inventory .*missing.yaml"):
        SimulatedBackend.from_file(str(tmp_path / "missing.yaml"))


@pytest.fixture
def node() -> SimulatedBackend:
    return SimulatedBackend.from_file(str(INVENTORIES / "mixed.yaml"))


def test_critical_xid_then_recovery(node):
    h100, a100 = node.discover()
    node.inject_xid(h100.uuid, 79)
    node.inject_xid(h100.uuid, 48)  # already unhealthy: no second event
    node.recover(h100.uuid)
    node.recover(h100.uuid)  # already healthy: nothing
    assert drain(node) == [
        HealthEvent(uuid=h100.uuid, healthy=False, reason="xid 79", xid=79),
        HealthEvent(uuid=h100.uuid, healthy=True, reason="gpu answers again"),
    ]


@pytest.mark.parametrize("xid", sorted(IGNORED))
def test_application_xids_are_ignored_by_default(node, xid):
    node.inject_xid(node.discover()[0].uuid, xid)
    assert drain(node) == []


def test_ignored_xids_come_from_the_caller(node):
    uuid = node.discover()[0].uuid
    node.inject_xid(uuid, 13)
    node.inject_xid(uuid, 79)
    assert [e.xid for e in drain(node, ignored=frozenset({79}))] == [13]


def test_mig_instance_xid_names_the_instance(node):
    a100 = node.discover()[1]
    mig = a100.mig[2]
    node.inject_xid(a100.uuid, 94, mig_uuid=mig.uuid)
    node.recover(a100.uuid, mig_uuid=mig.uuid)
    assert [(e.uuid, e.mig_uuid, e.healthy) for e in drain(node)] == [
        (a100.uuid, mig.uuid, False), (a100.uuid, mig.uuid, True)]


def test_lost_gpu(node):
    uuid = node.discover()[0].uuid
    node.lose_gpu(uuid)
    assert drain(node) == [HealthEvent(uuid=uuid, healthy=False, reason=LOST_REASON)]


def test_faults_on_unknown_devices_are_refused(node):
    with pytest.raises(KeyError, match="no simulated GPU GPU-nope"):
        node.inject_xid("GPU-nope", 79)
    with pytest.raises(KeyError, match="has no MIG instance MIG-nope"):
        node.recover(node.discover()[1].uuid, mig_uuid="MIG-nope")


def test_discover_fails_n_times_then_answers(node):
    node.fail_discover(times=2, message="NVML: GPU is lost")
    for _ in range(2):
        with pytest.raises(BackendError, match="GPU is lost"):
            node.discover()
    assert len(node.discover()) == 2
    assert node.discover_calls == 3


def test_closed_backend_refuses_discover(node):
    node.close()
    with pytest.raises(BackendError, match="closed"):
        node.discover()


def test_stop_ends_watch_and_faults_from_other_threads_arrive(node):
    uuid = node.discover()[0].uuid
    stop, seen, got = threading.Event(), [], threading.Event()

    def on_event(event: HealthEvent) -> None:
        seen.append(event)
        if len(seen) == 2:
            got.set()

    watcher = threading.Thread(target=node.watch_health, args=(stop, on_event, IGNORED))
    watcher.start()
    injectors = [threading.Thread(target=node.inject_xid, args=(uuid, 79)),
                 threading.Thread(target=node.lose_gpu, args=(node.discover()[1].uuid,))]
    for t in injectors:
        t.start()
    assert got.wait(10), seen
    stop.set()
    watcher.join(10)
    assert not watcher.is_alive()
    assert sorted(e.reason for e in seen) == [LOST_REASON, "xid 79"]
