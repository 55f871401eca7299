"""The quota loop settles the memory no tenant holds and tells the node agent (``QuotaLoop.on_foreign``),
which publishes it for the extender (vramshare/foreign.py). Telemetry doubles at the NVML edge only."""
from __future__ import annotations

import dataclasses
import threading

from deviceplugin.nvml_limits import CgroupFinder, NvmlMemoryLimits
from deviceplugin.quota.fence import DriverFence
from deviceplugin.quota.loop import LoopSettings, QuotaLoop
from deviceplugin.quota.model import PolicyParams, Tenant, TenantKey
from deviceplugin.quota.telemetry import NvmlProcessReader, UsageSample
from tests.extender.conftest import eventually
from tests.quota.test_driver_mode import GPU, node  # noqa: F401 - the fixture
from tests.quota.test_loop import Usage
from tests.quota.test_telemetry import UID, FakeNvml, Proc, proc_root  # noqa: F401 - the fixture
from vramshare.inventory import EnforcementMode

P = PolicyParams(floor_fraction=0.5, ceiling_fraction=1.5, step_mib=512, margin_mib=1024)
TENANT = TenantKey("llm", "a", "vllm", pod_uid=UID)
GIB = 1 << 30


class Tenants:
    def __init__(self, tenants):
        self.tenants = tenants

    def list_tenants(self):
        return self.tenants


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def _loop(tmp_path, reader, tenants, capacities, **kw):
    clock = Clock()
    loop = QuotaLoop(Tenants(tenants), lambda: capacities, [reader] if reader else [], P, str(tmp_path / "q"),
                     settings=LoopSettings(params=P, startup_ticks=0), clock=clock, **kw)
    told = []
    loop.on_foreign = lambda settled: told.append(dict(settled))
    return loop, clock, told


def _ticks(loop, clock, n):
    for _ in range(n):
        loop.run_once()
        clock.now += 10


def test_a_host_process_is_reported_once_it_stays_and_withdrawn_when_it_goes(tmp_path, proc_root):
    """PID 100 is the tenant's (its cgroup names the pod), PID 300 a host process; GPU-b has no tenant."""
    nv = FakeNvml({"GPU-a": [Proc(100, 10 * GIB), Proc(300, 6 * GIB)], "GPU-b": [Proc(300, 3 * GIB)]})
    loop, clock, told = _loop(tmp_path, NvmlProcessReader(nv, proc_root=str(proc_root)),
                              [Tenant(TENANT, (("GPU-a", 20000),))], {"GPU-a": 40000, "GPU-b": 40000})
    _ticks(loop, clock, 1)  # one reading: never enough
    assert told == []
    _ticks(loop, clock, 1)
    assert told == [{"GPU-a": 6144, "GPU-b": 3072}]
    _ticks(loop, clock, 3)
    assert len(told) == 1  # unchanged: not told again
    nv.gpus["GPU-a"] = [Proc(100, 10 * GIB)]  # the host process exited
    _ticks(loop, clock, 1)
    assert told[-1] == {"GPU-b": 3072}


def test_a_reading_of_a_process_starting_before_its_pod_is_a_tenant_is_never_reported(tmp_path, proc_root):
    nv, tenants = FakeNvml({"GPU-a": []}), []
    loop, clock, told = _loop(tmp_path, NvmlProcessReader(nv, proc_root=str(proc_root)), tenants, {"GPU-a": 40000})
    _ticks(loop, clock, 3)
    nv.gpus["GPU-a"] = [Proc(100, 10 * GIB)]  # its pod is no tenant yet: foreign for one tick
    _ticks(loop, clock, 1)
    tenants.append(Tenant(TENANT, (("GPU-a", 20000),)))
    _ticks(loop, clock, 5)
    assert told == []


def test_a_reader_that_sees_only_our_processes_reports_nothing(tmp_path):
    """dcgm-exporter or a replay: a sample no tenant matches is unmatched there, not proven foreign."""
    usage = Usage([UsageSample("GPU-a", 10000, pod_uid="uid-stranger")])
    loop, clock, told = _loop(tmp_path, usage, [Tenant(TENANT, (("GPU-a", 20000),))], {"GPU-a": 40000})
    _ticks(loop, clock, 6)
    assert told == [] and loop.capacities["GPU-a"] == 30000  # the loop itself still takes it off


def test_the_driver_fence_reads_a_gpu_without_tenants_too(tmp_path, node):  # noqa: F811 - the fixture
    """A shared GPU nobody of ours uses yet still has its foreign memory measured and reported."""
    nv, cgroot, _ = node
    real = nv.nvmlDeviceGetMemoryInfo

    def with_a_stranger(handle, version=None):  # a host process holds 12,000 MiB
        info = real(handle, version)
        info.used = sum(nv.used.values()) + 12000 * (1 << 20)
        return info

    nv.nvmlDeviceGetMemoryInfo = with_a_stranger
    caps = {GPU: 60000}
    fence = DriverFence(NvmlMemoryLimits(nv), CgroupFinder(cgroot), lambda: caps)
    loop, clock, told = _loop(tmp_path, None, [], caps, mode=EnforcementMode.DRIVER, fence=fence)
    _ticks(loop, clock, 4)
    assert fence.whole_gpus == {GPU}
    assert told == [{GPU: 12000}]


def test_a_paused_loop_withdraws_what_it_can_no_longer_measure(tmp_path, proc_root):
    """``quota.enabled: false`` reloaded: the loop stops reading, so the node must not keep booking a figure
    nobody updates (the stuck process may be gone)."""
    nv = FakeNvml({"GPU-a": [Proc(300, 6 * GIB)]})
    loop, clock, told = _loop(tmp_path, NvmlProcessReader(nv, proc_root=str(proc_root)), [], {"GPU-a": 40000})
    _ticks(loop, clock, 2)
    assert told == [{"GPU-a": 6144}]
    loop.settings = dataclasses.replace(loop.settings, enabled=False)
    stop = threading.Event()
    worker = threading.Thread(target=loop.run, args=(stop, 0.01))
    worker.start()
    try:
        assert eventually(lambda: told[-1] == {})
    finally:
        stop.set()
        worker.join(5)


def test_a_process_whose_cgroup_cannot_be_read_proves_nothing_foreign(tmp_path, proc_root):
    """Without ``hostPID`` no PID NVML names is visible: every process would look foreign, and the node
    would report its tenants' memory as held outside our pods. A GPU with a process whose cgroup cannot
    be read is left out of the report's readings (PID 999 has no /proc entry here)."""
    nv = FakeNvml({"GPU-a": [Proc(999, 10 * GIB)], "GPU-b": [Proc(300, 3 * GIB)]})
    reader = NvmlProcessReader(nv, proc_root=str(proc_root))
    loop, clock, told = _loop(tmp_path, reader, [], {"GPU-a": 40000, "GPU-b": 40000})
    _ticks(loop, clock, 3)
    assert reader.whole_gpus == {"GPU-b"}
    assert told == [{"GPU-b": 3072}]


def test_a_restarted_loop_keeps_the_last_published_figure_until_its_own_readings_settle(tmp_path, proc_root):
    """QuotaLoop.keep_foreign: the figure the node agent read back from its last publication is in force from
    the start (nothing told: it is already published), stands through the first tick (one reading proves
    nothing), and is replaced by the loop's own verdict once the readings span the window: here the host
    process on GPU-a stayed, the one on GPU-b went while the agent was down."""
    nv = FakeNvml({"GPU-a": [Proc(300, 6 * GIB)], "GPU-b": []})
    loop, clock, told = _loop(tmp_path, NvmlProcessReader(nv, proc_root=str(proc_root)), [],
                              {"GPU-a": 40000, "GPU-b": 40000})
    assert loop.keep_foreign({"GPU-a": 6144, "GPU-b": 2048}, interval_s=10) == {"GPU-a": 6144, "GPU-b": 2048}
    _ticks(loop, clock, 1)
    assert told == []
    _ticks(loop, clock, 1)
    assert told == [{"GPU-a": 6144}]


def test_a_kept_figure_no_reader_can_confirm_ends_two_ticks_after_the_window(tmp_path):
    """A replay (or dcgm-exporter) never reads a GPU whole: the kept figure goes when nothing confirmed it."""
    usage = Usage([UsageSample("GPU-a", 10000, pod_uid=UID)])
    loop, clock, told = _loop(tmp_path, usage, [Tenant(TENANT, (("GPU-a", 20000),))], {"GPU-a": 40000})
    loop.keep_foreign({"GPU-a": 3072}, interval_s=10)
    _ticks(loop, clock, 3)  # t = 0, 10, 20: within settle (10) + two ticks (20)
    assert told == []
    _ticks(loop, clock, 1)  # t = 30
    assert told == [{}]
