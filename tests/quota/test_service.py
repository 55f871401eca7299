"""Wiring: building from config, the run thread's stop, and the vramshare_quota_* metrics."""
from __future__ import annotations

import threading

from kubernetes import client
from prometheus_client import CollectorRegistry, generate_latest

from deviceplugin.quota.loop import QuotaLoop
from deviceplugin.quota.model import PolicyParams, Tenant, TenantKey
from deviceplugin.quota.service import build_loop, register_metrics, start
from deviceplugin.quota.telemetry import UsageSample
from vramshare.config import parse_config

KEY = TenantKey("llm", "chat", "vllm", pod_uid="uid-chat")


class Node:
    """Tenant source and usage reader in one; stops the run loop on its first listing."""

    name = "fake"

    def __init__(self, stop: threading.Event | None = None) -> None:
        self.stop, self.listings = stop, 0

    def list_tenants(self):
        self.listings += 1
        if self.stop is not None:
            self.stop.set()
        return [Tenant(KEY, (("GPU-0", 20000),))]

    def read_usage(self):
        return [UsageSample("GPU-0", 19800, pod_uid="uid-chat")]


def test_metrics_show_limits_and_counters(tmp_path):
    node = Node()
    loop = QuotaLoop(node, lambda: {"GPU-0": 40000}, [node], PolicyParams(loans="any"), str(tmp_path))
    loop.run_once()
    reg = CollectorRegistry()
    register_metrics(loop, reg)
    text = generate_latest(reg).decode()
    limit = loop.limits()[(KEY, "GPU-0")]
    assert limit > 20000  # grew: use + margin was above the request
    assert (f'vramshare_quota_limit_mib{{class="default",gpu="GPU-0",tenant_container="vllm",tenant_namespace="llm",'
            f'tenant_pod="chat"}} {limit}.0') in text
    assert "vramshare_quota_ticks_total 1.0" in text
    assert "vramshare_quota_changes_total 1.0" in text


def test_run_ticks_until_stopped_and_start_honours_enabled(tmp_path):
    stop = threading.Event()
    node = Node(stop)
    loop = QuotaLoop(node, lambda: {"GPU-0": 40000}, [node], PolicyParams(loans="any"), str(tmp_path))
    loop.run(stop, interval_seconds=3600)  # returns: the first tick sets stop
    assert node.listings == 1 and loop.counts["ticks"] == 1
    assert start(loop, parse_config("quota: {enabled: false}"), threading.Event()) is None


def test_build_loop_from_config_constructs_every_adapter():
    # no network here: construction only; the adapters are exercised in test_kube/test_scrape
    with client.ApiClient(client.Configuration()) as api:
        loop = build_loop(parse_config("quota: {stepMiB: 256}"), api, "gpu-node-1", lambda: {}, Node(),
                          dcgm_url="http://localhost:9400/metrics")
    assert isinstance(loop, QuotaLoop) and loop.limits() == {} and loop.counts["ticks"] == 0
