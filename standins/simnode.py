"""A simulated GPU node for the demo and end-to-end tests: the real device plugin, a stand-in kubelet.

Never on a production path. The device plugin daemon is the production one, fed by the simulated GPU
backend; the kubelet side is :class:`standins.kubelet.FakeKubelet`, whose device manager model
chooses device IDs as the kubelet does (healthy, not yet granted, the plugin's preference as a hint) and
calls Allocate per container and resource.
"""
from __future__ import annotations

import os
import random
from typing import Any

from deviceplugin.kubelet.main import DevicePluginDaemon
from deviceplugin.simulated_backend import SimulatedBackend
from standins.kubelet import FakeKubelet
from vramshare import contract, kube
from vramshare.config import Config

names = contract.Names()


class SimulatedNode:
    """One simulated GPU node: a stand-in kubelet and the real device plugin daemon, wired over sockets."""

    def __init__(self, name: str, backend: SimulatedBackend, api_url: str | None, root: str,
                 config: Config | None = None, rng: random.Random | None = None,
                 pod_resources: bool = True) -> None:
        self.name = name
        plugin_dir = os.path.join(root, name, "device-plugins")
        os.makedirs(plugin_dir)
        pr_socket = os.path.join(root, name, "pod-resources.sock")
        self.kubelet = FakeKubelet(plugin_dir, pr_socket, rng=rng)
        self.backend = backend
        self.api = kube.api_client_for(api_url) if api_url else None  # None: standalone plugin
        config = (config or Config()).with_overrides(quota_host_dir=os.path.join(root, name, "quota"))
        self.daemon = DevicePluginDaemon(backend, config, plugin_dir, node_name=name, api=self.api,
                                         pod_resources_socket=pr_socket if pod_resources else None,
                                         poll_seconds=0.05, reconcile_seconds=0.5)

    def start(self) -> None:
        self.kubelet.start()
        self.daemon.start()
        self.kubelet.wait_registered(self.daemon.state.snapshot.devices, timeout=10)

    def admit(self, pod: dict[str, Any]) -> list[tuple[str, dict[str, str]]]:
        """What the kubelet does for a bound pod (its device manager picks IDs, asking the plugin's
        preference, then Allocates); then one reconcile round, as the plugin's thread would do soon
        after. Returns each container's environment, per resource."""
        out = self.kubelet.admit(pod)
        self.daemon.reconciler.run_once()
        return out

    def release(self, pod: dict[str, Any]) -> None:
        """The pod ended: the kubelet frees its devices."""
        self.kubelet.remove_pod(pod["metadata"]["uid"])

    def close(self) -> None:
        self.daemon.close()
        self.kubelet.stop()
        if self.api is not None:
            self.api.close()
