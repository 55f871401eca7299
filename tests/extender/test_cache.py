"""List + watch against the API server double: start-up rebuild, live events, 410 Gone, cuts, expiry."""
from __future__ import annotations

import time

import pytest

from extender import main
from standins.apiserver import PODS, ApiServerDouble
from tests.extender import builders as b
from tests.extender.conftest import Scheduler, eventually
from vramshare.config import Config, ExtenderConfig, Policy


def used(ext: main.RunningExtender, node: str) -> list[int]:
    with ext.acct.lock:
        return [u.used for u in ext.acct.state.node_usage(node)]


def resyncs(ext: main.RunningExtender, resource: str) -> float:
    return ext.app.stats.registry.get_sample_value("vramshare_extender_cache_resyncs_total",
                                                   {"resource": resource}) or 0.0


def test_startup_rebuilds_usage_from_assignment_annotations(double: ApiServerDouble) -> None:
    double.create_node(b.gpu_node("n1", b.a100(), b.a100()))
    now = time.time_ns()
    double.create_pod(b.assigned(b.pod("running", 20), "n1", [("GPU-n1-0", 20480)], now, state="allocated"))
    double.create_pod(b.assigned(b.pod("assumed", 8), "", [("GPU-n1-1", 8192)], now))
    done = b.assigned(b.pod("done", 30), "n1", [("GPU-n1-1", 30720)], now)
    done["status"] = {"phase": "Succeeded"}
    double.create_pod(done)
    with main.start_for_url(double.url, Config()) as ext:
        assert ext.wait_ready(10)
        assert used(ext, "n1") == [20480, 8192]


def test_readiness_waits_for_the_initial_lists(double: ApiServerDouble) -> None:
    double.fail_next("GET", r"^/api/v1/nodes$", code=500, times=1000)
    with main.start_for_url(double.url, Config()) as ext:
        client = Scheduler(ext.url)
        try:
            assert eventually(lambda: double.count("GET", r"^/api/v1/nodes$") >= 1)
            assert client.get("/readyz").status == 503
            double.clear_faults()
            assert ext.wait_ready(15)
            assert client.get("/readyz").status == 200
        finally:
            client.close()


def test_watch_events_update_nodes_and_free_deleted_pods(double: ApiServerDouble,
                                                         extender: main.RunningExtender) -> None:
    double.create_node(b.gpu_node("late", b.l4()))
    assert eventually(lambda: "late" in extender.acct.slots)
    double.create_pod(b.assigned(b.pod("p", 20), "late", [("GPU-late-0", 20480)], time.time_ns()))
    assert eventually(lambda: used(extender, "late") == [20480])
    double.set_pod_phase("default", "p", "Failed")
    assert eventually(lambda: used(extender, "late") == [0])
    double.delete_node("late")
    assert eventually(lambda: "late" not in extender.acct.slots)


def test_410_gone_relists_and_keeps_following(double: ApiServerDouble, extender: main.RunningExtender) -> None:
    double.create_node(b.gpu_node("n1", b.a100()))  # moves the version past the pod watch's last one
    assert eventually(lambda: "n1" in extender.acct.slots)
    double.compact()
    double.drop_watches()  # the pod watch resumes from a compacted version: 410 Expired
    assert eventually(lambda: resyncs(extender, "pods") >= 1)
    assert double.wait_for_watches(2)
    double.create_pod(b.assigned(b.pod("p", 8), "n1", [("GPU-n1-0", 8192)], time.time_ns()))
    assert eventually(lambda: used(extender, "n1") == [8192])


def test_cut_connection_relists_and_catches_up(double: ApiServerDouble, extender: main.RunningExtender) -> None:
    double.create_node(b.gpu_node("n1", b.a100()))
    double.create_pod(b.assigned(b.pod("p", 8), "n1", [("GPU-n1-0", 8192)], time.time_ns()))
    assert eventually(lambda: used(extender, "n1") == [8192])
    lists_before = double.count("GET", r"^/api/v1/pods$")
    double.drop_watches(abrupt=True)
    assert eventually(lambda: resyncs(extender, "pods") >= 1 and resyncs(extender, "nodes") >= 1)
    double.delete_pod("default", "p")
    assert eventually(lambda: used(extender, "n1") == [0])
    assert double.count("GET", r"^/api/v1/pods$") > lists_before


@pytest.fixture
def extender_config() -> Config:
    return Config(extender=ExtenderConfig(policy=Policy.BINPACK, assume_timeout_seconds=0.5))


def test_assumed_pod_that_never_binds_expires(double: ApiServerDouble, extender: main.RunningExtender,
                                              scheduler: Scheduler) -> None:
    double.create_node(b.gpu_node("n1", b.l4()))
    assert eventually(lambda: "n1" in extender.acct.slots)
    pod = double.create_pod(b.pod("stuck", 20))
    assert eventually(lambda: "default/stuck" in extender.acct.pods)
    double.fail_next("POST", r"/binding$", code=504, times=1)  # annotated, but the Binding never happened
    assert scheduler.bind(pod, "n1")["Error"]
    # the failed bind released at once; make it look like an assumption from another extender instead:
    double.update(PODS, "default", "stuck", lambda p: p["metadata"]["annotations"].update(
        {b.NAMES.assume_time: str(time.time_ns())}))
    assert eventually(lambda: used(extender, "n1") == [20480])
    assert eventually(lambda: used(extender, "n1") == [0])  # expired after 0.5 s
    assert scheduler.filter(pod, ["n1"])["NodeNames"] == ["n1"]


def test_one_unreadable_object_costs_nothing_else(double: ApiServerDouble, extender: main.RunningExtender,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    double.create_node(b.gpu_node("n1", b.a100()))
    weird = {"metadata": {"name": "weird", "namespace": "default"},
             "spec": {"containers": [{"name": "c", "resources": {"limits": [b.NAMES.gpu_memory]}}]}}
    double.create_pod(weird)  # a real API server would refuse it; the watch must survive it anyway
    double.create_pod(b.assigned(b.pod("p", 8), "n1", [("GPU-n1-0", 8192)], time.time_ns()))
    assert eventually(lambda: used(extender, "n1") == [8192])
    assert resyncs(extender, "pods") == 0
    assert any(r.getMessage() == "event not applied" for r in caplog.records)


def test_a_relist_skips_an_unreadable_pod(double: ApiServerDouble) -> None:
    double.create_node(b.gpu_node("n1", b.a100()))
    double.create_pod({"metadata": {"name": "weird", "namespace": "default"},
                       "spec": {"containers": [{"name": "c", "resources": {"limits": [b.NAMES.gpu_memory]}}]}})
    double.create_pod(b.assigned(b.pod("p", 8), "n1", [("GPU-n1-0", 8192)], time.time_ns()))
    with main.start_for_url(double.url, Config()) as ext:
        assert ext.wait_ready(10)
        assert used(ext, "n1") == [8192]
