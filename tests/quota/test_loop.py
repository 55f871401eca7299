"""The loop end to end on a temp quota root: telemetry doubles at the edges, real policy and writer."""
from __future__ import annotations

import json

import pytest

from deviceplugin.quota.loop import LoopSettings, QuotaLoop
from deviceplugin.quota.model import PolicyParams, Tenant, TenantKey
from deviceplugin.quota.scrape import VllmMetricsReader
from deviceplugin.quota.telemetry import TelemetryError, UsageSample, VllmSample
from deviceplugin.quota.writer import GpuQuota, QuotaFile, container_dir, read_quota, write_quota

P = PolicyParams(floor_fraction=0.5, ceiling_fraction=1.5, step_mib=512, margin_mib=1024,
                 loans="any", headroom="peak")  # lending mechanics; the loan rule of issue 19 has its own tests
# these tenants are not newcomers (issue 19's startup rule is tested in test_claims.py)
SETTINGS = LoopSettings(params=P, startup_ticks=0)
HOT = TenantKey("llm", "hot", "vllm", pod_uid="uid-hot")
IDLE = TenantKey("llm", "idle", "vllm", pod_uid="uid-idle")


class Tenants:
    def __init__(self, tenants):
        self.tenants, self.fail = list(tenants), False

    def list_tenants(self):
        if self.fail:
            raise ConnectionError("apiserver unreachable")
        return self.tenants


class Usage:
    name = "fake"

    def __init__(self, samples):
        self.samples, self.fail = samples, False

    def read_usage(self):
        if self.fail:
            raise TelemetryError("nvml: NVMLError_Unknown")
        return self.samples


class Signals:
    def __init__(self, by_url):
        self.by_url = by_url

    def read_signals(self, url):
        value = self.by_url[url]
        if isinstance(value, Exception):
            raise value
        return value


class Mirror:
    def __init__(self):
        self.calls = []

    def mirror(self, key, quotas, states=None, details=None):
        self.calls.append((key.pod, quotas))
        self.states = states
        self.details = details


def make(tmp_path, usage, signals=None, mirror=None, tenants=None):
    tenants = tenants or Tenants([Tenant(HOT, (("GPU-0", 20000),), metrics_url="http://hot/metrics"),
                                  Tenant(IDLE, (("GPU-0", 20000),))])
    loop = QuotaLoop(tenants, lambda: {"GPU-0": 40000}, [usage], P, str(tmp_path), signals=signals, settings=SETTINGS,
                     mirror=mirror)
    return loop, tenants


def on_disk(tmp_path, key):
    return read_quota(container_dir(str(tmp_path), key.pod_uid, key.container))


def test_pressure_moves_memory_and_files_follow(tmp_path):
    usage = Usage([UsageSample("GPU-0", 19500, pod_uid="uid-hot"), UsageSample("GPU-0", 4000, pod_uid="uid-idle")])
    signals = Signals({"http://hot/metrics": VllmSample(kv_usage=0.97, waiting=2, preemptions_total=5)})
    mirror = Mirror()
    loop, _ = make(tmp_path, usage, signals, mirror)
    first = loop.run_once()
    hot, idle = on_disk(tmp_path, HOT), on_disk(tmp_path, IDLE)
    assert hot.gpus[0].limit_mib > 20000 > idle.gpus[0].limit_mib >= 5024
    assert hot.gpus[0].limit_mib + idle.gpus[0].limit_mib <= 40000
    assert hot.gpus[0] == GpuQuota("GPU-0", hot.gpus[0].limit_mib, 10000, 30000)
    assert {k.pod for k in first.written} == {"hot", "idle"}
    assert dict(mirror.calls)["hot"] == {"vllm": {"GPU-0": hot.gpus[0].limit_mib}}
    # the preemption counter moved by 4 since the last scrape: it shows in the reason
    signals.by_url["http://hot/metrics"] = VllmSample(kv_usage=0.97, waiting=2, preemptions_total=9)
    second = loop.run_once()
    assert "4 preemptions" in next(d.reason for d in second.decisions if d.key == HOT)
    assert on_disk(tmp_path, HOT).generation == 2


def test_allocate_file_is_the_starting_point_and_unchanged_limits_are_not_rewritten(tmp_path):
    for key in (HOT, IDLE):  # what the device plugin writes at Allocate
        write_quota(container_dir(str(tmp_path), key.pod_uid, key.container),
                    QuotaFile(gpus=(GpuQuota("GPU-0", 20000, 10000, 30000),)))
    usage = Usage([UsageSample("GPU-0", 8000, pod_uid="uid-hot"), UsageSample("GPU-0", 4000, pod_uid="uid-idle")])
    loop, _ = make(tmp_path, usage)
    report = loop.run_once()
    assert report.written == [] and all(d.reason == "hold" for d in report.decisions)
    assert on_disk(tmp_path, HOT).generation == 1


@pytest.mark.parametrize("what", ["tenants", "usage"])
def test_bad_input_keeps_the_last_good_quotas(tmp_path, what):
    usage = Usage([UsageSample("GPU-0", 19500, pod_uid="uid-hot"), UsageSample("GPU-0", 2000, pod_uid="uid-idle")])
    loop, tenants = make(tmp_path, usage)
    loop.run_once()
    before = on_disk(tmp_path, HOT)
    usage.samples = [UsageSample("GPU-0", 100, pod_uid="uid-hot"), UsageSample("GPU-0", 30000, pod_uid="uid-idle")]
    if what == "tenants":
        tenants.fail = True
    else:
        usage.fail = True
    report = loop.run_once()
    assert report.skipped and not report.decisions
    assert on_disk(tmp_path, HOT) == before


def test_a_broken_metrics_page_only_drops_that_tenants_signals(tmp_path):
    usage = Usage([UsageSample("GPU-0", 15000, pod_uid="uid-hot"), UsageSample("GPU-0", 4000, pod_uid="uid-idle")])
    broken = VllmMetricsReader(fetch=lambda url: "vllm:kv_cache_usage_perc{ 0.9\n")
    loop, _ = make(tmp_path, usage, signals=broken)
    report = loop.run_once()
    assert any("malformed" in e for e in report.errors)
    assert [d.reason for d in report.decisions] == ["hold", "hold"]
    assert on_disk(tmp_path, HOT).gpus[0].limit_mib == 20000


def test_foreign_memory_shrinks_what_can_be_handed_out(tmp_path):
    usage = Usage([UsageSample("GPU-0", 19500, pod_uid="uid-hot"), UsageSample("GPU-0", 4000, pod_uid="uid-idle"),
                   UsageSample("GPU-0", 10000, pod_uid="uid-stranger")])
    signals = Signals({"http://hot/metrics": VllmSample(kv_usage=0.99)})
    loop, _ = make(tmp_path, usage, signals)
    loop.run_once()
    total = sum(on_disk(tmp_path, k).gpus[0].limit_mib for k in (HOT, IDLE))
    assert total <= 40000 - 10000


def test_vanished_tenants_are_forgotten_and_write_errors_retried(tmp_path):
    usage = Usage([UsageSample("GPU-0", 19500, pod_uid="uid-hot")])
    tenants = Tenants([Tenant(HOT, (("GPU-0", 20000),))])
    blocker = tmp_path / "uid-hot"
    blocker.write_text("not a directory")  # the pod's quota dir cannot be created
    loop, _ = make(tmp_path, usage, tenants=tenants)
    report = loop.run_once()
    assert report.written == [] and report.errors
    blocker.unlink()
    assert loop.run_once().written == [HOT]
    doc = json.loads((tmp_path / "uid-hot" / "vllm" / "quota.json").read_text())
    assert doc["gpus"][0]["limitMiB"] == 30000  # alone on the GPU: spare shared up to its ceiling
    tenants.tenants = []
    assert loop.run_once().decisions == []


def test_a_gpu_missing_from_the_inventory_keeps_its_line_in_a_multi_gpu_file(tmp_path):
    wide = TenantKey("llm", "wide", "vllm", pod_uid="uid-wide")
    d = container_dir(str(tmp_path), wide.pod_uid, wide.container)
    write_quota(d, QuotaFile(gpus=(GpuQuota("GPU-0", 20000, 10000, 30000), GpuQuota("GPU-9", 7000, 5000, 15000))))
    tenants = Tenants([Tenant(wide, (("GPU-0", 20000), ("GPU-9", 10000)))])
    usage = Usage([UsageSample("GPU-0", 19800, pod_uid="uid-wide"), UsageSample("GPU-9", 9000, pod_uid="uid-wide")])
    loop = QuotaLoop(tenants, lambda: {"GPU-0": 40000}, [usage], P, str(tmp_path))  # GPU-9 unknown
    loop.run_once()
    doc = read_quota(d)
    assert doc.generation == 2 and doc.limits()["GPU-0"] > 20000
    assert doc.gpus[1] == GpuQuota("GPU-9", 7000, 5000, 15000)


def test_a_tenant_named_by_its_quota_dir_is_written_there(tmp_path):
    """A tenant is one container's allocation on a GPU, identified by its quota dir (the device plugin
    may key dirs by allocation and learn the pod later)."""
    alloc_dir = tmp_path / "alloc-3f2a"
    key = TenantKey("", "", "", pod_uid="")
    usage = Usage([UsageSample("GPU-0", 5000, container_id="d" * 64)])
    tenants = Tenants([Tenant(key, (("GPU-0", 20000),), container_ids=frozenset(["d" * 64]),
                              quota_dir=str(alloc_dir))])
    loop = QuotaLoop(tenants, lambda: {"GPU-0": 40000}, [usage], P, str(tmp_path))
    loop.run_once()
    assert read_quota(str(alloc_dir)).limits()["GPU-0"] >= 5000 + 1024
