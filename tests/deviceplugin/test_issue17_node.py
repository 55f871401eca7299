"""Regression tests for issue 17, the node's share (items 1, 2, 11 node part, 12, 14), each failing on the
code before the fix (5527bda). The kubelet's PodResources here is an independent double written from
upstream's source, not our stand-in: ``pkg/kubelet/cm/container_manager.go
containerDevicesFromResourceDeviceInstances`` answers one ``ContainerDevices`` per device ID and NUMA node,
and ``pkg/kubelet/apis/podresources/server_v1.go List`` names pods without their UID. Imports only what
both versions have, so the file runs against either.
"""
from __future__ import annotations

import json
import os
import random
import stat
import threading
from concurrent import futures
from typing import Any

import grpc
import pytest

from deviceplugin.allocation import Refusal
from deviceplugin.backend import DiscoveredGpu
from deviceplugin.kubelet.allocator import Allocator
from deviceplugin.kubelet.main import DevicePluginDaemon
from deviceplugin.kubelet.reconcile import Held
from deviceplugin.kubelet.reconcile_loop import Reconciler
from deviceplugin.metrics import PluginMetrics
from deviceplugin.node_state import NodeState
from deviceplugin.quota import writer
from deviceplugin.quota_files import ALLOC_DIR, QuotaFiles, allocation_key
from deviceplugin.simulated_backend import SimulatedBackend
from protos.podresources.v1 import api_pb2 as pr
from protos.podresources.v1 import api_pb2_grpc as pr_grpc
from standins.apiserver import ApiServerDouble
from vramshare import contract
from vramshare.config import Config

from .conftest import MEM, NODE, TWO_GPUS
from .test_issue8_regressions import actual, bound_pod

NAMES = contract.Names()
Listed = tuple[str, str, list[tuple[str, list[tuple[str, str, Any]]]]]  # ns, name, [(container, [(res, id, numa)])]


class UpstreamPodResources(pr_grpc.PodResourcesListerServicer):
    """A PodResources server in upstream's shape, independent of vramshare's stand-ins: per container one
    ContainerDevices per device ID and per NUMA node of its topology, map order shuffled, no UID."""

    def __init__(self, socket: str, seed: int = 0) -> None:
        self.socket = socket
        self.pods: list[Listed] = []
        self.rng = random.Random(seed)
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        pr_grpc.add_PodResourcesListerServicer_to_server(self, self.server)
        os.makedirs(os.path.dirname(socket), exist_ok=True)
        self.server.add_insecure_port(f"unix://{socket}")
        self.server.start()

    def List(self, request: Any, context: Any) -> pr.ListPodResourcesResponse:
        out = []
        for ns, name, containers in self.pods:
            cs = []
            for cname, devs in containers:
                entries = []
                for resource, dev, numa in devs:
                    nodes = numa if isinstance(numa, (list, tuple)) else [numa]
                    for n in nodes:
                        topo = pr.TopologyInfo(nodes=[pr.NUMANode(ID=n)]) if n is not None else None
                        entries.append(pr.ContainerDevices(resource_name=resource, device_ids=[dev], topology=topo))
                self.rng.shuffle(entries)
                cs.append(pr.ContainerResources(name=cname, devices=entries))
            out.append(pr.PodResources(name=name, namespace=ns, containers=cs))
        self.rng.shuffle(out)
        return pr.ListPodResourcesResponse(pod_resources=out)

    def stop(self) -> None:
        self.server.stop(grace=None).wait()


@pytest.fixture
def upstream(short_dir):
    double = UpstreamPodResources(os.path.join(short_dir, "upr", "kubelet.sock"))
    yield double
    double.stop()


def cached(daemon: DevicePluginDaemon, api: ApiServerDouble, name: str) -> dict:
    """Wait until the plugin's pod cache has the API's current version of the pod; return it."""
    pod = api.get_pod("default", name)
    rv, uid = pod["metadata"]["resourceVersion"], pod["metadata"]["uid"]
    assert api.wait_for(lambda _: any(p["metadata"]["name"] == name and p["metadata"]["uid"] == uid
                                      and p["metadata"]["resourceVersion"] == rv for p in daemon.pods.pods()))
    return pod


def quota_mount(resp: Any) -> str:
    return next(m.host_path for m in resp.mounts if m.container_path == contract.CONTAINER_QUOTA_DIR)


def daemon_for(http: Any, kubelet: Any, short_dir: str, pod_resources_socket: str | None) -> DevicePluginDaemon:
    config = Config(quota_host_dir=os.path.join(short_dir, "q"))
    return DevicePluginDaemon(SimulatedBackend.from_dict(TWO_GPUS), config, kubelet.plugin_dir, node_name=NODE,
                              api=http, pod_resources_socket=pod_resources_socket, poll_seconds=0.02,
                              reconcile_seconds=3600)


def units(gpu: str, *ns: int) -> list[str]:
    return [contract.unit_device_id(gpu, n) for n in ns]


# -- item 1: one ContainerDevices per device ID ------------------------------------------------------------
def test_issue17_item1_a_container_of_22_units_gets_a_quota_link_that_resolves_and_is_never_pruned(
        api, http, kubelet, short_dir, upstream):
    """Old code keyed a directory per PodResources entry: with one entry per device, the link dangled and
    prune_allocations deleted the directory the container mounts."""
    bound_pod(api, "big", {"c": 22}, {"c": [("GPU-aaaa", 22 * 1024)]})
    ids = units("GPU-aaaa", *range(22))
    with daemon_for(http, kubelet, short_dir, upstream.socket) as daemon:
        kubelet.wait_registered([MEM])
        mounted = quota_mount(kubelet.allocate(MEM, list(reversed(ids))))
        # the kubelet lists each device on its own, some on two NUMA nodes (two entries for one ID)
        upstream.pods = [("default", "big", [("c", [(MEM, d, (0, 1) if i % 5 == 0 else 0) for i, d in enumerate(ids)])])]
        pod = cached(daemon, api, "big")
        daemon.reconciler.alloc_dir_ttl_s = 0.0  # prune anything nobody holds, now
        daemon.reconciler.run_once()
        link = os.path.join(os.path.join(short_dir, "q"), pod["metadata"]["uid"], "c")
        assert os.path.isfile(os.path.join(link, contract.QUOTA_FILE_NAME)), "the quota link dangles"
        assert os.path.realpath(link) == os.path.realpath(mounted)
        assert os.path.isdir(mounted), "prune removed the directory a live container mounts"
        assert actual(api, "big") == (contract.STATE_ALLOCATED, {"c": [{"uuid": "GPU-aaaa", "mib": 22 * 1024}]})
        daemon.reconciler.run_once()  # and a second round changes nothing
        assert os.path.isdir(mounted) and os.path.realpath(link) == os.path.realpath(mounted)


# -- item 2: no pod UID in PodResources --------------------------------------------------------------------
def test_issue17_item2_a_pod_recreated_under_its_name_never_takes_the_old_pods_gpus_or_quota_link(
        api, http, kubelet, short_dir, upstream):
    """Old code gave the new pod (new UID) the old pod's GPUs and linked it to the old quota directory while
    the kubelet still listed the old pod under the name, and both pods' GPUs when it listed both. (One
    device per container, so what fails here is the name, not item 1's one-entry-per-device.)"""
    bound_pod(api, "web-0", {"c": 1}, {"c": [("GPU-aaaa", 1024)]})
    old_ids, new_ids = units("GPU-aaaa", 0), units("GPU-bbbb", 0)
    old_entry = ("default", "web-0", [("c", [(MEM, d, 0) for d in old_ids])])
    new_entry = ("default", "web-0", [("c", [(MEM, d, 1) for d in new_ids])])
    with daemon_for(http, kubelet, short_dir, upstream.socket) as daemon:
        kubelet.wait_registered([MEM])
        root = os.path.join(short_dir, "q")
        old_dir = quota_mount(kubelet.allocate(MEM, old_ids))
        upstream.pods = [old_entry]
        old = cached(daemon, api, "web-0")
        daemon.reconciler.run_once()
        old_link = os.path.join(root, old["metadata"]["uid"], "c")
        assert os.path.realpath(old_link) == os.path.realpath(old_dir)
        # a StatefulSet deletes web-0 and makes it again; the kubelet still runs the old one (terminating)
        api.delete_pod("default", "web-0")
        bound_pod(api, "web-0", {"c": 1}, {"c": [("GPU-bbbb", 1024)]})
        new = cached(daemon, api, "web-0")
        new_link = os.path.join(root, new["metadata"]["uid"], "c")
        daemon.reconciler.run_once()
        assert actual(api, "web-0") == (contract.STATE_ASSUMED, {"c": [{"uuid": "GPU-bbbb", "mib": 1024}]}), \
            "the new pod was recorded with the old pod's GPUs"
        assert not os.path.lexists(new_link), "the new pod was linked to the old pod's quota directory"
        assert os.path.realpath(old_link) == os.path.realpath(old_dir), "the terminating pod lost its link"
        # the kubelet admits the new pod while the old one still terminates: List names web-0 twice
        new_dir = quota_mount(kubelet.allocate(MEM, new_ids))
        upstream.pods = [old_entry, new_entry]
        daemon.reconciler.run_once()
        assert actual(api, "web-0") == (contract.STATE_ALLOCATED, {"c": [{"uuid": "GPU-bbbb", "mib": 1024}]}), \
            "the new pod was recorded with both pods' GPUs or the old ones"
        assert os.path.realpath(new_link) == os.path.realpath(new_dir)
        assert os.path.realpath(old_link) == os.path.realpath(old_dir)
        # the old pod is gone from the kubelet: its link goes, the new one stays
        upstream.pods = [new_entry]
        daemon.reconciler.run_once()
        assert not os.path.lexists(old_link)
        assert os.path.realpath(new_link) == os.path.realpath(new_dir)
        assert actual(api, "web-0")[1] == {"c": [{"uuid": "GPU-bbbb", "mib": 1024}]}


class _Api:
    """The API server as the reconciler's patcher sees it: the name's UID now, patches recorded."""

    def __init__(self, uid: str) -> None:
        self.uid, self.patches = uid, []

    def uid_of(self, namespace: str, name: str) -> str | None:
        return self.uid

    def apply(self, patch: Any) -> dict:
        self.patches.append(patch)
        return {}


def test_issue17_item2_a_pod_cache_behind_a_forced_recreate_ties_nothing_to_the_old_uid(tmp_path):
    """Old code linked the stale cache's UID (a pod force-deleted and made again, the watch not there yet)
    to the new pod's allocation, and recorded it as the old pod's."""
    root = str(tmp_path / "q")
    config = Config(quota_host_dir=root)
    state = NodeState([DiscoveredGpu(0, "GPU-aaaa", "H100", 16 * 1024)], config)
    quota = QuotaFiles(root, config.quota)
    ids = units("GPU-aaaa", 3)
    Allocator(state, quota, PluginMetrics(), "n1").allocate(MEM, ids)  # the new pod's container
    stale = {"metadata": {"name": "web-0", "namespace": "ns", "uid": "uid-old", "resourceVersion": "1",
                          "annotations": {}},
             "spec": {"nodeName": "n1", "containers": [{"name": "c", "resources": {"limits": {MEM: "1"}}}]}}
    api = _Api("uid-new")
    pods = _Pods([stale])
    rec = Reconciler(state, "n1", quota, PluginMetrics(), _Listing([Held("ns", "web-0", "c", MEM, tuple(ids))]),
                     pods, api)
    rec.run_once()
    assert not os.path.lexists(os.path.join(root, "uid-old")), "the old UID was linked to the new pod's allocation"
    assert api.patches == []
    pods._pods = [{**stale, "metadata": {**stale["metadata"], "uid": "uid-new"}}]  # the watch catches up
    rec.run_once()
    assert os.path.realpath(os.path.join(root, "uid-new", "c")) == os.path.realpath(quota.allocation_dir(ids))
    assert [p.pod.uid for p in api.patches] == ["uid-new"]


# -- item 11 (node part): UIDs never leave the quota root --------------------------------------------------
class _Listing:
    def __init__(self, held: list[Held]) -> None:
        self.held = held

    def list(self) -> list[Held]:
        return self.held


class _Pods:
    def __init__(self, pods: list[dict]) -> None:
        self._pods = pods

    def pods(self) -> list[dict]:
        return self._pods

    def written(self, pod: dict) -> None:
        pass


@pytest.mark.parametrize("bad_uid", ["..", "ABS", "../..", "a/b"])
def test_issue17_item11_a_pod_uid_that_would_leave_the_quota_root_links_nothing(tmp_path, bad_uid):
    """Old code joined the cached pod's UID into ``<root>/<uid>/<container>`` unchecked: ``..`` or an
    absolute UID put a link outside the quota root."""
    outside = tmp_path / "outside"
    outside.mkdir()
    uid = str(outside) if bad_uid == "ABS" else bad_uid
    root = tmp_path / "base" / "q"
    config = Config(quota_host_dir=str(root))
    state = NodeState([DiscoveredGpu(0, "GPU-aaaa", "H100", 16 * 1024)], config)
    quota = QuotaFiles(str(root), config.quota)
    ids = units("GPU-aaaa", 0, 1)
    Allocator(state, quota, PluginMetrics(), "n1").allocate(MEM, ids)
    pod = {"metadata": {"name": "p", "namespace": "ns", "uid": uid, "resourceVersion": "1", "annotations": {}},
           "spec": {"nodeName": "n1", "containers": [{"name": "c", "resources": {"limits": {MEM: "2"}}}]}}
    before = sorted(os.listdir(tmp_path)), sorted(os.listdir(tmp_path / "base"))
    Reconciler(state, "n1", quota, PluginMetrics(), _Listing([Held("ns", "p", "c", MEM, tuple(ids))]),
               _Pods([pod]), None).run_once()
    assert (sorted(os.listdir(tmp_path)), sorted(os.listdir(tmp_path / "base"))) == before
    assert os.listdir(outside) == []
    assert sorted(os.listdir(root)) == [ALLOC_DIR]
    with pytest.raises(ValueError):
        quota.link(uid, "c", allocation_key(ids))
    assert os.listdir(outside) == [] and sorted(os.listdir(root)) == [ALLOC_DIR]


# -- item 12: PodResources down -----------------------------------------------------------------------------
def test_issue17_item12_without_pod_resources_an_allocate_no_single_plan_explains_is_refused_with_the_reason(
        api, http, kubelet, short_dir):
    """Old code granted it: the pod ran on GPUs its own assignment did not name, and nobody could record it."""
    bound_pod(api, "a", {"c": 2}, {"c": [("GPU-aaaa", 2048)]})
    bound_pod(api, "b", {"c": 2}, {"c": [("GPU-bbbb", 2048)]})
    with daemon_for(http, kubelet, short_dir, None) as daemon:  # no PodResources
        kubelet.wait_registered([MEM])
        cached(daemon, api, "a")
        cached(daemon, api, "b")
        with pytest.raises(grpc.RpcError) as err:
            kubelet.allocate(MEM, units("GPU-aaaa", 0, 1))  # a's plan, or b's pod on a's GPU? nobody can tell
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "PodResources" in err.value.details() and "different plans" in err.value.details()
        api.delete_pod("default", "b")  # now one pod of that size is assumed here: its plan decides
        assert api.wait_for(lambda _: all(p["metadata"]["name"] != "b" for p in daemon.pods.pods()))
        with pytest.raises(grpc.RpcError) as err:
            kubelet.allocate(MEM, units("GPU-bbbb", 0, 1))  # not a's plan
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "not these devices" in err.value.details()
        resp = kubelet.allocate(MEM, units("GPU-aaaa", 0, 1))  # exactly a's plan: granted
        assert resp.envs["NVIDIA_VISIBLE_DEVICES"] == "GPU-aaaa"


# -- item 14: FIFOs, links and the generation ---------------------------------------------------------------
def _allocator(root: str) -> tuple[Allocator, QuotaFiles]:
    config = Config(quota_host_dir=root)
    state = NodeState([DiscoveredGpu(0, "GPU-aaaa", "H100", 16 * 1024)], config)
    quota = QuotaFiles(root, config.quota)
    return Allocator(state, quota, PluginMetrics(), "n1"), quota


def test_issue17_item14_a_fifo_as_quota_json_does_not_stall_allocate(tmp_path):
    """Old code opened ``quota.json`` blocking, under the allocator's lock: a FIFO stalled every Allocate."""
    allocator, quota = _allocator(str(tmp_path / "q"))
    ids = units("GPU-aaaa", 0, 1)
    d = quota.allocation_dir(ids)
    os.makedirs(d)
    fifo = os.path.join(d, contract.QUOTA_FILE_NAME)
    os.mkfifo(fifo)
    done: list[Any] = []
    t = threading.Thread(target=lambda: done.append(allocator.allocate(MEM, ids)), daemon=True)
    t.start()
    t.join(20)
    stuck = t.is_alive()
    if stuck:  # free the old code's blocked open so the thread can end
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        t.join(5)
    assert not stuck, "Allocate blocked on a FIFO"
    assert done and stat.S_ISREG(os.lstat(fifo).st_mode)
    assert writer.read_quota(d).limits() == {"GPU-aaaa": 2048}


def test_issue17_item14_a_linked_allocation_directory_is_never_written_through(tmp_path):
    """Old code created ``quota.json`` inside whatever ``_alloc/<key>`` linked to."""
    allocator, quota = _allocator(str(tmp_path / "q"))
    ids = units("GPU-aaaa", 0, 1)
    target = tmp_path / "elsewhere"
    target.mkdir()
    os.makedirs(os.path.dirname(quota.allocation_dir(ids)))
    os.symlink(str(target), quota.allocation_dir(ids))
    with pytest.raises(Refusal) as err:
        allocator.allocate(MEM, ids)
    assert "not a directory" in str(err.value)
    assert os.listdir(target) == []


def test_issue17_item14_a_linked_quota_json_is_replaced_not_followed(tmp_path):
    allocator, quota = _allocator(str(tmp_path / "q"))
    ids = units("GPU-aaaa", 0, 1)
    secret = tmp_path / "secret.json"
    secret.write_text('{"generation": 5, "updated": "x", "gpus": []}')
    os.makedirs(quota.allocation_dir(ids))
    os.symlink(str(secret), os.path.join(quota.allocation_dir(ids), contract.QUOTA_FILE_NAME))
    allocator.allocate(MEM, ids)
    assert secret.read_text() == '{"generation": 5, "updated": "x", "gpus": []}'
    on_disk = writer.read_quota(quota.allocation_dir(ids))
    assert on_disk.generation == 1  # the link's target was not read either
    assert stat.S_ISREG(os.lstat(os.path.join(quota.allocation_dir(ids), contract.QUOTA_FILE_NAME)).st_mode)


def test_issue17_item14_a_generation_of_int64_max_is_never_written_past_int64(tmp_path):
    """Old code rewrote a generation of 2^63-1 as 2^63, which no int64 reader can hold."""
    d = tmp_path / "c"
    d.mkdir()
    (d / contract.QUOTA_FILE_NAME).write_text(json.dumps({"generation": 2**63 - 1, "updated": "x", "gpus": []}))
    written = writer.write_quota(str(d), writer.QuotaFile(gpus=(writer.GpuQuota("GPU-a", 10, 0, 10),)))
    assert written.generation <= 2**63 - 1
    assert json.loads((d / contract.QUOTA_FILE_NAME).read_text())["generation"] <= 2**63 - 1
    written = writer.write_quota(str(d), writer.QuotaFile(gpus=(writer.GpuQuota("GPU-a", 10, 0, 10),), generation=2**70))
    assert written.generation <= 2**63 - 1


def test_issue17_item14_the_quota_loops_write_never_follows_a_link_out_of_the_quota_root(tmp_path):
    """A ``<uid>/<container>`` link planted to lead outside the root: the writer refuses, the target stays
    empty (old code wrote ``quota.json`` there)."""
    root = tmp_path / "q"
    outside = tmp_path / "elsewhere"
    (root / "uid-1").mkdir(parents=True)
    outside.mkdir()
    os.symlink(str(outside), str(root / "uid-1" / "c"))
    with pytest.raises(ValueError):
        writer.write_quota(writer.container_dir(str(root), "uid-1", "c"),
                           writer.QuotaFile(gpus=(writer.GpuQuota("GPU-a", 10, 0, 10),)), root=str(root))
    assert os.listdir(outside) == []
