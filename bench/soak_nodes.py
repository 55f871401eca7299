"""The soak's nodes with the device plugin's real core in the loop (issue 17): kubelet model, Allocate,
PodResources in upstream's shape, reconcile, quota links. Never imported by a daemon.

Per node: the kubelet's device manager model (:mod:`standins.devicemanager`: its own device
accounting, the plugin's preference as a hint, admission in creation order with ties random; a pod deleted
gracefully kept *active* for a random termination grace, so a pod recreated under its name is listed
twice; a force-deleted pod no longer active at once, as upstream's ``GetActivePods`` omits it
(kubernetes#104824: gone from PodResources, its device IDs handed out again at the next admission) while its
containers still hold their memory for the grace), the plugin's :class:`~deviceplugin.kubelet.allocator.Allocator` (the GPU follows the device IDs,
a quota directory per allocation, steering from the pods), and its
:class:`~deviceplugin.kubelet.reconcile_loop.Reconciler`, which reads PodResources exactly as a real kubelet
answers it (``List`` in upstream's shape through :func:`deviceplugin.kubelet.podresources.held`: one entry per
device ID and NUMA node, no UID), patches the pods with the plugin's own adapter (server-side apply under its
field manager, over the double's REST: until round 12 a Python-side write kept the extender as the owner of
``allocation-state``, so the extender believed no report and took every node for silent), links the quota
directories and prunes. PodResources goes down on a node now and then: the reconciler then records
nothing and Allocate refuses what no single plan explains (what that costs is counted). The node agent's
report of deleted pods that may still run (:class:`vramshare.departing.Departures`, fed by the pod
deletions a watch delivers) goes into the node's inventory through the plugin's own publisher, and so does
the memory no pod holds (:mod:`vramshare.foreign`): with ``stuck_share``, that share of force-deleted pods
keeps its containers' memory past the grace (a process stuck in the driver), and each node reads, per GPU,
what the containers of pods gone from the API hold, once per ``foreign_every_s`` (the quota loop's tick,
scaled like the soak's grace), settles it over one such tick as the quota loop does and publishes it.

Checked every few ticks, from the truth (the kubelet model's grants per pod UID):

* ``dangling_links``: quota links ``<root>/<uid>/<container>`` that do not resolve;
* ``links_to_other_pods``: links of a running pod UID to an allocation that is not its own;
* ``pods_recorded_on_other_gpus``: pods recorded ``allocated`` with GPUs or sizes their UID's containers
  do not hold (another pod's, or a previous pod's of the same name);
* ``links_missing_after_settle``: running containers without a link to their own directory at the end.
"""
from __future__ import annotations

import dataclasses
import os
import random
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

from deviceplugin.backend import DiscoveredGpu
from deviceplugin.kubelet import podresources
from deviceplugin.kubelet.allocator import Allocator
from deviceplugin.kubelet.kube_adapter import InventoryPublisher, PodPatcher
from deviceplugin.kubelet.podresources import PodResourcesError
from deviceplugin.kubelet.reconcile import Held, Patch
from deviceplugin.kubelet.reconcile_loop import Reconciler
from deviceplugin.metrics import PluginMetrics
from deviceplugin.node_state import NodeState
from deviceplugin.quota_files import QuotaFiles, allocation_key
from standins.apiserver import PODS, ApiServerDouble
from standins.apiserver.errors import ApiError
from standins.devicemanager import AdmissionError, DeviceManager, FnEndpoint
from standins.kubelet import admission_order, list_response
from vramshare import contract
from vramshare.config import Config
from vramshare.contract import assignment
from vramshare.contract import inventory as contract_inventory
from vramshare.departing import Departures
from vramshare.foreign import SettledForeign, schedulable_foreign, with_foreign
from vramshare.inventory import NodeInventory
from vramshare.kube import api_client_for

N = contract.Names()
Obj = dict[str, Any]
REFUSED_UNRECORDED = "PodResources is down"


@dataclass
class Stats:
    admitted: int = 0
    admission_failures: int = 0
    refused_unrecorded: int = 0  # Allocates refused while PodResources was down (item 12's cost)
    steering_misses: int = 0  # pods whose actual GPUs differ from their plan
    steering_examples: list[dict[str, Any]] = field(default_factory=list)  # the first few: plan, got, when
    ambiguous: int = 0
    unsteered: int = 0
    pod_resources_outages: int = 0
    admitted_while_down: int = 0
    names_listed_twice: int = 0  # reconcile rounds where List named a pod twice (the old one terminating)
    same_name_waits: int = 0  # rounds where a pod waited because List showed only an earlier pod's devices
    rounds: int = 0
    dangling_links: set[str] = field(default_factory=set)
    links_to_other_pods: set[str] = field(default_factory=set)
    pods_recorded_on_other_gpus: set[str] = field(default_factory=set)
    admit_latency_s: list[float] = field(default_factory=list)
    departing_reported: int = 0  # force-deleted pods the node agents reported in their inventory
    stuck: int = 0  # force-deleted pods whose containers kept their memory past the grace
    foreign_reports: int = 0  # inventories published with memory no pod holds
    departures_lost: int = 0  # times the deletion history ran out (410) and what went meanwhile was lost


class _View:
    """The plugin's pod cache: this node's pods of the tick's snapshot, our own patches seen at once."""

    def __init__(self) -> None:
        self.snapshot: list[Obj] = []

    def pods(self) -> list[Obj]:
        return self.snapshot

    def written(self, pod: Mapping[str, Any]) -> None:
        uid = pod["metadata"]["uid"]
        self.snapshot = [p if p["metadata"]["uid"] != uid else dict(pod) for p in self.snapshot]


class _PodResources:
    """``List`` of this node's kubelet, upstream's shape, through the plugin's own reading of it."""

    def __init__(self, node: "Node") -> None:
        self.node = node

    def list(self) -> list[Held]:
        if not self.node.pr_up:
            raise PodResourcesError("PodResources List: UNAVAILABLE (the kubelet double's socket is down)")
        listed = self.node.dm.pod_resources()
        names = [(ns, name) for ns, name, _ in listed]
        if len(names) != len(set(names)):
            self.node.listed_twice = True
        return podresources.held(list_response(listed), N)


@dataclass
class Node:
    name: str
    root: str
    dm: DeviceManager
    view: _View
    state: NodeState
    quota: QuotaFiles
    allocator: Allocator
    reconciler: Reconciler
    pr_up: bool = True
    down_until: float = 0.0
    wake: bool = False
    next_round: float = 0.0
    listed_twice: bool = False
    departures: Departures = field(default_factory=lambda: Departures(N))
    publisher: InventoryPublisher | None = None
    base_inventory: NodeInventory | None = None  # the node's inventory as created
    reported: tuple = ()  # the departing pods and the foreign memory last published
    foreign: SettledForeign = field(default_factory=SettledForeign)
    next_reading: float = 0.0


class PluginNodeSim(threading.Thread):
    """All nodes' kubelets and device plugins; the same surface as ``soak_harness.KubeletSim``."""

    def __init__(self, api: ApiServerDouble, capacity: dict[str, dict[str, int]], gpus: dict[str, list[DiscoveredGpu]],
                 unit_mib: int, admit_delay_s: tuple[float, float], seed: int, grace_s: tuple[float, float] = (0.0, 2.0),
                 outage_per_s: float = 0.02, outage_s: tuple[float, float] = (1.0, 4.0), tick_s: float = 0.02,
                 round_every_s: float = 1.0, report_departing: bool = True, stuck_share: float = 0.0,
                 stuck_s: tuple[float, float] = (10.0, 30.0), report_foreign: bool = True,
                 foreign_every_s: float = 1.0) -> None:
        super().__init__(name="plugin-node-sim", daemon=True)
        self.api, self.unit, self.capacity = api, unit_mib, capacity
        self.delay, self.grace, self.tick = admit_delay_s, grace_s, tick_s
        self.outage_per_s, self.outage_s, self.round_every = outage_per_s, outage_s, round_every_s
        self.rng = random.Random(seed)
        self.dir = tempfile.mkdtemp(prefix="vramshare-soak-nodes-")
        # the plugin's own adapter over the double's REST: server-side apply under its field manager, so
        # the extender believes each report as it believes a real plugin's
        self.client = api_client_for(api.url)
        self.nodes = {n: self._node(n, gs) for n, gs in gpus.items()}
        self.stats = Stats()
        self.lock = threading.Lock()
        self.stop_event = threading.Event()
        self.outages = True
        self.seen_bound: dict[str, float] = {}  # uid -> first seen bound
        self.due: dict[str, float] = {}
        # (node, uid) -> (when the kubelet lets it go, the API pod to remove then: "" when none)
        self.leaving: dict[tuple[str, str], tuple[float, str]] = {}
        self.failed: set[str] = set()
        self.real: dict[str, dict[str, int]] = {}  # uid -> gpu -> units (what containers hold)
        self.rv = api.resource_version  # the pod deletions the node agents' watches have delivered
        self.report_departing = report_departing  # off: the baseline of a node agent without the report
        self.stuck_share, self.stuck_s = stuck_share, stuck_s
        self.stuck_uids: set[str] = set()
        self.gone_at: dict[str, float] = {}  # uid -> when the node saw its pod gone from the API (examples)
        self.published_log: dict[str, Any] = {}  # node -> the last inventories' (wall, foreign, departing)
        self.report_foreign, self.foreign_every = report_foreign, foreign_every_s
        for n in self.nodes.values():
            n.foreign = SettledForeign(settle_s=foreign_every_s)

    def _node(self, name: str, gpus: list[DiscoveredGpu]) -> Node:
        root = os.path.join(self.dir, name)
        config = Config(quota_host_dir=root, memory_unit_mib=self.unit, reserved_mib_per_gpu=0)
        state = NodeState(gpus, config)
        quota = QuotaFiles(root, config.quota)
        view = _View()
        dm = DeviceManager(random.Random(self.rng.random()))
        node = Node(name, root, dm, view, state, quota, None, None)  # type: ignore[arg-type]
        node.reconciler = Reconciler(state, name, quota, PluginMetrics(), _PodResources(node), view,
                                     PodPatcher(self.client, N))
        node.reconciler.alloc_dir_ttl_s = 5.0  # prune early, so a wrong prune would show within the run

        def woken() -> None:
            node.wake = True
        node.allocator = Allocator(state, quota, PluginMetrics(), name, view, on_allocated=woken,
                                   recording=lambda: node.reconciler.recording)
        for resource, devs in state.snapshot.devices.items():
            dm.register(resource, FnEndpoint(lambda a, m, s, r=resource: node.allocator.preferred(r, a, m, s),
                                             lambda ids, r=resource: node.allocator.allocate(r, ids)))
            dm.update_devices(resource, [(d.id, d.healthy, (d.numa_node,) if d.numa_node is not None else ())
                                         for d in devs])
        node.reconciler.run_once()
        node.base_inventory = contract_inventory.parse(
            (self.api.get_node(name) or {})["metadata"]["annotations"][N.inventory])
        node.publisher = InventoryPublisher(self.client, name, N)
        return node

    # -- the surface bench_soak reads ----------------------------------------------------------------
    def reality_mib(self) -> dict[str, int]:
        with self.lock:
            out = {g: 0 for gpus in self.capacity.values() for g in gpus}
            for r in self.real.values():
                for g, u in r.items():
                    out[g] += u * self.unit
            return out

    def who_holds(self, gpu: str) -> list[dict[str, Any]]:
        """Who holds memory on ``gpu`` now, in what state (``live``; ``leaving``: its kubelet stops it;
        ``stuck``: it outlives its grace) and since when, and the node's last published inventories (what
        the extender was told): an over-capacity example's explanation."""
        with self.lock:
            names = {u: e.name for n in self.nodes.values() for u, e in n.dm.pods.items()}
            out = []
            for uid, gpus in self.real.items():
                if gpu not in gpus:
                    continue
                key = next((k for k in self.leaving if k[1] == uid), None)
                state = "live" if key is None else "leaving"
                if uid in self.stuck_uids:
                    state = "stuck"
                out.append({"pod": names.get(uid, uid), "uid": uid, "mib": gpus[gpu] * self.unit, "state": state,
                            **({"gone_at": round(self.gone_at[uid], 2)} if uid in self.gone_at else {}),
                            **({"ends_at": round(self.leaving[key][0] - time.monotonic() + time.time(), 2)}
                               if key is not None else {})})
            node = next(n for n, gs in self.capacity.items() if gpu in gs)
            return out + [{"published": [(round(t, 2), f.get(gpu, 0), [(d.uid, d.until_s, dict(d.gpus).get(gpu))
                                                                       for d in dep if gpu in dict(d.gpus)])
                                         for t, f, dep in self.published_log.get(node, [])]}]

    def pending_admissions(self) -> int:
        with self.lock:
            return len(self.seen_bound)

    def running_names(self) -> list[str]:
        with self.lock:
            return sorted({f"{e.namespace}/{e.name}" for n in self.nodes.values() for u, e in n.dm.pods.items()
                           if u in n.dm.active and u in self.real and (n.name, u) not in self.leaving})

    def end_outages(self) -> None:
        with self.lock:
            self.outages = False
            for n in self.nodes.values():
                n.pr_up, n.wake = True, True

    def run(self) -> None:
        for n in self.nodes.values():
            threading.Thread(target=n.publisher.run, args=(self.stop_event,), name=f"publish-{n.name}",  # type: ignore[union-attr]
                             daemon=True).start()
        while not self.stop_event.wait(self.tick):
            self.step()

    # -- one tick ------------------------------------------------------------------------------------
    def step(self) -> None:
        pods = self.api.pods()
        now = time.monotonic()
        by_uid = {p["metadata"]["uid"]: p for p in pods}
        with self.lock:
            self._departures()
            wall = time.time()
            for n in self.nodes.values():
                self._publish(n, by_uid, now, wall)
                n.view.snapshot = [p for p in pods if p["spec"].get("nodeName") == n.name
                                   and (p.get("status") or {}).get("phase") not in ("Succeeded", "Failed")]
                self._outage(n, now)
                self._terminate(n, by_uid, now)
                self._admit(n, now)
                if n.wake or now >= n.next_round:
                    n.wake, n.next_round = False, now + self.round_every
                    n.listed_twice = False
                    out = n.reconciler.run_once()
                    self.stats.rounds += 1
                    self.stats.names_listed_twice += n.listed_twice
                    self.stats.same_name_waits += sum("earlier pod" in why for why in out.waiting.values())
                    if out.waiting or out.failed:
                        n.next_round = min(n.next_round, now + 0.2)
            for key in [k for k in self.seen_bound if k not in by_uid]:
                self.seen_bound.pop(key, None)
                self.due.pop(key, None)
            if self.rng.random() < 0.1:
                self.check(pods)

    def _departures(self) -> None:
        """Each node agent's pod watch delivers the deletions (the object as it went); the ones that may
        still run go into its inventory's ``departing`` section, which is published when it changes."""
        try:
            gone, self.rv = self.api.deleted_after(PODS, self.rv)
        except ApiError:  # 410: the agents relist; what went meanwhile is lost to them (counted)
            gone, self.rv = [], self.api.resource_version
            self.stats.departures_lost += 1
        wall = time.time()
        for pod in gone if self.report_departing else ():
            n = self.nodes.get((pod.get("spec") or {}).get("nodeName") or "")
            if n is not None and n.departures.note(pod, wall) is not None:
                self.stats.departing_reported += 1

    def _publish(self, n: Node, by_uid: Mapping[str, Obj], now: float, wall: float) -> None:
        """The node's inventory with its departing pods and the memory no pod holds, when either changed.
        That memory is what the containers of pods gone from the API still hold (the node agent's pod cache
        no longer lists them: no tenant), read once per ``foreign_every_s`` and settled as the quota loop
        does (vramshare.foreign)."""
        if self.report_foreign and now >= n.next_reading:
            n.next_reading = now + self.foreign_every
            held = {g: 0 for g in self.capacity[n.name]}
            for (node, uid) in self.leaving:
                if node == n.name and uid not in by_uid:
                    for g, units in self.real.get(uid, {}).items():
                        held[g] += units * self.unit
            n.foreign.observe(now, held)
        departing = n.departures.current(wall)
        assert n.base_inventory is not None
        booked = schedulable_foreign(n.base_inventory, n.foreign.settled(now))
        if (departing, booked) != n.reported:
            n.reported = (departing, booked)
            self.stats.foreign_reports += bool(booked)
            n.publisher.publish(contract_inventory.encode(  # type: ignore[union-attr]
                dataclasses.replace(with_foreign(n.base_inventory, booked), departing=departing)))
            log = self.published_log.setdefault(n.name, [])
            log.append((wall, booked, departing))
            del log[:-12]

    def _outage(self, n: Node, now: float) -> None:
        if not self.outages:
            return
        if n.pr_up and self.rng.random() < self.outage_per_s * self.tick:
            n.pr_up, n.down_until = False, now + self.rng.uniform(*self.outage_s)
            self.stats.pod_resources_outages += 1
        elif not n.pr_up and now >= n.down_until:
            n.pr_up, n.wake = True, True

    def _terminate(self, n: Node, by_uid: Mapping[str, Obj], now: float) -> None:
        """How pods leave the kubelet. Finished (Succeeded/Failed): at once, the containers have exited.
        Deleted gracefully (a ``deletionTimestamp``): the kubelet stops the containers over a random grace,
        lets the devices go, then removes the API object (what a kubelet's status manager does), and only
        then may a StatefulSet make the pod again. Force-deleted (the API forgot it at once): the kubelet
        forgets it at once too (upstream's ``HandlePodRemoves`` drops it from the pod manager, so
        ``GetActivePods`` omits it, kubernetes#104824): PodResources no longer lists it and its device IDs
        go to the next admission, while its containers still hold their memory for the grace."""
        for uid in list(n.dm.active):
            p = by_uid.get(uid)
            if (n.name, uid) in self.leaving:
                continue
            if p is not None and (p.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
                self.leaving[(n.name, uid)] = (now, "")
            elif p is None:
                self.gone_at[uid] = time.time()
                n.dm.remove_pod(uid)
                n.wake = True
                end = now + self.rng.uniform(*self.grace)
                if self.stuck_share and self.rng.random() < self.stuck_share:
                    end += self.rng.uniform(*self.stuck_s)  # a process stuck in the driver outlives the grace
                    self.stats.stuck += 1
                    self.stuck_uids.add(uid)
                self.leaving[(n.name, uid)] = (end, "")
            elif p["metadata"].get("deletionTimestamp"):
                self.leaving[(n.name, uid)] = (now + self.rng.uniform(*self.grace), p["metadata"]["name"])
        for (node, uid), (at, finish) in list(self.leaving.items()):
            if node == n.name and at <= now:
                del self.leaving[(node, uid)]
                n.dm.remove_pod(uid)
                self.real.pop(uid, None)
                n.wake = True
                if finish:
                    self._finish_deletion(finish, uid)
        for p in n.view.snapshot:  # deleted before the kubelet admitted it: nothing to stop
            uid = p["metadata"]["uid"]
            if p["metadata"].get("deletionTimestamp") and uid not in n.dm.pods:
                self._finish_deletion(p["metadata"]["name"], uid)

    def _report_containers(self, meta: Mapping[str, Any], uid: str, state: str) -> None:
        """The kubelet's status manager: containers ``running`` once started, ``terminated`` before it
        deletes the object (``status_manager.go``: ``canBeDeleted`` needs them stopped)."""
        def change(obj: Obj) -> None:
            if obj["metadata"]["uid"] != uid:
                return
            status = obj.setdefault("status", {})
            if state == "running":
                status["phase"] = "Running"
            status["containerStatuses"] = [
                {"name": c["name"], "ready": state == "running",
                 "state": {state: {"exitCode": 0, "reason": "Completed"} if state == "terminated" else {}}}
                for c in obj["spec"].get("containers", [])]
        try:
            self.api.update(PODS, meta.get("namespace", "default"), meta["name"], change)
        except Exception:  # noqa: BLE001 - deleted meanwhile
            pass

    def _finish_deletion(self, name: str, uid: str) -> None:
        live = self.api.get_pod("default", name)
        if live is not None and live["metadata"]["uid"] == uid:
            self._report_containers(live["metadata"], uid, "terminated")
            try:
                self.api.delete_pod("default", name)
            except Exception:  # noqa: BLE001 - gone meanwhile
                pass

    def _admit(self, n: Node, now: float) -> None:
        ready = []
        for p in n.view.snapshot:
            uid = p["metadata"]["uid"]
            if uid in n.dm.pods or uid in self.failed or p["metadata"].get("deletionTimestamp"):
                continue
            if uid not in self.seen_bound:
                self.seen_bound[uid] = now
                self.due[uid] = now + self.rng.uniform(*self.delay)
            if self.due[uid] <= now:
                ready.append(p)
        for p in admission_order(ready, self.rng):
            uid, meta = p["metadata"]["uid"], p["metadata"]
            waited = now - self.seen_bound.pop(uid, now)
            self.due.pop(uid, None)
            try:
                n.dm.admit(p)
            except AdmissionError as exc:
                self.stats.admission_failures += 1
                self.stats.refused_unrecorded += REFUSED_UNRECORDED in str(exc)
                self.failed.add(uid)
                try:
                    self.api.update(PODS, meta.get("namespace", "default"), meta["name"], _fail_if(uid))
                except Exception:  # noqa: BLE001 - deleted meanwhile
                    pass
                continue
            self.stats.admitted += 1
            self.stats.admitted_while_down += not n.pr_up
            self._report_containers(meta, uid, "running")
            self.stats.admit_latency_s.append(waited)
            got = self._gpus_of(n, uid)
            self.real[uid] = {g: sum(m for m in mib.values()) // self.unit for g, mib in _per_gpu(got).items()}
            own = self._units(p)
            if self.real[uid] != own:
                self.stats.steering_misses += 1
                if len(self.stats.steering_examples) < 5:
                    self.stats.steering_examples.append({
                        "pod": meta["name"], "uid": uid, "planned": own, "got": self.real[uid], "at": round(time.time(), 2),
                        # what steering saw: the node's other pods of this size not admitted yet, and their plans
                        "same_size_waiting": sorted(
                            f"{q['metadata']['name']}:{(q['metadata'].get('annotations') or {}).get(N.allocation_state)}:"
                            f"{(q['metadata'].get('annotations') or {}).get(N.assignment)}"
                            for q in n.view.snapshot if q["metadata"]["uid"] not in n.dm.pods
                            and q["metadata"]["uid"] != uid and sum(self._units(q).values()) == sum(own.values()))})

    def _units(self, pod: Obj) -> dict[str, int]:
        """GPU -> units a pod's assignment names (its plan, or the plugin's report)."""
        text = (pod["metadata"].get("annotations") or {}).get(N.assignment) or "{}"
        return {g.uuid: g.mib // self.unit for gpus in assignment.parse(text).values() for g in gpus}

    def _gpus_of(self, n: Node, uid: str) -> dict[str, dict[str, int]]:
        """Per container, GPU -> MiB the kubelet model's grants stand for (the truth)."""
        devices = {d.id: d for ds in n.state.snapshot.devices.values() for d in ds}
        out: dict[str, dict[str, int]] = {}
        entry = n.dm.pods.get(uid)
        for c, grants in (entry.containers.items() if entry else ()):
            for g in grants.values():
                for i in g.device_ids:
                    d = devices[i]
                    out.setdefault(c, {})[d.gpu_uuid] = out.setdefault(c, {}).get(d.gpu_uuid, 0) + d.mib
        return out

    # -- the checks ----------------------------------------------------------------------------------
    def check(self, pods: list[Obj]) -> None:
        for n in self.nodes.values():
            for uid in _listdir(n.root):
                if uid.startswith("_"):
                    continue
                for c in _listdir(os.path.join(n.root, uid)):
                    link = os.path.join(n.root, uid, c)
                    if not os.path.islink(link):
                        continue
                    if not os.path.exists(link):
                        self.stats.dangling_links.add(link)
                        continue
                    entry = n.dm.pods.get(uid)
                    if entry is None or uid not in n.dm.active:
                        continue  # a pod the kubelet let go: pruned next round
                    grants = entry.containers.get(c, {})
                    mine = {allocation_key(sorted(g.device_ids)) for g in grants.values()}
                    if os.path.basename(os.path.realpath(link)) not in mine:
                        self.stats.links_to_other_pods.add(f"{n.name}/{uid}/{c}")
        for p in pods:
            meta = p["metadata"]
            ann = meta.get("annotations") or {}
            n = self.nodes.get(p["spec"].get("nodeName") or "")
            if n is None or ann.get(N.allocation_state) != contract.STATE_ALLOCATED:
                continue
            uid = meta["uid"]
            if uid not in n.dm.active:
                continue
            recorded = {c: {g.uuid: g.mib for g in gpus} for c, gpus in assignment.parse(ann[N.assignment]).items()}
            if recorded != self._gpus_of(n, uid):
                self.stats.pods_recorded_on_other_gpus.add(f"{meta.get('namespace', 'default')}/{meta['name']}/{uid}")

    def missing_links(self) -> list[str]:
        """Running containers whose ``<uid>/<container>`` does not lead to their own directory."""
        out = []
        with self.lock:
            for n in self.nodes.values():
                for uid in n.dm.active:
                    entry = n.dm.pods.get(uid)
                    for c, grants in (entry.containers.items() if entry else ()):
                        spec = entry.pod.get("spec") or {}
                        if c not in {x["name"] for x in spec.get("containers") or []}:
                            continue
                        link = os.path.join(n.root, uid, c)
                        keys = {allocation_key(sorted(g.device_ids)) for g in grants.values()}
                        if not os.path.exists(link) or os.path.basename(os.path.realpath(link)) not in keys:
                            out.append(f"{n.name}/{uid}/{c}")
        return out

    def settle_rounds(self) -> None:
        """A reconcile round on every node now (PodResources up)."""
        with self.lock:
            pods = self.api.pods()
            for n in self.nodes.values():
                n.view.snapshot = [p for p in pods if p["spec"].get("nodeName") == n.name
                                   and (p.get("status") or {}).get("phase") not in ("Succeeded", "Failed")]
                n.reconciler.run_once()
            self.check(self.api.pods())

    def cleanup(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def _per_gpu(per_container: Mapping[str, Mapping[str, int]]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for c, gpus in per_container.items():
        for g, mib in gpus.items():
            out.setdefault(g, {})[c] = mib
    return out


def _fail_if(uid: str):  # type: ignore[no-untyped-def]
    def change(obj: Obj) -> None:
        if obj["metadata"]["uid"] == uid:
            obj.setdefault("status", {})["phase"] = "Failed"
    return change


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except (FileNotFoundError, NotADirectoryError):
        return []
