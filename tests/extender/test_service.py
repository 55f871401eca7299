"""The extender over real HTTP against the API server double: the verbs as kube-scheduler sees them."""
from __future__ import annotations

import threading

import orjson
import pytest

from extender import main
from standins.apiserver import ApiServerDouble
from tests.extender import builders as b
from tests.extender.conftest import Scheduler, eventually
from vramshare.config import Config, ExtenderConfig, Policy

N = b.NAMES


@pytest.fixture
def cluster(double: ApiServerDouble) -> ApiServerDouble:
    double.create_node(b.gpu_node("n1", b.a100(), b.l4()))
    double.create_node(b.gpu_node("n2", b.l4()))
    double.create_node(b.plain_node("cpu"))
    return double


def used(ext: main.RunningExtender, node: str) -> list[int]:
    with ext.acct.lock:
        return [u.used for u in ext.acct.state.node_usage(node)]


def test_filter_answers_names_from_the_input_exactly(cluster: ApiServerDouble, extender: main.RunningExtender,
                                                     scheduler: Scheduler) -> None:
    pod = cluster.create_pod(b.pod("p", 30))
    raw = scheduler.http.request("POST", f"{extender.url}/filter", body=orjson.dumps(
        {"Pod": pod, "Nodes": None, "NodeNames": ["n2", "n1", "cpu"]})).data
    assert raw == (b'{"Nodes":null,"NodeNames":["n1"],"FailedNodes":{},"FailedAndUnresolvableNodes":'
                   b'{"n2":"no GPU here holds 30 GiB (the largest holds 22 GiB): ask at most 22 GiB, or '
                   b'split the request over several GPUs with the annotation vramshare.io/gpu-count",'
                   b'"cpu":"node publishes no vramshare GPU inventory"},"Error":""}')


def test_filter_with_full_node_objects_echoes_the_fitting_ones(cluster: ApiServerDouble, extender: main.RunningExtender,
                                                                scheduler: Scheduler) -> None:
    pod = cluster.create_pod(b.pod("p", 8))
    nodes = cluster.nodes()
    out = scheduler.post("filter", {"Pod": pod, "Nodes": {"metadata": {}, "items": nodes}, "NodeNames": None})
    assert out["NodeNames"] == ["n1", "n2"]
    assert out["Nodes"] == {"metadata": {}, "items": [n for n in nodes if n["metadata"]["name"] != "cpu"]}


def test_prioritize_is_a_bare_host_score_list(cluster: ApiServerDouble, extender: main.RunningExtender,
                                              scheduler: Scheduler) -> None:
    out = scheduler.prioritize(b.pod("p", 8), ["n1", "n2"])
    assert [h["Host"] for h in out] == ["n1", "n2"]
    assert all(set(h) == {"Host", "Score"} and 0 <= h["Score"] <= 10 for h in out)


def test_filter_and_prioritize_never_call_the_api(cluster: ApiServerDouble, extender: main.RunningExtender,
                                                  scheduler: Scheduler) -> None:
    pod = cluster.create_pod(b.pod("p", 8))
    cluster.clear_requests()
    for _ in range(20):
        assert scheduler.filter(pod, ["n1", "n2", "cpu"])["NodeNames"] == ["n1", "n2"]
        scheduler.prioritize(pod, ["n1", "n2"])
    assert cluster.requests() == []
    assert extender.app.stats.registry.get_sample_value(
        "vramshare_extender_requests_total", {"verb": "filter", "outcome": "ok"}) == 20


@pytest.mark.parametrize("verb, body, expect", [
    ("filter", b"{oops", {"Nodes": None, "NodeNames": [], "FailedNodes": {}, "FailedAndUnresolvableNodes": {}}),
    ("filter", b'{"NodeNames": ["n1"]}', {"NodeNames": []}),
    ("prioritize", b"{oops", []),
    ("bind", b'{"PodName": "p"}', {}),
], ids=["filter-not-json", "filter-no-pod", "prioritize-not-json", "bind-missing-keys"])
def test_bad_input_is_http_200_with_error(cluster: ApiServerDouble, extender: main.RunningExtender,
                                          scheduler: Scheduler, verb: str, body: bytes, expect: object) -> None:
    out = scheduler.post(verb, body)
    if isinstance(expect, dict):
        assert out["Error"]
        assert all(out[k] == v for k, v in expect.items())
    else:
        assert out == expect
    assert extender.app.stats.registry.get_sample_value(
        "vramshare_extender_requests_total", {"verb": verb, "outcome": "bad_request"}) == 1


def test_bind_writes_the_assignment_then_binds(cluster: ApiServerDouble, extender: main.RunningExtender,
                                                scheduler: Scheduler) -> None:
    pod = cluster.create_pod(b.pod("p", 20))
    assert scheduler.bind(pod, "n1") == {"Error": ""}
    stored = cluster.get_pod("default", "p")
    ann = stored["metadata"]["annotations"]
    assert stored["spec"]["nodeName"] == "n1"
    assert orjson.loads(ann[N.assignment]) == {"c0": [{"uuid": "GPU-n1-1", "mib": 20480}]}  # best fit: the L4
    assert ann[N.allocation_state] == "assumed" and int(ann[N.assume_time]) > 0
    writes = [(r.verb, r.path) for r in cluster.requests() if r.verb != "GET"]
    assert writes == [("PATCH", "/api/v1/namespaces/default/pods/p"),
                      ("POST", "/api/v1/namespaces/default/pods/p/binding")]
    assert used(extender, "n1") == [0, 20480]
    assert extender.app.stats.registry.get_sample_value("vramshare_extender_binds_total", {"result": "bound"}) == 1


def test_bind_retries_the_patch_on_conflict(cluster: ApiServerDouble, extender: main.RunningExtender,
                                            scheduler: Scheduler) -> None:
    pod = cluster.create_pod(b.pod("p", 4))
    cluster.fail_next("PATCH", r"/pods/p$", code=409, times=2)
    assert scheduler.bind(pod, "n2") == {"Error": ""}
    assert cluster.count("PATCH", r"/pods/p$") == 3
    assert cluster.get_pod("default", "p")["spec"]["nodeName"] == "n2"


@pytest.mark.parametrize("verb, path", [("POST", r"/binding$"), ("PATCH", r"/pods/p$")], ids=["binding", "patch"])
def test_failed_api_write_releases_the_reservation(cluster: ApiServerDouble, extender: main.RunningExtender,
                                                   scheduler: Scheduler, verb: str, path: str) -> None:
    pod = cluster.create_pod(b.pod("p", 20))
    cluster.fail_next(verb, path, code=500)
    out = scheduler.bind(pod, "n2")
    assert "500" in out["Error"] and "default/p" in out["Error"]
    assert used(extender, "n2") == [0]
    assert not cluster.get_pod("default", "p")["spec"].get("nodeName")
    assert scheduler.bind(pod, "n2") == {"Error": ""}  # kube-scheduler retries: it works
    assert eventually(lambda: used(extender, "n2") == [20480])


def test_bind_to_a_node_without_room_fails_cleanly(cluster: ApiServerDouble, extender: main.RunningExtender,
                                                    scheduler: Scheduler) -> None:
    pod = cluster.create_pod(b.pod("big", 40))
    out = scheduler.bind(pod, "n2")
    assert "does not fit node n2" in out["Error"]
    assert cluster.count("PATCH") == 0 and cluster.count("POST", r"/binding$") == 0


def test_bind_of_an_already_bound_pod(cluster: ApiServerDouble, extender: main.RunningExtender,
                                      scheduler: Scheduler) -> None:
    pod = cluster.create_pod(b.pod("p", 4))
    assert scheduler.bind(pod, "n2") == {"Error": ""}
    assert eventually(lambda: extender.acct.pods["default/p"]["spec"].get("nodeName") == "n2")
    assert scheduler.bind(pod, "n2") == {"Error": ""}  # a timed-out retry of the same bind
    assert "already bound to n2" in scheduler.bind(pod, "n1")["Error"]
    assert cluster.count("POST", r"/binding$") == 1


NO_HOLD = Config(extender=ExtenderConfig(policy=Policy.BINPACK, assume_timeout_seconds=120, hold_timeout_seconds=0))


@pytest.mark.parametrize("extender_config", [NO_HOLD], ids=["no-hold"])  # same-size pods: see test_holds
def test_concurrent_binds_to_one_node_never_overcommit(double: ApiServerDouble, extender: main.RunningExtender,
                                                       scheduler: Scheduler) -> None:
    double.create_node(b.gpu_node("hot", b.l4(), b.l4()))  # 2 x 22 GiB
    assert eventually(lambda: "hot" in extender.acct.slots)
    pods = [double.create_pod(b.pod(f"p{i}", 5)) for i in range(16)]  # 16 x 5 GiB > 2 x 22 GiB
    results: list[dict] = []
    threads = [threading.Thread(target=lambda p=p: results.append(scheduler.bind(p, "hot"))) for p in pods]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(1 for r in results if r["Error"] == "") == 8  # 4 per GPU
    per_gpu: dict[str, int] = {}
    for p in double.pods():
        for entries in orjson.loads(p["metadata"].get("annotations", {}).get(N.assignment, "{}")).values():
            for e in entries:
                per_gpu[e["uuid"]] = per_gpu.get(e["uuid"], 0) + e["mib"]
    assert per_gpu == {"GPU-hot-0": 20480, "GPU-hot-1": 20480}


def test_probes_metrics_and_unknown_routes(cluster: ApiServerDouble, extender: main.RunningExtender,
                                           scheduler: Scheduler) -> None:
    assert scheduler.get("/healthz").status == 200
    assert scheduler.get("/readyz").status == 200
    metrics = scheduler.get("/metrics").data.decode()
    assert "vramshare_extender_cache_nodes 2.0" in metrics
    assert "vramshare_extender_cache_capacity_mib 126976.0" in metrics  # 80 + 22 + 22 GiB
    assert scheduler.get("/nope").status == 404


def test_inspect_cluster_and_node(cluster: ApiServerDouble, extender: main.RunningExtender,
                                  scheduler: Scheduler) -> None:
    pod = cluster.create_pod(b.pod("p", 20))
    scheduler.bind(pod, "n1")
    doc = orjson.loads(scheduler.get("/inspect").data)
    assert [n["name"] for n in doc["nodes"]] == ["n1", "n2"]
    node = orjson.loads(scheduler.get("/inspect/n1").data)
    assert node == doc["nodes"][0]
    assert node["gpus"][1] == {"index": 1, "uuid": "GPU-n1-1", "model": "NVIDIA L4", "kind": "shared",
                               "healthy": True, "totalMiB": 22528, "usedMiB": 20480, "freeMiB": 2048,
                               "pods": [{"pod": "default/p", "mib": 20480}]}
    missing = scheduler.get("/inspect/cpu")
    assert missing.status == 404 and b"cpu" in missing.data


def test_inspect_shows_the_tenants_the_quota_loop_mirrored(cluster: ApiServerDouble, extender: main.RunningExtender,
                                                            scheduler: Scheduler) -> None:
    """Issue 14, end to end: the quota loop's real mirror (official client) patches the pod, the extender's
    watch sees it, and /inspect lists the tenant on its GPU with class, request, floor, use and reason."""
    from deviceplugin.quota.kube import ApiQuotaMirror
    from deviceplugin.quota.model import TenantKey
    from vramshare import contract
    from vramshare.kube import api_client_for
    from kubernetes import client
    pod = cluster.create_pod(b.pod("p", 20))
    scheduler.bind(pod, "n1")
    gpu = orjson.loads(scheduler.get("/inspect/n1").data)["gpus"][1]["uuid"]
    mirror = ApiQuotaMirror(client.CoreV1Api(api_client_for(cluster.url)), contract.Names())
    mirror.mirror(TenantKey("default", "p", "main"), {"main": {gpu: 16384}}, {"main": "hot"},
                  {"main": {gpu: {"class": "batch", "req": 20480, "floor": 6758, "used": 15000,
                                  "why": "cut -4096: GPU over-committed"}}})

    def tenants() -> list:
        return orjson.loads(scheduler.get("/inspect/n1").data)["gpus"][1].get("tenants", [])
    assert eventually(lambda: tenants() != [])
    assert tenants() == [{"pod": "default/p", "container": "main", "class": "batch", "requestMiB": 20480,
                          "floorMiB": 6758, "limitMiB": 16384, "usedMiB": 15000, "state": "hot",
                          "reason": "cut -4096: GPU over-committed"}]
