"""Prometheus metrics of the plugin, each test on its own registry: devices per resource and health
(pulled at scrape time), allocations by result, the Allocate latency histogram, registrations, and
/metrics over HTTP."""
from __future__ import annotations

import urllib.request

import grpc
import pytest

from deviceplugin.inventory_file import load
from deviceplugin.metrics import MetricsServer, PluginMetrics

from .conftest import MEM, MIXED

H100, _ = load(MIXED)


def sample(metrics: PluginMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


@pytest.fixture
def plugin(start_plugin):
    return start_plugin(metrics=PluginMetrics())  # a fresh registry; the daemon attaches its devices


def test_backend_errors_are_counted():
    m = PluginMetrics()
    m.backend_error("nvml")
    m.backend_error("nvml")
    assert sample(m, "vramshare_deviceplugin_backend_errors_total", backend="nvml") == 2


def test_devices_per_resource_and_health_are_read_at_scrape_time(plugin, backend, kubelet):
    m = plugin.metrics
    assert sample(m, "vramshare_deviceplugin_devices", resource=MEM, health="Healthy") == 79
    assert sample(m, "vramshare_deviceplugin_devices", resource=MEM, health="Unhealthy") == 0
    assert sample(m, "vramshare_gpu_healthy", gpu=H100.uuid, model=H100.model, mode="shared") == 1
    backend.inject_xid(H100.uuid, 79)
    kubelet.wait_for(lambda: kubelet.healthy_ids(MEM) == [], what="units unhealthy")
    assert sample(m, "vramshare_deviceplugin_devices", resource=MEM, health="Unhealthy") == 79
    assert sample(m, "vramshare_gpu_healthy", gpu=H100.uuid, model=H100.model, mode="shared") == 0


def test_allocations_are_counted_by_result_with_latency(plugin, kubelet):
    m = plugin.metrics
    kubelet.allocate(MEM, kubelet.healthy_ids(MEM)[:2])
    with pytest.raises(grpc.RpcError):
        kubelet.allocate(MEM, ["GPU-nope::0"])
    assert sample(m, "vramshare_deviceplugin_allocations_total", resource=MEM, result="ok") == 1
    assert sample(m, "vramshare_deviceplugin_allocations_total", resource=MEM, result="invalid") == 1
    assert sample(m, "vramshare_deviceplugin_allocate_seconds_count", resource=MEM) == 2


def test_registrations_are_counted(plugin, kubelet):
    before = sample(plugin.metrics, "vramshare_deviceplugin_registrations_total", resource=MEM, result="ok")
    kubelet.restart()
    assert plugin.lifecycle.wait_registered(2, timeout=5)
    assert before == 1
    assert sample(plugin.metrics, "vramshare_deviceplugin_registrations_total", resource=MEM, result="ok") == 2


def test_metrics_are_served_over_http(plugin):
    server = MetricsServer(plugin.metrics.registry, port=0, host="127.0.0.1")
    server.start()
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5) as resp:
            body = resp.read().decode()
    finally:
        server.close()
    assert f'vramshare_deviceplugin_devices{{health="Healthy",resource="{MEM}"}} 79.0' in body
