"""Reconcile after admission, the pure core: what the kubelet handed out -> the pod annotations it implies.

The kubelet's PodResources ``List`` is the only source that says which pod container holds which
device IDs. From it and this node's pods (the watch-fed cache) :func:`plan` computes, with no I/O:

* for each pod, its *actual* ``assignment`` (the same JSON the extender writes: per container the GPU
  or MIG UUIDs and MiB its device IDs stand for) and ``allocation-state: allocated``, as a patch when
  the pod does not say exactly that already. This also covers pods that bypassed the scheduler: they
  get an assignment from reality, so the extender's books count them;
* the owner of each allocation-keyed quota directory (:func:`deviceplugin.quota_files.allocation_key`
  of the container's IDs), so the quota loop finds ``<pod-uid>/<container>`` and nothing is guessed.

PodResources answers one ``ContainerDevices`` per device ID (and per NUMA node of its topology:
``container_manager.go containerDevicesFromResourceDeviceInstances``), so :func:`group` first puts a
container's entries back together per resource: the allocation key is that of the whole set, exactly
the IDs its Allocate carried.

PodResources names pods, not UIDs (``server_v1.go List``). A pod deleted and recreated under its name
(a StatefulSet) can be listed with the old pod's devices, or twice, while the cache already has the new
UID. So an allocation is never tied to a UID by the name alone (:func:`whose`): the node stamps every
Allocate (:class:`Allocation`, node clock) and remembers the UID each stamp was attributed to. A listed
allocation is the cached pod's when it was attributed to that UID, or attributed to nobody yet and the
pod is not terminating; it is an *earlier* pod's when it was made before this pod was created (allowing
:data:`CLOCK_SKEW_S` between the node and the API server) or attributed to another UID. An earlier
pod's allocation keeps its links (its container may still run and mount its directory) and gives the
new pod nothing; a name listed with two candidate entries waits. An owner that is gone from the API is
overruled only by an allocation made clearly after the new pod was created (it could not be the old
pod's). Pod UIDs and container names are checked (:func:`deviceplugin.quota.writer.safe_component`)
before they name anything under the quota root.

A device the kubelet lists for both an init container and an app container (the kubelet reuses init
devices, ``devicesToReuse`` in its device manager) is counted once, for the app container. A pod whose
containers do not yet hold everything they ask for is mid-admission and waits for the next round, as
does a pod the cache has not seen (no UID or resourceVersion to patch with).
"""
from __future__ import annotations

import calendar
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from deviceplugin.assignment import (AssignedGpu, AssignmentError, PodRef, encode_assignment, parse_all,
                                    requested, resources_of, same_assignment)
from deviceplugin.devices import PluginDevice
from deviceplugin.quota.writer import UnsafePathError, safe_component
from deviceplugin.quota_files import Allocation, allocation_key
from vramshare import contract, managed
from vramshare.podspec import PodSpecError, pod_demand


NOT_CACHED = "not in the pod cache yet"
REFUSED = "nothing is linked or recorded for it"  # a UID or name that would leave the quota root
CLOCK_SKEW_S = 5.0  # how far the node's clock may be behind the API server's (creationTimestamp)


@dataclass(frozen=True)
class Held:
    """One ``ContainerDevices`` of PodResources ``List``: some device IDs of one container and resource.

    ``entry`` is the pod's place in the answer, so two pods listed under one name stay apart."""

    namespace: str
    pod: str
    container: str
    resource: str
    device_ids: tuple[str, ...]
    entry: int = 0


Entry = dict[tuple[str, str], tuple[str, ...]]  # (container, resource) -> sorted device IDs


def group(held: Iterable[Held]) -> dict[tuple[str, str, int], Entry]:
    """(namespace, name, entry) -> (container, resource) -> the union of their device IDs, sorted.

    Undoes upstream's one-entry-per-device-and-NUMA-node answer; a device listed under two NUMA
    nodes counts once."""
    out: dict[tuple[str, str, int], dict[tuple[str, str], set[str]]] = {}
    for h in held:
        if h.device_ids:
            out.setdefault((h.namespace, h.pod, h.entry), {}).setdefault((h.container, h.resource), set()).update(
                h.device_ids)
    return {k: {cr: tuple(sorted(ids)) for cr, ids in v.items()} for k, v in out.items()}


def created_s(meta: Mapping[str, Any]) -> float | None:
    """``metadata.creationTimestamp`` (RFC 3339, whole seconds) as epoch seconds, None when absent."""
    text = str(meta.get("creationTimestamp") or "")
    try:
        return float(calendar.timegm(time.strptime(text[:19], "%Y-%m-%dT%H:%M:%S")))
    except ValueError:
        return None


MINE, THEIRS, UNSURE = "mine", "theirs", "unsure"


def whose(a: Allocation | None, uid: str, created: float | None, terminating: bool, alive: set[str],
          skew_s: float = CLOCK_SKEW_S) -> str:
    """Whether a listed allocation is the cached pod ``uid``'s (:data:`MINE`), an earlier pod's of that
    name (:data:`THEIRS`), or cannot be told yet (:data:`UNSURE`). See the module docstring."""
    if a is None or (a.stamp_ns is None and not a.owner):
        return MINE  # nothing recorded (a directory of an older plugin): the name decides, as before
    if a.owner == uid:
        return MINE
    stamp = a.stamp_ns / 1e9 if a.stamp_ns is not None else None
    if stamp is not None and created is not None and stamp < created - skew_s:
        return THEIRS  # made before this pod existed: a pod deleted and recreated under this name
    if a.owner:
        if (a.owner not in alive and stamp is not None and created is not None
                and stamp > created + 1 + skew_s):
            return MINE  # attributed to a pod the API no longer has, but made after this one was created
        return THEIRS
    return UNSURE if terminating else MINE  # a terminating pod is never admitted again


@dataclass(frozen=True)
class Owner:
    """Who holds an allocation: the pod container the quota loop writes for."""

    uid: str
    namespace: str
    pod: str
    container: str


@dataclass(frozen=True)
class Patch:
    """Set ``assignment`` and ``allocation-state`` on ``pod``, if its resourceVersion is still this one."""

    pod: PodRef
    assignment: str
    state: str = contract.STATE_ALLOCATED


@dataclass(frozen=True)
class Holding:
    """A pod container that holds all its devices, as a round found them (PodResources + the pod cache):
    what the quota loop's tenants are, read in-process instead of back from the annotation (issue 21)."""

    owner: Owner
    gpus: tuple[AssignedGpu, ...]  # the actual GPUs and MiB, as the ``assignment`` patch says them


@dataclass
class Plan:
    patches: list[Patch] = field(default_factory=list)
    owners: dict[str, Owner] = field(default_factory=dict)  # allocation key -> holder
    links: dict[tuple[str, str], str] = field(default_factory=dict)  # (pod uid, container) -> allocation key
    waiting: dict[str, str] = field(default_factory=dict)  # namespace/name -> why not (yet) reconciled
    unlisted: dict[str, dict[str, int]] = field(default_factory=dict)  # pod -> init devices List omits
    in_sync: int = 0  # pods whose annotations already say what they hold
    held_keys: set[str] = field(default_factory=set)  # allocation keys of every listed container
    attributions: dict[str, tuple[str, int | None]] = field(default_factory=dict)  # key -> (uid, stamp) to record
    holdings: list[Holding] = field(default_factory=list)  # containers of pods whose devices are all held


def _share_of(device_id: str, resource: str, devices: Mapping[str, PluginDevice], names: contract.Names,
              unit_mib: int) -> tuple[str, int]:
    dev = devices.get(device_id)
    if dev is not None:
        return (dev.gpu_uuid if resource == names.gpu_memory else dev.id), dev.mib
    if resource == names.gpu_memory:  # a unit of a GPU gone from the inventory: the ID still names it
        uuid, _ = contract.parse_unit_device_id(device_id)
        return uuid, unit_mib
    raise KeyError(device_id)


def _ours(pod: Mapping[str, Any], names: contract.Names) -> bool:
    """Whether vramshare wrote the pod's report (managedFields): the device plugin its state, the device
    plugin or the extender its assignment. An equal value written by anyone else is re-applied, so the
    extender, which believes only our writers (issue 18), counts the pod."""
    owners = managed.annotation_owners(pod, (names.assignment, names.allocation_state))
    return (contract.FIELD_MANAGER_DEVICE_PLUGIN in owners[names.allocation_state]
            and bool(owners[names.assignment] & {contract.FIELD_MANAGER_DEVICE_PLUGIN,
                                                 contract.FIELD_MANAGER_EXTENDER}))


def actual_assignment(pod: Mapping[str, Any], held: Iterable[Held], devices: Mapping[str, PluginDevice],
                      names: contract.Names, unit_mib: int,
                      mig_plans: Mapping[str, tuple[str, int]] | None = None) -> dict[str, tuple[AssignedGpu, ...]]:
    """Per container, the GPUs (or MIG/whole-GPU UUIDs) and MiB its device IDs stand for.

    ``mig_plans``: allocation key -> (placement ID, MiB) of memory units Allocate served as an
    ``isolation: mig`` partition (issue 24); such a container holds that placement, as the extender planned
    it, so the books keep counting the partition and not shared memory of a MIG GPU.

    Raises ``KeyError`` for a MIG or whole-GPU ID this node does not know (its size is unknown) and
    ``ValueError`` for a memory-unit ID that does not parse."""
    spec = pod.get("spec") or {}
    order = [c.get("name") for c in spec.get("containers") or []] + \
            [c.get("name") for c in spec.get("initContainers") or []]
    rank = {name: i for i, name in enumerate(order)}
    seen: set[str] = set()
    out: dict[str, dict[str, int]] = {}
    for h in sorted(held, key=lambda h: (rank.get(h.container, len(rank)), h.container, h.resource)):
        plan = (mig_plans or {}).get(allocation_key(h.device_ids)) if h.resource == names.gpu_memory else None
        if plan is not None and not seen & set(h.device_ids):
            seen.update(h.device_ids)
            out.setdefault(h.container, {})[plan[0]] = plan[1]
            continue
        for device_id in sorted(h.device_ids):
            if device_id in seen:
                continue
            seen.add(device_id)
            uuid, mib = _share_of(device_id, h.resource, devices, names, unit_mib)
            per = out.setdefault(h.container, {})
            per[uuid] = per.get(uuid, 0) + mib
    return {c: tuple(AssignedGpu(u, m) for u, m in gpus.items()) for c, gpus in out.items()}


def _missing(pod: Mapping[str, Any], held: Iterable[Held], names: contract.Names) -> str | None:
    """Why the pod's app containers do not hold all they ask for yet, or None."""
    try:
        demand = pod_demand(pod, names)
    except PodSpecError:
        return None  # unreadable spec: what the kubelet lists is still the truth
    have: dict[tuple[str, str], int] = {}
    for h in held:
        have[(h.container, h.resource)] = have.get((h.container, h.resource), 0) + len(h.device_ids)
    for c in demand.containers:
        for resource in resources_of(c, names):
            need = requested(c, resource, names)
            if have.get((c.container, resource), 0) < need:
                return (f"container {c.container} holds {have.get((c.container, resource), 0)} of {need} "
                        f"{resource} (admission in progress)")
    return None


def unlisted_init_devices(pod: Mapping[str, Any], names: contract.Names) -> dict[str, int]:
    """Devices per resource that non-restartable init containers hold and no app container reuses.

    The kubelet keeps an init container's devices for the pod's life unless later containers reuse
    them, but PodResources ``List`` does not list non-restartable init containers, so these devices
    are invisible to the reconciler (and to the books). Rare (an init container asking for more of a
    resource than the app containers); reported so a person can see it, never guessed."""
    spec = pod.get("spec") or {}
    try:
        inits = pod_demand({**pod, "spec": {**spec, "containers": [
            c for c in spec.get("initContainers") or [] if c.get("restartPolicy") != "Always"]}}, names)
        apps = pod_demand(pod, names)
    except PodSpecError:
        return {}
    out: dict[str, int] = {}
    for c in inits.containers:
        for resource in resources_of(c, names):
            reused = sum(requested(a, resource, names) for a in apps.containers)
            left = requested(c, resource, names) - reused
            if left > 0:
                out[resource] = max(out.get(resource, 0), left)
    return out


def drop_unconfirmed(out: Plan, wrong: Mapping[str, str]) -> None:
    """Take back this round's new attributions to the pod UIDs in ``wrong`` (UID -> why), and their
    links, owners and patches: the API server has another pod (or none) under that name now."""
    for key, (uid, _) in list(out.attributions.items()):
        if uid in wrong:
            del out.attributions[key]
            owner = out.owners.pop(key, None)
            if owner is not None:
                out.waiting[f"{owner.namespace}/{owner.pod}"] = wrong[uid]
    out.links = {k: v for k, v in out.links.items() if k[0] not in wrong}
    out.patches = [p for p in out.patches if p.pod.uid not in wrong]
    out.holdings = [h for h in out.holdings if h.owner.uid not in wrong]


def _keep_earlier(out: Plan, entry: Entry, allocs: Mapping[str, Allocation], ns: str, name: str) -> None:
    """An earlier pod's listed allocations keep the links of the UID they were attributed to: its
    container may still be running (terminating) and mounts that directory."""
    for (container, _), ids in sorted(entry.items()):
        alloc = allocation_key(ids)
        a = allocs.get(alloc)
        if a is None or not a.owner:
            continue
        try:
            safe_component(a.owner, "pod UID")
            safe_component(container, "container name")
        except UnsafePathError:
            continue
        out.owners.setdefault(alloc, Owner(a.owner, ns, name, container))
        out.links.setdefault((a.owner, container), alloc)


def plan(held: Iterable[Held], pods: Iterable[Mapping[str, Any]], devices: Mapping[str, PluginDevice],
         names: contract.Names, node: str, unit_mib: int, allocations: Mapping[str, Allocation] | None = None,
         skew_s: float = CLOCK_SKEW_S) -> Plan:
    """Patches, quota-directory owners and links from PodResources ``held`` and this node's ``pods``.

    ``allocations``: what the node recorded per allocation key (stamps and owners); without it the
    name decides, as PodResources alone would."""
    allocs = allocations or {}
    by_name: dict[tuple[str, str], list[Entry]] = {}
    for (ns, name, _), entry in sorted(group(h for h in held if names.is_ours(h.resource)).items()):
        by_name.setdefault((ns, name), []).append(entry)
    known: dict[tuple[str, str], Mapping[str, Any]] = {}
    alive: set[str] = set()
    for p in pods:
        meta = p.get("metadata") or {}
        alive.add(str(meta.get("uid") or ""))
        if (p.get("spec") or {}).get("nodeName") == node:
            known[(meta.get("namespace", "default"), meta.get("name", ""))] = p
    out = Plan()
    out.held_keys = {allocation_key(ids) for es in by_name.values() for e in es for ids in e.values()}
    for (ns, name), entries in sorted(by_name.items()):
        key = f"{ns}/{name}"
        pod = known.get((ns, name))
        if pod is None:
            out.waiting[key] = NOT_CACHED
            for e in entries:
                _keep_earlier(out, e, allocs, ns, name)
            continue
        meta = pod.get("metadata") or {}
        uid = str(meta.get("uid") or "")
        try:
            safe_component(uid, "pod UID")
        except UnsafePathError as exc:
            out.waiting[key] = f"{exc}: {REFUSED}"
            continue
        created, terminating = created_s(meta), bool(meta.get("deletionTimestamp"))
        mine: list[Entry] = []
        for e in entries:
            verdicts = {whose(allocs.get(allocation_key(ids)), uid, created, terminating, alive, skew_s)
                        for ids in e.values()}
            if verdicts == {MINE}:
                mine.append(e)
            elif verdicts == {THEIRS}:
                _keep_earlier(out, e, allocs, ns, name)
        if len(mine) != 1:
            out.waiting[key] = (f"PodResources lists {key} {len(mine)} times with devices that may be pod {uid}'s; "
                                "waiting until one is left" if mine else
                                f"PodResources lists {key} only with devices of an earlier pod of that name "
                                f"(not pod {uid}); waiting for the kubelet to admit {uid}")
            continue
        hs = [Held(ns, name, c, r, ids) for (c, r), ids in sorted(mine[0].items())]
        for h in hs:
            alloc = allocation_key(h.device_ids)
            try:
                safe_component(h.container, "container name")
            except UnsafePathError:
                continue  # the kubelet validated it; never joined into a path unchecked all the same
            out.owners[alloc] = Owner(uid, ns, name, h.container)
            out.links.setdefault((uid, h.container), alloc)
            a = allocs.get(alloc)
            if a is not None and a.owner != uid:
                out.attributions[alloc] = (uid, a.stamp_ns)
        why = _missing(pod, hs, names)
        if why is not None:
            out.waiting[key] = why
            continue
        try:
            actual = actual_assignment(pod, hs, devices, names, unit_mib,
                                       {k: (a.mig_plan, a.mig_mib) for k, a in allocs.items() if a.mig_plan})
        except (KeyError, ValueError) as exc:
            out.waiting[key] = f"device {exc} is not a device of this node; its size is unknown"
            continue
        out.holdings.extend(Holding(Owner(uid, ns, name, c), gpus) for c, gpus in sorted(actual.items()))
        hidden = unlisted_init_devices(pod, names)
        if hidden:
            out.unlisted[key] = hidden
        ann = meta.get("annotations") or {}
        try:
            current = parse_all(ann.get(names.assignment)) if ann.get(names.assignment) else None
        except AssignmentError:
            current = None
        if (current is not None and ann.get(names.allocation_state) == contract.STATE_ALLOCATED
                and same_assignment(current, actual) and _ours(pod, names)):
            out.in_sync += 1
            continue
        ref = PodRef(ns, name, uid, str(meta.get("resourceVersion") or ""))
        try:
            out.patches.append(Patch(ref, encode_assignment(actual)))
        except AssignmentError as exc:  # e.g. a device of 0 MiB: the contract's rule, never written
            out.waiting[key] = f"its actual GPUs break the assignment contract: {exc}"
    return out
