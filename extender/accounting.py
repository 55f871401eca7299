"""The extender's view of the cluster: node and pod events, and the binder's reservations, folded into
one ClusterState. No I/O and an injectable clock, so every rule below is tested on literal events.

Rules, each there because a peer got it wrong (extender-anchors, Implications 5):

* GPU capacity comes from each node's inventory annotation (per GPU, never total/count). A node whose
  annotation cannot be read keeps its last good slots and logs why; the other nodes are untouched.
* A pod holds memory from the moment the binder reserves it until it is deleted or reaches Succeeded or
  Failed: then it frees at once (HAMi#2923), unless its containers may still run. A pod whose deletion
  the kubelet finished shows every container terminated (the kubelet's status manager deletes the
  object only then, ``status_manager.go canBeDeleted``); a force-deleted pod (``kubectl delete --force``)
  vanishes from the API while its kubelet still runs it for its termination grace, holding its devices
  (taken at admission, before any container status: a bound pod that shows no terminated containers
  may hold them, reported allocated or not). Such a departing pod's GPUs stay booked, under a key of its
  own, for ``terminationGracePeriodSeconds`` plus ``DEPARTING_MARGIN_S`` (:mod:`vramshare.departing`;
  the soak found GPUs planned twice without this). The node reports the same pods in its inventory's
  ``departing`` section: a restarted extender, which saw no deletion, books them from there.
* Usage is rebuilt from the pods' assignment annotations alone, so a restarted extender sees what the
  old one placed. An assignment whose pod never binds expires after ``assume_timeout_seconds``,
  counted from its assume-time, or from when we first saw it if that time lies in the future (a
  forged or skewed time never holds memory for ever).
* **Actual over assigned**: an ``allocated`` assignment on a bound pod is the device plugin's report
  of the GPUs the kubelet really gave it. It replaces whatever we assumed, is recorded even where the
  books thought the GPU full (the books must say what the GPUs hold), and never expires; a pod
  deleted frees exactly what that report said. ``allocated`` on an unbound pod is not believed.
* A reservation is newer than any event that predates it: an event with an older (or no) assignment
  never undoes a bind in flight, and an assignment the binder gave up on is not revived by the watch.
  Pods are keyed by namespace/name, so this holds across a pod recreated under its name too: the
  binder reads the successor fresh and books it under its UID; the predecessor's events the watch
  delivers after that book nothing (its deletion frees the successor's memory on 0fd81fb), and a
  predecessor reported allocated keeps its GPUs as a departing pod until its deletion shows it stopped.
* **Trust by writer** (issue 18): an assignment is believed only from vramshare's own field managers
  (``metadata.managedFields``): ``assumed`` when the extender wrote the assignment, its assume-time
  and its state; ``allocated`` when the device plugin wrote the state (and the extender or the device
  plugin the assignment). Anyone else's is logged and counted (:attr:`Accounting.untrusted`) and
  holds nothing: an untrusted ``assumed`` is ignored; an untrusted ``allocated`` on a bound pod counts
  only within the GPU's free memory and the pod's own request, never forced over capacity and never
  as a hold. The admission policy stays the first wall (a manager name is the client's claim).
* While a pod is ``assumed`` on a node, pods sharing a container size with it wait unless they take the
  same GPUs for that size (:mod:`extender.holds`).
* A node update is all or nothing: a refused inventory keeps the node's last good slots and usage.
* Each node's ``status.allocatable`` CPU and memory, and the CPU and memory requests of every pod bound
  to it (GPU or not, counted as the kubelet counts them), are tracked as kube-scheduler's cache tracks
  them: FGD counts the idle GPUs a node's remaining CPU and memory cannot feed, as the simulator does.

ClusterState is not thread-safe; :attr:`lock` serialises every read and write of it.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

from extender import cluster, held_pick, holds, parsed, placement, translate, verbs
from vramshare import contract, inventory, logs, managed, podspec
from vramshare.config import Config, Policy
from vramshare.departing import TERMINAL_PHASES, DepartingPod, booked_seconds, ghost_key, may_still_run, pod_key

__all__ = ["Accounting", "TERMINAL_PHASES"]

log = logs.get("vramshare.extender.accounting")
Obj = Mapping[str, Any]
_FORGET_LIMIT = 10_000
WARM_QUIET_S = 0.02  # the warmer works only after this long without a scheduling verb


@dataclass(frozen=True)
class _Hold:
    node: str
    assume_ns: int  # the assume-time, or when we first saw it if it lay in the future
    since_ns: int  # when we started holding it (our clock): relists only drop holds older than the list
    raw_ns: int = -1  # the assume-time as the annotation says it (compared with later events)
    allocated: bool = False  # the device plugin's report: authoritative, never expires

    @property
    def stamp(self) -> int:
        return self.assume_ns if self.raw_ns < 0 else self.raw_ns


class Accounting:
    """Live per-GPU usage of every vramshare node, fed by the cache and the binder."""

    def __init__(self, config: Config, clock: Callable[[], int] = time.time_ns) -> None:
        self.config = config
        self.names = config.names
        self.clock = clock
        self.lock = threading.RLock()
        self.state = cluster.ClusterState(workload_window=config.extender.workload_window)
        self.slots: dict[str, list[cluster.Slot]] = {}
        self.pods: dict[str, Obj] = {}  # latest object of every live pod that asks for our resources
        self._annotation: dict[str, str] = {}
        self._node_of_uuid: dict[str, str] = {}
        self._held: dict[str, _Hold] = {}
        self._departing: dict[str, int] = {}  # "<pod key>@<uid>" -> when its booking ends (ns)
        self._node_departing: dict[str, tuple[DepartingPod, ...]] = {}  # node -> its inventory's report
        # pod key -> the UID a bind booked under it that the watch has not shown yet (otherwise the UID
        # booked under a key is that of the pod object in :attr:`pods`)
        self._ahead: dict[str, str] = {}
        self._forgotten: dict[str, int] = {}
        self.holds = holds.Holds(int(config.extender.hold_timeout_seconds * 1e9), started_ns=clock())
        self.unaccounted: dict[str, str] = {}  # pod -> why its assignment could not be recorded
        self.untrusted: dict[str, str] = {}  # pod -> why its annotations are not believed (not our writer)
        self.untrusted_events: dict[str, int] = {}  # by state: pod events whose annotations were not believed
        self._untrusted_held: set[str] = set()  # pods whose only holding is an untrusted allocated report
        self._host: dict[str, tuple[int, int] | None] = {}  # node -> allocatable (CPU milli, memory MiB)
        self.other_unit: dict[str, int] = {}  # node -> its gpu-memory unit, where it is not ours
        # Pods that ask no GPU but are bound to a node: their CPU and memory, by node (kept while the
        # node is away, so they are charged again when it returns), and the node of each.
        self._host_pods: dict[str, dict[str, cluster.HostDemand]] = {}
        self._host_node: dict[str, str] = {}
        self.models: dict[str, tuple] = {}  # node -> resident models it reports (issue 23), merged
        self._model_reports: dict[str, dict[str, tuple[str, tuple]]] = {}  # node -> key -> (text, models)
        # Every pod read once per resourceVersion: the watch's events and the verbs share the reading.
        self.pods_read = parsed.PodReader(self.names, config.memory_unit_mib)
        self.follows = held_pick.FollowMemo()  # filter's held-plan answers (extender.held_pick)
        self.last_verb = 0.0  # time.monotonic() of the last filter/prioritize/bind: the warmer waits for a lull

    def view(self, policy: Policy) -> verbs.View:
        return verbs.View(self.state, self.slots, self.names, self.config.memory_unit_mib, policy,
                          self.holds if len(self.holds) else None, self.clock(), self.models,
                          self.config.warm_tier.residency_max_steps, frozenset(self.holds.silent),
                          self.pods_read, self.holds.timeout_ns, self.follows,
                          dict(self.other_unit) if self.other_unit else {})

    def commit(self, expected: verbs.Expectation | None) -> None:
        """The one place a filter or prioritize answer changes state: the expected bind it implies
        (:func:`extender.verbs.expectation`) is held (:meth:`expect_bind`)."""
        if expected is not None:
            self.expect_bind(expected.pod, expected.node, expected.signature)

    # -- nodes ----------------------------------------------------------------------------
    def apply_node(self, event: str, node: Obj) -> None:
        name = (node.get("metadata") or {}).get("name", "")
        with self.lock:
            if event == "DELETED":
                self._drop_node(name)
                self._forget_models(name)
                return
            self._set_models(name, node)
            text = ((node.get("metadata") or {}).get("annotations") or {}).get(self.names.inventory)
            try:
                host = translate.node_host(node)
            except translate.TranslateError as exc:
                log.error("bad allocatable, keeping last good", node=name, error=str(exc))
                host = self._host.get(name)
            if text is not None and text == self._annotation.get(name) and host == self._host.get(name):
                return  # a heartbeat: nothing we read changed
            try:
                inv = translate.node_inventory(node, self.names)
                if inv is None:
                    self._drop_node(name)
                    return
                slots = translate.slots_from_inventory(inv)
                self.state.set_node(name, slots)  # all or nothing
            except (ValueError, TypeError, OverflowError) as exc:  # e.g. units 1e30, one GPU uuid twice
                log.error("bad inventory, keeping last good", node=name, error=f"{type(exc).__name__}: {exc}")
                return
            new = name not in self.slots
            for s in self.slots.get(name, ()):
                self._node_of_uuid.pop(s.uuid, None)
            self.slots[name] = slots
            self._set_host(name, host)
            if new:
                for key, need in self._host_pods.get(name, {}).items():
                    self.state.add_pod(key, name, (), need, strict_host=False)
            self._annotation[name] = text or ""
            self._set_unit(name, inv.unit_mib)
            self._node_of_uuid.update((s.uuid, name) for s in slots)
            log.info("node inventory", node=name, gpus=len(slots), capacity_mib=sum(s.capacity for s in slots))
            for key in list(self.unaccounted):  # pods that named a node or GPU we did not know yet
                if key in self.pods:
                    self._account(key, self.pods[key])
            self._node_departing[name] = inv.departing
            self._book_reported(name)

    def _set_unit(self, name: str, unit_mib: int) -> None:
        """A node whose device plugin counts gpu-memory in another unit than ours (one of the two not
        restarted since ``memoryUnitMiB`` changed) gives an ask of n units another size there: filter
        keeps gpu-memory pods off it (:func:`extender.verbs.filter_pod`) until the two agree."""
        if unit_mib == self.config.memory_unit_mib:
            if self.other_unit.pop(name, None) is not None:
                log.info("node counts in our memory unit again", node=name, unit_mib=unit_mib)
        elif self.other_unit.get(name) != unit_mib:
            self.other_unit[name] = unit_mib
            log.warning("node counts gpu-memory in another unit: no gpu-memory pod is placed there until the "
                        "device plugin and the extender run with the same memoryUnitMiB", node=name,
                        node_unit_mib=unit_mib, extender_unit_mib=self.config.memory_unit_mib)

    def _set_models(self, name: str, node: Obj) -> None:
        """The node's resident models (issue 23): its inventory's ``models`` (device plugin) and its
        ``resident-models`` annotation (DRA plugin; a node with no inventory may have it), merged. A report
        that cannot be read keeps its last reading, logged; it is a hint and never drops the node."""
        old = self._model_reports.get(name, {})
        new: dict[str, tuple[str, tuple]] = {}
        for key, text in translate.model_reports(node, self.names).items():
            if key in old and old[key][0] == text:
                new[key] = old[key]
                continue
            try:
                new[key] = (text, translate.reported_models(key, text, self.names))
            except contract.ContractError as exc:
                if key != self.names.inventory:  # a bad inventory is logged below, with its GPUs
                    log.warning("resident models unreadable, keeping the last", node=name, annotation=key,
                                error=str(exc))
                new[key] = (text, old[key][1] if key in old else ())
        if new:
            self._model_reports[name] = new
        else:
            self._model_reports.pop(name, None)
        models = inventory.merge_models(*(m for _, m in new.values()))
        if models:  # only nodes that report one: prioritize looks these up, never every node
            self.models[name] = models
        else:
            self.models.pop(name, None)

    def _forget_models(self, name: str) -> None:
        self._model_reports.pop(name, None)
        self.models.pop(name, None)

    def _set_host(self, name: str, host: tuple[int, int] | None) -> None:
        self._host[name] = host
        if host is None:
            self.state.untrack_host(name)
        else:
            self.state.set_host(name, *host)
            log.debug("node host", node=name, cpu_milli=host[0], memory_mib=host[1])

    def _drop_node(self, name: str) -> None:
        if name not in self.slots:
            return
        for s in self.slots.pop(name):
            self._node_of_uuid.pop(s.uuid, None)
        self._annotation.pop(name, None)
        self._host.pop(name, None)
        self.other_unit.pop(name, None)
        for key in self._host_pods.get(name, {}):
            self.state.remove_pod(key)
        self.state.remove_node(name)
        for key in [k for k, h in self._held.items() if h.node == name]:
            self._release(key)
        for ghost in [g for g in self._departing if self.state.pod_node(g) in (name, None)]:
            del self._departing[ghost]
            self.state.remove_pod(ghost)
        self._node_departing.pop(name, None)
        log.info("node gone", node=name)

    def replace_nodes(self, items: Iterable[Obj]) -> None:
        """A fresh node list (start-up or resync): apply all, forget the ones no longer there."""
        with self.lock:
            seen = set()
            for node in items:
                seen.add((node.get("metadata") or {}).get("name", ""))
                self._safely(self.apply_node, node)
            for name in [n for n in self.slots if n not in seen]:
                self._drop_node(name)
            for name in [n for n in self._model_reports if n not in seen]:
                self._forget_models(name)

    # -- pods -----------------------------------------------------------------------------
    def apply_pod(self, event: str, pod: Obj) -> None:
        key = pod_key(pod)
        uid = str((pod.get("metadata") or {}).get("uid") or "")
        with self.lock:
            phase = (pod.get("status") or {}).get("phase")
            ended = event == "DELETED" or phase in TERMINAL_PHASES
            if (ahead := self._ahead.get(key)) and uid and uid != ahead:
                self._predecessor(key, uid, pod, ended)
                return
            self._ahead.pop(key, None)  # the watch shows the pod a bind booked: it has caught up
            if ended:
                self.pods_read.forget(pod)
                self._stopped(key, uid, pod)  # kept by a successor's bind that then failed
                if event == "DELETED" and may_still_run(pod):
                    self._keep_departing(key, pod)
                if self.pods.pop(key, None) is not None or key in self._held:
                    log.info("pod freed", pod=key, reason="deleted" if event == "DELETED" else phase)
                self._release(key)
                self._drop_host_pod(key)
                self._forgotten.pop(key, None)
                self.unaccounted.pop(key, None)
                self.untrusted.pop(key, None)
                return
            if not self.pods_read.read(pod).wants_gpu:
                self._account_host_pod(key, pod)
                return
            if key not in self.pods:
                self._observe(key, pod)
            pod = self.pods[key] = _keep_node_name(self.pods.get(key), pod)
            self._account(key, pod)

    def _predecessor(self, key: str, uid: str, pod: Obj, ended: bool) -> None:
        """An event of an earlier pod of this name, delivered after a bind booked its successor: the
        watch is ordered (the API cannot create the successor before the predecessor is gone), so only
        the binder runs ahead of it. It books nothing; a departing predecessor (:meth:`_supersede`)
        is freed once its deletion shows its containers stopped, else at the end of its grace."""
        self.pods_read.forget(pod)
        if ended:
            self._stopped(key, uid, pod)
        log.info("event of a replaced pod ignored", pod=key, uid=uid, successor=self._ahead.get(key))

    def _stopped(self, key: str, uid: str, pod: Obj) -> None:
        """The end of a pod kept as departing (:meth:`_supersede`) frees it once it shows its containers
        stopped."""
        ghost = ghost_key(key, uid)
        if ghost in self._departing and not may_still_run(pod):
            del self._departing[ghost]
            self.state.remove_pod(ghost)

    def _observe(self, key: str, pod: Obj) -> None:
        """Feed FGD's target workload; a size no GPU of the cluster has is no workload to plan for (a
        flood of absurd requests must not steer every other pod's placement)."""
        read = self.pods_read.read(pod)
        if read.want is None:
            return
        cap = self.state.capacity
        biggest = int(cap.max()) if cap.size else 0
        demands = [d for d in read.demands if d.per_gpu <= biggest]
        if demands:
            self.state.observe(demands, self._pod_host(key, pod))

    def _pod_host(self, key: str, pod: Obj) -> cluster.HostDemand:
        read = self.pods_read.read(pod)
        if read.host is None:  # the API server refuses such pods: count nothing
            log.error("bad CPU/memory request ignored", pod=key, error=read.host_error)
            return cluster.HostDemand()
        return read.host

    def _account_host_pod(self, key: str, pod: Obj) -> None:
        """A pod that asks no GPU uses the CPU and memory of the node it is bound to."""
        node = (pod.get("spec") or {}).get("nodeName") or ""
        if not node:
            return
        need = self._pod_host(key, pod)
        if self._host_node.get(key) == node and self._host_pods[node].get(key) == need:
            return
        self._drop_host_pod(key)
        self._host_node[key] = node
        self._host_pods.setdefault(node, {})[key] = need
        if node in self.slots:
            self.state.add_pod(key, node, (), need, strict_host=False)

    def _drop_host_pod(self, key: str) -> None:
        node = self._host_node.pop(key, None)
        if node is None:
            return
        self._host_pods[node].pop(key, None)
        if not self._host_pods[node]:
            del self._host_pods[node]
        self.state.remove_pod(key)

    def _account(self, key: str, pod: Obj) -> None:
        try:
            asg = translate.decode_assignment(pod, self.names)
        except translate.TranslateError as exc:
            log.error("bad assignment ignored", pod=key, error=str(exc))
            return
        if asg is None:
            self.untrusted.pop(key, None)
            return
        node_name = (pod.get("spec") or {}).get("nodeName") or ""
        raw = asg.assume_time_ns
        allocated = asg.state == contract.STATE_ALLOCATED and bool(node_name)
        distrust = self._distrust(pod, allocated)
        if distrust is not None:
            self._untrusted(key, pod, asg, node_name, allocated, distrust)
            return
        self.untrusted.pop(key, None)
        if key in self._untrusted_held:  # a believed event replaces what an untrusted one booked
            self._untrusted_held.discard(key)
            self._release(key)
        held = self._held.get(key)
        if not allocated:
            if self._forgotten.get(key) == raw:
                return
            if held is not None and (held.allocated or held.stamp > raw):
                return  # a bind in flight, or the device plugin's report, is newer than this event
        now = self.clock()
        assume = held.assume_ns if held is not None and held.stamp == raw else min(raw, now)
        if raw > now and (held is None or held.stamp != raw):
            log.warning("assume-time in the future, counted from now", pod=key, assume_time_ns=raw)
        allocations = asg.allocations(pod)
        if not node_name:
            if self._expired(assume):
                self._release(key)
                self._forgotten[key] = raw
                return
            node_name = next((self._node_of_uuid[u] for u, _ in allocations if u in self._node_of_uuid), "")
        try:
            self.state.add_pod(key, node_name, allocations, self._pod_host(key, pod), strict_host=False,
                               force=allocated, beside_foreign=False)
        except cluster.OverCommit as exc:
            self.unaccounted[key] = str(exc)
            log.error("assignment not accounted", pod=key, node=node_name or "?", error=str(exc))
            return
        if allocated and self._over(node_name):
            log.warning("device plugin reports a GPU over capacity", pod=key, node=node_name)
        self.unaccounted.pop(key, None)
        self._held[key] = _Hold(node_name, assume, held.since_ns if held else now, raw, allocated)
        if allocated:
            self.holds.release(key)
            if held is None or not held.allocated:  # a new report: the node's plugin is alive
                self.holds.reported(node_name, now)
        else:
            self._hold(key, node_name, pod, asg, assume)

    def _distrust(self, pod: Obj, allocated: bool) -> str | None:
        """Why the pod's assignment annotations are not vramshare's own writing, or None (believed)."""
        n = self.names
        owners = managed.annotation_owners(pod, (n.assignment, n.assume_time, n.allocation_state))
        ext, plugin = contract.FIELD_MANAGER_EXTENDER, contract.FIELD_MANAGER_DEVICE_PLUGIN
        if allocated:
            need = {n.allocation_state: {plugin}, n.assignment: {plugin, ext}}
        else:
            need = {n.assignment: {ext}, n.assume_time: {ext}, n.allocation_state: {ext}}
        annotations = (pod.get("metadata") or {}).get("annotations") or {}
        for key, allowed in need.items():
            if key not in annotations and key != n.assignment:
                continue  # an absent state or time (an older writer) is judged by the others
            if not owners[key] & allowed:
                who = ",".join(sorted(owners[key])) or "no recorded manager"
                return f"{key} written by {who}, not {' or '.join(sorted(allowed))}"
        return None

    def _untrusted(self, key: str, pod: Obj, asg: translate.Assignment, node: str, allocated: bool,
                   why: str) -> None:
        """Not our writer: hold nothing; an ``allocated`` bound pod counts only what fits and what it asked."""
        state = contract.STATE_ALLOCATED if allocated else (asg.state or contract.STATE_ASSUMED)
        self.untrusted_events[state] = self.untrusted_events.get(state, 0) + 1
        if self.untrusted.get(key) != why:
            log.warning("assignment not believed: not written by vramshare", pod=key, state=state, reason=why)
        self.untrusted[key] = why
        held = self._held.get(key)
        if held is not None and key not in self._untrusted_held:
            return  # what we believed earlier (our reservation, the plugin's report) stands: an untrusted
            # report must not move the pod's memory to another GPU and leave the real one looking free
        if not allocated:
            return  # an untrusted assumption holds nothing (our own reservation, if any, stays)
        allocations = asg.allocations(pod)
        try:
            asked = sum(a.demand.per_gpu * a.demand.count for a in
                        translate.pod_asks(pod, self.names, self.config.memory_unit_mib))
        except podspec.PodSpecError:
            asked = 0
        if sum(m for _, m in allocations) > asked:
            log.warning("untrusted assignment claims more than the pod asks; not counted", pod=key,
                        claimed_mib=sum(m for _, m in allocations), asked_mib=asked)
            return
        try:
            self.state.add_pod(key, node, allocations, self._pod_host(key, pod), strict_host=False,
                               beside_foreign=False)
        except cluster.OverCommit as exc:
            self.unaccounted[key] = str(exc)
            log.warning("untrusted assignment not counted", pod=key, node=node, error=str(exc))
            return
        self._held[key] = _Hold(node, self.clock(), self.clock(), asg.assume_time_ns, False)
        self._untrusted_held.add(key)

    def _hold(self, key: str, node: str, pod: Obj, asg: translate.Assignment, assume_ns: int) -> None:
        """The pod's size signature is held on the node with the plans its assignment names."""
        read = self.pods_read.read(pod)
        if read.want is None or read.signature is None:
            return
        self.holds.hold(key, node, read.signature, assume_ns, holds.plans_of(read.want, self.names, asg.containers))

    def _over(self, node: str) -> bool:
        return any(u.used > u.slot.capacity for u in self.state.node_usage(node))

    def _expired(self, assume_ns: int) -> bool:
        return self.clock() - assume_ns > self.config.extender.assume_timeout_seconds * 1e9

    def _keep_departing(self, key: str, pod: Obj) -> None:
        """A deleted pod whose containers may still run (:func:`may_still_run`): book its GPUs under its
        own key until its grace has passed (see the module's rules). What the books hold for it: the
        device plugin's report, or the plan while that report has not come (the kubelet may have taken
        the planned devices already)."""
        hold = self._held.get(key)
        if hold is None:
            return
        here = {u.slot.uuid for u in self.state.node_usage(hold.node)}  # a GPU gone from the node's
        allocations = tuple((g, mib) for g, mib in self.state.pod_allocations(key) if g in here)  # inventory
        if not allocations:  # holds nothing now
            return
        uid = (pod.get("metadata") or {}).get("uid") or "?"
        ghost = ghost_key(key, uid)
        reported = [d.until_s * 1_000_000_000 for d in self._node_departing.get(hold.node, ()) if d.ghost == ghost]
        until = max([self.clock() + booked_seconds(pod) * 1_000_000_000, *reported])  # the node's end, where later
        if ghost in self._departing:  # the node's report came first: it is booked, the caller frees ``key``
            self._departing[ghost] = max(self._departing[ghost], until)
            return
        host = self.state.pod_host(key) or cluster.HostDemand()
        self.state.remove_pod(key)
        self.state.add_pod(ghost, hold.node, allocations, host, strict_host=False, force=True)
        self._departing[ghost] = until
        log.warning("pod deleted while its containers may still run; its GPUs stay booked",
                    pod=key, uid=uid, node=hold.node, mib=sum(a for _, a in allocations),
                    seconds=(until - self.clock()) // 1_000_000_000)

    def _book_reported(self, node: str) -> None:
        """The node's report of its deleted pods that may still run (:class:`vramshare.departing.Departures`):
        each not booked yet is booked under its own key until the end the node gave. That is the only
        record an extender restarted inside the grace has of them. A pod the watch still shows live under
        that UID stays booked as itself (its deletion, once delivered, keeps it by the rule above); a
        report that ended, or of GPUs the node no longer has, books nothing. A pod booked by our own rule
        keeps its booking until the node's end where that is later: the node saw the deletion later than
        we did, and an extender restarted after our end and before the node's would book it again on GPUs
        we had planned meanwhile (the soak found a GPU over capacity in the books so)."""
        now = self.clock()
        here = {u.slot.uuid for u in self.state.node_usage(node)}
        for d in self._node_departing.get(node, ()):
            until = d.until_s * 1_000_000_000
            live = self.pods.get(d.pod)
            if d.ghost in self._departing:  # booked by our own rule: it ends at the later of the two ends (a
                self._departing[d.ghost] = max(self._departing[d.ghost], until)  # restart would book the node's)
                continue
            if until <= now or (live is not None and (live.get("metadata") or {}).get("uid") == d.uid):
                continue
            allocations = tuple((g, mib) for g, mib in d.gpus if g in here)
            if not allocations:
                continue
            self.state.add_pod(d.ghost, node, allocations, cluster.HostDemand(), strict_host=False, force=True)
            self._departing[d.ghost] = until
            log.warning("node reports a deleted pod whose containers may still run; its GPUs stay booked",
                        pod=d.pod, uid=d.uid, node=node, mib=sum(a for _, a in allocations),
                        seconds=(until - now) // 1_000_000_000)

    def _release(self, key: str) -> None:
        self._held.pop(key, None)
        self._ahead.pop(key, None)
        self._untrusted_held.discard(key)
        self.holds.release(key)
        self.state.remove_pod(key)

    def replace_pods(self, items: Iterable[Obj], started_ns: int) -> None:
        """A fresh pod list: apply all; drop pods that vanished, except holds taken after the list began."""
        with self.lock:
            seen = set()
            for pod in items:
                seen.add(pod_key(pod))
                self._safely(self.apply_pod, pod)
            for key in [k for k in self.pods if k not in seen]:
                self.pods.pop(key)
            for key in [k for k in self._host_node if k not in seen]:
                self._drop_host_pod(key)
            for key, hold in list(self._held.items()):
                if key not in seen and hold.since_ns <= started_ns:
                    log.info("pod freed", pod=key, reason="gone at resync")
                    self._release(key)
            for node in list(self._node_departing):  # a pod deleted while the watch was away
                self._book_reported(node)

    @staticmethod
    def _safely(apply: Callable[[str, Obj], None], obj: Obj) -> None:
        """One unreadable object in a list must not cost the others."""
        try:
            apply("ADDED", obj)
        except Exception:  # noqa: BLE001
            log.error("object not applied", name=(obj.get("metadata") or {}).get("name", "?"), exc_info=True)

    def expire(self) -> list[str]:
        """Free assumed pods that never bound within ``assume_timeout_seconds``; returns their keys."""
        gone = []
        with self.lock:
            for key, hold in list(self._held.items()):
                pod = self.pods.get(key)
                bound = pod is not None and (pod.get("spec") or {}).get("nodeName")
                if not bound and not hold.allocated and self._expired(hold.assume_ns):
                    self._release(key)
                    self._forgotten[key] = hold.stamp
                    gone.append(key)
                    log.warning("assumed pod expired", pod=key, node=hold.node,
                                timeout_s=self.config.extender.assume_timeout_seconds)
            now = self.clock()
            for ghost, until in list(self._departing.items()):
                if now >= until:
                    del self._departing[ghost]
                    self.state.remove_pod(ghost)
                    log.info("departing pod's GPUs freed", pod=ghost)
            for key in self.holds.expire(self.clock()):
                log.info("hold ended by timeout", pod=key,
                         timeout_s=self.config.extender.hold_timeout_seconds)
        return gone

    # -- the warmer ---------------------------------------------------------------------
    def warm_step(self, max_rows: int = 512) -> bool:
        """One short step of precomputing placement tables under the lock; ``True`` while more remain."""
        with self.lock:
            return placement.warm(self.state, self.config.extender.policy.value, max_rows)

    def warm_loop(self, stop: threading.Event, idle_s: float = 0.05) -> None:
        """Keep the placement tables of every expected request shape current, between requests: each
        step holds the lock for about a millisecond at 5,000 nodes, so filter never waits long. While
        kube-scheduler's cycles keep coming (a verb within :data:`WARM_QUIET_S`) the warmer waits:
        with binds changing the books every cycle it would recompute every expected shape's rows
        that the requests compute for their own shape anyway, and take the lock and the GIL from them
        (bench_extender, real mix: ~40% of the server's CPU per cycle)."""
        while not stop.is_set():
            quiet = self.last_verb + WARM_QUIET_S - time.monotonic()
            if quiet > 0:
                stop.wait(quiet)
                continue
            try:
                more = self.warm_step()
            except Exception:  # noqa: BLE001 - a warmer that dies only costs speed: say so, keep going
                log.error("warm step failed", exc_info=True)
                more = False
            stop.wait(0.0005 if more else idle_s)

    # -- the binder's reservations --------------------------------------------------------
    def reserve(self, key: str, node: str, allocations: list[tuple[str, int]], assume_ns: int,
                signature: translate.Signature = frozenset(), plans: holds.Plans | None = None,
                host: cluster.HostDemand = cluster.HostDemand(), uid: str = "") -> None:
        """Hold memory (and the pod's CPU and memory) for a bind in flight; raises ``cluster.OverCommit``
        (caller holds :attr:`lock`). The pod also holds its size ``signature`` on the node, planned as
        ``plans`` (:func:`holds.plans_of`), until it is reported allocated. ``uid``: the pod's, as the
        binder read it; when the books hold an earlier pod of that name, :meth:`_supersede` first."""
        with self.lock:
            cached = ((self.pods.get(key) or {}).get("metadata") or {}).get("uid")
            if uid and self._ahead.get(key, cached or uid) != uid:
                self._supersede(key)
                cached = None
            self.state.add_pod(key, node, allocations, host)
            self._held[key] = _Hold(node, assume_ns, self.clock(), assume_ns)
            self._forgotten.pop(key, None)
            self.holds.hold(key, node, signature, assume_ns, plans)
            if uid and cached != uid:
                self._ahead[key] = uid

    def _supersede(self, key: str) -> None:
        """A bind of a new pod under ``key`` while the books hold an earlier one of that name (recreated,
        its deletion not delivered yet). Until that deletion says whether its containers stopped (a
        graceful deletion) or may still run (a forced one), an earlier pod the device plugin reported
        allocated, or one bound whose containers may run (:func:`may_still_run`), keeps its GPUs under a
        key of its own for its grace (:meth:`_keep_departing`); an assumption the watch shows unbound holds
        nothing. Its late events then book nothing (:meth:`_predecessor`)."""
        earlier = self.pods.pop(key, None)
        if earlier is not None:
            hold = self._held.get(key)
            if hold is not None and (hold.allocated or may_still_run(earlier)):
                self._keep_departing(key, earlier)
            self.pods_read.forget(earlier)
        self._release(key)
        self.unaccounted.pop(key, None)
        self.untrusted.pop(key, None)
        if self.state.pod_allocations(key):  # a booking left without a pod object: it goes too
            self.state.remove_pod(key)

    def release(self, key: str, assume_ns: int) -> None:
        """Undo a reservation whose bind failed; a later event carrying it will not bring it back."""
        with self.lock:
            hold = self._held.get(key)
            if hold is not None and hold.stamp == assume_ns and not hold.allocated:
                self._release(key)
            self.holds.release_expected(key)
            self._forgotten[key] = assume_ns
            if len(self._forgotten) > _FORGET_LIMIT:
                self._forgotten.pop(next(iter(self._forgotten)))

    def release_unbound(self, key: str) -> None:
        """Drop an earlier assumption for a pod that is being bound again (it never bound)."""
        with self.lock:
            hold = self._held.get(key)
            if hold is not None and not hold.allocated:
                self._release(key)
                self._forgotten[key] = hold.stamp

    def expect_bind(self, key: str, node: str, signature: translate.Signature) -> None:
        """kube-scheduler will most likely bind ``key`` to ``node`` next (see :mod:`extender.holds`)."""
        with self.lock:
            if key not in self._held:
                self.holds.expect(key, node, signature, self.clock())

    def lingering_plans(self, key: str, node: str, signature: translate.Signature) -> dict[holds.Element, holds.Plan]:
        """Per element of ``signature``, the plan the other pods still assumed on ``node`` share whose
        hold has ended (its timeout, or cut short on a silent node, or lost with a restart): the device
        plugin steers by the plans written on pending pods, so a pod of that size that takes the same
        GPUs keeps the steering unambiguous. A preference only, never a reason to wait (that is what
        ending the hold was for); elements where those pods disagree are left out."""
        out: dict[holds.Element, holds.Plan] = {}
        split: set[holds.Element] = set()
        with self.lock:
            others = {k for use in self.state.node_usage(node) for k in use.pods if k != key}
            for other in sorted(others):
                hold, pod = self._held.get(other), self.pods.get(other)
                if hold is None or hold.allocated or hold.node != node or pod is None:
                    continue
                read = self.pods_read.read(pod)
                try:
                    asg = translate.decode_assignment(pod, self.names)
                except translate.TranslateError:
                    continue
                if read.want is None or asg is None:
                    continue
                for element, plan in holds.plans_of(read.want, self.names, asg.containers).items():
                    if element not in signature:
                        continue
                    if plan is None or out.setdefault(element, plan) != plan:
                        split.add(element)
        return {e: p for e, p in out.items() if e not in split}

    def hold_required(self, key: str, node: str, signature: translate.Signature) -> holds.Required:
        """What the bind of ``key`` to ``node`` needs now: wait for a same-size pod assumed there on
        other terms, or take the GPUs held there for its size (see :mod:`extender.holds`; expected
        holds do not count at bind)."""
        with self.lock:
            return self.holds.required(node, key, signature, self.clock(), binding=True)

    def hold_reason(self, h: holds.Hold) -> str:
        return self.holds.reason(h, self.clock())

    def mark_bound(self, key: str, node: str) -> None:
        """The Binding was created: remember the node so expiry never frees it before the watch says so."""
        with self.lock:
            pod = self.pods.get(key)
            if pod is not None:
                self.pods[key] = {**pod, "spec": {**(pod.get("spec") or {}), "nodeName": node}}


def _keep_node_name(known: Obj | None, event: Obj) -> Obj:
    """``event``, keeping the node :meth:`Accounting.mark_bound` wrote on the pod it replaces.

    ``spec.nodeName`` cannot be unset once set, so an event of the same UID without it is older than
    the Binding we created (the watch delivers the assignment patch's event after the bind returned).
    Taking it as-is would let a retried bind of that pod patch it again and expiry free its GPUs."""
    node = ((known or {}).get("spec") or {}).get("nodeName")
    if not node or (event.get("spec") or {}).get("nodeName"):
        return event
    if ((known or {}).get("metadata") or {}).get("uid") != (event.get("metadata") or {}).get("uid"):
        return event
    return {**event, "spec": {**(event.get("spec") or {}), "nodeName": node}}
