"""Wiring for the DaemonSet: build the quota loop from the v1 config, run it on a thread, export metrics.

The device plugin's main owns the process; it calls :func:`build_loop` with what it already has (an
API client, the node name, and a function giving each shared GPU's schedulable MiB from its
inventory), then :func:`start`. Kept apart from ``loop`` so the loop stays free of config and
threading decisions and is driven directly (``run_once``) by tests and the bench.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Iterator, Mapping

from kubernetes import client
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

from deviceplugin.quota.kube import ApiQuotaMirror, ApiTenantSource
from deviceplugin.quota.loop import QuotaLoop
from deviceplugin.quota.model import PolicyParams
from deviceplugin.quota.scrape import DcgmExporterReader, VllmMetricsReader
from deviceplugin.quota.telemetry import NvmlProcessReader, UsageReader
from vramshare import logs
from vramshare.config import Config

log = logs.get("vramshare.quota.service")


def build_loop(cfg: Config, api: client.ApiClient, node: str, capacities: Callable[[], Mapping[str, int]],
               *, nvml: Any | None = None, dcgm_url: str | None = None, tenants: Any | None = None) -> QuotaLoop:
    """A loop reading NVML (then dcgm-exporter at ``dcgm_url``, when given) and vLLM metrics.

    ``capacities`` returns ``{gpu uuid: schedulable MiB}`` (units x memoryUnitMiB) for the GPUs in
    ``shared`` mode; tenants of any other GPU keep their quotas untouched. ``tenants`` replaces the
    pod-annotation source (the DRA plugin passes its prepared claims).
    """
    v1 = client.CoreV1Api(api)
    usage: list[UsageReader] = [NvmlProcessReader(nvml)]
    if dcgm_url:
        usage.append(DcgmExporterReader(dcgm_url))
    return QuotaLoop(tenants or ApiTenantSource(v1, node, cfg.names), capacities, usage,
                     PolicyParams.from_config(cfg.quota), cfg.quota_host_dir,
                     signals=VllmMetricsReader(), mirror=ApiQuotaMirror(v1, cfg.names))


def start(loop: QuotaLoop, cfg: Config, stop: threading.Event) -> threading.Thread | None:
    """Run ``loop`` every ``quota.intervalSeconds`` on a daemon thread; ``None`` when disabled."""
    if not cfg.quota.enabled:
        log.info("quota loop disabled by config (quota.enabled: false)")
        return None
    t = threading.Thread(target=loop.run, args=(stop, cfg.quota.interval_seconds), name="quota-loop",
                         daemon=True)
    t.start()
    log.info("quota loop started", interval_s=cfg.quota.interval_seconds, step_mib=cfg.quota.step_mib,
             margin_mib=cfg.quota.margin_mib)
    return t


class QuotaCollector(Collector):
    """``vramshare_quota_*`` metrics from the loop's latest tick, computed at scrape time."""

    def __init__(self, loop: QuotaLoop) -> None:
        self._loop = loop

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        labels = ["namespace", "pod", "container", "gpu"]
        limit = GaugeMetricFamily("vramshare_quota_limit_mib", "Memory quota in force (MiB)", labels=labels)
        for (key, gpu), mib in sorted(self._loop.limits().items()):
            limit.add_metric([key.namespace, key.pod, key.container, gpu], mib)
        yield limit
        for name, help_text in (("ticks", "Quota loop ticks"), ("skipped", "Ticks skipped on bad input"),
                                ("changes", "Quota changes decided"), ("writes", "quota.json files written"),
                                ("errors", "Telemetry, write and mirror errors")):
            c = CounterMetricFamily(f"vramshare_quota_{name}", help_text)
            c.add_metric([], self._loop.counts[name])
            yield c


def register_metrics(loop: QuotaLoop, registry: CollectorRegistry) -> None:
    """Add the loop's metrics to the daemon's registry (served on its /metrics)."""
    registry.register(QuotaCollector(loop))
