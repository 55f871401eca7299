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

from deviceplugin.nvml_limits import CgroupFinder, NvmlMemoryLimits
from deviceplugin.quota.fence import DriverFence
from deviceplugin.quota.kube import ApiOverLimitActor, ApiQuotaMirror
from deviceplugin.quota.loop import LoopSettings, QuotaLoop, TenantSource
from deviceplugin.quota.model import TENANT_LABELS, Phase
from deviceplugin.quota.model import PolicyParams
from deviceplugin.quota.scrape import DcgmExporterReader, VllmMetricsReader
from deviceplugin.quota.telemetry import NvmlProcessReader, UsageReader
from deviceplugin.quota.warm import WarmBroker
from deviceplugin.quota.warm_channel import WarmChannels, WarmCollector
from vramshare import contract, logs
from vramshare.config import DEFAULT_CLASS, Config
from vramshare.inventory import EnforcementMode

log = logs.get("vramshare.quota.service")


def build_loop(cfg: Config, api: client.ApiClient, node: str, capacities: Callable[[], Mapping[str, int]],
               tenants: TenantSource, *, nvml: Any | None = None, dcgm_url: str | None = None,
               mode: EnforcementMode = EnforcementMode.COOPERATIVE, cgroup_root: str = contract.HOST_CGROUP_ROOT,
               process_attribution: bool | None = None, usage: list[UsageReader] | None = None,
               warm: Any | None = None) -> QuotaLoop:
    """A loop reading per-container use, then dcgm-exporter at ``dcgm_url`` (when given), and vLLM metrics.

    ``capacities`` returns ``{gpu uuid: schedulable MiB}`` (units x memoryUnitMiB) for the GPUs in
    ``shared`` mode; tenants of any other GPU keep their quotas untouched. In ``driver`` mode use
    comes from each container's cgroup (``currentUsed``, no host PID namespace) and the loop moves
    the cgroup limits; per-process NVML attribution (needs ``hostPID``) is the fallback when
    ``process_attribution`` is on (default: the config's ``quota.processAttribution``). ``usage``
    replaces every reader (a simulated node's replay). ``tenants``: the device plugin passes
    ``kube.NodeTenantSource`` over its reconciler and pod cache (no API call in a tick), the DRA plugin
    its prepared claims.
    """
    v1 = client.CoreV1Api(api)
    given = usage is not None
    usage = list(usage or [])
    fence: DriverFence | None = None
    if mode is EnforcementMode.DRIVER and nvml is not None:
        # read first, given the tenants; no write takes a GPU's hard limits past its capacity
        fence = DriverFence(NvmlMemoryLimits(nvml), CgroupFinder(cgroup_root), capacities)
    if process_attribution is None:
        process_attribution = cfg.quota.process_attribution
    if not given and process_attribution:
        usage.append(NvmlProcessReader(nvml))
    elif not given:
        # Without hostPID the host PIDs NVML reports resolve to no pod, and their memory would count
        # as foreign: better no per-process reader than one that shrinks every GPU's capacity.
        log.info("per-process GPU memory attribution off (quota.processAttribution: false, no hostPID): "
                 "usage comes from the driver's per-cgroup counters, dcgm-exporter and vLLM metrics where available",
                 driver=fence is not None, dcgm=bool(dcgm_url))
    if dcgm_url and not given:
        usage.append(DcgmExporterReader(dcgm_url))
    actor = ApiOverLimitActor(v1, cfg.names, node)  # over-limit reports and ignored hints: events on the pod
    loop = QuotaLoop(tenants, capacities, usage,
                     PolicyParams.from_config(cfg.quota), cfg.quota_host_dir,
                     signals=VllmMetricsReader(), mirror=ApiQuotaMirror(v1, cfg.names),
                     settings=LoopSettings.from_config(cfg.quota, cfg.enforcement), mode=mode, fence=fence,
                     actor=actor, warm=warm, hints=actor)
    for reader in usage:
        if hasattr(reader, "bind"):  # a simulated node's replay reads the tenants of the tick
            reader.bind(lambda: loop.tenants_now)
    return loop


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
        labels = [*TENANT_LABELS, "gpu", "class"]
        classes, views = self._loop.classes(), self._loop.views()
        limit = GaugeMetricFamily("vramshare_quota_limit_mib", "Memory quota in force (MiB)", labels=labels)
        for (key, gpu), mib in sorted(self._loop.limits().items()):
            limit.add_metric([key.namespace, key.pod, key.container, gpu, classes.get(key, DEFAULT_CLASS)], mib)
        yield limit
        used = GaugeMetricFamily("vramshare_quota_used_mib", "GPU memory the container uses, as the loop "
                                 "measured it in its latest tick (MiB)", labels=labels)
        request = GaugeMetricFamily("vramshare_quota_request_mib", "GPU memory the scheduler reserved for the "
                                    "container on this GPU (MiB)", labels=labels)
        floor = GaugeMetricFamily("vramshare_quota_floor_mib", "The least quota its class guarantees (MiB)",
                                  labels=labels)
        for (key, gpu), v in sorted(views.items()):
            lv = [key.namespace, key.pod, key.container, gpu, v.qclass]
            request.add_metric(lv, v.request_mib)
            floor.add_metric(lv, v.floor_mib)
            if v.used_mib is not None:
                used.add_metric(lv, v.used_mib)
        yield from (used, request, floor)
        cap = GaugeMetricFamily("vramshare_quota_gpu_capacity_mib", "GPU memory the quota loop divides among "
                                "tenants (schedulable MiB less foreign use)", labels=["gpu"])
        for gpu, mib in sorted(self._loop.capacities.items()):
            cap.add_metric([gpu], mib)
        yield cap
        state = GaugeMetricFamily("vramshare_quota_tenant_state", "1 for each tenant's warmth (hot, warm, "
                                  "waking, cold)", labels=[*TENANT_LABELS, "class", "state"])
        for key, phase in sorted(self._loop.phases().items()):
            for p in Phase:
                state.add_metric([key.namespace, key.pod, key.container, classes.get(key, DEFAULT_CLASS), p.value],
                                 1.0 if p is phase else 0.0)
        yield state
        for name, help_text in (("ticks", "Quota loop ticks"), ("skipped", "Ticks skipped on bad input"),
                                ("changes", "Quota changes decided"), ("writes", "quota.json files written"),
                                ("errors", "Telemetry, write and mirror errors"),
                                ("breaches", "Containers found above their limit past the grace period")):
            c = CounterMetricFamily(f"vramshare_quota_{name}", help_text)
            c.add_metric([], self._loop.counts[name])
            yield c
        clamped = CounterMetricFamily("vramshare_quota_fence_clamped", "Hard-limit writes the driver fence lowered "
                                      "to fit the GPU's capacity (outcome over_capacity: not even at the cgroups' "
                                      "use)", labels=["gpu", "outcome"])
        for (gpu, outcome), n in sorted(self._loop.fence_clamps().items()):
            clamped.add_metric([gpu, outcome], n)
        yield clamped
        for what, help_text in (("changes", "Quota changes decided, by quota class"),
                                ("breaches", "Containers found above their limit past the grace period, by class")):
            c = CounterMetricFamily(f"vramshare_quota_class_{what}", help_text, labels=["class"])
            for (cls, kind), n in sorted(self._loop.class_counts.items()):
                if kind == what:
                    c.add_metric([cls], n)
            yield c


class WarmTier:
    """The warm tier's node-agent half (issue 23), the same in both node plugins: the broker, a unix
    socket in each tenant's quota dir (``warm.sock``, where its engine connects) and the broker's metrics.

    Built before the loop (the loop takes the broker), then :meth:`serve` runs the sockets on a thread of
    the plugin's own. ``on_credits``: where a plugin turns sleeping pods of overcommit classes into
    schedulable memory (the node state: kubelet units, or a shared device's published capacity on DRA)."""

    def __init__(self, config: Config, registry: CollectorRegistry,
                 on_credits: Callable[[dict[str, int]], None] | None = None) -> None:
        self.broker = WarmBroker(send=lambda key, msg: self.channels.send(key, msg),
                                 params=PolicyParams.from_config(config.quota), on_credits=on_credits)
        self.channels = WarmChannels(self.broker)
        registry.register(WarmCollector(self.broker))

    def serve(self, loop: QuotaLoop, stop: threading.Event) -> None:
        """Until ``stop``: listen in the quota dir of each of ``loop``'s tenants; a wake request pokes
        ``loop`` (no waiting for its next tick)."""
        self.broker.poke = loop.poke
        self.channels.serve(stop, lambda: {t.key: loop.quota_dir(t) for t in loop.tenants_now})


def register_metrics(loop: QuotaLoop, registry: CollectorRegistry) -> None:
    """Add the loop's metrics to the daemon's registry (served on its /metrics)."""
    registry.register(QuotaCollector(loop))
