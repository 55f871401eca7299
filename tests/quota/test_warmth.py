"""Hot, warm and waking tenants: idle ones shrink toward their floor and lend memory to pressured
co-tenants; the first sign of traffic restores them ahead of others (issue 9 item 4)."""
from __future__ import annotations

import dataclasses

from deviceplugin.quota.loop import LoopSettings, QuotaLoop
from deviceplugin.quota.model import (GpuState, Phase, PolicyParams, Signals, Tenant, TenantKey,
                                      TenantState)
from deviceplugin.quota.policy import rebalance
from deviceplugin.quota.service import QuotaCollector
from deviceplugin.quota.telemetry import UsageSample, VllmSample
from deviceplugin.quota.warmth import Warmth
from deviceplugin.quota.writer import container_dir, read_quota

P = PolicyParams(floor_fraction=0.25, ceiling_fraction=1.5, step_mib=512, margin_mib=1024, share_spare=False,
                 loans="any")  # lending mechanics; the loan rule of issue 19 has its own tests
IDLE = TenantKey("llm", "idle", "vllm", pod_uid="uid-idle")
BUSY = TenantKey("llm", "busy", "vllm", pod_uid="uid-busy")
QUIET, TRAFFIC = Signals(running=0, waiting=0), Signals(running=3, waiting=0)


def test_idle_for_the_configured_time_makes_a_tenant_warm_and_traffic_wakes_it():
    w = Warmth()
    assert w.update(IDLE, 8000, QUIET, 0, 60, 512) is Phase.HOT
    assert w.update(IDLE, 8100, QUIET, 59, 60, 512) is Phase.HOT
    assert w.update(IDLE, 8000, QUIET, 60, 60, 512) is Phase.WARM
    assert w.update(IDLE, 8000, QUIET, 500, 60, 512) is Phase.WARM
    assert w.update(IDLE, 8000, TRAFFIC, 510, 60, 512) is Phase.WAKING
    assert w.update(IDLE, 9000, TRAFFIC, 520, 60, 512) is Phase.HOT
    assert w.update(IDLE, 9000, QUIET, 530, 60, 512) is Phase.HOT  # the idle clock starts again


def test_rising_use_wakes_and_no_signals_never_warms():
    w = Warmth()
    w.update(IDLE, 8000, QUIET, 0, 10, 512)
    assert w.update(IDLE, 8000, QUIET, 10, 10, 512) is Phase.WARM
    assert w.update(IDLE, 9000, QUIET, 11, 10, 512) is Phase.WAKING
    assert all(w.update(BUSY, 8000, Signals(), t, 10, 512) is Phase.HOT for t in range(0, 100, 10))
    assert Warmth().update(IDLE, 8000, QUIET, 0, 0, 512) is Phase.HOT  # idleSeconds 0: never warm


def test_requests_that_come_and_go_between_ticks_keep_a_tenant_hot():
    """vLLM's gauges read 0 at every tick while short requests finish in between: only the finished
    counter's increase shows them (a 10 s tick misses a 2 s request every 8 s)."""
    w, between = Warmth(), Signals(running=0, waiting=0, finished=2)
    assert all(w.update(BUSY, 8000, between, t, 30, 512) is Phase.HOT for t in range(0, 200, 10))
    assert w.update(BUSY, 8000, QUIET, 200, 30, 512) is Phase.HOT  # quiet from here: the idle clock starts
    assert w.update(BUSY, 8000, QUIET, 230, 30, 512) is Phase.WARM
    assert w.update(BUSY, 8000, between, 240, 30, 512) is Phase.WAKING


def _gpu(idle_phase, idle_cur, busy_cur, busy_used=19500):
    return GpuState("GPU-0", 40000, (
        TenantState(IDLE, 20000, idle_cur, 3000, QUIET, phase=idle_phase),
        TenantState(BUSY, 20000, busy_cur, busy_used, Signals(waiting=4, kv_usage=0.97))))


def test_a_warm_tenant_shrinks_toward_its_floor_and_its_memory_goes_to_the_pressured():
    # the busy tenant borrowed 6000; while the idle one is hot it keeps its 14000, nothing is spare
    share = dataclasses.replace(P, share_spare=True)
    hot = {d.key.pod: d for d in rebalance(_gpu(Phase.HOT, 14000, 26000, 25500), share)}
    warm = {d.key.pod: d for d in rebalance(_gpu(Phase.WARM, 14000, 26000, 25500), share)}
    assert warm["idle"].limit_mib == max(5000, 3000 + 1024) < hot["idle"].limit_mib
    assert warm["idle"].phase is Phase.WARM and "warm" in warm["idle"].reason
    assert warm["busy"].limit_mib > hot["busy"].limit_mib  # a warm tenant gets no share of the spare


def test_a_waking_tenant_is_restored_ahead_of_a_pressured_co_tenant():
    # the busy tenant borrowed the idle one's memory; traffic comes back to the idle one
    gpu = GpuState("GPU-0", 40000, (
        TenantState(IDLE, 20000, 5000, 3000, TRAFFIC, phase=Phase.WAKING),
        TenantState(BUSY, 20000, 30000, 18000, Signals(preemptions=3, waiting=4))))
    d = {x.key.pod: x for x in rebalance(gpu, P)}
    assert d["idle"].limit_mib == 20000 and "waking" in d["idle"].reason  # its whole request back first
    assert d["busy"].limit_mib == 20000


class Source:
    name = "fake"

    def __init__(self):
        self.used = {IDLE: 3000, BUSY: 19500}

    def list_tenants(self):
        return [Tenant(IDLE, (("GPU-0", 20000),), metrics_url="http://idle"),
                Tenant(BUSY, (("GPU-0", 20000),), metrics_url="http://busy")]

    def read_usage(self):
        return [UsageSample("GPU-0", self.used[k], pod_uid=k.pod_uid) for k in self.used]


class Vllm:
    def __init__(self):
        self.by_url = {"http://idle": VllmSample(waiting=0, running=0), "http://busy": VllmSample(waiting=3, running=8)}

    def read_signals(self, url):
        return self.by_url[url]


def test_the_loop_writes_the_state_and_exports_it(tmp_path):
    clock, src, vllm = [0.0], Source(), Vllm()
    loop = QuotaLoop(src, lambda: {"GPU-0": 40000}, [src], P, str(tmp_path), signals=vllm,
                     settings=LoopSettings(P, idle_seconds=30, startup_ticks=0),  # not newcomers (test_node_soundness)
                     clock=lambda: clock[0])
    for t in range(0, 50, 10):
        clock[0] = float(t)
        loop.run_once()
    doc = read_quota(container_dir(str(tmp_path), IDLE.pod_uid, "vllm"))
    assert doc.state == "warm" and doc.limits()["GPU-0"] == 5000
    assert read_quota(container_dir(str(tmp_path), BUSY.pod_uid, "vllm")).state == "hot"
    text = {(m.name, tuple(s.labels.items())): s.value for m in QuotaCollector(loop).collect() for s in m.samples}
    assert text[("vramshare_quota_tenant_state", (("tenant_namespace", "llm"), ("tenant_pod", "idle"), ("tenant_container", "vllm"),
                                                  ("class", "default"), ("state", "warm")))] == 1.0
    vllm.by_url["http://idle"] = VllmSample(waiting=2, running=1)  # traffic again
    clock[0] = 60.0
    report = loop.run_once()
    idle = next(d for d in report.decisions if d.key == IDLE)
    assert idle.phase is Phase.WAKING and idle.limit_mib > 5000
    assert read_quota(container_dir(str(tmp_path), IDLE.pod_uid, "vllm")).state == "waking"


def test_the_loop_reads_the_finished_counter_between_ticks_and_survives_its_reset(tmp_path):
    """Through the loop: an engine whose gauges are 0 at every scrape but whose
    vllm:request_success_total rises is never made warm; a restart (the counter falls) counts from zero."""
    clock, src, vllm = [0.0], Source(), Vllm()
    loop = QuotaLoop(src, lambda: {"GPU-0": 40000}, [src], P, str(tmp_path), signals=vllm,
                     settings=LoopSettings(P, idle_seconds=30, startup_ticks=0), clock=lambda: clock[0])

    def state() -> str:
        return read_quota(container_dir(str(tmp_path), IDLE.pod_uid, "vllm")).state

    for n, t in enumerate(range(0, 100, 10)):
        clock[0] = float(t)
        vllm.by_url["http://idle"] = VllmSample(waiting=0, running=0, finished_total=100.0 + 3 * n)
        loop.run_once()
        assert state() == "hot", t
    for t in range(100, 140, 10):  # the counter stops: idle from the first tick it did not move
        clock[0] = float(t)
        loop.run_once()
    assert state() == "warm"
    clock[0] = 140.0
    vllm.by_url["http://idle"] = VllmSample(waiting=0, running=0, finished_total=0.0)  # restarted, no request yet
    loop.run_once()
    assert state() == "warm"
    clock[0] = 150.0
    vllm.by_url["http://idle"] = VllmSample(waiting=0, running=0, finished_total=1.0)  # one since the restart
    loop.run_once()
    assert state() == "waking"
