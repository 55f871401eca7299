"""Enforcement modes: detection from node facts, refusal with the reason, what Allocate adds, and the
daemon refusing to start on a mode the node cannot honour (issue 9 item 1)."""
from __future__ import annotations

import os

import pytest
from prometheus_client import generate_latest

from deviceplugin import allocation, enforcement
from deviceplugin.allocation import GpuShare
from deviceplugin.enforcement import EnforcementRefused, NodeFacts, choose, probe
from deviceplugin.kubelet.main import DevicePluginDaemon
from deviceplugin.simulated_backend import SimulatedBackend
from tests.fixtures.fake_nvml import A100_80GB_MIG, H100_80GB, FakeNvml
from vramshare.config import Config, EnforcementConfig
from vramshare.inventory import EnforcementMode, NodeInventory

DRIVER_OK = NodeFacts("615.20.01", True, None, "no MPS control pipe at /run/nvidia/mps/nvidia.com/gpu/pipe/control")
OLD_DRIVER = NodeFacts("580.95.05", True, "FunctionNotFound", None)
V1_CGROUPS = NodeFacts("615.20.01", False, None, "no MPS control pipe")
NOTHING = NodeFacts(None, True, "no NVML", "no MPS control pipe")


@pytest.mark.parametrize("facts, mode", [(DRIVER_OK, EnforcementMode.DRIVER), (OLD_DRIVER, EnforcementMode.MPS),
                                         (V1_CGROUPS, EnforcementMode.COOPERATIVE),
                                         (NOTHING, EnforcementMode.COOPERATIVE)])
def test_auto_takes_the_best_mode_the_node_supports(facts, mode):
    chosen = choose(None, facts)
    assert chosen.mode is mode and chosen.reason.startswith("auto")


@pytest.mark.parametrize("asked, facts, why", [
    (EnforcementMode.DRIVER, OLD_DRIVER, "driver 580.95.05 is older than R615"),
    (EnforcementMode.DRIVER, V1_CGROUPS, "cgroup v1"),
    (EnforcementMode.DRIVER, NOTHING, "no NVIDIA driver"),
    (EnforcementMode.DRIVER, NodeFacts("615.1", True, "NotSupported on GPU-x", None), "NotSupported on GPU-x"),
    (EnforcementMode.MPS, DRIVER_OK, "no MPS control pipe"),
])
def test_a_mode_the_node_cannot_honour_is_refused_with_the_reason(asked, facts, why):
    with pytest.raises(EnforcementRefused, match=why):
        choose(asked, facts)


def test_asked_modes_that_the_node_honours():
    assert choose(EnforcementMode.DRIVER, DRIVER_OK).mode is EnforcementMode.DRIVER
    assert choose(EnforcementMode.MPS, OLD_DRIVER).mode is EnforcementMode.MPS
    assert choose(EnforcementMode.COOPERATIVE, DRIVER_OK).mode is EnforcementMode.COOPERATIVE  # never refused


CAP_SYS_ADMIN = 1 << 21
AS_DEPLOYED_BY_DEFAULT = 0  # capabilities: drop: [ALL]


def _status(tmp_path, cap_eff: int) -> str:
    """A /proc/self/status with the given effective capability set."""
    path = tmp_path / f"status-{cap_eff:x}"
    path.write_text(f"Name:\tvramshare\nCapInh:\t0000000000000000\nCapEff:\t{cap_eff:016x}\n")
    return str(path)


@pytest.fixture
def own_cgroup_ns(tmp_path):
    """/sys/fs/cgroup as an unprivileged container sees it: cgroup v2, its own namespace (no kubepods)."""
    root = tmp_path / "cgroup"
    root.mkdir()
    (root / "cgroup.controllers").write_text("cpu memory dmem\n")
    return str(root)


@pytest.fixture
def cgroup_v2(own_cgroup_ns):
    """The host's cgroup v2 tree, as the driver-enforcement variant mounts it."""
    os.makedirs(os.path.join(own_cgroup_ns, "kubepods.slice"))
    return own_cgroup_ns


@pytest.fixture
def privileged(tmp_path):
    return _status(tmp_path, CAP_SYS_ADMIN | 0x1)


def _nvml(version: str, gpus=(H100_80GB,)) -> FakeNvml:
    nv = FakeNvml(list(gpus))
    nv.driver_version = version
    nv.nvmlInit()
    return nv


def test_probe_on_an_r615_node_with_cgroup_v2(cgroup_v2, privileged):
    facts = probe(_nvml("615.20.01"), EnforcementConfig(), cgroup_root=cgroup_v2, shared_uuids=[H100_80GB.uuid],
                proc_status=privileged)
    assert facts.driver_problem() is None and choose(None, facts).mode is EnforcementMode.DRIVER


def test_probe_finds_each_driver_failure(cgroup_v2, tmp_path, privileged):
    old = probe(_nvml("580.95.05"), EnforcementConfig(), cgroup_root=cgroup_v2, shared_uuids=[H100_80GB.uuid],
                proc_status=privileged)
    assert "older than R615" in old.driver_problem() and "FunctionNotFound" in old.memory_limits_problem
    mig = probe(_nvml("615.20.01", (A100_80GB_MIG,)), EnforcementConfig(), cgroup_root=cgroup_v2,
                shared_uuids=[A100_80GB_MIG.uuid], proc_status=privileged)
    assert "NotSupported" in mig.driver_problem()
    unprivileged = _nvml("615.20.01")
    unprivileged.privileged = False
    denied = probe(unprivileged, EnforcementConfig(), cgroup_root=cgroup_v2, shared_uuids=[H100_80GB.uuid],
                proc_status=privileged)
    assert "NoPermission" in denied.driver_problem() and "privileged" in denied.driver_problem()
    v1 = probe(_nvml("615.20.01"), EnforcementConfig(), cgroup_root=str(tmp_path), shared_uuids=[H100_80GB.uuid])
    assert "cgroup v1" in v1.driver_problem()
    with pytest.raises(EnforcementRefused, match="NoPermission"):
        choose(EnforcementMode.DRIVER, denied)


def test_probe_writes_the_root_limits_back_unchanged(cgroup_v2, privileged):
    nv = _nvml("615.20.01")
    probe(nv, EnforcementConfig(), cgroup_root=cgroup_v2, shared_uuids=[H100_80GB.uuid],
                proc_status=privileged)
    assert nv.limits[(H100_80GB.uuid, "/")] == (0, nv.NVML_DEVICE_MEMORY_LIMIT_MAX)


def test_mps_is_found_by_its_control_pipe_and_shared_memory(tmp_path):
    pipe, shm = tmp_path / "pipe", tmp_path / "shm"
    cfg = EnforcementConfig(mps_pipe_directory=str(pipe), mps_shm_directory=str(shm))
    assert "no MPS control pipe" in probe(None, cfg, cgroup_root=str(tmp_path)).mps_problem
    pipe.mkdir()
    os.mkfifo(pipe / "control")
    assert "shared-memory" in probe(None, cfg, cgroup_root=str(tmp_path)).mps_problem
    shm.mkdir()
    assert choose(None, probe(None, cfg, cgroup_root=str(tmp_path))).mode is EnforcementMode.MPS


# -- issue 17 item 7: driver mode as deployed ---------------------------------------------------------
@pytest.mark.parametrize("lacks", ["capability", "host-cgroups", "both"])
def test_a_plugin_without_the_privilege_or_the_host_cgroups_does_not_advertise_driver(
        lacks, tmp_path, own_cgroup_ns, privileged):
    """The default DaemonSet drops every capability and sees its own cgroup namespace: on an R615 node
    auto must not pick driver (its first limit move would fail), and an explicit driver is refused."""
    cgroups = own_cgroup_ns if lacks in ("host-cgroups", "both") else str(tmp_path / "host")
    if lacks == "capability":
        os.makedirs(os.path.join(cgroups, "kubepods.slice"))
        (tmp_path / "host" / "cgroup.controllers").write_text("cpu memory dmem\n")
    status = privileged if lacks == "host-cgroups" else _status(tmp_path, AS_DEPLOYED_BY_DEFAULT)
    facts = probe(_nvml("615.20.01"), EnforcementConfig(), cgroup_root=cgroups, shared_uuids=[H100_80GB.uuid],
                  proc_status=status)
    chosen = choose(None, facts)
    assert chosen.mode is EnforcementMode.COOPERATIVE
    [(mode, why), _mps] = chosen.skipped
    assert mode is EnforcementMode.DRIVER and "deploy/components/driver-enforcement" in why
    assert ("CAP_SYS_ADMIN" if lacks != "host-cgroups" else "no kubepods cgroup") in why
    with pytest.raises(EnforcementRefused, match="enforcement.mode driver refused: .*driver-enforcement"):
        choose(EnforcementMode.DRIVER, facts)


def test_the_fallback_and_its_reason_are_in_the_metrics(tmp_path):
    lacking = NodeFacts("615.20.01", True, "not probed", "no MPS control pipe", "this container lacks CAP_SYS_ADMIN")
    daemon = DevicePluginDaemon(_backend(lacking), Config(), str(tmp_path))
    try:
        scrape = generate_latest(daemon.metrics.registry).decode()
        assert 'vramshare_enforcement_mode{mode="cooperative"} 1.0' in scrape
        assert 'vramshare_enforcement_unavailable{mode="driver",reason="this container lacks CAP_SYS_ADMIN"} 1.0' in scrape
    finally:
        daemon.close()
    with pytest.raises(EnforcementRefused, match="lacks CAP_SYS_ADMIN"):
        DevicePluginDaemon(_backend(lacking), Config(enforcement=EnforcementConfig(mode="driver")), str(tmp_path))


def _pinned(mode: EnforcementMode) -> Config:
    return Config(enforcement=EnforcementConfig(resolved=mode))


def test_allocate_sets_the_toolkit_variables_in_driver_mode():
    spec = allocation.container_spec([GpuShare("GPU-a", 20480)], _pinned(EnforcementMode.DRIVER), None)
    assert spec.envs["NVIDIA_GPU_MEMORY_REQUEST"] == spec.envs["NVIDIA_GPU_MEMORY_LIMIT"] == "20480"
    assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" not in spec.envs
    uneven = allocation.container_spec([GpuShare("GPU-a", 3072), GpuShare("GPU-b", 1024)],
                                       _pinned(EnforcementMode.DRIVER), None)
    assert uneven.envs["NVIDIA_GPU_MEMORY_LIMIT"] == "3072"  # the loop narrows GPU-b at its first tick


def test_a_mig_instance_gets_no_driver_limit():
    """Driver limits cover non-MIG GPUs only (R615): a container given a MIG instance got the toolkit's
    variables too, and the hook would set a cgroup limit for a device the driver does not limit."""
    mig = allocation.container_spec([GpuShare("MIG-4f8b0a2e-6c1d-5e3f-9a7b-0c2d4e6f8a1b", 9856)],
                                    _pinned(EnforcementMode.DRIVER), None)
    assert not {k for k in mig.envs if k.startswith("NVIDIA_GPU_MEMORY")}
    mixed = allocation.container_spec([GpuShare("MIG-4f8b0a2e-6c1d-5e3f-9a7b-0c2d4e6f8a1b", 40192),
                                       GpuShare("GPU-a", 8192)], _pinned(EnforcementMode.DRIVER), None)
    assert mixed.envs["NVIDIA_GPU_MEMORY_LIMIT"] == "8192"


def test_allocate_in_mps_mode_mounts_what_a_client_needs():
    spec = allocation.container_spec([GpuShare("GPU-a", 8192)], _pinned(EnforcementMode.MPS), None)
    assert spec.envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=8192M"
    assert spec.envs["CUDA_MPS_PIPE_DIRECTORY"] == "/mps/pipe"
    assert {(c, h) for c, h, _ in spec.mounts} >= {("/mps/pipe", "/run/nvidia/mps/nvidia.com/gpu/pipe"),
                                                   ("/dev/shm", "/run/nvidia/mps/shm")}


@pytest.mark.parametrize("mode", [None, EnforcementMode.COOPERATIVE])
def test_allocate_adds_nothing_when_nothing_fences(mode):
    spec = allocation.container_spec([GpuShare("GPU-a", 8192)], _pinned(mode) if mode else Config(), None)
    assert not {k for k in spec.envs if k.startswith(("NVIDIA_GPU_MEMORY", "CUDA_MPS"))}


def _backend(facts: NodeFacts) -> SimulatedBackend:
    b = SimulatedBackend.demo()
    b.enforcement_facts = facts
    return b


def test_daemon_refuses_to_start_on_a_mode_it_cannot_honour(tmp_path):
    cfg = Config(enforcement=EnforcementConfig(mode="driver"))
    with pytest.raises(EnforcementRefused, match="older than R615"):
        DevicePluginDaemon(_backend(OLD_DRIVER), cfg, str(tmp_path))


def test_detected_mode_is_in_the_inventory_and_survives_a_reload(tmp_path):
    daemon = DevicePluginDaemon(_backend(DRIVER_OK), Config(), str(tmp_path))
    try:
        inv = NodeInventory.from_json(daemon.state.snapshot.inventory.to_json())
        assert inv.enforcement is EnforcementMode.DRIVER
        scrape = generate_latest(daemon.metrics.registry).decode()
        assert 'vramshare_enforcement_mode{mode="driver"} 1.0' in scrape
        assert 'vramshare_enforcement_mode{mode="cooperative"} 0.0' in scrape
        daemon.reload(Config(memory_unit_mib=2048))
        assert daemon.state.snapshot.inventory.enforcement is EnforcementMode.DRIVER
        assert daemon.state.snapshot.config.enforcement.resolved is EnforcementMode.DRIVER
    finally:
        daemon.close()


def test_inventory_readers_tolerate_the_field_absent_or_unknown():
    base = NodeInventory(unit_mib=1024)
    assert '"enforcement"' not in base.to_json()
    assert NodeInventory.from_json(base.to_json()).enforcement is None
    text = base.to_json().replace('"gpus"', '"enforcement":"hami","gpus"')
    assert NodeInventory.from_json(text).enforcement is None


def test_pin_keeps_the_running_mode_when_the_config_asks_another():
    chosen = enforcement.Chosen(EnforcementMode.MPS, "asked for")
    cfg = enforcement.pin(Config(enforcement=EnforcementConfig(mode="driver")), chosen)
    assert cfg.enforcement.resolved is EnforcementMode.MPS
