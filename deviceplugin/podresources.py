"""What the kubelet has already handed out, from its PodResources API: the truth after a restart.

The plugin keeps no state on disk. After a plugin restart (or when a device looks taken twice) it
asks the kubelet's ``v1.PodResourcesLister/List`` which pod containers hold which of our device IDs.
The socket's inode changes when the kubelet restarts, so every call dials afresh.
"""
from __future__ import annotations

import grpc

from deviceplugin.allocator import Holder
from protos.podresources.v1 import api_pb2 as pr
from protos.podresources.v1 import api_pb2_grpc as pr_grpc
from vramshare import contract

TIMEOUT_S = 5.0


def held_devices(response: pr.ListPodResourcesResponse, names: contract.Names) -> dict[str, Holder]:
    """Device ID -> (namespace/name, container, resource), for our resources only."""
    out: dict[str, Holder] = {}
    for pod in response.pod_resources:
        for container in pod.containers:
            for devs in container.devices:
                if names.is_ours(devs.resource_name):
                    for device_id in devs.device_ids:
                        out[device_id] = (f"{pod.namespace}/{pod.name}", container.name, devs.resource_name)
    return out


class KubeletPodResources:
    """:class:`deviceplugin.allocator.HeldDevices` over the kubelet's pod-resources socket."""

    def __init__(self, socket: str, names: contract.Names) -> None:
        self.socket = socket
        self._names = names

    def held(self) -> dict[str, Holder]:
        with grpc.insecure_channel(f"unix://{self.socket}") as channel:
            response = pr_grpc.PodResourcesListerStub(channel).List(pr.ListPodResourcesRequest(), timeout=TIMEOUT_S)
        return held_devices(response, self._names)
