"""``vramshare dra-plugin``: the DRA kubelet plugin's composition root (Kubernetes 1.36+).

Threads (named, started by :meth:`DraPluginDaemon.start`, stopped by ``close``): ``slice-publisher``
(applies this node's ResourceSlices as soon as the API server answers, whether or not a kubelet has
registered the plugin, and again on every health or config change, on every registration and
whenever ``slice-watch`` sees one deleted: the kubelet wipes them at its start and after a
deregistration; retrying failures),
``gpu-health`` (the backend's health watch), the two gRPC servers (DRA service and registration),
``metrics-http``, ``pod-watch`` (this node's pods, by list+watch: a prepared claim whose pods were all
deleted, a forced deletion, keeps its grant off the published capacity until Unprepare, also when they
went while the plugin was down; the quota loop's tenants, so a tick reads no API server), with the
quota loop ``quota-loop``, and with ``warmTier.enabled`` ``warm-channel`` (the warm tier's
socket in each claim's quota dir: idle engines sleep and their memory is lent to co-tenants, as on the
device plugin's GPUs; a sleeping claim of an overcommit class adds its credit to its GPU's published
capacity), and with ``warmTier.enabled`` or ``warmTier.modelCacheDir`` ``model-residency`` and
``models-publisher`` (the models this node can start fast, in the node's ``resident-models`` annotation,
issue 23). Same backends and config file as the device plugin; the config's ``dra.gpus`` decides which
GPUs are served here (the device plugin leaves those out).

Dynamic MIG (issue 24): on NVML, GPUs in MIG mode listed in ``dynamicMig.gpus`` are published as
partitionable devices (every profile at every placement, with counters) and their instances made at
Prepare. With ``dra.partitionableDevices: auto`` a server that drops the counters (its
DRAPartitionableDevices gate off) is detected at the first publication, before any device slice is
applied, and the plugin falls back to today's devices (the instances as they exist).

Enforcement: as the device plugin, the node's mode (``enforcement.mode``: driver, mps, cooperative) is
detected at start by :func:`deviceplugin.enforcement.detect` (a named mode the node cannot honour stops
the plugin with the reason) and pinned in the config: each claim's CDI spec carries its fence, and in
driver mode the quota loop moves the claims' containers' cgroup limits. The pinned mode is published as
each shared device's ``enforcement`` attribute (:mod:`vramshare.contract.slice_enforcement`).
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
from typing import Any, Callable, Mapping

import urllib3
from kubernetes import client
from kubernetes.client.rest import ApiException
from prometheus_client import CollectorRegistry, Counter, Gauge

from deviceplugin import enforcement
from deviceplugin.backend import BackendError, GpuBackend
from deviceplugin.backend_choice import open_backend
from deviceplugin.dra import slices
from deviceplugin.dra.grpc_service import KubeletPlugin
from deviceplugin.dra.preparer import ClaimPreparer, FileEffects
from deviceplugin.dra.publisher import FIELD_MANAGER, CountersDropped, SlicePublisher, SliceWatch
from deviceplugin.metrics import (EnforcementModeCollector, MetricsServer, config_reloads_counter,
                                  enforcement_unavailable_gauge, restart_pending_gauge)
from deviceplugin.mig_dynamic import DynamicMig, MigError, MigMetrics
from deviceplugin.mig_nvml import MigNvmlError, NvmlMig
from deviceplugin.node_state import NodeState, Snapshot
from deviceplugin.pod_cache import NodePodCache
from deviceplugin.quota import rights
from deviceplugin.serve import NodeDaemon, serve
from vramshare import contract, foreign, kube, logs, mig
from vramshare.config import Config, ConfigError, load_config
from vramshare.contract import config_in_force
from vramshare.inventory import GpuMode

log = logs.get(__name__)
READ_TIMEOUT_S = 5.0  # a claim or pod read (Prepare, or the quota tick's claim allocated before Prepare)
KEPT_FILE = "foreign-memory.json"  # beside the checkpoint: the settled foreign memory, for the next start
MAX_KEPT_BYTES = 1 << 20


class DraMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        p = contract.METRICS_PREFIX
        self.devices = Gauge(f"{p}dra_published_devices", "Devices in this node's ResourceSlices",
                             registry=self.registry)
        self.generation = Gauge(f"{p}dra_pool_generation", "Generation of this node's pool", registry=self.registry)
        self.prepared = Gauge(f"{p}dra_prepared_claims", "Claims prepared on this node", registry=self.registry)
        self.publish_errors = Counter(f"{p}dra_publish_errors", "Failed ResourceSlice publications",
                                      registry=self.registry)
        self.enforcement_unavailable = enforcement_unavailable_gauge(self.registry)
        self.config_reloads = config_reloads_counter(self.registry, f"{p}dra_")
        self.restart_pending = restart_pending_gauge(self.registry, f"{p}dra_")
        self.foreign_mib = Gauge(f"{p}dra_foreign_memory_mib", "Memory of a shared GPU held outside the allocator's "
                                 "books, in whole units: what no claim of ours holds (a host process, a stuck one; "
                                 "settled) and the grants of force-deleted pods' claims still prepared; taken off the "
                                 "device's published capacity", ["gpu"], registry=self.registry)
        self.departed_claims = Gauge(f"{p}dra_departed_claims", "Claims still prepared on this node whose pods "
                                     "were all deleted (forced deletions: their containers are still stopping); "
                                     "their grants are in dra_foreign_memory_mib until the kubelet unprepares them",
                                     registry=self.registry)


class DraPluginDaemon(NodeDaemon):
    """The node's DRA driver. ``api`` is required: Prepare reads claims from the API server."""

    component = "vramshare-dra-plugin"

    def __init__(self, backend: GpuBackend, config: Config, api: client.ApiClient, node_name: str, *,
                 plugin_dir: str, registry_dir: str, metrics_port: int = 0, retry_seconds: float = 5.0,
                 resync_seconds: float = 300.0, cgroup_root: str = contract.HOST_CGROUP_ROOT) -> None:
        self._init_daemon()
        self.backend = backend
        discovered = backend.discover()
        # as the device plugin: the node's fence, detected once (a named mode it cannot honour raises
        # EnforcementRefused with the reason) and pinned, so Prepare's CDI specs carry it and the loop moves it
        self.enforcement = enforcement.detect(backend, config, discovered)
        config = enforcement.pin(config, self.enforcement)
        rights.check(config, api)  # overLimitAction: evict needs the eviction right; raises RightRefused
        self.state = NodeState(discovered, config, dra=True)
        self.node = node_name
        self.metrics = DraMetrics()
        self.metrics.registry.register(EnforcementModeCollector(self.enforcement.mode))
        for mode, why in self.enforcement.skipped:
            self.metrics.enforcement_unavailable.labels(mode.value, why).set(1)
        self._cgroup_root = cgroup_root  # the host's cgroup v2 tree, where driver mode finds tenants' cgroups
        self.mig = _dynamic_mig(backend, discovered, self.metrics.registry)  # None off NVML: no partitions
        self.partitionable = config.dra.partitionable_devices != "off"  # false once the server drops counters
        self.publisher = SlicePublisher(api, node_name, config.names)
        self._resource = client.ResourceV1Api(api)
        self._api = api
        self.preparer = ClaimPreparer(node_name, lambda: self.state.snapshot.config, self.devices, self._read_claim,
                                      mig=self.mig, read_pod=self._read_pod)
        self._dirty = threading.Event()
        self.plugin = KubeletPlugin(self.preparer, config.names.dra_driver, plugin_dir, registry_dir,
                                    on_registered=self._dirty.set)
        self.slice_watch = SliceWatch(api, node_name, config.names, on_gone=self._dirty.set)
        self.metrics.prepared.set_function(lambda: len(self.preparer.prepared()))
        self._metrics_port = metrics_port
        self._metrics_server: MetricsServer | None = None
        self._retry, self._resync = retry_seconds, resync_seconds
        self.refused: frozenset[str] = frozenset()
        self._foreign: dict[str, int] = {}  # the quota loop's settled foreign MiB per shared GPU
        self._kept_path = os.path.join(config.dra.state_dir, KEPT_FILE)
        # UIDs of the prepared claims' pods the pod watch saw deleted: a claim all of whose pods are gone
        # while it stays prepared holds its grant outside the allocator's books (tenants.departed_claims)
        self._gone: set[str] = set()
        self._departed: tuple[str, ...] = ()  # those claims (namespace/name), as last published
        # the claims prepared when the pod list in flight was requested (claim UID -> its pods' UIDs): a pod
        # of theirs that list lacks was deleted while nobody watched (the plugin was down, the watch broken)
        self._before_list: dict[str, tuple[str, ...]] = {}
        self._listed = False  # a pod list landed (its callback ran): until then nobody knows who left
        self._gone_lock = threading.Lock()
        # this node's pods by list+watch: the claims' pods leaving (the report above) and the quota loop's tenants;
        # a broken watch relists within ``retry_seconds`` at most, as a failed publish retries
        self.pods = NodePodCache(api, node_name, config.names, retry_max_s=retry_seconds)
        self.pods.before_list, self.pods.on_listed, self.pods.on_deleted = (
            self._listing, self._pods_listed, self._pod_deleted)
        self.preparer.on_unprepared = self._dirty.set
        self._quota_loop: Any = None
        self.warm: Any = None  # the warm tier's broker, when warmTier.enabled and the quota loop runs
        self.models: tuple = ()  # issue 23: resident models, published in the node's resident-models
        self.models_publisher: Any = None  # its writer, with warmTier.modelCacheDir or warmTier.enabled
        self.state.add_listener(self._changed)

    def _start_quota_loop(self) -> None:
        """The quota loop over prepared claims: needs per-process memory from NVML (a real node), or a
        simulated node's replayed use. Its tenants' pods come from a pod cache it starts (list+watch)."""
        config = self.state.snapshot.config
        if not config.quota.enabled:
            return
        replay = getattr(self.backend, "usage_replay", None)  # a simulated node replaying a trace
        if self.backend.name != "nvml" and replay is None:
            log.info("quota loop off: it reads per-process GPU memory from NVML", backend=self.backend.name)
            return
        from deviceplugin.dra.tenants import AllocatedClaims, ClaimTenantSource
        from deviceplugin.quota import service as quota_service

        def capacities() -> dict[str, int]:  # schedulable MiB of each shared GPU, what the loop divides
            inv = self.state.snapshot.inventory
            return {g.uuid: inv.capacity_mib(g) for g in inv.gpus if g.mode is GpuMode.SHARED}
        allocated = AllocatedClaims(self._read_claim, self.node, lambda: self.state.snapshot.config, self.devices)
        tenants = ClaimTenantSource(self.preparer.prepared, self.pods.pods, self.pods.synced.is_set, config.names,
                                    allocated)  # no API call per tick (issue 21), one per claim before Prepare
        warm = None
        if config.warm_tier.enabled:  # issue 23: idle engines sleep and lend, and sleepers of overcommit
            # classes add their credit to their GPU's published capacity (item 5), as on the device plugin
            warm = quota_service.WarmTier(config, self.metrics.registry, on_credits=self.state.on_credits)
            self.warm = broker = warm.broker
            self.preparer.sleeping = lambda: {(k.namespace, k.container, gpu): mib
                                              for (k, gpu), mib in broker.booked_sleepers().items()}
        loop = quota_service.build_loop(config, self._api, self.node, capacities, tenants,
                                        nvml=getattr(self.backend, "nvml", None), mode=self.enforcement.mode,
                                        cgroup_root=self._cgroup_root,
                                        usage=[replay] if replay is not None else None, warm=self.warm)
        self._quota_loop = loop
        self._foreign = loop.keep_foreign(self._last_foreign(), config.quota.interval_seconds)
        loop.on_foreign = self.on_foreign_settled
        self.state.add_listener(lambda old, new: loop.reconfigure(new.config.quota, new.config.enforcement))
        quota_service.register_metrics(loop, self.metrics.registry)
        self._spawn("quota-loop", lambda: loop.run(self._stop, config.quota.interval_seconds))
        if warm is not None:
            self._spawn("warm-channel", lambda: warm.serve(loop, self._stop))

    def _last_foreign(self) -> dict[str, int]:
        """The settled foreign memory an earlier run of this plugin kept beside its checkpoint
        (:func:`vramshare.foreign.encode_kept`), for this node's shared GPUs: the quota loop keeps it until its
        own readings settle. Kept in a file, not read back from the slices: a device the memory fills is
        withheld from them (without device taints), and the kubelet wipes them at its start."""
        try:
            with open(self._kept_path, "rb") as fh:
                kept = foreign.decode_kept(fh.read(MAX_KEPT_BYTES))
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            log.warning("kept foreign memory unreadable; none kept until it settles again", path=self._kept_path,
                        error=str(exc))
            return {}
        shared = {g.uuid for g in self.state.snapshot.inventory.gpus if g.mode is GpuMode.SHARED}
        kept = {g: m for g, m in kept.items() if g in shared}
        if kept:
            log.info("foreign memory kept from the last run until it settles again", node=self.node,
                     gpus=",".join(f"{g}:{m}MiB" for g, m in kept.items()))
        return kept

    def on_foreign_settled(self, settled: Mapping[str, int]) -> None:
        """The quota loop's settled foreign memory moved: the shared devices' published capacity follows
        (:mod:`vramshare.contract.slice_foreign`), at the next publish, now; and the figures are kept on disk
        for the next start (:meth:`_last_foreign`)."""
        self._foreign = dict(settled)
        self._dirty.set()
        try:
            FileEffects().write_file(self._kept_path, foreign.encode_kept(settled))
        except OSError as exc:
            log.warning("foreign memory not kept on disk; a restart settles it again", path=self._kept_path,
                        error=str(exc))

    def _pod_deleted(self, pod: Mapping[str, Any]) -> None:
        """The pod watch saw a pod leave: if a prepared claim names it, the claim may now hold its grant
        outside the allocator's books (a forced deletion); the next publish says so."""
        uid = str((pod.get("metadata") or {}).get("uid") or "")
        if uid and any(uid in c.pod_uids for c in self.preparer.prepared().values()):
            with self._gone_lock:
                self._gone.add(uid)
            self._dirty.set()

    def _listing(self) -> None:
        """A pod list is about to be requested: the claims prepared now have their pods in it unless deleted."""
        prepared = {c.uid: c.pod_uids for c in self.preparer.prepared().values()}
        with self._gone_lock:
            self._before_list = prepared

    def _pods_listed(self, pods: list[Mapping[str, Any]]) -> None:
        """A list landed: the pods of claims prepared before it was requested that it lacks were deleted
        while nobody watched (a restart reads its prepared claims from the checkpoint; a broken watch
        relists), so no deletion event will ever name them."""
        present = {str((p.get("metadata") or {}).get("uid") or "") for p in pods}
        with self._gone_lock:
            missing = {u for uids in self._before_list.values() for u in uids if u not in present}
            self._gone |= missing
            self._before_list = {}
            self._listed = True
        self._dirty.set()  # also when nothing is missing: the first list lifts what _held_outside held until it

    def _held_outside(self) -> dict[str, int]:
        """Per GPU, MiB held outside the allocator's books: the loop's settled foreign memory plus the grants
        of claims whose pods were all deleted while they stay prepared (until the kubelet unprepares); only
        shared GPUs' figures are read (:func:`vramshare.foreign.schedulable_foreign`).

        Until the first pod list lands, any prepared claim's pods may have left while this plugin was down
        (the checkpoint outlives them): every prepared claim's grant is held, so a restart's first publish
        never offers memory a lingering claim holds (a live claim's grant is counted twice, by the
        allocator too, until the list lands: the safe side)."""
        from deviceplugin.dra.tenants import departed_claims

        prepared = list(self.preparer.prepared().values())
        with self._gone_lock:
            listed = self._listed
            self._gone &= {u for c in prepared for u in c.pod_uids}  # only what may still matter
            gone = self._gone if listed else {u for c in prepared for u in c.pod_uids}
            departed = departed_claims(prepared, gone, self.pods.pods())
        held = dict(self._foreign)
        for c in departed:
            for gpu, mib in c.gpus.items():
                held[gpu] = held.get(gpu, 0) + mib
        if not listed:
            if departed:
                log.info("pods not listed yet: every prepared claim's grant is held outside the allocator until "
                         "the list shows whose pods are gone", node=self.node, claims=len(departed))
            return held
        names = tuple(f"{c.namespace}/{c.name}" for c in departed)
        self.metrics.departed_claims.set(len(names))
        if names != self._departed:
            if names:
                log.warning("claims of deleted pods still prepared: their grants are booked outside the allocator "
                            "until the kubelet unprepares them", node=self.node, claims=",".join(names))
            else:
                log.info("no claim of a deleted pod is prepared any more", node=self.node)
            self._departed = names
        return held

    def _start_residency(self) -> None:
        """Issue 23: which models this node can start fast (files in ``warmTier.modelCacheDir``, engines
        awake or asleep on its GPUs from the warm broker), as the device plugin reports them, published in
        the node's ``resident-models`` annotation: not in an inventory, whose GPUs the extender would book
        beside the slices (on a node that runs both plugins, each reports its own GPUs' engines)."""
        from deviceplugin.node_annotation import NodeAnnotationPublisher
        from deviceplugin.residency import node_reporter
        from vramshare.contract import resident_models

        wt = self.state.snapshot.config.warm_tier
        publisher = self.models_publisher = NodeAnnotationPublisher(
            self._api, self.node, self.state.snapshot.config.names.resident_models, FIELD_MANAGER)
        if not (wt.model_cache_dir or wt.enabled):  # off: an earlier run's report would stay a hint forever
            publisher.remove()
            self._spawn("models-publisher", lambda: publisher.run(self._stop))
            return

        def changed(models: tuple) -> None:
            self.models = models
            publisher.publish(resident_models.encode(models))

        publisher.publish(resident_models.encode(()))  # replaces an earlier run's report until the first scan
        reporter = node_reporter(wt, changed, self.warm, lambda: self._quota_loop)
        self._spawn("models-publisher", lambda: publisher.run(self._stop))
        self._spawn("model-residency", lambda: reporter.run(self._stop))

    def _dynamic(self, published: bool = True) -> dict[str, mig.MigModel]:
        """Dynamic-MIG GPUs: in MIG mode, allowed by ``dynamicMig.gpus``, reachable through NVML, and (for
        publishing) while the API server keeps counters."""
        if self.mig is None or (published and not self.partitionable):
            return {}
        snap = self.state.snapshot
        return {u: m for u, m in slices.dynamic_models(snap.inventory, snap.config.dra_partitions).items()
                if u in self.mig.gpus}

    def devices(self) -> Mapping[str, slices.DeviceRef]:
        """Devices Prepare may hand out: this plugin's, minus GPUs a device plugin advertises."""
        inv = self.state.snapshot.inventory  # a dynamic GPU's partitions, and its instances as they are
        both = {**slices.device_index(inv), **slices.device_index(inv, self._dynamic(False))}
        return {n: r for n, r in both.items() if r.gpu.uuid not in self.refused}

    def _admin_instances(self, dynamic: Mapping[str, mig.MigModel]) -> dict[str, list[mig.Placed]] | None:
        """Per dynamic GPU, the instances no claim of ours holds (their placements are withheld);
        None when NVML cannot say (then nothing of those GPUs is published this round)."""
        assert self.mig is not None
        ours = self.preparer.checkpoint.partitions()
        out = {}
        for uuid in dynamic:
            try:
                out[uuid] = [mig.Placed(i.start, name) for name, i in self.mig.instances(uuid)
                             if (uuid, name, i.start) not in ours]
            except (MigError, MigNvmlError) as exc:
                log.warning("cannot read the GPU's MIG instances; its partitions are not published", gpu=uuid,
                            error=str(exc))
                return None
        return out

    def desired_pool(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """The devices and counter sets to publish; a device the API server would refuse is left out
        (and logged), not the slice."""
        snap = self.state.snapshot
        dynamic = self._dynamic()
        admins = self._admin_instances(dynamic) if dynamic else {}
        if admins is None:
            dynamic, admins = {}, {}
        sets = slices.counter_sets(snap.inventory, dynamic, self.refused)
        held = foreign.schedulable_foreign(snap.inventory, self._held_outside())
        for gpu in snap.inventory.gpus:
            self.metrics.foreign_mib.labels(gpu.uuid).set(held.get(gpu.uuid, 0))
        ok, invalid = slices.publishable(slices.desired_devices(foreign.with_foreign(snap.inventory, held),
                                                                snap.config.names, self.node,
                                                                taints=snap.config.dra.device_taints,
                                                                refused=self.refused, dynamic=dynamic,
                                                                foreign=admins), sets)
        for name, errors in invalid:
            log.error("device not published: the API server would refuse it", node=self.node, device=name,
                      errors="; ".join(errors))
        return ok, sets

    def desired(self) -> list[dict[str, Any]]:
        """The devices to publish (:meth:`desired_pool` without the counter sets)."""
        return self.desired_pool()[0]

    def _read_claim(self, namespace: str, name: str) -> Mapping[str, Any]:
        return _read(self._resource.read_namespaced_resource_claim, namespace, name)

    def _read_pod(self, namespace: str, name: str) -> Mapping[str, Any]:
        return _read(client.CoreV1Api(self._api).read_namespaced_pod, namespace, name)

    def _changed(self, old: Snapshot, new: Snapshot) -> None:
        if new.inventory != old.inventory or new.config != old.config:
            self._dirty.set()

    def publish_once(self) -> int:
        """Refresh the refused set, then apply the pool. Raises on API errors."""
        refused = self.publisher.device_plugin_gpus() & {g.uuid for g in self.state.snapshot.inventory.gpus}
        if refused != self.refused:
            log.error("GPUs also advertised by a device plugin on this node; not serving them by DRA "
                      "(set dra.gpus the same in both plugins' config)", node=self.node, gpus=",".join(sorted(refused)))
        self.refused = refused
        devices, sets = self.desired_pool()
        said = self.config_in_force
        notes = ({self.state.snapshot.config.names.config_in_force: config_in_force.encode(said)}
                 if said is not None else None)
        try:
            generation = self.publisher.publish(devices, sets, notes)
        except CountersDropped as exc:
            if self.state.snapshot.config.dra.partitionable_devices == "on":
                raise
            log.error("the API server drops ResourceSlice counters (DRAPartitionableDevices off): publishing the "
                      "MIG instances as they are, no dynamic MIG", node=self.node, error=str(exc))
            self.partitionable = False
            devices, sets = self.desired_pool()
            generation = self.publisher.publish(devices, sets, notes)
        self.metrics.devices.set(len(devices))
        self.metrics.generation.set(generation)
        return generation

    def _publish_loop(self) -> None:
        while not self._stop.is_set():
            self._dirty.clear()
            try:
                self.publish_once()
                wait = self._resync
            except (ApiException, OSError, ValueError) as exc:
                self.metrics.publish_errors.inc()
                log.warning("resource slices not published; retrying", node=self.node, error=str(exc),
                            retry_seconds=self._retry)
                wait = self._retry
            self._dirty.wait(wait)  # a health or config change (or close) wakes us early

    # -- start/stop ------------------------------------------------------------------------------
    def start(self) -> None:
        self._spawn("pod-watch", lambda: self.pods.run(self._stop))
        self._start_quota_loop()  # before the first publish: it keeps the foreign memory the last run settled
        self._spawn("slice-publisher", self._publish_loop)
        self._spawn("slice-watch", lambda: self.slice_watch.run(self._stop))
        self.plugin.start()
        health = self.state.snapshot.config.health
        if not health.disabled:
            self._spawn("gpu-health", lambda: self.backend.watch_health(
                self._stop, self.state.on_health, frozenset(health.ignored_xids)))
        self._start_residency()
        if self._metrics_port:
            self._metrics_server = MetricsServer(self.metrics.registry, self._metrics_port)
            self._metrics_server.start()

    def _wake(self) -> None:
        self._dirty.set()

    def _config_accepted(self, _digest: str) -> None:
        """The config file text in force changed: the slices say so at the next publish (now)."""
        self._dirty.set()

    def close(self) -> None:
        self._stop.set()
        self._dirty.set()
        self.slice_watch.stop()
        if self.models_publisher is not None:
            self.models_publisher.stop()
        self.pods.stop()
        self.plugin.stop()
        self.backend.close()
        for thread in self._threads:
            thread.join(timeout=10)
        if self._metrics_server is not None:
            self._metrics_server.close()


def _read(call: Callable[..., Any], namespace: str, name: str) -> Mapping[str, Any]:
    """One object read from the API server (a claim, a pod), decoded; every failure is a ``LookupError``
    naming why, so the caller (Prepare, the quota tick) refuses or retries."""
    try:
        resp = call(name, namespace, _preload_content=False, _request_timeout=READ_TIMEOUT_S)
    except ApiException as exc:
        raise LookupError(f"{exc.status} {exc.reason}") from exc
    except urllib3.exceptions.HTTPError as exc:  # refused, reset, timed out: the caller retries
        raise LookupError(str(exc)) from exc
    return kube.decode(resp)  # type: ignore[no-any-return]


def _dynamic_mig(backend: GpuBackend, discovered: list[Any], registry: CollectorRegistry) -> DynamicMig | None:
    """The dynamic-MIG maker over every GPU in MIG mode (config decides which are used), or None off NVML;
    its metrics (instances created/destroyed, time to create, failures by reason) on ``registry``."""
    nvml = getattr(backend, "nvml", None)
    if backend.name != "nvml" or nvml is None:
        return None
    gpus = {g.uuid: (backend.call("nvmlDeviceGetHandleByIndex", g.index), g.model, g.memory_mib)  # type: ignore[attr-defined]
            for g in discovered if g.mig_enabled}
    if not gpus:
        return None
    return DynamicMig(NvmlMig(nvml, backend.call), gpus, metrics=MigMetrics(registry))  # type: ignore[attr-defined]


def run(args: argparse.Namespace) -> int:
    """Entry point of ``vramshare dra-plugin``; returns the exit status."""
    try:
        config = load_config(args.config, os.environ)
    except ConfigError as exc:
        print(f"vramshare dra-plugin: {exc}", file=sys.stderr)
        return 2
    api = kube.api_client(args.kubeconfig)
    if api is None:
        print("vramshare dra-plugin: needs the API server (--kubeconfig or an in-cluster service account): "
              "Prepare reads each claim's allocation", file=sys.stderr)
        return 2
    if not args.node_name:
        print("vramshare dra-plugin: --node-name (or $NODE_NAME) is required", file=sys.stderr)
        return 2
    driver = config.names.dra_driver
    plugin_dir = args.plugin_dir or os.path.join(contract.KUBELET_PLUGINS_DIR, driver)
    try:
        daemon = DraPluginDaemon(open_backend(args.backend, args.inventory), config, api, args.node_name,
                                 plugin_dir=plugin_dir, registry_dir=args.registry_dir,
                                 metrics_port=args.metrics_port)
    except (BackendError, enforcement.EnforcementRefused, rights.RightRefused) as exc:
        print(f"vramshare dra-plugin: {exc}", file=sys.stderr)
        return 1
    watcher = daemon.config_watcher(args.config, config, os.environ) if args.config else None
    return serve(daemon, watcher, "dra-plugin")
