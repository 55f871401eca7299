"""Conformance: the kubelet stand-in's PodResources answers in upstream's exact shape, over its real socket.

* ``pkg/kubelet/cm/container_manager.go containerDevicesFromResourceDeviceInstances``: one
  ``ContainerDevices`` per device ID without topology, else one per NUMA node of its topology, each with
  that single ID and that single node; over ``pkg/kubelet/cm/devicemanager/pod_devices.go
  getContainerDevices``, which reads the NUMA nodes recorded at Allocate (``allocDevicesWithNUMA``).
* ``pkg/kubelet/apis/podresources/server_v1.go List``: active pods, namespace and name only (no UID),
  restartable init containers then app containers, every container listed (devices or not); ``Get``:
  the pod the pod manager knows by that name, and ``fmt.Errorf("pod %s in namespace %s not found")``
  otherwise, which gRPC carries as ``Unknown``.
Our kubelet stand-in answered one entry per resource with every ID in it (issue 17 item 1).
"""
from __future__ import annotations

import os
import random
import shutil
import tempfile
from typing import Any, Iterator

import grpc
import pytest

from protos.podresources.v1 import api_pb2 as pr
from protos.podresources.v1 import api_pb2_grpc as pr_grpc
from standins.devicemanager import FnEndpoint
from standins.kubelet import FakeKubelet

R, OTHER = "vramshare.io/gpu-memory", "vramshare.io/gpu"


@pytest.fixture
def kubelet() -> Iterator[FakeKubelet]:
    d = tempfile.mkdtemp(prefix="vs-", dir="/tmp")
    k = FakeKubelet(os.path.join(d, "dp"), os.path.join(d, "pr", "kubelet.sock"), rng=random.Random(3))
    k.start()
    yield k
    k.stop()
    shutil.rmtree(d, ignore_errors=True)


def stub(k: FakeKubelet) -> Any:
    return pr_grpc.PodResourcesListerStub(grpc.insecure_channel(f"unix://{k.pod_resources_socket}"))


def pod(name: str, uid: str, limits: dict[str, int], sidecar: int = 0, init: int = 0) -> dict:
    spec: dict[str, Any] = {"containers": [{"name": "app", "resources": {"limits": {r: str(n) for r, n in limits.items()}}},
                                           {"name": "plain"}]}
    inits = []
    if sidecar:
        inits.append({"name": "side", "restartPolicy": "Always", "resources": {"limits": {R: str(sidecar)}}})
    if init:
        inits.append({"name": "setup", "resources": {"limits": {OTHER: str(init)}}})
    if inits:
        spec["initContainers"] = inits
    return {"metadata": {"name": name, "namespace": "ns", "uid": uid,
                         "creationTimestamp": "2026-12-01T10:00:00Z"}, "spec": spec}


def setup(k: FakeKubelet, topology: dict[str, tuple[int, ...]]) -> None:
    """Register both resources in-process with devices of the given NUMA topology."""
    with k._cond:  # the stand-in's own lock; the devices come as a ListAndWatch message would bring them
        for resource in (R, OTHER):
            k.manager.register(resource, FnEndpoint(lambda a, m, s: [], lambda ids: None))
            k.manager.update_devices(resource, [(d, True, topology.get(d, ())) for d in sorted(topology)
                                                if d.startswith("m" if resource == R else "g")])


def entries(p: pr.PodResources) -> dict[str, list[tuple[str, tuple[str, ...], tuple[int, ...] | None]]]:
    return {c.name: sorted((d.resource_name, tuple(d.device_ids),
                            tuple(n.ID for n in d.topology.nodes) if d.HasField("topology") else None)
                           for d in c.devices) for c in p.containers}


def test_two_devices_on_two_numa_nodes_give_upstreams_entries(kubelet):
    """container_manager.go containerDevicesFromResourceDeviceInstances: per device, per NUMA node."""
    setup(kubelet, {"m0": (0,), "m1": (1,), "m2": (0, 1), "m3": (), "g0": (1,)})
    with kubelet._cond:
        kubelet.manager.admit(pod("p", "uid-1", {R: 4, OTHER: 1}))
    [listed] = stub(kubelet).List(pr.ListPodResourcesRequest(), timeout=5).pod_resources
    assert (listed.namespace, listed.name) == ("ns", "p")
    assert [f.name for f, _ in listed.ListFields()] == ["name", "namespace", "containers"]  # no UID anywhere
    assert entries(listed) == {
        "app": [(OTHER, ("g0",), (1,)),
                (R, ("m0",), (0,)), (R, ("m1",), (1,)), (R, ("m2",), (0,)), (R, ("m2",), (1,)), (R, ("m3",), None)],
        "plain": []}
    assert all(len(d.device_ids) == 1 for c in listed.containers for d in c.devices)


def test_entry_order_follows_go_maps_not_sorted_ids(kubelet):
    setup(kubelet, {f"m{i}": (i % 2,) for i in range(8)})
    with kubelet._cond:
        kubelet.manager.admit(pod("p", "uid-1", {R: 8}))
    orders = {tuple(d.device_ids[0] for d in stub(kubelet).List(pr.ListPodResourcesRequest(), timeout=5)
                    .pod_resources[0].containers[0].devices) for _ in range(6)}
    assert len(orders) > 1


def test_restartable_init_containers_come_first_and_plain_init_containers_are_not_listed(kubelet):
    """server_v1.go List: IsRestartableInitContainer ones, then spec.containers; others skipped."""
    setup(kubelet, {"m0": (0,), "m1": (0,), "m2": (0,), "g0": (0,)})
    with kubelet._cond:
        kubelet.manager.admit(pod("p", "uid-1", {R: 2}, sidecar=1, init=1))
    [listed] = stub(kubelet).List(pr.ListPodResourcesRequest(), timeout=5).pod_resources
    assert [c.name for c in listed.containers] == ["side", "app", "plain"]


def test_get_answers_the_newest_pod_of_the_name_and_unknown_for_none(kubelet):
    """server_v1.go Get: GetPodByName; a name listed twice (the old pod terminating) gives the newest."""
    setup(kubelet, {"m0": (0,), "m1": (1,)})
    with kubelet._cond:
        kubelet.manager.admit(pod("web-0", "uid-old", {R: 1}))
        kubelet.manager.admit(pod("web-0", "uid-new", {R: 1}))
        old = {d for g in kubelet.manager.pods["uid-old"].containers["app"].values() for d in g.device_ids}
        new = {d for g in kubelet.manager.pods["uid-new"].containers["app"].values() for d in g.device_ids}
    listed = stub(kubelet).List(pr.ListPodResourcesRequest(), timeout=5).pod_resources
    assert sorted(p.name for p in listed) == ["web-0", "web-0"]  # both, told apart by nothing but devices
    got = stub(kubelet).Get(pr.GetPodResourcesRequest(pod_name="web-0", pod_namespace="ns"), timeout=5)
    assert {d.device_ids[0] for c in got.pod_resources.containers for d in c.devices} == new != old
    with pytest.raises(grpc.RpcError) as err:
        stub(kubelet).Get(pr.GetPodResourcesRequest(pod_name="nope", pod_namespace="ns"), timeout=5)
    assert err.value.code() == grpc.StatusCode.UNKNOWN
    assert err.value.details() == "pod nope in namespace ns not found"
