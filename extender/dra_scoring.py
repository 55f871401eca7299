"""Prioritize for pods whose ResourceClaims use vramshare's DeviceClasses (the DRA path, 1.36+).

kube-scheduler filters, allocates and binds such pods itself; its DRA allocator has no scorer for
shared devices and takes the first fitting devices of whatever feasible node it ends up on. This
module gives prioritize the same per-GPU view the device-plugin path has, built from:

* this driver's ResourceSlices: one slot per device, in published order (the allocator's device
  order), shared GPUs sized by ``capacity.memory`` plus the ``foreignMiB`` the plugin took off it, which
  is booked as used (:mod:`vramshare.contract.slice_foreign`), exclusive GPUs and MIG instances whole,
  tainted devices unhealthy;
* allocated ResourceClaims: every result's ``consumedCapacity.memory`` charged to its GPU (whole
  devices charged in full), keyed by claim;
* the pod's own, not yet allocated, claims (``status.resourceClaimStatuses``): one Demand per request
  of our classes (memory rounded up to the device's step, ``count`` distinct GPUs).

Scores come from :func:`extender.placement.score_nodes` with the configured policy; ``fgd`` becomes
``dra-fgd``, which scores the GPU the allocator will really take (first fit). A pod that names a model
(``<domain>/model``) gets the residency term of the device plugin's path (issue 23,
:func:`extender.residency.bonus_for`, same bound) from the models the nodes report (a DRA node in its
``resident-models`` annotation), which the extender's node watch keeps. Each DRA node's enforcement
mode (the ``enforcement`` attribute of its shared devices) is read for ``/inspect``
(:meth:`DraCluster.modes`). Pure: objects in, scores out; :class:`DraWatch` keeps the objects current
from the API server.

Dynamic MIG (issue 24): a GPU published as partitionable devices (every MIG profile at every
placement, drawing on the GPU's counter set) is not a row of slots. For a pod asking MIG profiles,
each such node's score is the MIG fragmentation term: the allocator takes the first partition in
published order whose placement still fits (:func:`first_fit_partition`), and the node loses what
that placement costs the GPU in instances still creatable (:func:`vramshare.mig.placement_loss`,
every non-media profile weighted alike, over the empty GPU's potential); the node whose placement
keeps the largest profiles possible scores highest. A pod that names its model gets the residency term
there too, in the same bound (:func:`extender.residency.step_of`: it reorders only nodes within one
step of the MIG term), not lost to the MIG score replacing the policy's.
"""
from __future__ import annotations

import math
import re
import threading
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
from kubernetes import client

from extender import apicalls, cluster, placement, residency
from extender.translate import EXCLUSIVE, SHARED, mig_kind
from vramshare import contract, logs, mig, podspec, quantity
from vramshare.contract import slice_enforcement, slice_foreign
from vramshare.inventory import ResidentModel
from vramshare.retry import Backoff
from vramshare.watch import ListWatch

log = logs.get("vramshare.extender.dra")
Obj = Mapping[str, Any]
MiB = 1024 * 1024
_PROFILE = re.compile(r'\.profile\s*==\s*"([^"]+)"')
DRA_POLICY = {"fgd": "dra-fgd"}


def _mib(value: Any) -> int:
    return -(-quantity.byte_count(value, "capacity") // MiB)


def slots_of_slice(obj: Obj) -> list[cluster.Slot]:
    """The slots one ResourceSlice publishes, in device order (partitions are not slots: see
    :func:`partitions_of_slices`)."""
    out = []
    for pos, d in enumerate((obj.get("spec") or {}).get("devices") or ()):
        if d.get("consumesCounters"):
            continue
        attrs = d.get("attributes") or {}
        value = lambda k, default="": next(iter((attrs.get(k) or {default: default}).values()))  # noqa: E731
        mode = value("mode")
        cap = _mib(((d.get("capacity") or {}).get("memory") or {}).get("value", "0"))
        kind = SHARED if d.get("allowMultipleAllocations") else (
            mig_kind(value("profile")) if mode == "mig" else EXCLUSIVE)
        foreign = slice_foreign.decode(d) if kind == SHARED else 0  # taken off the capacity: booked as used
        healthy = not any(t.get("effect") in ("NoSchedule", "NoExecute") for t in d.get("taints") or ())
        out.append(cluster.Slot(uuid=f"{obj['spec']['pool']['name']}/{d['name']}", model=value("model"), kind=kind,
                                capacity=cap + foreign, healthy=healthy, index=int(value("index", pos) or pos),
                                foreign=foreign))
    return out


@dataclass(frozen=True)
class PartitionGpu:
    """One dynamic-MIG GPU of a node: its MIG table and its partition devices in published order."""

    counter_set: str
    model: mig.MigModel
    devices: tuple[tuple[str, str, int], ...]  # (slot uuid "pool/device", profile, start)


def partitions_of_slices(node_slices: Sequence[Obj]) -> list[PartitionGpu]:
    """The dynamic-MIG GPUs a node's slices (newest generation, in name order) publish."""
    found: dict[str, list[tuple[str, str, int, str, int]]] = {}
    for obj in node_slices:
        pool = (obj.get("spec") or {}).get("pool", {}).get("name", "")
        for d in (obj.get("spec") or {}).get("devices") or ():
            if not d.get("consumesCounters"):
                continue
            attrs = d.get("attributes") or {}
            value = lambda k: next(iter((attrs.get(k) or {"": None}).values()))  # noqa: E731
            if value("profile") is None or value("placementStart") is None:
                continue
            cap = _mib(((d.get("capacity") or {}).get("memory") or {}).get("value", "0"))
            found.setdefault(d["consumesCounters"][0]["counterSet"], []).append(
                (f"{pool}/{d['name']}", str(value("profile")), int(value("placementStart")), str(value("model") or ""),
                 cap))
    out = []
    for name, devs in found.items():
        model = mig.model_for(devs[0][3], max(d[4] for d in devs))
        if model is not None:
            out.append(PartitionGpu(name, model, tuple((u, p, st) for u, p, st, _m, _c in devs if p in model.names)))
    return out


def first_fit_partition(gpus: Sequence[PartitionGpu], layouts: Mapping[str, Sequence[mig.Placed]],
                        profile: str) -> tuple[PartitionGpu, str, int] | None:
    """The partition the allocator takes for ``profile``: the first in published order whose counters
    still fit, i.e. whose placement NVML's rules allow beside what is allocated (allocateOne +
    checkAvailableCounters; the counters encode exactly :func:`vramshare.mig.free_starts`)."""
    for g in gpus:
        layout = list(layouts.get(g.counter_set, ()))
        for uuid, p, start in g.devices:
            if p == profile and start in mig.free_starts(g.model, layout, p):
                return g, uuid, start
    return None


def mig_weights(model: mig.MigModel) -> dict[str, float]:
    """Every profile a plain request may map to counts alike (``+me`` ones hold the media engines)."""
    return {p.name: 1.0 for p in model.profiles if not p.media}


def partition_loss(gpus: Sequence[PartitionGpu], held: Iterable[str], profiles: Sequence[str]) -> float | None:
    """The MIG fragmentation term of one node: what the allocator's placements of ``profiles`` cost its
    GPUs, each GPU's loss a share of its empty potential (0 = nothing lost; None = they do not fit)."""
    taken = set(held)
    layouts = {g.counter_set: [mig.Placed(st, p) for u, p, st in g.devices if u in taken] for g in gpus}
    loss = 0.0
    for profile in profiles:
        pick = first_fit_partition(gpus, layouts, profile)
        if pick is None:
            return None
        g, _uuid, start = pick
        weights = mig_weights(g.model)
        loss += mig.placement_loss(g.model, layouts[g.counter_set], profile, start, weights) / \
            max(mig.potential(g.model, [], weights), 1e-9)
        layouts[g.counter_set].append(mig.Placed(start, profile))
    return loss


def claim_usage(claim: Obj, driver: str, capacity: Mapping[str, int]) -> list[tuple[str, int]]:
    """``[(slot uuid, MiB)]`` an allocated claim holds of this driver's devices."""
    alloc = (claim.get("status") or {}).get("allocation") or {}
    out = []
    for r in (alloc.get("devices") or {}).get("results") or ():
        if r.get("driver") != driver:
            continue
        uuid = f"{r['pool']}/{r['device']}"
        mem = (r.get("consumedCapacity") or {}).get("memory")
        out.append((uuid, _mib(mem) if mem is not None else capacity.get(uuid, 0)))
    return out


def claim_demands(claim: Obj, names: contract.Names, unit_mib: int) -> list[cluster.Demand]:
    """What an unallocated claim asks of our classes; requests of other classes are not ours to score."""
    out = []
    for req in ((claim.get("spec") or {}).get("devices") or {}).get("requests") or ():
        ex = req.get("exactly") or {}
        cls, count = ex.get("deviceClassName"), int(ex.get("count", 1))
        if cls == names.device_class("gpu-memory"):
            mem = ((ex.get("capacity") or {}).get("requests") or {}).get("memory")
            mib = _mib(mem) if mem is not None else unit_mib
            out.append(cluster.Demand(per_gpu=math.ceil(mib / unit_mib) * unit_mib, count=count, kind=SHARED))
        elif cls == names.device_class("gpu"):
            out.append(cluster.Demand(per_gpu=0, count=count, kind=EXCLUSIVE))
        elif cls == names.device_class("mig"):
            profiles = {p for s in ex.get("selectors") or () for p in _PROFILE.findall(s["cel"]["expression"])}
            if len(profiles) == 1:
                out.append(cluster.Demand(per_gpu=0, count=count, kind=mig_kind(profiles.pop())))
    return out


class DraCluster:
    """Slices and claims by key; the ClusterState over them is rebuilt when either changed."""

    def __init__(self, names: contract.Names, unit_mib: int) -> None:
        self.names, self.unit_mib = names, unit_mib
        self.slices: dict[str, Obj] = {}
        self.claims: dict[str, Obj] = {}  # "ns/name"
        self._lock = threading.RLock()  # puts (watch threads) and scoring (HTTP threads)
        self._state: cluster.ClusterState | None = None
        self._partitions: dict[str, list[PartitionGpu]] = {}  # node -> dynamic-MIG GPUs, of the state built
        self._capacity: dict[str, int] = {}  # slot uuid -> MiB, of the state built
        self._unaccounted: set[str] = set()  # claims the built state could not hold (transient views)

    def replace(self, kind: str, objs: Iterable[Obj]) -> None:
        """A fresh list of ``kind``: it is the whole truth, so whatever it lacks (deleted while the watch
        was down) goes, and the state is rebuilt on the next score."""
        table: dict[str, Obj] = {}
        for obj in objs:
            meta = obj.get("metadata") or {}
            if kind == "ResourceSlice":
                if (obj.get("spec") or {}).get("driver") == self.names.dra_driver:
                    table[meta["name"]] = obj
            else:
                table[f"{meta.get('namespace')}/{meta['name']}"] = obj
        with self._lock:
            if kind == "ResourceSlice":
                self.slices = table
            else:
                self.claims = table
            self._state = None

    def put(self, kind: str, obj: Obj, deleted: bool = False) -> None:
        """A watched object changed. A claim is applied to the built state in place (claims churn
        with every pod); a slice invalidates it (slices change with health and config only)."""
        meta = obj.get("metadata") or {}
        if kind == "ResourceSlice":
            if (obj.get("spec") or {}).get("driver") != self.names.dra_driver:
                return
            table, key = self.slices, meta["name"]
        else:
            table, key = self.claims, f"{meta.get('namespace')}/{meta['name']}"
        with self._lock:
            if deleted:
                table.pop(key, None)
            else:
                table[key] = obj
            if kind == "ResourceSlice" or self._unaccounted:
                self._state = None  # rebuilt on the next score (a refused claim may fit now)
            elif self._state is not None:
                self._state.remove_pod(key)
                if not self._charge(self._state, key, None if deleted else obj):
                    self._state = None

    def _charge(self, st: cluster.ClusterState, key: str, claim: Obj | None) -> bool:
        """Charge a claim's holdings; False (and remembered) when the view cannot hold them."""
        self._unaccounted.discard(key)
        if claim is None:
            return True
        usage = [(u, m) for u, m in claim_usage(claim, self.names.dra_driver, self._capacity) if u in self._capacity]
        if usage:
            try:
                # pool name = node name; an allocation is a decision made: recorded beside foreign memory
                st.add_pod(key, usage[0][0].split("/", 1)[0], usage, beside_foreign=False)
            except Exception as exc:  # noqa: BLE001 - a stale view must not break scoring of others
                log.warning("claim not accounted", claim=key, error=str(exc))
                self._unaccounted.add(key)
                return False
        return True

    def state(self) -> cluster.ClusterState:
        """The per-GPU state; built from every slice and claim when a slice changed."""
        with self._lock:
            if self._state is not None:
                return self._state
            per_node: dict[str, list[tuple[str, Obj]]] = {}
            for s in self.slices.values():  # newest generation of each pool only, as the allocator reads
                per_node.setdefault(s["spec"].get("nodeName", ""), []).append((s["metadata"]["name"], s))
            st = cluster.ClusterState()
            self._capacity, self._unaccounted, self._partitions = {}, set(), {}
            for node, members in per_node.items():
                newest = max(int(s["spec"]["pool"].get("generation", 0)) for _, s in members)
                current = [s for _, s in sorted(members) if int(s["spec"]["pool"].get("generation", 0)) == newest]
                slots = [slot for s in current for slot in slots_of_slice(s)]
                st.set_node(node, slots)
                self._partitions[node] = partitions_of_slices(current)
                self._capacity.update({s.uuid: s.capacity for s in slots})
            for key, c in self.claims.items():
                self._charge(st, key, c)
            self._state = st
            return st

    def modes(self) -> dict[str, slice_enforcement.DraNodeMode]:
        """Node -> the enforcement mode its DRA plugin publishes on its shared devices (newest generation
        of its pool; "not published" for an older plugin), for ``/inspect``."""
        with self._lock:
            current = list(self.slices.values())
        return slice_enforcement.node_modes(current, self.names.dra_driver)

    def demands(self, pod: Obj) -> list[cluster.Demand]:
        ns = (pod.get("metadata") or {}).get("namespace")
        out: list[cluster.Demand] = []
        for name in podspec.claim_names(pod):
            claim = self.claims.get(f"{ns}/{name}")
            if claim is not None and not (claim.get("status") or {}).get("allocation"):
                out += claim_demands(claim, self.names, self.unit_mib)
        return out

    def handles(self, pod: Obj) -> bool:
        """Does the pod have an unallocated claim of our DeviceClasses (what this module scores)?"""
        return bool(self.demands(pod))

    def score(self, pod: Obj, node_names: Sequence[str], policy: str,
              models: Mapping[str, Sequence[ResidentModel]] | None = None,
              residency_max_steps: float = residency.ResidencyConfig.max_steps) -> list[tuple[str, int]]:
        """0..10 per name; ``models`` (node -> the models it reports, the extender's ``Accounting.models``)
        adds the residency term for a pod that names a model, as on the device plugin's path."""
        with self._lock:
            demands = self.demands(pod)
            if not demands:
                return [(n, 0) for n in node_names]
            bonus = self._residency(pod, node_names, models or {}, residency_max_steps)
            scores = placement.score_nodes(self.state(), demands, node_names, DRA_POLICY.get(policy, policy),
                                           bonus=bonus)
            mig_term = self.mig_scores(demands, node_names, bonus)
            return [(n, mig_term.get(n, s)) for n, s in scores]

    def _residency(self, pod: Obj, node_names: Sequence[str], models: Mapping[str, Sequence[ResidentModel]],
                   max_steps: float) -> Any:
        """Issue 23: the residency bonus (:func:`extender.residency.bonus_for`, the same term and bound as
        the device plugin's path: added to the policy's raw score among the nodes that fit, below one
        step). A ``model`` annotation that does not parse is ignored and logged, never a refusal."""
        meta = pod.get("metadata") or {}
        model, why = podspec.pod_model(meta.get("annotations") or {}, self.names)
        if why:
            log.info("model annotation ignored", pod=f"{meta.get('namespace')}/{meta.get('name')}", reason=why)
        return residency.bonus_for(model, node_names, models, residency.ResidencyConfig(max_steps=max_steps))

    def held_partitions(self) -> set[str]:
        """Slot uuids ("pool/device") of the partitions allocated claims hold."""
        return {f"{r['pool']}/{r['device']}" for c in self.claims.values()
                for r in (((c.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results") or ()
                if r.get("driver") == self.names.dra_driver}

    def mig_scores(self, demands: Sequence[cluster.Demand], node_names: Sequence[str],
                   bonus: np.ndarray | None = None) -> dict[str, int]:
        """0..10 for the nodes with dynamic-MIG GPUs, when the pod asks MIG profiles only: the node
        whose first-fit placements lose least of its GPUs' MIG potential gets 10, one that cannot
        place them 0 (scaled as :func:`extender.placement.score_nodes` scales).

        ``bonus`` (per name, the residency term of :meth:`score`) is added to the fitting nodes' raw
        term (the loss, negated) in its step, :func:`extender.residency.step_of` (a tenth of their
        loss range): the rule and bound of ``placement.score_rows``, so a pod asking a MIG profile also
        prefers the node that holds its model among nodes whose MIG loss is within that step."""
        self.state()
        kinds = {mig_kind(p.name): p.name for g in (x for gs in self._partitions.values() for x in gs)
                 for p in g.model.profiles}
        if not demands or any(d.kind not in kinds for d in demands):
            return {}
        profiles = [kinds[d.kind] for d in demands for _ in range(max(1, d.count))]
        held = self.held_partitions()
        losses = {n: partition_loss(self._partitions[n], held, profiles) for n in node_names
                  if self._partitions.get(n)}
        fit = [n for n, v in losses.items() if v is not None]
        top, low = contract.MAX_EXTENDER_PRIORITY, contract.MIN_EXTENDER_PRIORITY
        out = {n: low for n in losses if losses[n] is None}
        if fit:
            raw = -np.array([losses[n] for n in fit], np.float64)
            if bonus is not None:
                at = {n: i for i, n in enumerate(node_names)}
                add = np.asarray(bonus, np.float64)[[at[n] for n in fit]]
                if add.any():
                    raw = residency.with_bonus(raw, add, residency.step_of(raw))
            lo, hi = float(raw.min()), float(raw.max())
            for n, r in zip(fit, raw.tolist()):  # a fitting node never scores as low as one that does not fit
                scaled = top if hi - lo < 1e-12 else int(round(top - (top - low - 1) * (hi - r) / (hi - lo)))
                # as score_rows: a node below the best never shares the top (rounded up to it, a node a
                # step worse lifted by its bonus to within half a point would tie the best at random)
                out[n] = scaled if r >= hi else min(scaled, top - 1)
        return out


class DraWatch:
    """List+watch of ResourceSlices and ResourceClaims into a :class:`DraCluster` (two threads, each a
    :class:`vramshare.watch.ListWatch` through :class:`extender.apicalls.Kube`: raw JSON, no client
    model classes, whose names differ between client versions).

    A list replaces that kind's whole view, so an object deleted while the watch was down is dropped; a
    watch the server ends resumes from the last resourceVersion without a list; a 410 or a failure
    relists after a jittered backoff (1 s doubling to 60 s). A 403 or 404 before the first list means
    this cluster has no ``resource.k8s.io/v1`` (before 1.34) or no RBAC for it: DRA scoring is off. The
    same answer later (an API server upgrade, an RBAC edit) is an outage like any other: the view is
    kept, the watch retries, and the next list drops whatever was deleted meanwhile."""

    KINDS = (("ResourceSlice", "resourceslices"), ("ResourceClaim", "resourceclaims"))

    def __init__(self, api: client.ApiClient, dra: DraCluster, timeout_s: int = 300,
                 backoff_s: float = 1.0, max_backoff_s: float = 60.0) -> None:
        kube = apicalls.Kube(api)
        self.dra = dra
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.watches: dict[str, ListWatch] = {
            kind: kube.list_watch(plural, on_replace=lambda items, _deleted, kind=kind: dra.replace(kind, items),
                                  on_event=lambda typ, obj, kind=kind: dra.put(kind, obj, deleted=typ == "DELETED"),
                                  on_failure=lambda exc, kind=kind: self._keep_going(kind, exc),
                                  min_watch_timeout_s=timeout_s, backoff=Backoff(backoff_s, max_backoff_s, jitter=1.0))
            for kind, plural in self.KINDS}

    def start(self) -> None:
        for kind, _ in self.KINDS:
            t = threading.Thread(target=self.watches[kind].run, args=(self._stop,), name=f"dra-watch-{kind}",
                                 daemon=True)
            self._threads.append(t)
            t.start()

    def _keep_going(self, kind: str, exc: BaseException) -> bool:
        if (isinstance(exc, apicalls.ApiException) and exc.status in (403, 404)
                and not self.watches[kind].synced.is_set()):
            log.info("DRA scoring off: cannot list", kind=kind, status=exc.status)
            return False
        return True

    def stop(self) -> None:
        self._stop.set()
        for w in self.watches.values():
            w.stop()
        for t in self._threads:
            t.join(timeout=5)


def scores_for(dra: DraCluster | None, pod: Obj, node_names: Iterable[str], policy: str,
               models: Mapping[str, Sequence[ResidentModel]] | None = None,
               residency_max_steps: float = residency.ResidencyConfig.max_steps) -> list[tuple[str, int]] | None:
    """The hook prioritize calls: scores for a DRA pod of ours, ``None`` for every other pod."""
    if dra is None or not dra.handles(pod):
        return None
    return dra.score(pod, list(node_names), policy, models, residency_max_steps)
