"""Prometheus metrics of the device plugin, on its own registry (no global state, testable).

Device counts and GPU health are pulled from the node state at scrape time; allocations,
registrations and backend (NVML) errors are counted as they happen. Names start with
``vramshare_deviceplugin_`` (``vramshare_gpu_healthy`` is per GPU).
"""
from __future__ import annotations

import threading
from typing import Callable, Iterator, Sequence
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from vramshare import contract
from vramshare.inventory import EnforcementMode, NodeInventory

_PREFIX = contract.METRICS_PREFIX + "deviceplugin_"
_LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class _DeviceCollector(Collector):
    """Devices per resource and health, and per-GPU health, read from the current snapshot."""

    def __init__(self, snapshot: Callable[[], object]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        devices = GaugeMetricFamily(_PREFIX + "devices", "Devices advertised to the kubelet",
                                    labels=["resource", "health"])
        for resource, devs in getattr(snap, "devices").items():
            healthy = sum(1 for d in devs if d.healthy)
            devices.add_metric([resource, contract.HEALTHY], healthy)
            devices.add_metric([resource, contract.UNHEALTHY], len(devs) - healthy)
        yield devices
        inventory: NodeInventory = getattr(snap, "inventory")
        gpus = GaugeMetricFamily(contract.METRICS_PREFIX + "gpu_healthy", "1 when the GPU is healthy",
                                 labels=["gpu", "model", "mode"])
        for g in inventory.gpus:
            gpus.add_metric([g.uuid, g.model, g.mode.value], 1.0 if g.healthy else 0.0)
        yield gpus
        if inventory.enforcement is not None:  # issue 9: the mode detected at start, 1 for the one in force
            yield enforcement_mode_family(inventory.enforcement)


def enforcement_mode_family(mode: EnforcementMode) -> GaugeMetricFamily:
    """``vramshare_enforcement_mode``: 1 for the mode in force, 0 for the others (both node plugins)."""
    family = GaugeMetricFamily(contract.METRICS_PREFIX + "enforcement_mode",
                               "1 for the node's GPU memory enforcement mode", labels=["mode"])
    for m in EnforcementMode:
        family.add_metric([m.value], 1.0 if m is mode else 0.0)
    return family


class EnforcementModeCollector(Collector):
    """``vramshare_enforcement_mode`` of a fixed mode (the DRA plugin: pinned at start, no inventory
    annotation to read it from)."""

    def __init__(self, mode: EnforcementMode) -> None:
        self._mode = mode

    def collect(self) -> Iterator[Metric]:
        yield enforcement_mode_family(self._mode)


def enforcement_unavailable_gauge(registry: CollectorRegistry) -> Gauge:
    """``vramshare_enforcement_unavailable`` on ``registry`` (both node plugins set it from
    ``enforcement.Chosen.skipped`` at start)."""
    return Gauge(contract.METRICS_PREFIX + "enforcement_unavailable", "1 for each better enforcement mode the node "
                 "passed over at start (enforcement.mode auto), with why", ["mode", "reason"], registry=registry)


def config_reloads_counter(registry: CollectorRegistry, prefix: str) -> Counter:
    """``<prefix>config_reloads_total{result}`` on ``registry``: each node plugin counts its refused reloads
    there (:class:`deviceplugin.config_refusal.RefusalReporter`)."""
    return Counter(prefix + "config_reloads", "Config reloads refused (the last good config stays; a Warning "
                   "Event VramshareConfigRefused names the key)", ["result"], registry=registry)


def restart_pending_gauge(registry: CollectorRegistry, prefix: str) -> Gauge:
    """``<prefix>config_restart_pending{key}``: 1 for each config key whose file value differs from the one
    in force because the plugin reads it only at start (a reload kept it): a restart applies it."""
    return Gauge(prefix + "config_restart_pending", "1 for each config key the file changed that waits for a "
                 "restart of this plugin (read only at start)", ["key"], registry=registry)


def set_restart_pending(gauge: Gauge, keys: Sequence[str]) -> None:
    """The keys a reload left for a restart, replacing the last reload's (a file that reverts one clears it)."""
    gauge.clear()
    for key in keys:
        gauge.labels(key).set(1)


class PluginMetrics:
    """The instruments; ``snapshot`` (optional) feeds the pull collector."""

    def __init__(self, registry: CollectorRegistry | None = None,
                 snapshot: Callable[[], object] | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.allocations = Counter(_PREFIX + "allocations", "Allocate calls by resource and result "
                                   "(ok, invalid, precondition, unavailable)", ["resource", "result"],
                                   registry=self.registry)
        self.allocate_seconds = Histogram(_PREFIX + "allocate_seconds", "Allocate latency", ["resource"],
                                          buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.registrations = Counter(_PREFIX + "registrations", "Register calls to the kubelet",
                                     ["resource", "result"], registry=self.registry)
        self.backend_errors = Counter(_PREFIX + "backend_errors", "GPU backend (NVML) errors",
                                      ["backend"], registry=self.registry)
        self.enforcement_unavailable = enforcement_unavailable_gauge(self.registry)
        self.steered = Counter(_PREFIX + "preferred_allocations", "GetPreferredAllocation answers by how "
                               "they were chosen (steered by the plan of the assumed pods of that size, or best-fit)",
                               ["resource", "how"], registry=self.registry)
        self.reconciles = Counter(_PREFIX + "reconciles", "Reconcile rounds by outcome (ok, unavailable: "
                                  "no PodResources, error)", ["result"], registry=self.registry)
        self.reconcile_patches = Counter(_PREFIX + "reconcile_patches", "Pod assignment patches by result "
                                         "(ok, conflict, gone, error)", ["result"], registry=self.registry)
        self.pod_resources_up = Gauge(_PREFIX + "pod_resources_up", "1 when the kubelet's PodResources List "
                                      "answered in the last round; 0: pods' actual GPUs are unknown and "
                                      "nothing is guessed", registry=self.registry)
        self.departing = Counter(_PREFIX + "departing_pods", "Pods of this node deleted while their containers "
                                 "may still run (a forced deletion), reported in the inventory for their grace",
                                 registry=self.registry)
        self.foreign_mib = Gauge(_PREFIX + "foreign_memory_mib", "Memory of a shared GPU held by no pod of "
                                 "ours (a process that outlived its pod, a host process), settled and in whole "
                                 "units: the extender books it (published in the inventory)", ["gpu"],
                                 registry=self.registry)
        self.config_reloads = config_reloads_counter(self.registry, _PREFIX)
        self.restart_pending = restart_pending_gauge(self.registry, _PREFIX)
        self._attached = False
        if snapshot is not None:
            self.attach(snapshot)

    def attach(self, snapshot: Callable[[], object]) -> None:
        """Pull device and GPU health gauges from ``snapshot()`` at every scrape (once per registry)."""
        if not self._attached:
            self.registry.register(_DeviceCollector(snapshot))
            self._attached = True

    def backend_error(self, backend: str) -> None:
        self.backend_errors.labels(backend).inc()

    def allocation(self, resource: str, result: str, seconds: float) -> None:
        self.allocations.labels(resource, result).inc()
        self.allocate_seconds.labels(resource).observe(seconds)

    def steering(self, resource: str, how: str) -> None:
        self.steered.labels(resource, how).inc()

    def reconciled(self, result: str, pod_resources_up: bool) -> None:
        self.reconciles.labels(result).inc()
        self.pod_resources_up.set(1 if pod_resources_up else 0)

    def patched(self, result: str) -> None:
        self.reconcile_patches.labels(result).inc()

    def registration(self, resource: str, ok: bool) -> None:
        self.registrations.labels(resource, "ok" if ok else "error").inc()


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - wsgiref's signature
        pass


class MetricsServer:
    """``/metrics`` over HTTP in one named thread; ``close()`` stops it."""

    def __init__(self, registry: CollectorRegistry, port: int, host: str = "0.0.0.0") -> None:
        self._server: WSGIServer = make_server(host, port, make_wsgi_app(registry), handler_class=_QuietHandler)
        self.port = self._server.server_port
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="metrics-http", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
