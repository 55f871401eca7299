"""What the kubelet has handed out, from its PodResources API: the only record of which pod holds what.

The kubelet never tells Allocate which pod it serves; ``v1.PodResourcesLister/List`` does, after the
fact, per pod container and resource. The reconciler (:mod:`deviceplugin.kubelet.reconcile_loop`) reads it
on start, before the plugin registers, and then periodically. The socket's inode changes when the
kubelet restarts (mount the directory), so every call dials afresh.
"""
from __future__ import annotations

import grpc

from deviceplugin.kubelet.reconcile import Held
from protos.podresources.v1 import api_pb2 as pr
from protos.podresources.v1 import api_pb2_grpc as pr_grpc
from vramshare import contract

TIMEOUT_S = 2.0


class PodResourcesError(Exception):
    """The kubelet's PodResources socket did not answer; the message says why."""


def held(response: pr.ListPodResourcesResponse, names: contract.Names) -> list[Held]:
    """Every ``ContainerDevices`` of our resources as a :class:`Held`, as the kubelet lists them.

    A real kubelet answers one entry per device ID, and one per NUMA node of its topology
    (``container_manager.go containerDevicesFromResourceDeviceInstances``), so a container holding 22
    units comes as 22 entries; :func:`deviceplugin.kubelet.reconcile.group` puts them back together per
    container and resource. ``entry`` is the pod's place in the answer: List names pods, not UIDs,
    and may list one name twice (a pod recreated under its name while the old one terminates)."""
    return [Held(pod.namespace, pod.name, container.name, devs.resource_name, tuple(devs.device_ids), i)
            for i, pod in enumerate(response.pod_resources) for container in pod.containers
            for devs in container.devices if names.is_ours(devs.resource_name) and devs.device_ids]


class KubeletPodResources:
    """``List`` over the kubelet's pod-resources socket."""

    def __init__(self, socket: str, names: contract.Names) -> None:
        self.socket = socket
        self._names = names

    def list(self) -> list[Held]:
        try:
            with grpc.insecure_channel(f"unix://{self.socket}") as channel:
                response = pr_grpc.PodResourcesListerStub(channel).List(pr.ListPodResourcesRequest(),
                                                                        timeout=TIMEOUT_S)
        except grpc.RpcError as exc:
            raise PodResourcesError(f"PodResources List on {self.socket}: {exc.code().name} "
                                    f"{exc.details() or ''}".rstrip()) from None
        return held(response, self._names)
