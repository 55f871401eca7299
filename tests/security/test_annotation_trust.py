"""Trust by writer (issue 18 item 2): the extender believes an assignment only from vramshare's field managers.

The attacker is a user with the rights every namespace user has (update their own pods), writing
through the official ``kubernetes`` client as ``kubectl annotate`` would; the API double records
``metadata.managedFields`` as the real server does (tests/standins/test_apiserver_double_managed_fields.py).
On main the extender read every ``vramshare.io/*`` annotation by its shape alone: each attack below held
or over-committed a GPU.
"""
from __future__ import annotations

import time
from typing import Callable, Iterator

import orjson
import pytest
from kubernetes import client

from deviceplugin.assignment import PodRef
from deviceplugin.kubelet.kube_adapter import PodPatcher
from deviceplugin.kubelet.reconcile import Patch
from extender import main
from standins.apiserver import ApiServerDouble
from tests.extender import builders as b
from vramshare import contract
from vramshare.kube import api_client_for

N = b.NAMES
MERGE = "application/merge-patch+json"
GPU = b.uuid_of("n1", 0)


class Cluster:
    def __init__(self, api: ApiServerDouble, ext: main.RunningExtender, http: client.ApiClient) -> None:
        self.api, self.ext, self.v1 = api, ext, client.CoreV1Api(http)
        self.http = http

    def wait(self, what: Callable[[], bool], timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not what():
            assert time.monotonic() < deadline, "the extender's cache never caught up"
            time.sleep(0.02)

    def used(self) -> int:
        with self.ext.acct.lock:
            return sum(u.used for u in self.ext.acct.state.node_usage("n1"))

    def forge(self, name: str, state: str, mib: int, containers: tuple[str, ...] = ("c0",),
              manager: str = "kubectl-annotate") -> None:
        """What a user can write on their own pod (metadata is theirs to update)."""
        text = orjson.dumps({c: [{"uuid": GPU, "mib": mib}] for c in containers}).decode()
        done = self.v1.patch_namespaced_pod(name, "default", {"metadata": {"annotations": {
            N.assignment: text, N.assume_time: str(time.time_ns()), N.allocation_state: state}}},
            _content_type=MERGE, field_manager=manager)
        self.seen(name, done.metadata.resource_version)

    def seen(self, name: str, rv: str) -> None:
        """Wait until the extender's cache holds ``rv`` of the pod (or a later one)."""
        def current() -> int:
            with self.ext.acct.lock:
                pod = self.ext.acct.pods.get(f"default/{name}") or {}
            return int((pod.get("metadata") or {}).get("resourceVersion") or 0)
        self.wait(lambda: current() >= int(rv))

    def filter_passes(self, gib: int) -> bool:
        args = {"Pod": b.pod("asker", gib, uid="asker-uid"), "NodeNames": ["n1"]}
        out = self.ext.app.handle("POST", "/filter", orjson.dumps(args))
        return "n1" in (orjson.loads(out.body).get("NodeNames") or [])


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    with ApiServerDouble() as api:
        api.create_node(b.gpu_node("n1", b.a100()))
        with main.start_for_url(api.url) as ext, api_client_for(api.url) as http:
            assert ext.wait_ready(10)
            yield Cluster(api, ext, http)


def test_a_forged_assumed_assignment_on_a_pending_pod_holds_nothing(cluster: Cluster) -> None:
    """The issue's attack: a user's pending pod with an ``assumed`` 79 GiB assignment, its assume-time
    rewritten every 3 s, kept the GPU full for as long as the user kept writing."""
    cluster.api.create_pod(b.pod("mallory", 1))
    for _ in range(3):
        cluster.forge("mallory", contract.STATE_ASSUMED, 79 * 1024)
    assert cluster.used() == 0 and len(cluster.ext.acct.holds) == 0
    assert cluster.filter_passes(60)


def test_a_forged_plan_holds_no_size_on_the_node(cluster: Cluster) -> None:
    """A forged two-container plan blocked every pod of its size on the node for the hold timeout."""
    cluster.api.create_pod(b.pod("mallory", 20, containers=2))
    cluster.forge("mallory", contract.STATE_ASSUMED, 20 * 1024, containers=("c0", "c1"))
    assert len(cluster.ext.acct.holds) == 0
    assert cluster.filter_passes(20)


@pytest.mark.parametrize("mib", [79 * 1024, 16 * 1024 * 1024 * 1024])
def test_a_forged_allocated_report_counts_nothing_over_capacity_or_beyond_the_request(
        cluster: Cluster, mib: int) -> None:
    """A bound pod asking 1 GiB with a forged ``allocated`` 79 GiB (or 16 TiB) assignment was counted
    for good, over capacity: the GPU took no pod until the attacker's pod ended."""
    cluster.api.create_pod(b.pod("mallory", 1))
    cluster.api.bind_pod("default", "mallory", "n1")
    cluster.forge("mallory", contract.STATE_ALLOCATED, mib)
    assert cluster.used() <= 1024
    assert cluster.filter_passes(60)


def test_our_managers_writing_is_believed_end_to_end(cluster: Cluster) -> None:
    cluster.api.create_pod(b.pod("good", 20, uid="ignored"))
    cluster.wait(lambda: "default/good" in cluster.ext.acct.pods)
    pod = cluster.api.get_pod("default", "good")
    out = cluster.ext.app.handle("POST", "/bind", orjson.dumps({
        "PodName": "good", "PodNamespace": "default", "PodUID": pod["metadata"]["uid"], "Node": "n1"}))
    assert orjson.loads(out.body).get("Error", "") == ""
    written = cluster.api.get_pod("default", "good")
    assert {e["manager"] for e in written["metadata"]["managedFields"]} >= {contract.FIELD_MANAGER_EXTENDER}
    cluster.seen("good", written["metadata"]["resourceVersion"])
    assert cluster.used() == 20 * 1024 and "default/good" not in cluster.ext.acct.untrusted
    # the device plugin reports it allocated (its own field manager, server-side apply)
    report = orjson.dumps({"c0": [{"uuid": GPU, "mib": 20 * 1024}]}).decode()
    PodPatcher(cluster.http, N).apply(Patch(PodRef("default", "good", pod["metadata"]["uid"],
                                                   written["metadata"]["resourceVersion"]), report))
    cluster.wait(lambda: cluster.ext.acct._held.get("default/good") is not None  # noqa: SLF001
                 and cluster.ext.acct._held["default/good"].allocated)  # noqa: SLF001
    assert cluster.used() == 20 * 1024 and "default/good" not in cluster.ext.acct.untrusted


def test_what_was_ignored_is_logged_and_metered(cluster: Cluster, caplog: pytest.LogCaptureFixture) -> None:
    cluster.api.create_pod(b.pod("mallory", 1))
    cluster.forge("mallory", contract.STATE_ASSUMED, 79 * 1024)
    scrape = cluster.ext.app.handle("GET", "/metrics", b"").body.decode()
    assert 'vramshare_extender_untrusted_annotations_total{state="assumed"}' in scrape
    assert "vramshare_extender_cache_untrusted_pods 1.0" in scrape
    assert "kubectl-annotate" in cluster.ext.acct.untrusted["default/mallory"]


def test_a_forged_report_cannot_move_a_pods_memory_to_another_gpu(cluster: Cluster) -> None:
    """Our own bind booked the pod on GPU 0; a forged ``allocated`` naming GPU 1 (within the pod's
    request and GPU 1's room) would leave GPU 0 looking free while the pod really uses it."""
    cluster.api.create_node(b.gpu_node("n2", b.a100(), b.a100()))
    cluster.api.create_pod(b.pod("victim", 40, uid="ignored"))
    cluster.wait(lambda: "default/victim" in cluster.ext.acct.pods and "n2" in cluster.ext.acct.slots)
    uid = cluster.api.get_pod("default", "victim")["metadata"]["uid"]
    out = cluster.ext.app.handle("POST", "/bind", orjson.dumps({
        "PodName": "victim", "PodNamespace": "default", "PodUID": uid, "Node": "n2"}))
    assert orjson.loads(out.body).get("Error", "") == ""
    booked = orjson.loads(cluster.api.get_pod("default", "victim")["metadata"]["annotations"][N.assignment])
    real_gpu = booked["c0"][0]["uuid"]
    other = b.uuid_of("n2", 1) if real_gpu == b.uuid_of("n2", 0) else b.uuid_of("n2", 0)
    done = cluster.v1.patch_namespaced_pod("victim", "default", {"metadata": {"annotations": {
        N.assignment: orjson.dumps({"c0": [{"uuid": other, "mib": 40 * 1024}]}).decode(),
        N.allocation_state: contract.STATE_ALLOCATED}}}, _content_type=MERGE, field_manager="kubectl-annotate")
    cluster.seen("victim", done.metadata.resource_version)
    with cluster.ext.acct.lock:
        usage = {u.slot.uuid: u.used for u in cluster.ext.acct.state.node_usage("n2")}
    assert usage == {real_gpu: 40 * 1024, other: 0}
