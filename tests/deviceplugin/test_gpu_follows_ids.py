"""The GPU follows the device IDs, against the API server double (real kubernetes client) and the stand-in
kubelet (real gRPC): Allocate grants what the IDs name and makes no API call; the reconciler then writes
each pod's actual GPUs from PodResources (also for pods that bypassed the scheduler), links the quota
directory, survives conflicts, runs before Register on a restart, and refuses to guess without
PodResources. The regression tests for issue 8 items 1, 5 and 8 are in test_issue8_regressions.py."""
from __future__ import annotations

import json
import os

from deviceplugin.inventory_file import load
from deviceplugin.kubelet.main import DevicePluginDaemon
from deviceplugin.quota import writer
from deviceplugin.quota_files import allocation_key
from deviceplugin.simulated_backend import SimulatedBackend
from standins.apiserver import ApiServerDouble
from vramshare import contract
from vramshare.config import Config
from vramshare.inventory import NodeInventory

from .conftest import MEM, MIXED, NODE

NAMES = contract.Names()
H100, A100 = load(MIXED)


def bound_pod(api: ApiServerDouble, name: str, containers: dict[str, int], plan: dict[str, list[tuple[str, int]]]
              | None = None, assume: int = 100, **ann: str) -> dict:
    """A pod bound to NODE; with ``plan`` the extender's annotations (assumed), without: it bypassed it."""
    annotations = dict(ann)
    if plan is not None:
        annotations.update({
            NAMES.assignment: json.dumps({c: [{"uuid": u, "mib": m} for u, m in g] for c, g in plan.items()}),
            NAMES.assume_time: str(assume), NAMES.allocation_state: contract.STATE_ASSUMED})
    return api.create_pod({
        "metadata": {"name": name, "namespace": "default", "annotations": annotations},
        "spec": {"nodeName": NODE, "containers": [
            {"name": c, "image": "vllm", "resources": {"limits": {MEM: str(n)}}} for c, n in containers.items()]},
        "status": {"phase": "Pending"},
    })


def annotations(api: ApiServerDouble, name: str) -> dict:
    return api.get_pod("default", name)["metadata"].get("annotations") or {}


def actual(api: ApiServerDouble, name: str) -> tuple[str | None, dict | None]:
    ann = annotations(api, name)
    text = ann.get(NAMES.assignment)
    return ann.get(NAMES.allocation_state), (json.loads(text) if text else None)


def synced(daemon: DevicePluginDaemon, api: ApiServerDouble, name: str) -> None:
    """The pod cache has the pod's current version (watch events are asynchronous)."""
    rv = api.get_pod("default", name)["metadata"]["resourceVersion"]
    assert api.wait_for(lambda _: any(p["metadata"]["name"] == name and p["metadata"]["resourceVersion"] == rv
                                      for p in daemon.pods.pods()))


def test_allocate_grants_the_ids_gpu_and_the_reconciler_records_it(api, http, kubelet, start_plugin, config):
    pod = bound_pod(api, "p", {"vllm": 4}, {"vllm": [(H100.uuid, 4096)]})
    daemon = start_plugin(api=http)
    synced(daemon, api, "p")
    ids = kubelet.preferred(MEM, kubelet.healthy_ids(MEM), 4)
    resp = kubelet.allocate(MEM, ids, pod=("default", "p", "vllm"))
    assert resp.envs["NVIDIA_VISIBLE_DEVICES"] == H100.uuid and resp.envs["VRAMSHARE_MEMORY_LIMIT_MIB"] == "4096"
    alloc_dir = os.path.join(config.quota_host_dir, "_alloc", allocation_key(ids))
    assert resp.mounts[0].host_path == alloc_dir and os.path.exists(os.path.join(alloc_dir, "quota.json"))
    done = daemon.reconciler.run_once()
    assert done.patched == ["default/p"]
    assert actual(api, "p") == (contract.STATE_ALLOCATED, {"vllm": [{"uuid": H100.uuid, "mib": 4096}]})
    link = os.path.join(config.quota_host_dir, pod["metadata"]["uid"], "vllm")
    assert os.path.realpath(link) == os.path.realpath(alloc_dir)  # the quota loop's path reaches the file
    assert daemon.reconciler.owners()[allocation_key(ids)].pod == "p"
    assert daemon.reconciler.run_once().patched == []  # already says so: no second patch
    # the quota loop writes through the pod's path and the container's mount sees it
    writer.write_quota(writer.container_dir(config.quota_host_dir, pod["metadata"]["uid"], "vllm"),
                       writer.QuotaFile(gpus=(writer.GpuQuota(H100.uuid, 3000, 2048, 6144),)))
    assert writer.read_quota(alloc_dir).limits() == {H100.uuid: 3000}
    kubelet.forget_pod("default", "p")  # the pod ended: its link goes, the allocation's directory stays a while
    daemon.reconciler.run_once()
    assert not os.path.lexists(link) and os.path.isdir(alloc_dir)
    daemon.reconciler.alloc_dir_ttl_s = 0.0
    daemon.reconciler.run_once()
    assert not os.path.exists(alloc_dir)


def test_a_late_re_allocate_moves_the_books_with_the_container(api, http, kubelet, start_plugin):
    pod = bound_pod(api, "p", {"c": 2}, {"c": [(H100.uuid, 2048)]})
    daemon = start_plugin(api=http)
    synced(daemon, api, "p")
    kubelet.admit(api.get_pod("default", "p"))
    daemon.reconciler.run_once()
    assert actual(api, "p")[0] == contract.STATE_ALLOCATED
    held = set(kubelet.manager.holdings()[("default", "p")]["c"][MEM])
    kubelet.reallocate(pod["metadata"]["uid"], "c")  # the cached devices were lost: Allocate again
    now = set(kubelet.manager.holdings()[("default", "p")]["c"][MEM])
    assert len(now) == 2 and kubelet.manager.allocate_calls == 2
    synced(daemon, api, "p")
    daemon.reconciler.run_once()
    assert actual(api, "p") == (contract.STATE_ALLOCATED, {"c": [{"uuid": H100.uuid, "mib": 2048}]})
    assert held or now  # the IDs may differ; the books follow whatever the kubelet holds


def test_a_pod_that_bypassed_the_scheduler_gets_an_assignment_from_reality(api, http, kubelet, start_plugin):
    bound_pod(api, "rogue", {"c": 5})  # schedulerName forgotten: no plan at all
    daemon = start_plugin(api=http)
    synced(daemon, api, "rogue")
    kubelet.admit(api.get_pod("default", "rogue"))
    daemon.reconciler.run_once()
    assert actual(api, "rogue") == (contract.STATE_ALLOCATED, {"c": [{"uuid": H100.uuid, "mib": 5120}]})


def test_a_conflicting_patch_waits_for_the_next_round(api, http, kubelet, start_plugin):
    bound_pod(api, "p", {"c": 1}, {"c": [(H100.uuid, 1024)]})
    daemon = start_plugin(api=http)
    synced(daemon, api, "p")
    kubelet.admit(api.get_pod("default", "p"))
    api.fail_next("PATCH", r"/pods/p$", code=409)
    assert "default/p" in daemon.reconciler.run_once().failed
    assert actual(api, "p")[0] == contract.STATE_ASSUMED
    assert daemon.reconciler.run_once().patched == ["default/p"]


def test_a_restarted_plugin_reconciles_before_it_registers(api, http, kubelet, short_dir):
    bound_pod(api, "p", {"c": 2}, {"c": [(H100.uuid, 2048)]})
    config = Config(quota_host_dir=os.path.join(short_dir, "q"))
    with DevicePluginDaemon(SimulatedBackend.from_file(MIXED), config, kubelet.plugin_dir, node_name=NODE,
                            pod_resources_socket=kubelet.pod_resources_socket, poll_seconds=0.02):
        kubelet.wait_registered([MEM])  # standalone: cannot write annotations
        kubelet.admit(api.get_pod("default", "p"))
    assert actual(api, "p")[0] == contract.STATE_ASSUMED
    registered = kubelet.registrations.get(MEM, 0)
    daemon = DevicePluginDaemon(SimulatedBackend.from_file(MIXED), config, kubelet.plugin_dir, node_name=NODE,
                                api=http, pod_resources_socket=kubelet.pod_resources_socket, poll_seconds=0.02)
    try:
        daemon.start()  # returns after the start-up round; Register happens on the kubelet-watch thread
        assert actual(api, "p") == (contract.STATE_ALLOCATED, {"c": [{"uuid": H100.uuid, "mib": 2048}]})
        kubelet.wait_for(lambda: kubelet.registrations.get(MEM, 0) > registered, what="Register")
    finally:
        daemon.close()


def test_the_node_inventory_is_published_on_start_and_on_health_changes_only(api, http, kubelet, backend,
                                                                              start_plugin):
    start_plugin(api=http)

    def inventory(d: ApiServerDouble) -> NodeInventory | None:
        text = (d.get_node(NODE)["metadata"].get("annotations") or {}).get(NAMES.inventory)
        return NodeInventory.from_json(text) if text else None

    assert api.wait_for(lambda d: inventory(d) is not None)
    published = inventory(api)
    assert [(g.uuid, g.units, g.numa_node, g.healthy) for g in published.gpus] == [
        (H100.uuid, 79, 0, True), (A100.uuid, 0, 1, True)]
    assert [m.profile for m in published.gpus[1].mig] == ["3g.40gb", "2g.20gb", "1g.10gb"]
    backend.inject_xid(H100.uuid, 79)
    assert api.wait_for(lambda d: not inventory(d).gpus[0].healthy)
    backend.inject_xid(H100.uuid, 48)  # already unhealthy: no change, no patch
    backend.recover(H100.uuid)
    assert api.wait_for(lambda d: inventory(d).gpus[0].healthy)
    assert api.count("PATCH", rf"/nodes/{NODE}$") == 3


def _scrape(daemon: DevicePluginDaemon) -> str:
    from prometheus_client import generate_latest
    return generate_latest(daemon.metrics.registry).decode()


def test_the_reconcile_thread_records_a_pod_soon_after_its_allocate(api, http, kubelet, start_plugin):
    bound_pod(api, "two", {"a": 1, "b": 1}, {"a": [(H100.uuid, 1024)], "b": [(H100.uuid, 1024)]})
    daemon = start_plugin(api=http, reconcile_seconds=60.0)  # only the wake-up after Allocate can do it
    synced(daemon, api, "two")
    kubelet.admit(api.get_pod("default", "two"))
    assert api.wait_for(lambda _: actual(api, "two")[0] == contract.STATE_ALLOCATED, timeout=5)
