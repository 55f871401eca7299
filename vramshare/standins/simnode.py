"""A simulated GPU node for the demo and end-to-end tests: the real device plugin, a stand-in kubelet.

Never on a production path. The device plugin daemon is the production one, fed by the simulated GPU
backend; the kubelet side is :class:`vramshare.standins.kubelet.FakeKubelet`, plus what the kubelet's device
manager does when a bound pod is admitted: per container and resource, take devices that are healthy and
not yet granted, ask the plugin's preference, then Allocate.
"""
from __future__ import annotations

import os
from typing import Any

from deviceplugin.main import DevicePluginDaemon
from deviceplugin.simulated_backend import SimulatedBackend
from vramshare import contract, kube, podspec
from vramshare.config import Config
from vramshare.standins.kubelet import FakeKubelet

names = contract.Names()


class SimulatedNode:
    """One simulated GPU node: a stand-in kubelet and the real device plugin daemon, wired over sockets."""

    def __init__(self, name: str, backend: SimulatedBackend, api_url: str | None, root: str,
                 config: Config | None = None) -> None:
        self.name = name
        plugin_dir = os.path.join(root, name, "device-plugins")
        os.makedirs(plugin_dir)
        pr_socket = os.path.join(root, name, "pod-resources.sock")
        self.kubelet = FakeKubelet(plugin_dir, pr_socket)
        self.backend = backend
        self.api = kube.api_client_for(api_url) if api_url else None  # None: standalone plugin
        config = (config or Config()).with_overrides(quota_host_dir=os.path.join(root, name, "quota"))
        self.daemon = DevicePluginDaemon(backend, config, plugin_dir, node_name=name, api=self.api,
                                         pod_resources_socket=pr_socket, poll_seconds=0.05)
        self.grants: dict[tuple[str, str], list[tuple[str, list[str]]]] = {}  # pod -> (resource, device IDs)

    def start(self) -> None:
        self.kubelet.start()
        self.daemon.start()
        self.kubelet.wait_registered(self.daemon.state.snapshot.devices, timeout=10)

    def admit(self, pod: dict[str, Any]) -> list[tuple[str, dict[str, str]]]:
        """What the kubelet does for a bound pod: per container and resource, pick devices (asking the
        plugin's preference), then Allocate. Returns each container's environment."""
        demand = podspec.pod_demand(pod, names)
        out = []
        for c in demand.containers:
            asks = [(names.gpu_memory, c.units)] if c.units else []
            asks += [(names.gpu, c.whole_gpus)] if c.whole_gpus else []
            asks += [(names.mig(profile), n) for profile, n in c.mig]
            for resource, size in asks:
                taken = {i for grants in self.grants.values() for r, ids in grants if r == resource for i in ids}
                available = [i for i in self.kubelet.healthy_ids(resource) if i not in taken]
                ids = self.kubelet.preferred(resource, available, size)
                resp = self.kubelet.allocate(resource, ids, pod=(demand.namespace, demand.name, c.container))
                self.grants.setdefault((demand.namespace, demand.name), []).append((resource, ids))
                out.append((c.container, dict(resp.envs)))
        return out

    def release(self, pod: dict[str, Any]) -> None:
        """The pod ended: the kubelet frees its devices."""
        meta = pod["metadata"]
        self.kubelet.forget_pod(meta["namespace"], meta["name"])
        self.grants.pop((meta["namespace"], meta["name"]), None)

    def close(self) -> None:
        self.daemon.close()
        self.kubelet.stop()
        if self.api is not None:
            self.api.close()
