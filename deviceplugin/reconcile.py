"""Reconcile after admission, the pure core: what the kubelet handed out -> the pod annotations it implies.

The kubelet's PodResources ``List`` is the only source that says which pod container holds which
device IDs. From it and this node's pods (the watch-fed cache) :func:`plan` computes, with no I/O:

* for each pod, its *actual* ``assignment`` (the same JSON the extender writes: per container the GPU
  or MIG UUIDs and MiB its device IDs stand for) and ``allocation-state: allocated``, as a patch when
  the pod does not say exactly that already. This also covers pods that bypassed the scheduler: they
  get an assignment from reality, so the extender's books count them;
* the owner of each allocation-keyed quota directory (:func:`deviceplugin.quota_files.allocation_key`
  of the container's IDs), so the quota loop finds ``<pod-uid>/<container>`` and nothing is guessed.

A device the kubelet lists for both an init container and an app container (the kubelet reuses init
devices, ``devicesToReuse`` in its device manager) is counted once, for the app container. A pod whose
containers do not yet hold everything they ask for is mid-admission and waits for the next round, as
does a pod the cache has not seen (no UID or resourceVersion to patch with).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from deviceplugin.devices import PluginDevice
from deviceplugin.handshake import (AssignedGpu, AssignmentError, PodRef, encode_assignment, parse_all,
                                    requested, resources_of, same_assignment)
from deviceplugin.quota_files import allocation_key
from vramshare import contract, managed
from vramshare.podspec import PodSpecError, pod_demand


NOT_CACHED = "not in the pod cache yet"


@dataclass(frozen=True)
class Held:
    """One container's devices of one resource, as PodResources ``List`` reports them."""

    namespace: str
    pod: str
    container: str
    resource: str
    device_ids: tuple[str, ...]


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


@dataclass
class Plan:
    patches: list[Patch] = field(default_factory=list)
    owners: dict[str, Owner] = field(default_factory=dict)  # allocation key -> holder
    links: dict[tuple[str, str], str] = field(default_factory=dict)  # (pod uid, container) -> allocation key
    waiting: dict[str, str] = field(default_factory=dict)  # namespace/name -> why not (yet) reconciled
    unlisted: dict[str, dict[str, int]] = field(default_factory=dict)  # pod -> init devices List omits
    in_sync: int = 0  # pods whose annotations already say what they hold
    held_keys: set[str] = field(default_factory=set)  # allocation keys of every listed container


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
                      names: contract.Names, unit_mib: int) -> dict[str, tuple[AssignedGpu, ...]]:
    """Per container, the GPUs (or MIG/whole-GPU UUIDs) and MiB its device IDs stand for.

    Raises ``KeyError`` for a MIG or whole-GPU ID this node does not know (its size is unknown) and
    ``ValueError`` for a memory-unit ID that does not parse."""
    spec = pod.get("spec") or {}
    order = [c.get("name") for c in spec.get("containers") or []] + \
            [c.get("name") for c in spec.get("initContainers") or []]
    rank = {name: i for i, name in enumerate(order)}
    seen: set[str] = set()
    out: dict[str, dict[str, int]] = {}
    for h in sorted(held, key=lambda h: (rank.get(h.container, len(rank)), h.container, h.resource)):
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


def plan(held: Iterable[Held], pods: Iterable[Mapping[str, Any]], devices: Mapping[str, PluginDevice],
         names: contract.Names, node: str, unit_mib: int) -> Plan:
    """Patches and quota-directory owners from PodResources ``held`` and this node's ``pods``."""
    by_pod: dict[tuple[str, str], list[Held]] = {}
    for h in held:
        if names.is_ours(h.resource) and h.device_ids:
            by_pod.setdefault((h.namespace, h.pod), []).append(h)
    known: dict[tuple[str, str], Mapping[str, Any]] = {}
    for p in pods:
        meta = p.get("metadata") or {}
        if (p.get("spec") or {}).get("nodeName") == node:
            known[(meta.get("namespace", "default"), meta.get("name", ""))] = p
    out = Plan()
    out.held_keys = {allocation_key(h.device_ids) for hs in by_pod.values() for h in hs}
    for (ns, name), hs in sorted(by_pod.items()):
        key = f"{ns}/{name}"
        pod = known.get((ns, name))
        if pod is None:
            out.waiting[key] = NOT_CACHED
            continue
        meta = pod.get("metadata") or {}
        uid = str(meta.get("uid") or "")
        for h in sorted(hs, key=lambda h: (h.container, h.resource)):
            owner = Owner(uid, ns, name, h.container)
            alloc = allocation_key(h.device_ids)
            out.owners[alloc] = owner
            out.links.setdefault((uid, h.container), alloc)
        why = _missing(pod, hs, names)
        if why is not None:
            out.waiting[key] = why
            continue
        try:
            actual = actual_assignment(pod, hs, devices, names, unit_mib)
        except (KeyError, ValueError) as exc:
            out.waiting[key] = f"device {exc} is not a device of this node; its size is unknown"
            continue
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
        out.patches.append(Patch(ref, encode_assignment(actual)))
    return out
