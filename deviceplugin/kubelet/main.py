"""``vramshare device-plugin``: the composition root. Builds every part once, starts every thread here.

Threads (all named, all started by :meth:`DevicePluginDaemon.start`, all stopped by ``close``):
``kubelet-watch`` (sockets, Register, restarts), ``gpu-health`` (the backend's health watch),
``inventory-publisher``, ``pod-watch`` and ``departures`` (node annotation, this node's pods, and the
inventory's deleted pods that may still run; only with an API server), ``reconcile`` (PodResources ->
each pod's actual GPUs and its quota link) and ``metrics-http``. Start order matters: the pod cache
syncs (bounded wait) and one reconcile round reads PodResources *before* the gRPC servers register, so a
restarted plugin knows what the kubelet already handed out before it serves anything. Threads, not
asyncio: NVML and the kubernetes client block. A thread that dies unexpectedly stops the daemon, so the
DaemonSet restarts it rather than leaving a plugin that looks alive but is not.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import threading
import time
from typing import Any

from deviceplugin import allocation, enforcement
from deviceplugin.backend import BackendError, GpuBackend
from deviceplugin.backend_choice import open_backend
from deviceplugin.kubelet import cdi_names
from deviceplugin.kubelet.allocator import Allocator
from deviceplugin.kubelet.kube_adapter import InventoryPublisher, PodPatcher
from deviceplugin.kubelet.lifecycle import PluginLifecycle
from deviceplugin.kubelet.manager import DeviceFeeds, NodeResourceManager, ResourceManager
from deviceplugin.kubelet.mig_cdi import MigCdi
from deviceplugin.kubelet.mig_node import MigNode
from deviceplugin.kubelet.podresources import KubeletPodResources
from deviceplugin.kubelet.reconcile_loop import Reconciler
from deviceplugin.metrics import MetricsServer, PluginMetrics
from deviceplugin.node_state import NodeState, Snapshot
from deviceplugin.pod_cache import NodePodCache
from deviceplugin.quota import rights
from deviceplugin.quota_files import QuotaFiles
from deviceplugin.serve import NodeDaemon, serve, wait_poked
from vramshare import foreign, kube, logs
from vramshare.config import Config, ConfigError, DeviceListStrategy, load_config, node_limits
from vramshare.contract import inventory as contract_inventory
from vramshare.departing import Departures
from vramshare.inventory import GpuMode

log = logs.get(__name__)


class DevicePluginDaemon(NodeDaemon):
    """The whole node agent. ``api=None`` is standalone: no annotations, no steering, no reconcile
    patches (Allocate is the same either way: it never reads a pod)."""

    component = "vramshare-device-plugin"
    threads_run_until_stop = True

    def __init__(self, backend: GpuBackend, config: Config, plugin_dir: str, *, node_name: str = "",
                 api: Any = None, pod_resources_socket: str | None = None, metrics_port: int = 0,
                 poll_seconds: float = 0.1, stream_grace_seconds: float = 1.0,
                 metrics: PluginMetrics | None = None, reconcile_seconds: float = 2.0,
                 startup_sync_seconds: float = 5.0, cdi_roots: tuple[str, ...] = cdi_names.DEFAULT_ROOTS) -> None:
        self._init_daemon()
        self.backend = backend
        self._cdi_roots = cdi_roots
        discovered = backend.discover()
        self.enforcement = enforcement.detect(backend, config, discovered)  # raises EnforcementRefused
        config = enforcement.pin(config, self.enforcement)
        rights.check(config, api)  # overLimitAction: evict needs the eviction right; raises RightRefused
        self.state = NodeState(discovered, config)
        node_limits(config, self.state.snapshot.inventory)  # raises ConfigError naming the key
        names = config.names
        self.metrics = metrics or PluginMetrics()
        self.metrics.attach(lambda: self.state.snapshot)
        for mode, why in self.enforcement.skipped:
            self.metrics.enforcement_unavailable.labels(mode.value, why).set(1)
        self.feeds = DeviceFeeds(self.state)
        self.pod_resources = KubeletPodResources(pod_resources_socket, names) if pod_resources_socket else None
        self.pods = NodePodCache(api, node_name, names) if api else None
        self.departures = Departures(names)  # deleted pods that may still run here, in the inventory
        self._departures_poked = threading.Event()
        if self.pods is not None:
            self.pods.on_deleted = self._pod_deleted
        quota = QuotaFiles(config.quota_host_dir, config.quota)
        self.reconciler = Reconciler(self.state, node_name, quota, self.metrics, self.pod_resources, self.pods,
                                     PodPatcher(api, names) if api else None)
        self.allocator = Allocator(self.state, quota, self.metrics, node_name, self.pods,
                                   on_allocated=self.reconciler.wake,
                                   recording=lambda: self.reconciler.recording)
        self.mig = MigNode.build(backend, self.state, self.metrics.registry)  # issue 24; None: off
        if self.mig is not None:
            self.allocator.make_mig = self.mig.make
            self.reconciler.on_held = self.mig.on_held
            self.mig.quota = quota
            if config.device_list_strategy is DeviceListStrategy.CDI_CRI:  # made instances' CDI names resolve
                self.mig.cdi = MigCdi(cdi_roots)
                why = self.mig.cdi.problem()
                if why is not None:  # every made instance's container would fail at creation: say so now
                    log.error("made MIG instances' CDI specs cannot be written", reason=why)
                self.mig.sync_cdi()
            if self.pods is not None:  # Allocate finds each isolation: mig pod's plan in the pod cache
                self.state.serve_isolation()
        self._reconcile_seconds = reconcile_seconds
        self._startup_sync_seconds = startup_sync_seconds
        self.lifecycle = PluginLifecycle(plugin_dir, self._managers, self.metrics, self.feeds.open_watches,
                                         poll_seconds, stream_grace_seconds)
        self.publisher = InventoryPublisher(api, node_name, names) if api else None
        self._api, self.node = api, node_name
        self._metrics_port = metrics_port
        self._metrics_server: MetricsServer | None = None
        self.models: tuple = ()  # issue 23: resident models, published in the inventory's ``models``
        self.warm: Any = None  # the warm tier's broker, when warmTier.enabled and the quota loop runs
        self._quota_loop: Any = None
        self._foreign: dict[str, int] = {}  # the quota loop's settled foreign MiB per shared GPU
        self._last_foreign: dict[str, int] = {}  # what the node's last inventory booked, as settled figures
        self.state.add_listener(self._changed)

    def _shared_capacities(self) -> dict[str, int]:
        """Schedulable MiB of each shared GPU (units x memoryUnitMiB): what the quota loop divides."""
        inv = self.state.snapshot.inventory
        return {g.uuid: inv.capacity_mib(g) for g in inv.gpus if g.mode is GpuMode.SHARED}

    def _start_quota_loop(self) -> None:
        """The quota feedback loop needs pods (the API) and per-process memory (NVML): a real node."""
        config = self.state.snapshot.config
        if self._api is None or not config.quota.enabled:
            return
        replay = getattr(self.backend, "usage_replay", None)  # a simulated node replaying a trace
        if self.backend.name != "nvml" and replay is None:
            log.info("quota loop off: it reads per-container GPU memory from NVML", backend=self.backend.name)
            return
        from deviceplugin.quota import service as quota_service
        warm = None
        if config.warm_tier.enabled:  # issue 23: the warm tier's broker and its sockets
            warm = quota_service.WarmTier(config, self.metrics.registry,
                                          on_credits=self.state.on_credits)  # issue 23 item 5: overcommit
            self.warm = warm.broker
        from deviceplugin.quota.kube import NodeTenantSource
        pods = self.pods.pods if self.pods is not None else list  # (the API is there: so is the cache)
        tenants = NodeTenantSource(self.reconciler.holdings, pods, config.names)  # no API call per tick
        loop = quota_service.build_loop(config, self._api, self.node, self._shared_capacities, tenants,
                                        nvml=getattr(self.backend, "nvml", None), mode=self.enforcement.mode,
                                        usage=[replay] if replay is not None else None, warm=self.warm)
        self._quota_loop = loop
        self._foreign = loop.keep_foreign(self._last_foreign, config.quota.interval_seconds)
        loop.on_foreign = self.on_foreign_settled
        self.state.add_listener(lambda old, new: loop.reconfigure(new.config.quota, new.config.enforcement))
        quota_service.register_metrics(loop, self.metrics.registry)
        self._spawn("quota-loop", lambda: loop.run(self._stop, config.quota.interval_seconds))
        if warm is not None:
            self._spawn("warm-channel", lambda: warm.serve(loop, self._stop))

    def _start_residency(self) -> None:
        """Issue 23: which models this node can start fast (cache files, engines), in the inventory."""
        wt = self.state.snapshot.config.warm_tier
        if self.publisher is None or not (wt.model_cache_dir or wt.enabled):
            return
        from deviceplugin.residency import node_reporter

        def changed(models: tuple) -> None:
            self.models = models
            self._publish_inventory()

        reporter = node_reporter(wt, changed, self.warm, lambda: self._quota_loop)
        self._spawn("model-residency", lambda: reporter.run(self._stop))

    def _inventory_json(self, inventory: Any) -> str:
        departing = self.departures.current(time.time())
        booked = foreign.schedulable_foreign(inventory, self._foreign)
        for gpu in inventory.gpus:
            self.metrics.foreign_mib.labels(gpu.uuid).set(booked.get(gpu.uuid, 0))
        return contract_inventory.encode(dataclasses.replace(foreign.with_foreign(inventory, booked),
                                                             models=self.models, config=self.config_in_force,
                                                             departing=departing))

    def on_foreign_settled(self, settled: Any) -> None:
        """The quota loop's settled foreign memory moved: the inventory says what the extender must book
        (:mod:`vramshare.foreign`; the publisher sends nothing when the text is the same)."""
        self._foreign = dict(settled)
        self._publish_inventory()

    def _publish_inventory(self, inventory: Any = None) -> None:
        if self.publisher is not None:
            self.publisher.publish(self._inventory_json(
                self.state.snapshot.inventory if inventory is None else inventory))

    def _config_accepted(self, _digest: str) -> None:
        """The config file text in force changed: the inventory says so (``vramshare check`` compares it
        with the ConfigMap), with the keys of it that wait for a restart."""
        self._publish_inventory()

    def _pod_deleted(self, pod: Any) -> None:
        """The pod cache saw a pod of this node go: one that may still run (a forced deletion) is reported
        in the inventory for its grace (:mod:`vramshare.departing`), which an extender restarted meanwhile
        books; the kubelet itself forgets its devices at once (kubernetes#104824)."""
        entry = self.departures.note(pod, time.time())
        if entry is None:
            return
        self.metrics.departing.inc()
        log.warning("pod deleted while its containers may still run; reported as departing", pod=entry.pod,
                    uid=entry.uid, gpus=",".join(g for g, _ in entry.gpus), until=entry.until_s)
        self._publish_inventory()
        self._departures_poked.set()

    def _restore_last_report(self) -> None:
        """A restarted plugin keeps what its predecessor reported, read back from the node's inventory before
        the first publish would drop it: the departing pods whose grace runs on, and the foreign memory
        (kept by the quota loop until its own readings settle, :meth:`QuotaLoop.keep_foreign`)."""
        text = self.publisher.current() if self.publisher is not None else None
        if not text:
            return
        try:
            last = contract_inventory.parse(text)
        except contract_inventory.InventoryError as exc:
            log.warning("the node's last inventory is unreadable; no departing pods or foreign memory kept",
                        error=str(exc))
            return
        kept = self.departures.restore(last.departing, time.time())
        if kept:
            log.info("departing pods kept from the node's last inventory", pods=kept)
        self._last_foreign = foreign.settled_from_booked(self.state.snapshot.inventory,
                                                         {g.uuid: g.foreign_mib for g in last.gpus})
        if self._last_foreign:
            log.info("foreign memory kept from the node's last inventory until it settles again",
                     gpus=",".join(f"{g}:{m}MiB" for g, m in self._last_foreign.items()))

    def _departures_loop(self) -> None:
        """Body of the ``departures`` thread: republish when a departing pod's report ends, so the
        inventory lists only pods that may still run."""
        while not self._stop.is_set():
            end = self.departures.next_end_s()
            wait = 3600.0 if end is None else max(0.0, end - time.time())
            wait_poked(self._stop, self._departures_poked, wait)
            if end is not None and time.time() >= end:
                self._publish_inventory()

    def _managers(self) -> list[ResourceManager]:
        return [NodeResourceManager(r, self.state, self.feeds, self.allocator) for r in self.state.snapshot.devices]

    def _changed(self, old: Snapshot, new: Snapshot) -> None:
        """A new snapshot (a reload among them): device lists follow at once (ListAndWatch resends);
        the servers restart only when the set of resources changes."""
        if new.inventory != old.inventory:
            self._publish_inventory(new.inventory)
        if set(new.devices) != set(old.devices):
            self.lifecycle.request_restart("resources changed")

    # -- start/stop ------------------------------------------------------------------------------
    def start(self) -> None:
        if self.pods is not None:
            self._spawn("pod-watch", lambda: self.pods.run(self._stop))  # type: ignore[union-attr]
            if not self.pods.synced.wait(self._startup_sync_seconds):
                log.warning("pod cache not synced before serving; pods are reconciled once it is",
                            waited_s=self._startup_sync_seconds)
        try:  # before Register: learn what the kubelet already handed out (a restart loses nothing)
            first = self.reconciler.run_once()
            log.info("start-up reconcile", pod_resources=first.pod_resources, patched=len(first.patched),
                     waiting=len(first.waiting), in_sync=first.in_sync)
        except Exception as exc:  # noqa: BLE001 - Allocate does not need it; the thread retries
            log.warning("start-up reconcile failed", error=f"{type(exc).__name__}: {exc}")
        self._spawn("reconcile", lambda: self.reconciler.run(self._stop, self._reconcile_seconds))
        self._check_cdi_names()
        self._spawn("kubelet-watch", lambda: self.lifecycle.run(self._stop))
        health = self.state.snapshot.config.health
        if not health.disabled:
            self._spawn("gpu-health", lambda: self.backend.watch_health(
                self._stop, self.state.on_health, frozenset(health.ignored_xids)))
        if self.publisher is not None:
            self._restore_last_report()
        self._start_quota_loop()  # before the first publish: it keeps the foreign memory last reported
        if self.publisher is not None:
            self._publish_inventory()
            self._spawn("inventory-publisher", lambda: self.publisher.run(self._stop))  # type: ignore[union-attr]
            self._spawn("departures", self._departures_loop)
        self._start_residency()
        if self._metrics_port:
            self._metrics_server = MetricsServer(self.metrics.registry, self._metrics_port)
            self._metrics_server.start()

    def _check_cdi_names(self) -> None:
        """With the cdi-cri strategy, say at start which GPUs' CDI names no spec on this node defines."""
        snapshot = self.state.snapshot
        if snapshot.config.device_list_strategy is not DeviceListStrategy.CDI_CRI:
            return
        wanted = [allocation.cdi_name(uuid) for g in snapshot.inventory.gpus
                  for uuid in ([m.uuid for m in g.mig] if g.mig else [g.uuid])]
        specs, problems = cdi_names.read_specs(self._cdi_roots)
        for problem in problems:
            log.warning("CDI spec not readable", problem=problem)
        gone = cdi_names.missing(wanted, specs)
        if gone:
            log.error("CDI device names do not resolve: containers given these GPUs will fail at creation",
                      missing=",".join(gone), roots=",".join(self._cdi_roots), fix=cdi_names.FIX)
        else:
            log.info("CDI device names resolve", devices=len(wanted))

    def _wake(self) -> None:
        self.lifecycle.wake()

    def close(self) -> None:
        self._stop.set()
        self.lifecycle.wake()
        self.reconciler.wake()
        if self.publisher is not None:
            self.publisher.stop()
        if self.pods is not None:
            self.pods.stop()
        self.backend.close()
        for thread in self._threads:
            thread.join(timeout=10)
        self.feeds.close_all()
        if self._metrics_server is not None:
            self._metrics_server.close()


def run(args: argparse.Namespace) -> int:
    """Entry point of ``vramshare device-plugin``; returns the exit status."""
    overrides = {"quota_host_dir": args.quota_dir}
    try:
        config = load_config(args.config, os.environ).with_overrides(**overrides)
    except ConfigError as exc:
        print(f"vramshare device-plugin: {exc}", file=sys.stderr)
        return 2
    api = kube.api_client(args.kubeconfig)
    if api is None:
        log.info("standalone: no kubeconfig and no in-cluster service account; no inventory annotation, "
                 "no steering, no reconcile patches (Allocate grants the GPU the device IDs name, as always)")
    elif not args.node_name:
        print("vramshare device-plugin: --node-name (or $NODE_NAME) is required with an API server", file=sys.stderr)
        return 2
    metrics = PluginMetrics()
    try:
        backend = open_backend(args.backend, args.inventory, lambda function, kind: metrics.backend_error("nvml"))
        daemon = DevicePluginDaemon(backend, config, args.device_plugin_dir,
                                    node_name=args.node_name or "", api=api,
                                    pod_resources_socket=args.pod_resources_socket,
                                    metrics_port=args.metrics_port, metrics=metrics)
    except (BackendError, enforcement.EnforcementRefused, ConfigError) as exc:  # RightRefused is a ConfigError
        print(f"vramshare device-plugin: {exc}", file=sys.stderr)
        return 1
    watcher = daemon.config_watcher(args.config, config, os.environ, overrides) if args.config else None
    # SIGHUP also restarts every gRPC server, as NVIDIA's plugin does.
    return serve(daemon, watcher, "device-plugin", lambda: daemon.lifecycle.request_restart("SIGHUP"))
