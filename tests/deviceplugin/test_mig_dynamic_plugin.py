"""Issue 24, the device-plugin path on the node: placements advertised, made at Allocate, reaped.

Through the real daemon over real gRPC to the stand-in kubelet, on the simulated backend whose MIG GPU
is cut by :class:`deviceplugin.simulated_mig.SimulatedMig` (the tables of vramshare.mig). On main the
plugin advertised only the admin's instances: none of these IDs existed and nothing was ever made.
"""
from __future__ import annotations

import grpc
import pytest

from deviceplugin.simulated_backend import SimulatedBackend
from tests.deviceplugin.mig_node import A100, NODE, pid, with_dynamic_mig
from vramshare import contract
from vramshare.config import Config
from vramshare.inventory import NodeInventory

R1G, R2G, R3G, R7G = (f"vramshare.io/mig-{p}" for p in ("1g.10gb", "2g.20gb", "3g.40gb", "7g.80gb"))


@pytest.fixture
def backend() -> SimulatedBackend:
    return SimulatedBackend.from_dict(NODE)


@pytest.fixture
def dynamic(config: Config) -> Config:
    return with_dynamic_mig(config)


def test_off_by_default_the_admin_instances_are_all_there_is(start_plugin, kubelet):
    daemon = start_plugin()
    assert daemon.mig is None
    assert kubelet.healthy_ids(R3G) == [m.uuid for m in daemon.state.snapshot.inventory.gpus[1].mig]
    assert R1G not in kubelet.resources


def test_inventory_publishes_instances_and_free_placements(start_plugin, dynamic):
    daemon = start_plugin(dynamic)
    inv = NodeInventory.from_json(daemon.state.snapshot.inventory.to_json())
    d = inv.gpus[1].dynamic_mig
    assert d is not None and d.table == "A100-SXM4-80GB" and d.instances == (("3g.40gb", 0),)
    free = dict(d.free)
    assert free["1g.10gb"] == (4, 5, 6) and free["2g.20gb"] == (4,) and free["3g.40gb"] == (4,)
    assert free["4g.40gb"] == () and free["7g.80gb"] == ()
    assert inv.gpus[0].dynamic_mig is None  # the shared H100 is no MIG GPU


def test_allocate_makes_the_planned_instance_and_the_lists_follow(start_plugin, kubelet, dynamic, backend):
    daemon = start_plugin(dynamic)
    assert sorted(kubelet.healthy_ids(R1G)) == [pid("1g.10gb", s) for s in (4, 5, 6)]
    assert kubelet.healthy_ids(R3G) == [pid("3g.40gb", 0), pid("3g.40gb", 4)]  # the existing one keeps its ID
    assert kubelet.healthy_ids(R7G) == []  # registered, no device: no re-registration when one appears
    resp = kubelet.allocate(R2G, [pid("2g.20gb", 4)])
    made = resp.envs[contract.ENV_VISIBLE_DEVICES]
    assert made.startswith("MIG-") and resp.envs[contract.ENV_MEMORY_LIMIT_MIB] == "20480"
    assert [str(p) for p in backend.mig_nvml.layout(A100)] == ["Placed(start=0, profile='3g.40gb')",
                                                                "Placed(start=4, profile='2g.20gb')"]
    kubelet.wait_for(lambda: sorted(kubelet.healthy_ids(R1G)) == [pid("1g.10gb", 6)], what="1g list shrinks")
    assert kubelet.healthy_ids(R2G) == [pid("2g.20gb", 4)]  # what the kubelet granted stays listed
    # idempotent per plan: a retried Allocate adopts, never makes a second instance
    again = kubelet.allocate(R2G, [pid("2g.20gb", 4)])
    assert again.envs[contract.ENV_VISIBLE_DEVICES] == made
    assert len(backend.mig_nvml.layout(A100)) == 2
    # a stale list's overlapping placement is refused with the reason; the 2g instance is untouched
    with pytest.raises(grpc.RpcError) as err:
        kubelet.allocate(R1G, [pid("1g.10gb", 5)])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "stale" in err.value.details()
    assert len(backend.mig_nvml.layout(A100)) == 2
    assert daemon.metrics.registry.get_sample_value("vramshare_mig_instances_created_total", {"gpu": A100}) == 1.0


def test_a_crash_between_the_creates_is_recovered_by_the_retry(start_plugin, kubelet, dynamic, backend):
    daemon = start_plugin(dynamic)
    backend.mig_nvml.fail_next("create_ci", "NVMLError_Unknown")
    with pytest.raises(grpc.RpcError) as err:
        kubelet.allocate(R3G, [pid("3g.40gb", 4)])
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "NVMLError_Unknown" in err.value.details()
    assert len(backend.mig_nvml.layout(A100)) == 2  # the GPU instance exists, without compute instance
    resp = kubelet.allocate(R3G, [pid("3g.40gb", 4)])
    assert resp.envs[contract.ENV_VISIBLE_DEVICES].startswith("MIG-")
    assert len(backend.mig_nvml.layout(A100)) == 2  # adopted: no leaked, no doubled instance
    assert [c.split()[0] for c in backend.mig_nvml.calls] == ["create", "create_ci"]
    text = daemon.metrics.registry.get_sample_value
    assert text("vramshare_mig_instances_created_total", {"gpu": A100}) is None
    assert text("vramshare_mig_instances_adopted_total", {"gpu": A100}) == 1.0
    assert text("vramshare_mig_failures_total", {"gpu": A100, "reason": "NVMLError_Unknown"}) == 1.0


def test_unheld_instances_are_reaped_held_and_busy_ones_never(start_plugin, kubelet, dynamic, backend):
    daemon = start_plugin(dynamic)
    daemon.reconciler.run_once()
    assert len(backend.mig_nvml.layout(A100)) == 1  # within the grace the admin's unheld 3g@0 stays
    daemon.mig.fresh_seconds = daemon.mig.dynamic.grace_seconds = 0.0
    kubelet.allocate(R1G, [pid("1g.10gb", 4)], pod=("ns", "held", "c"))
    busy = kubelet.allocate(R1G, [pid("1g.10gb", 5)]).envs[contract.ENV_VISIBLE_DEVICES]
    kubelet.allocate(R1G, [pid("1g.10gb", 6)])
    backend.mig_nvml.set_busy(busy)
    daemon.reconciler.run_once()  # PodResources lists only the held one; grace 0
    left = {(p.profile, p.start) for p in backend.mig_nvml.layout(A100)}
    assert left == {("1g.10gb", 4), ("1g.10gb", 5)}  # 3g@0 (unheld, admin's) and 1g@6 destroyed
    kubelet.wait_for(lambda: pid("3g.40gb", 0) in kubelet.healthy_ids(R3G), what="3g@0 free again")
    assert daemon.metrics.registry.get_sample_value("vramshare_mig_instances_destroyed_total", {"gpu": A100}) == 2.0


def test_a_plugin_restart_between_create_and_answer_adopts_the_instance(start_plugin, kubelet, dynamic, backend):
    """The instance was made but the plugin died before the kubelet got the answer: the kubelet retries
    Allocate against the new process, which knows only what NVML shows and adopts it."""
    first = start_plugin(dynamic)
    made = kubelet.allocate(R3G, [pid("3g.40gb", 4)]).envs[contract.ENV_VISIBLE_DEVICES]
    first.close()
    second = start_plugin(dynamic, gpus=backend.restarted())
    assert kubelet.allocate(R3G, [pid("3g.40gb", 4)]).envs[contract.ENV_VISIBLE_DEVICES] == made
    assert len(backend.mig_nvml.layout(A100)) == 2
    assert second.metrics.registry.get_sample_value("vramshare_mig_instances_adopted_total", {"gpu": A100}) == 1.0


def test_a_failed_destroy_leaves_the_instance_and_the_next_round_removes_it(start_plugin, kubelet, dynamic, backend):
    daemon = start_plugin(dynamic)
    kubelet.allocate(R1G, [pid("1g.10gb", 4)])
    daemon.mig.fresh_seconds = daemon.mig.dynamic.grace_seconds = 0.0
    backend.mig_nvml.fail_next("destroy", "NVMLError_Unknown")
    daemon.reconciler.run_once()
    assert len(backend.mig_nvml.layout(A100)) == 1  # 3g@0 went first (gi 1), then 1g@4 failed: it stays
    assert daemon.metrics.registry.get_sample_value(
        "vramshare_mig_failures_total", {"gpu": A100, "reason": "NVMLError_Unknown"}) == 1.0
    daemon.reconciler.run_once()
    assert backend.mig_nvml.layout(A100) == []
    kubelet.wait_for(lambda: pid("7g.80gb", 0) in kubelet.healthy_ids(R7G), what="the whole GPU creatable again")


def test_no_code_can_change_mig_mode_or_reset_a_gpu():
    """The rule of issue 24 that no test of behaviour can prove by absence: nothing shipped names the NVML
    calls that switch MIG mode or reset a GPU (a reset would kill every process on it)."""
    import pathlib
    root = pathlib.Path(__file__).resolve().parents[2]
    forbidden = ("nvmlDeviceSetMigMode", "nvmlDeviceResetGpu", "nvmlDeviceClearEccErrorCounts", "--gpu-reset",
                 "mig -e", "-mig 1", "-mig 0")
    hits = [f"{p.relative_to(root)}: {word}" for pkg in ("deviceplugin", "extender", "vramshare", "vllm_patches")
            for p in (root / pkg).rglob("*.py") for word in forbidden if word in p.read_text(encoding="utf-8")]
    assert hits == []
