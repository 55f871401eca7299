"""A model of the kubelet's device manager, for the kubelet stand-in and property tests. Never in production.

It reproduces what decides which device IDs a container gets, from kubernetes
``pkg/kubelet/cm/devicemanager/manager.go`` (ManagerImpl):

* ``genericDeviceUpdateCallback``: each ListAndWatch message replaces the resource's device set;
  only healthy devices are handed out (``healthyDevices``), capacity counts all of them.
* ``Allocate(pod, container)``: called by the topology manager's admit handler for every init
  container, then every app container, in spec order. Devices of a (non-restartable) init container
  go into ``devicesToReuse`` and app containers take them first; a restartable init container
  (sidecar) keeps its own.
* ``allocateContainerResources``: first ``UpdateAllocatedDevices`` (drop pods no longer active), then
  per resource ``devicesToAllocate``, then one ``Allocate`` RPC with exactly those IDs; on error
  ``allocatedDevices`` is rebuilt from ``podDevices`` (nothing leaks); on success ``podDevices.insert``
  and ``writeCheckpoint``.
* ``devicesToAllocate``: devices already in ``podDevices`` for the container mean "nothing to do" (a
  container restart does not call Allocate again; a changed count is an error); otherwise reusable
  devices first, then ``available = healthy - allocatedDevices`` ("requested number of devices
  unavailable" when too few). With no topology hint every device is in the ``noAffinity`` set, so
  the plugin is asked ``GetPreferredAllocation(available + already picked, mustInclude = already
  picked, size = required)`` only when it advertised it; its answer intersected with ``available``
  is taken first, then the rest of ``noAffinity`` in Go set order, which is random (``rng``).
* ``GetDeviceRunContainerOptions``: a container of an active pod with no cached devices is
  re-allocated (``needsReAllocate``: the late re-Allocate after a lost ``podDevices`` entry).
* ``readCheckpoint``: a kubelet restart keeps ``podDevices`` (``kubelet_internal_checkpoint``).

``pod_resources`` answers as ``v1.PodResourcesLister/List`` does (``pkg/kubelet/apis/podresources/
server_v1.go List``): active pods in no promised order (``GetActivePods`` walks a Go map), per pod its
restartable init containers then its app containers, and per container **one entry per device ID, one
per NUMA node of that device's topology** (``pkg/kubelet/cm/container_manager.go
containerDevicesFromResourceDeviceInstances`` over ``pod_devices.go getContainerDevices``, the NUMA
nodes recorded at Allocate as ``allocDevicesWithNUMA``), in Go map order (random here). No pod UID:
a pod deleted and recreated under the same name may be listed twice while the old one terminates.
``get_pod_resources`` is ``Get``: the pod the pod manager knows by that name (the newest).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Protocol, Sequence


NO_TOPOLOGY = -1  # devicemanager ``nodeWithoutTopology``: a device the plugin reported without NUMA nodes


class AdmissionError(Exception):
    """What the kubelet turns into ``UnexpectedAdmissionError`` for the pod (final)."""


class Endpoint(Protocol):
    """One registered resource's plugin, over gRPC or in-process."""

    preferred_available: bool

    def preferred(self, available: Sequence[str], must_include: Sequence[str], size: int) -> list[str]: ...

    def allocate(self, device_ids: Sequence[str]) -> Any: ...


@dataclass
class FnEndpoint:
    """An :class:`Endpoint` from two callables (in-process plugins in tests, gRPC stubs in the stand-in)."""

    preferred_fn: Callable[[Sequence[str], Sequence[str], int], list[str]]
    allocate_fn: Callable[[Sequence[str]], Any]
    preferred_available: bool = True

    def preferred(self, available: Sequence[str], must_include: Sequence[str], size: int) -> list[str]:
        return self.preferred_fn(available, must_include, size)

    def allocate(self, device_ids: Sequence[str]) -> Any:
        return self.allocate_fn(device_ids)


@dataclass
class Grant:
    """One container's devices of one resource and the plugin's answer (``podDevices`` entry)."""

    device_ids: frozenset[str]
    response: Any = None
    numa: dict[int, list[str]] = field(default_factory=dict)  # ``allocDevicesWithNUMA``: node -> IDs


DeviceEntry = tuple[str, str, "int | None"]  # one ContainerDevices: (resource, device ID, NUMA node or None)


def devices_per_numa(ids: Iterable[str], topology: Mapping[str, Sequence[int]],
                     rng: random.Random) -> dict[int, list[str]]:
    """``allocateContainerResources``' ``allocDevicesWithNUMA``: each device under every NUMA node of
    its topology when it was allocated, or under ``nodeWithoutTopology``; Go set order (random)."""
    out: dict[int, list[str]] = {}
    order = sorted(ids)
    rng.shuffle(order)
    for dev in order:
        nodes = list(topology.get(dev) or ())
        for node in nodes or [NO_TOPOLOGY]:
            out.setdefault(node, []).append(dev)
    return out


def _go_keys(keys: Iterable[Any], rng: random.Random) -> list[Any]:
    out = sorted(keys)
    rng.shuffle(out)
    return out


def container_devices(grants: Mapping[str, Grant], rng: random.Random) -> list[DeviceEntry]:
    """A container's ``ContainerDevices``, as the kubelet builds them for PodResources.

    ``pod_devices.go getContainerDevices`` turns ``deviceIds`` (NUMA node -> IDs) into a device ->
    topology map, where a device seen under a second node gets that node *and* the ones seen before;
    ``container_manager.go containerDevicesFromResourceDeviceInstances`` then answers one entry per
    device without topology, else one per NUMA node of its topology, each naming that one device.
    Every map walk is in Go order: random."""
    instances: dict[str, dict[str, list[int] | None]] = {}
    for resource in _go_keys(grants, rng):  # getContainerDevices
        per_numa = grants[resource].numa
        if not per_numa:
            continue
        devs: dict[str, list[int] | None] = {}
        for numa in _go_keys(per_numa, rng):
            for dev in per_numa[numa]:
                topology = None
                if numa != NO_TOPOLOGY:
                    topology = [numa] + list(devs.get(dev) or [])
                devs[dev] = topology
        instances[resource] = devs
    out: list[DeviceEntry] = []
    for resource in _go_keys(instances, rng):  # containerDevicesFromResourceDeviceInstances
        for dev in _go_keys(instances[resource], rng):
            topology = instances[resource][dev]
            if topology is None:
                out.append((resource, dev, None))
                continue
            out.extend((resource, dev, node) for node in topology)
    return out


@dataclass
class PodEntry:
    uid: str
    namespace: str
    name: str
    pod: Mapping[str, Any]
    containers: dict[str, dict[str, Grant]] = field(default_factory=dict)  # container -> resource -> grant
    seq: int = 0  # order the pod manager learnt of it (``GetPodByName`` answers the newest)


def _limits(container: Mapping[str, Any]) -> dict[str, int]:
    """Extended resources are integers and requests equal limits (the API server validates it)."""
    res = container.get("resources") or {}
    out: dict[str, int] = {}
    for k, v in {**(res.get("requests") or {}), **(res.get("limits") or {})}.items():
        try:
            out[k] = int(str(v))
        except ValueError:
            continue
    return out


def _restartable(container: Mapping[str, Any]) -> bool:
    return container.get("restartPolicy") == "Always"


class DeviceManager:
    """Per-resource device accounting of one kubelet; ``rng`` stands for Go's random set order."""

    def __init__(self, rng: random.Random | None = None, is_ours: Callable[[str], bool] = lambda r: "/" in r) -> None:
        self.rng = rng or random.Random(0)
        self.is_ours = is_ours
        self.endpoints: dict[str, Endpoint] = {}
        self.all_devices: dict[str, set[str]] = {}
        self.healthy_devices: dict[str, set[str]] = {}
        self.topology: dict[str, dict[str, tuple[int, ...]]] = {}  # resource -> device -> NUMA nodes
        self.allocated_devices: dict[str, set[str]] = {}
        self.pods: dict[str, PodEntry] = {}  # podDevices, by pod UID
        self.active: set[str] = set()  # UIDs of pods the kubelet runs (activePods)
        self._reuse: dict[str, dict[str, set[str]]] = {}  # devicesToReuse, for the pod being admitted
        self.allocate_calls = 0
        self._seq = 0

    # -- plugin side ----------------------------------------------------------------------------
    def register(self, resource: str, endpoint: Endpoint) -> None:
        self.endpoints[resource] = endpoint

    def unregister(self, resource: str) -> None:
        """Stream broke: every device unhealthy (allocatable 0); pods keep what they hold."""
        self.endpoints.pop(resource, None)
        self.healthy_devices[resource] = set()

    def update_devices(self, resource: str, devices: Iterable[tuple[Any, ...]]) -> None:
        """``genericDeviceUpdateCallback``: the message replaces the whole set. Each device is
        ``(id, healthy)`` or ``(id, healthy, NUMA nodes)`` (``Device.Topology.Nodes``)."""
        devs = list(devices)
        self.all_devices[resource] = {d[0] for d in devs}
        self.healthy_devices[resource] = {d[0] for d in devs if d[1]}
        self.topology[resource] = {d[0]: tuple(d[2]) for d in devs if len(d) > 2 and d[2]}

    # -- pods -----------------------------------------------------------------------------------
    def admit(self, pod: Mapping[str, Any]) -> None:
        """Allocate for every init container then every app container (the topology manager's admit
        handler with the ``none`` policy). Raises :class:`AdmissionError`; the pod then holds nothing."""
        meta = pod["metadata"]
        uid = meta["uid"]
        self.active.add(uid)
        if uid not in self.pods:
            self._seq += 1
            self.pods[uid] = PodEntry(uid, meta.get("namespace", "default"), meta["name"], pod, seq=self._seq)
        spec = pod.get("spec") or {}
        try:
            for c in list(spec.get("initContainers") or []) + list(spec.get("containers") or []):
                self.allocate(pod, c)
        except AdmissionError:
            self.remove_pod(uid)
            raise

    def allocate(self, pod: Mapping[str, Any], container: Mapping[str, Any]) -> None:
        """``ManagerImpl.Allocate``: init-container devices become reusable by later containers."""
        uid = pod["metadata"]["uid"]
        for other in [u for u in self._reuse if u != uid]:
            del self._reuse[other]
        reuse = self._reuse.setdefault(uid, {})
        inits = {c.get("name"): c for c in (pod.get("spec") or {}).get("initContainers") or []}
        self._allocate_container_resources(pod, container, reuse)
        grants = self.pods[uid].containers.get(container["name"], {})
        if container["name"] in inits:
            if _restartable(container):  # removeContainerAllocatedResources: a sidecar keeps its devices
                for r, g in grants.items():
                    reuse.get(r, set()).difference_update(g.device_ids)
            else:  # addContainerAllocatedResources
                for r, g in grants.items():
                    reuse.setdefault(r, set()).update(g.device_ids)
        else:
            for r, g in grants.items():
                reuse.get(r, set()).difference_update(g.device_ids)

    def record(self, namespace: str, name: str, container: str, resource: str, device_ids: Iterable[str],
               response: Any = None) -> None:
        """A grant made outside :meth:`admit` (a raw Allocate in a test), kept like any other."""
        uid = next((u for u, e in self.pods.items() if (e.namespace, e.name) == (namespace, name)),
                   f"{namespace}/{name}")
        if uid not in self.pods:
            self._seq += 1
        entry = self.pods.setdefault(uid, PodEntry(uid, namespace, name, {
            "metadata": {"uid": uid, "namespace": namespace, "name": name}, "spec": {"containers": []}},
            seq=self._seq))
        spec_containers = entry.pod["spec"].setdefault("containers", [])
        if all(c.get("name") != container for c in spec_containers):
            spec_containers.append({"name": container})
        ids = frozenset(device_ids)
        entry.containers.setdefault(container, {})[resource] = Grant(
            ids, response, devices_per_numa(ids, self.topology.get(resource, {}), self.rng))
        self.active.add(uid)
        self._rebuild_allocated()

    def _allocate_container_resources(self, pod: Mapping[str, Any], container: Mapping[str, Any],
                                      reuse: Mapping[str, set[str]]) -> None:
        uid, cname = pod["metadata"]["uid"], container["name"]
        updated = False
        for resource, needed in _limits(container).items():
            if not self.is_ours(resource) or needed <= 0:
                continue
            if not updated:
                self.update_allocated_devices()
                updated = True
            ids = self._devices_to_allocate(uid, cname, resource, needed, reuse.get(resource, set()))
            if not ids:
                continue
            endpoint = self.endpoints.get(resource)
            if endpoint is None:
                self._rebuild_allocated()
                raise AdmissionError(f"unknown device plugin {resource}")
            self.allocate_calls += 1
            try:
                response = endpoint.allocate(sorted(ids))
            except Exception as exc:  # noqa: BLE001 - any plugin error fails the pod
                self._rebuild_allocated()
                raise AdmissionError(f"Allocate failed for {resource}: {exc}") from exc
            self.pods[uid].containers.setdefault(cname, {})[resource] = Grant(
                frozenset(ids), response, devices_per_numa(ids, self.topology.get(resource, {}), self.rng))

    def _devices_to_allocate(self, uid: str, cname: str, resource: str, required: int,
                             reusable: set[str]) -> set[str]:
        have = self.pods.get(uid)
        grant = have.containers.get(cname, {}).get(resource) if have else None
        if grant is not None:
            if len(grant.device_ids) != required:
                raise AdmissionError(f"pod {uid} container {cname} changed request for {resource} "
                                     f"from {len(grant.device_ids)} to {required}")
            return set()  # no change, no work
        if resource not in self.healthy_devices:
            raise AdmissionError(f"cannot allocate unregistered device {resource}")
        if not self.healthy_devices[resource]:
            raise AdmissionError(f"no healthy devices present; cannot allocate unhealthy devices {resource}")
        allocated: set[str] = set()
        needed = required
        in_use = self.allocated_devices.setdefault(resource, set())

        def take_from(devices: Iterable[str]) -> bool:  # allocateRemainingFrom
            nonlocal needed
            for d in devices:
                if d in allocated:
                    continue
                in_use.add(d)
                allocated.add(d)
                needed -= 1
                if needed == 0:
                    return True
            return False

        if take_from(self._go_order(reusable)):
            return allocated
        available = self.healthy_devices[resource] - in_use
        if len(available) < needed:
            raise AdmissionError(f"requested number of devices unavailable for {resource}. "
                                 f"Requested: {needed}, Available: {len(available)}")
        endpoint = self.endpoints.get(resource)
        if endpoint is not None and endpoint.preferred_available:  # callGetPreferredAllocationIfAvailable
            try:
                preferred = endpoint.preferred(sorted(available | allocated), sorted(allocated), required)
            except Exception as exc:  # noqa: BLE001
                self._rebuild_allocated()
                raise AdmissionError(f"GetPreferredAllocation failed for {resource}: {exc}") from exc
            if take_from([d for d in preferred if d in available]):
                return allocated
        if take_from(self._go_order(available)):  # the noAffinity set
            return allocated
        raise AdmissionError(f"unexpectedly allocated less resources than required for {resource}")

    def _go_order(self, devices: Iterable[str]) -> list[str]:
        out = sorted(devices)
        self.rng.shuffle(out)
        return out

    def _rebuild_allocated(self) -> None:
        """``m.allocatedDevices = m.podDevices.devices()``."""
        out: dict[str, set[str]] = {}
        for entry in self.pods.values():
            for grants in entry.containers.values():
                for r, g in grants.items():
                    out.setdefault(r, set()).update(g.device_ids)
        self.allocated_devices = out

    def update_allocated_devices(self) -> None:
        """``UpdateAllocatedDevices``: pods no longer active give their devices back."""
        for uid in [u for u in self.pods if u not in self.active]:
            del self.pods[uid]
        self._rebuild_allocated()

    def remove_pod(self, uid: str) -> None:
        """The pod ended (or failed admission): no longer active; its devices free at the next update."""
        self.active.discard(uid)
        self.update_allocated_devices()

    def lose_container(self, uid: str, container: str) -> None:
        """A ``podDevices`` entry lost (the race ``needsReAllocate`` covers); see :meth:`reallocate`."""
        entry = self.pods.get(uid)
        if entry is not None:
            entry.containers.pop(container, None)
        self._rebuild_allocated()

    def reallocate(self, uid: str) -> None:
        """``GetDeviceRunContainerOptions``: containers of an active pod without cached devices are
        allocated again (possibly other IDs), as when its pod worker restarts the container."""
        entry = self.pods.get(uid)
        if entry is None or uid not in self.active:
            return
        spec = entry.pod.get("spec") or {}
        for c in spec.get("containers") or []:
            wants = {r for r, n in _limits(c).items() if self.is_ours(r) and n > 0}
            if wants - set(entry.containers.get(c["name"], {})):
                self._reuse.pop(uid, None)
                self.allocate(entry.pod, c)

    def checkpoint(self) -> dict[str, PodEntry]:
        """``writeCheckpoint``: what survives a kubelet restart."""
        return {uid: PodEntry(e.uid, e.namespace, e.name, e.pod, {c: dict(g) for c, g in e.containers.items()}, e.seq)
                for uid, e in self.pods.items()}

    def restore(self, checkpoint: Mapping[str, PodEntry]) -> None:
        """``readCheckpoint`` after a kubelet restart: podDevices back, endpoints gone until Register."""
        self.pods = {uid: PodEntry(e.uid, e.namespace, e.name, e.pod, {c: dict(g) for c, g in e.containers.items()}, e.seq)
                     for uid, e in checkpoint.items()}
        self.endpoints = {}
        self.healthy_devices = {}
        self._rebuild_allocated()

    # -- what PodResources says and what containers hold --------------------------------------------
    def _listed(self, entry: PodEntry) -> tuple[str, str, list[tuple[str, list[DeviceEntry]]]]:
        """``getContainerResources`` for the restartable init containers, then the app containers."""
        spec = entry.pod.get("spec") or {}
        names = [c["name"] for c in spec.get("initContainers") or [] if _restartable(c)]
        names += [c["name"] for c in spec.get("containers") or []]
        return entry.namespace, entry.name, [(c, container_devices(entry.containers.get(c, {}), self.rng))
                                             for c in names]

    def pod_resources(self) -> list[tuple[str, str, list[tuple[str, list[DeviceEntry]]]]]:
        """``List``: (namespace, name, [(container, [(resource, device ID, NUMA node or None)])]) for the
        active pods, in Go map order; one entry per device ID and NUMA node, as upstream answers."""
        self.update_allocated_devices()  # server_v1.go List: p.devicesProvider.UpdateAllocatedDevices()
        return [self._listed(self.pods[uid]) for uid in _go_keys(self.active, self.rng) if uid in self.pods]

    def get_pod_resources(self, namespace: str, name: str) -> tuple[str, str, list[tuple[str, list[DeviceEntry]]]]:
        """``Get``: the pod the pod manager knows by that name (``GetPodByName``: the newest); raises
        ``KeyError`` with upstream's message when there is none."""
        found = [e for e in self.pods.values() if (e.namespace, e.name) == (namespace, name)]
        if not found:
            raise KeyError(f"pod {name} in namespace {namespace} not found")
        return self._listed(max(found, key=lambda e: e.seq))

    def holdings(self) -> dict[tuple[str, str], dict[str, dict[str, frozenset[str]]]]:
        """(namespace, name) -> container -> resource -> device IDs, active pods only (the truth)."""
        return {(e.namespace, e.name): {c: {r: g.device_ids for r, g in gs.items()} for c, gs in e.containers.items()}
                for uid, e in self.pods.items() if uid in self.active}
