"""Regression tests for issue 8 (items 1, 5 and 8), each failing on the starting code (b53af7f): there,
Allocate guessed the pod by assume-time and handed out *its* GPU and quota directory, forgot what it had
served on a restart, and listed/patched pods on the kubelet's admission path. Imports only what both
versions have, so the file runs against either."""
from __future__ import annotations

import json
import os

from deviceplugin.inventory_file import load
from deviceplugin.kubelet.main import DevicePluginDaemon
from deviceplugin.simulated_backend import SimulatedBackend
from standins.apiserver import ApiServerDouble
from vramshare import contract
from vramshare.config import Config

from .conftest import MEM, MIXED, NODE, TWO_GPUS

NAMES = contract.Names()
H100, A100 = load(MIXED)


def bound_pod(api: ApiServerDouble, name: str, containers: dict[str, int], plan: dict[str, list[tuple[str, int]]],
              assume: int = 100) -> dict:
    """A pod the extender bound to NODE with its plan (assumed), written as the extender writes it."""
    return api.create_pod({
        "metadata": {"name": name, "namespace": "default", "annotations": {
            NAMES.assignment: json.dumps({c: [{"uuid": u, "mib": m} for u, m in g] for c, g in plan.items()}),
            NAMES.assume_time: str(assume), NAMES.allocation_state: contract.STATE_ASSUMED}},
        "spec": {"nodeName": NODE, "containers": [
            {"name": c, "image": "vllm", "resources": {"limits": {MEM: str(n)}}} for c, n in containers.items()]},
        "status": {"phase": "Pending"},
    }, manager=contract.FIELD_MANAGER_EXTENDER)


def actual(api: ApiServerDouble, name: str) -> tuple[str | None, dict | None]:
    ann = api.get_pod("default", name)["metadata"].get("annotations") or {}
    text = ann.get(NAMES.assignment)
    return ann.get(NAMES.allocation_state), (json.loads(text) if text else None)


def in_cache(daemon: DevicePluginDaemon, api: ApiServerDouble, name: str) -> None:
    """The plugin's pod cache has the pod's current version (watch events are asynchronous)."""
    rv = api.get_pod("default", name)["metadata"]["resourceVersion"]
    cached = getattr(daemon.pods, "pods", None)
    listing = cached if callable(cached) else (lambda: daemon.pods.pending_pods())  # the old cache's name
    assert api.wait_for(lambda _: any(p["metadata"]["name"] == name and p["metadata"]["resourceVersion"] == rv
                                      for p in listing()))


def test_issue8_item1_same_size_pods_admitted_in_the_other_order_keep_their_own_gpus(api, http, kubelet, short_dir):
    """Old code gave the kubelet's second pod the first pod's GPU and quota directory (oldest assume-time)."""
    older = bound_pod(api, "older", {"c": 3}, {"c": [("GPU-aaaa", 3072)]}, assume=1_000)
    newer = bound_pod(api, "newer", {"c": 3}, {"c": [("GPU-bbbb", 3072)]}, assume=2_000)
    config = Config(quota_host_dir=os.path.join(short_dir, "q"))
    with DevicePluginDaemon(SimulatedBackend.from_dict(TWO_GPUS), config, kubelet.plugin_dir, node_name=NODE,
                            api=http, pod_resources_socket=kubelet.pod_resources_socket, poll_seconds=0.02) as daemon:
        kubelet.wait_registered([MEM])
        # the kubelet admits "newer" first (its creation order) and hands it units of GPU-bbbb
        resp = kubelet.allocate(MEM, ["GPU-bbbb::0", "GPU-bbbb::1", "GPU-bbbb::2"], pod=("default", "newer", "c"))
        assert resp.envs["NVIDIA_VISIBLE_DEVICES"] == "GPU-bbbb"
        assert older["metadata"]["uid"] not in resp.mounts[0].host_path
        # ... and then "older" gets units of GPU-bbbb too (the kubelet's choice): it runs there
        resp = kubelet.allocate(MEM, ["GPU-bbbb::3", "GPU-bbbb::4", "GPU-bbbb::5"], pod=("default", "older", "c"))
        assert resp.envs["NVIDIA_VISIBLE_DEVICES"] == "GPU-bbbb"
        in_cache(daemon, api, "older")
        in_cache(daemon, api, "newer")
        daemon.reconciler.run_once()
    # the books now say where each one runs, not where it was planned
    assert actual(api, "older") == (contract.STATE_ALLOCATED, {"c": [{"uuid": "GPU-bbbb", "mib": 3072}]})
    assert actual(api, "newer") == (contract.STATE_ALLOCATED, {"c": [{"uuid": "GPU-bbbb", "mib": 3072}]})
    assert newer["metadata"]["uid"] != older["metadata"]["uid"]


def test_issue8_item5_a_restart_without_pod_resources_never_hands_out_a_previous_quota_dir(api, http, kubelet,
                                                                                            start_plugin, config,
                                                                                            request):
    """Old code forgot what it had served and gave the next Allocate of that size the same pod's directory."""
    bound_pod(api, "two", {"a": 2, "b": 2}, {"a": [(H100.uuid, 2048)], "b": [(H100.uuid, 2048)]})
    first = start_plugin(api=http)
    in_cache(first, api, "two")
    got_a = kubelet.allocate(MEM, kubelet.healthy_ids(MEM)[:2])
    first.close()
    kubelet.wait_for(lambda: not kubelet.plugin(MEM).connected, what="the old stream to end")
    second = DevicePluginDaemon(SimulatedBackend.from_file(MIXED), config, kubelet.plugin_dir, node_name=NODE,
                                api=http, poll_seconds=0.02)  # no PodResources socket
    request.addfinalizer(second.close)
    second.start()
    kubelet.wait_registered([MEM])
    kubelet.wait_for(lambda: kubelet.plugin(MEM).connected, what="the new stream")
    in_cache(second, api, "two")
    got_b = kubelet.allocate(MEM, kubelet.healthy_ids(MEM)[2:4])
    assert got_b.mounts[0].host_path != got_a.mounts[0].host_path
    assert got_b.envs["NVIDIA_VISIBLE_DEVICES"] == H100.uuid
    # and without PodResources nothing is guessed: the pod keeps the extender's plan
    assert second.reconciler.run_once().pod_resources is False
    assert actual(api, "two")[0] == contract.STATE_ASSUMED


def test_issue8_item8_allocate_makes_no_api_call_and_works_with_the_api_server_down(api, http, kubelet, start_plugin):
    """Old code listed and patched pods inside Allocate: with the API server down, admission failed."""
    bound_pod(api, "p", {"c": 4}, {"c": [(H100.uuid, 4096)]})
    daemon = start_plugin(api=http)
    in_cache(daemon, api, "p")
    before = api.count()
    resp = kubelet.allocate(MEM, kubelet.healthy_ids(MEM)[:4])
    assert resp.envs["NVIDIA_VISIBLE_DEVICES"] == H100.uuid
    assert api.count() == before  # not one request
    api.stop()
    for n in (4, 8):
        resp = kubelet.allocate(MEM, kubelet.healthy_ids(MEM)[n:n + 4])
        assert resp.envs["VRAMSHARE_MEMORY_LIMIT_MIB"] == "4096"
    whole = kubelet.allocate("vramshare.io/mig-1g.10gb", [A100.mig[2].uuid])
    assert whole.envs["NVIDIA_VISIBLE_DEVICES"] == A100.mig[2].uuid
