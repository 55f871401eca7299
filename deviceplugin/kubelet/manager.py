"""The narrow interface a kubelet servicer talks to: one :class:`ResourceManager` per resource.

The servicer (:mod:`deviceplugin.kubelet.server`) knows nothing of GPUs, NVML or pods; it only translates
protobuf to these five calls and back (NVIDIA's ``rm.ResourceManager`` split). Device changes reach
every open ListAndWatch stream through a per-stream queue fed by one :class:`DeviceFeeds` hub, which
listens to the node state once for the life of the process (servers come and go on restarts).
"""
from __future__ import annotations

import queue
import threading
from typing import Callable, Protocol, Sequence

from deviceplugin.allocation import ContainerSpec
from deviceplugin.devices import PluginDevice
from deviceplugin.kubelet.allocator import Allocator
from deviceplugin.node_state import NodeState, Snapshot

_CLOSED = None


class DeviceWatch:
    """One ListAndWatch stream: every changed device list, in order, until closed."""

    def __init__(self, on_close: Callable[["DeviceWatch"], None]) -> None:
        self._queue: queue.SimpleQueue[tuple[PluginDevice, ...] | None] = queue.SimpleQueue()
        self._on_close = on_close

    def publish(self, devices: tuple[PluginDevice, ...]) -> None:
        self._queue.put(devices)

    def next(self) -> tuple[PluginDevice, ...] | None:
        """Block until the list changes; ``None`` once the watch is closed."""
        return self._queue.get()

    def close(self) -> None:
        self._queue.put(_CLOSED)
        self._on_close(self)


class DeviceFeeds:
    """Fans device-list changes of each resource out to its open watches."""

    def __init__(self, state: NodeState) -> None:
        self._lock = threading.Lock()
        self._watches: dict[str, set[DeviceWatch]] = {}
        state.add_listener(self._changed)

    def watch(self, resource: str) -> DeviceWatch:
        w = DeviceWatch(lambda gone: self._forget(resource, gone))
        with self._lock:
            self._watches.setdefault(resource, set()).add(w)
        return w

    def open_watches(self, resource: str) -> int:
        with self._lock:
            return len(self._watches.get(resource, ()))

    def close_all(self) -> None:
        with self._lock:
            watches = [w for ws in self._watches.values() for w in ws]
        for w in watches:
            w.close()

    def _forget(self, resource: str, w: DeviceWatch) -> None:
        with self._lock:
            self._watches.get(resource, set()).discard(w)

    def _changed(self, old: Snapshot, new: Snapshot) -> None:
        with self._lock:
            targets = {r: list(ws) for r, ws in self._watches.items()}
        for resource, watches in targets.items():
            devices = new.devices.get(resource, ())
            if devices != old.devices.get(resource, ()):
                for w in watches:
                    w.publish(devices)


class ResourceManager(Protocol):
    """What one kubelet servicer needs; nothing else crosses into :mod:`deviceplugin.kubelet.server`."""

    resource: str

    def devices(self) -> tuple[PluginDevice, ...]: ...

    def watch(self) -> DeviceWatch: ...

    def preferred(self, available: Sequence[str], must_include: Sequence[str], size: int) -> list[str]: ...

    def allocate(self, device_ids: Sequence[str]) -> ContainerSpec: ...


class NodeResourceManager:
    """:class:`ResourceManager` for one resource of this node, over the shared state and allocator."""

    def __init__(self, resource: str, state: NodeState, feeds: DeviceFeeds, allocator: Allocator) -> None:
        self.resource = resource
        self._state = state
        self._feeds = feeds
        self._allocator = allocator

    def devices(self) -> tuple[PluginDevice, ...]:
        return self._state.snapshot.devices.get(self.resource, ())

    def watch(self) -> DeviceWatch:
        return self._feeds.watch(self.resource)

    def preferred(self, available: Sequence[str], must_include: Sequence[str], size: int) -> list[str]:
        return self._allocator.preferred(self.resource, available, must_include, size)

    def allocate(self, device_ids: Sequence[str]) -> ContainerSpec:
        return self._allocator.allocate(self.resource, device_ids)


_check: type[ResourceManager] = NodeResourceManager  # the servicer's interface is implemented
