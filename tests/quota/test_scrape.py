"""dcgm-exporter and vLLM /metrics readers against text fixtures of real exposition pages."""
from __future__ import annotations

import pathlib

import pytest

from deviceplugin.quota.scrape import DcgmExporterReader, VllmMetricsReader, http_get
from deviceplugin.quota.telemetry import SignalReader, TelemetryError, UsageReader, UsageSample

FIX = pathlib.Path(__file__).parent / "fixtures"
GPU0 = "GPU-6f1c3a52-0b8e-4a0c-9d7e-1b2c3d4e5f60"


def page(name: str):
    text = (FIX / name).read_text()
    return lambda url: text


def test_dcgm_reader_keeps_per_pod_fb_used_only():
    reader = DcgmExporterReader(fetch=page("dcgm_exporter.txt"))
    assert isinstance(reader, UsageReader)
    assert reader.read_usage() == [
        UsageSample(GPU0, 24001, namespace="llm", pod="chat-7d9f8-abcde", container="vllm"),
        UsageSample(GPU0, 17246, namespace="llm", pod="embed-5c6b7-xyz12", container="vllm"),
        UsageSample("GPU-0a9b8c7d-6e5f-4a3b-2c1d-0e9f8a7b6c5d", 8000, namespace="other", pod="train-0",
                    pod_uid="0e2c4d6f-1111-2222-3333-444455556666"),
    ]


def test_vllm_reader_combines_engines():
    reader = VllmMetricsReader(fetch=page("vllm_metrics.txt"))
    assert isinstance(reader, SignalReader)
    s = reader.read_signals("http://10.0.0.7:8000/metrics")
    assert s.kv_usage == pytest.approx(0.99)  # engine 1: 792 of its 800-block cap beats vLLM's 0.962
    assert s.waiting == 7
    assert s.preemptions_total == 20
    # vLLM's counter_request_success in its own label order, every finished_reason and engine; its
    # _created samples are timestamps, not requests
    assert s.finished_total == 2039
    assert s.extra == {"vramshare_vllm_quota_mib": 24576.0, "vramshare_vllm_kv_block_cap": 1800.0,
                       "vramshare_vllm_kv_blocks_used": 1492.0}


def test_vllms_own_gauge_counts_without_the_plugin():
    text = "\n".join(line for line in (FIX / "vllm_metrics.txt").read_text().splitlines()
                     if "vramshare_" not in line) + "\n"
    s = VllmMetricsReader(fetch=lambda url: text).read_signals("u")
    assert s.kv_usage == pytest.approx(0.962)  # the fullest engine
    assert s.extra == {}


def test_a_page_without_vllm_metrics_gives_no_signals():
    s = VllmMetricsReader(fetch=lambda url: "# TYPE up gauge\nup 1\n").read_signals("u")
    assert (s.kv_usage, s.waiting, s.preemptions_total) == (None, None, None)


@pytest.mark.parametrize("text", ["vllm:kv_cache_usage_perc{engine=\"0\" 0.5\n",
                                  "vllm:num_requests_waiting not-a-number\n"])
def test_malformed_pages_raise_telemetry_error(text):
    with pytest.raises(TelemetryError, match="malformed"):
        VllmMetricsReader(fetch=lambda url: text).read_signals("http://x/metrics")
    with pytest.raises(TelemetryError, match="malformed"):
        DcgmExporterReader(fetch=lambda url: text).read_usage()


def test_http_get_failure_names_the_url():
    with pytest.raises(TelemetryError, match="127.0.0.1:9"):
        http_get("http://127.0.0.1:9/metrics", timeout=0.5)


RELEASE_PAGE = """\
# HELP vramshare_vllm_release_mode How a shrink of the quota frees memory
# TYPE vramshare_vllm_release_mode gauge
vramshare_vllm_release_mode{engine="0",mode="unmap"} 1.0
vramshare_vllm_release_mode{engine="1",mode="unmap"} 1.0
# TYPE vramshare_vllm_kv_memory_held_bytes gauge
vramshare_vllm_kv_memory_held_bytes{engine="0"} 2147483648.0
vramshare_vllm_kv_memory_held_bytes{engine="1"} 1073741824.0
# TYPE vramshare_vllm_kv_demand_bytes gauge
vramshare_vllm_kv_demand_bytes{engine="0"} 4294967296.0
vramshare_vllm_kv_demand_bytes{engine="1"} 1073741824.0
# TYPE vramshare_vllm_quota_generation_applied gauge
vramshare_vllm_quota_generation_applied{engine="0"} 7.0
vramshare_vllm_quota_generation_applied{engine="1"} 6.0
"""


def test_release_signals_of_the_plugin_are_read_per_server():
    """SIGNALS.md's names: the weakest release mode, held and demanded KV bytes summed over engines,
    and the oldest generation any engine applied (the server follows the file only once all do)."""
    s = VllmMetricsReader(fetch=lambda url: RELEASE_PAGE).read_signals("http://x/metrics")
    assert (s.release_mode, s.kv_held_bytes, s.kv_demand_bytes, s.generation_applied) == \
        ("unmap", 3 * 2.0 ** 30, 5 * 2.0 ** 30, 6)
    one_throttles = RELEASE_PAGE.replace('engine="1",mode="unmap"', 'engine="1",mode="throttle"')
    assert VllmMetricsReader(fetch=lambda url: one_throttles).read_signals("u").release_mode == "throttle"
    assert VllmMetricsReader(fetch=lambda url: "").read_signals("u").release_mode is None
