"""Keeps this node's ResourceSlices current through the API server (server-side apply).

The adapter around :mod:`deviceplugin.dra.slices`: reads what is published (to continue the pool
generation after a restart), applies the desired slices with field manager ``vramshare-dra``
(``force``: this plugin alone owns its node's pool), and deletes slices the pool no longer needs.
It also reads the node's device-plugin inventory annotation: a GPU that a device plugin advertises
is refused here, so a stale config on either side never lets both plugins hand out one GPU.
:class:`SliceWatch` watches the published slices, as upstream's resourceslice controller does: the
kubelet deletes them at its start and 30 s after this plugin deregisters
(pkg/kubelet/cm/dra/plugin/dra_plugin_manager.go ``wipeResourceSlices``), and they must come back at
once, not at the next resync.
Uses the official client's ``ResourceV1Api`` with raw JSON responses (the dicts are the contract).
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Mapping, Sequence

from kubernetes import client
from kubernetes.client.rest import ApiException

from deviceplugin.dra import slices
from vramshare import contract, logs
from vramshare.contract import inventory as contract_inventory
from vramshare.inventory import InventoryError
from vramshare.kube import decode
from vramshare.retry import Backoff
from vramshare.watch import ListWatch

log = logs.get(__name__)

FIELD_MANAGER = "vramshare-dra"
APPLY = "application/apply-patch+yaml"
TIMEOUT_S = 5.0  # connect and read timeout of each request (a watch reads for its timeoutSeconds more)


class CountersDropped(ValueError):
    """The API server stored a counter slice without its ``sharedCounters``: its DRAPartitionableDevices
    gate is off (strategy.go ``dropDisabledDRAPartitionableDevicesFields`` clears them silently), so
    partitionable devices would be published without the counters that keep them apart."""


class SlicePublisher:
    """Publishes one node's pool; ``publish`` is safe to call from any thread and after any failure."""

    def __init__(self, api: client.ApiClient, node: str, names: contract.Names) -> None:
        self.node = node
        self.names = names
        self._resource = client.ResourceV1Api(api)
        self._core = client.CoreV1Api(api)
        self._lock = threading.Lock()
        self._generation: int | None = None
        self._devices: list[dict[str, Any]] | None = None
        self._counters: list[dict[str, Any]] = []
        self.published = threading.Event()

    def _published_slices(self) -> list[dict[str, Any]]:
        selector = f"spec.nodeName={self.node},spec.driver={self.names.dra_driver}"
        return decode(self._resource.list_resource_slice(field_selector=selector, _preload_content=False))["items"]

    def _node(self) -> dict[str, Any] | None:
        try:
            return decode(self._core.read_node(self.node, _preload_content=False))
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def device_plugin_gpus(self) -> frozenset[str]:
        """GPU UUIDs a device plugin advertises on this node (its inventory annotation); refused here."""
        node = self._node() or {}
        text = ((node.get("metadata") or {}).get("annotations") or {}).get(self.names.inventory)
        if not text:
            return frozenset()
        try:
            inv = contract_inventory.parse(text)
        except InventoryError as exc:
            log.warning("device plugin inventory unreadable; refusing nothing", node=self.node, error=str(exc))
            return frozenset()
        return frozenset(g.uuid for g in inv.gpus)

    def publish(self, devices: Sequence[dict[str, Any]], counter_sets: Sequence[dict[str, Any]] = (),
                annotations: Mapping[str, str] | None = None) -> int:
        """Apply the pool with ``devices`` (and the ``counter_sets`` partitionable devices draw from), its
        slices annotated with ``annotations``; returns its generation. Raises ``ApiException`` to retry, :class:`CountersDropped` (before any
        device slice is applied) when the server does not keep counters."""
        with self._lock:
            existing = self._published_slices()
            ordered = sorted(existing, key=lambda s: s["metadata"]["name"])
            if self._generation is None:
                self._generation = max((int(s["spec"]["pool"].get("generation", 0)) for s in existing), default=0)
                self._devices = [d for s in ordered for d in s["spec"].get("devices") or ()] if existing else None
                self._counters = [c for s in ordered for c in s["spec"].get("sharedCounters") or ()]
            generation = slices.next_generation(self._generation, self._devices, devices)
            if generation == self._generation and list(counter_sets) != self._counters:
                generation += 1  # the counters changed: a new generation, as for devices
            node = self._node()
            node_uid = ((node or {}).get("metadata") or {}).get("uid")
            desired = slices.resource_slices(self.node, node_uid, devices, generation, self.names, counter_sets,
                                             annotations)
            for obj in desired:
                stored = decode(self._resource.patch_resource_slice(obj["metadata"]["name"], obj,
                                                                   field_manager=FIELD_MANAGER, force=True,
                                                                   _content_type=APPLY, _preload_content=False))
                if obj["spec"].get("sharedCounters") and not (stored.get("spec") or {}).get("sharedCounters"):
                    raise CountersDropped(f"ResourceSlice {obj['metadata']['name']}: the API server dropped "
                                          "spec.sharedCounters (DRAPartitionableDevices is off)")
            keep = {o["metadata"]["name"] for o in desired}
            for old in existing:
                name = old["metadata"]["name"]
                if name not in keep:
                    decode(self._resource.delete_resource_slice(name, _preload_content=False))
            if generation != self._generation:
                log.info("resource slices published", node=self.node, generation=generation,
                         devices=len(devices), slices=len(desired))
            self._generation, self._devices, self._counters = generation, list(devices), list(counter_sets)
            self.published.set()
            return generation

    def withdraw(self) -> None:
        """Delete this node's slices (on uninstall: ``vramshare dra-plugin`` leaves them on restart)."""
        with self._lock:
            for old in self._published_slices():
                decode(self._resource.delete_resource_slice(old["metadata"]["name"], _preload_content=False))
            self._generation, self._devices, self._counters = None, None, []


class SliceWatch:
    """List+watch of this node's slices of our driver; ``on_gone()`` when one of them is deleted, and
    after every list (what happened while the watch was down is unknown). Raw JSON, no models; the
    watching is :class:`vramshare.watch.ListWatch`'s, with a read timeout (a half-open connection to a
    vanished API server would otherwise hold the watch, and the wiped slices, for ever)."""

    def __init__(self, api: client.ApiClient, node: str, names: contract.Names, on_gone: Callable[[], None],
                 watch_timeout_s: int = 300, request_timeout_s: float = TIMEOUT_S) -> None:
        resource = client.ResourceV1Api(api)
        selector = f"spec.nodeName={node},spec.driver={names.dra_driver}"
        self._on_gone = on_gone
        self.deletions = 0  # slices seen deleted (by the kubelet's wipes, mostly)
        self.watch = ListWatch("slice watch", lambda **kw: resource.list_resource_slice(field_selector=selector, **kw),
                               on_replace=self._listed, on_event=self._event, on_failure=self._keep_going,
                               min_watch_timeout_s=watch_timeout_s, request_timeout_s=request_timeout_s,
                               backoff=Backoff(0.2, 5.0, jitter=1.0))

    def run(self, stop: threading.Event) -> None:
        """Body of the ``slice-watch`` thread."""
        self.watch.run(stop)

    def stop(self) -> None:
        self.watch.stop()

    @staticmethod
    def _keep_going(exc: BaseException) -> bool:
        if isinstance(exc, ApiException) and exc.status == 403:  # an older RBAC without watch
            log.error("cannot watch resource slices; wiped slices return only at the resync "
                      "(grant watch on resourceslices)", error=str(exc.reason))
            return False
        return True

    def _listed(self, items: list[Mapping[str, Any]], deleted: list[Mapping[str, Any]]) -> None:
        self.deletions += len(deleted)
        self._on_gone()  # whatever happened meanwhile, the publisher compares and re-applies

    def _event(self, kind: str, obj: Mapping[str, Any]) -> None:
        if kind == "DELETED":
            self.deletions += 1
            log.info("resource slice deleted, republishing", slice=(obj.get("metadata") or {}).get("name"))
            self._on_gone()
