"""REST behaviour of the double, driven only through the real ``kubernetes`` client."""
from __future__ import annotations

import json
import threading

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from standins.apiserver import ApiServerDouble
from tests.standins.bodies import bind, binding, node_body, pod_body
from vramshare.kube import api_client_for


def _status(exc: pytest.ExceptionInfo[ApiException]) -> dict:
    return json.loads(exc.value.body)


def test_nodes_create_list_get_delete(double: ApiServerDouble, v1: client.CoreV1Api) -> None:
    created = v1.create_node(node_body("gpu-1", labels={"pool": "a"}))
    v1.create_node(node_body("gpu-2"))

    assert created.metadata.uid and created.metadata.creation_timestamp
    assert [n.metadata.name for n in v1.list_node().items] == ["gpu-1", "gpu-2"]
    assert v1.read_node("gpu-1").metadata.labels == {"pool": "a"}
    assert [n.metadata.name for n in v1.list_node(label_selector="pool=a").items] == ["gpu-1"]

    v1.delete_node("gpu-1")
    assert double.get_node("gpu-1") is None
    with pytest.raises(ApiException) as gone:
        v1.read_node("gpu-1")
    assert gone.value.status == 404 and _status(gone)["reason"] == "NotFound"


def test_duplicate_create_is_already_exists(v1: client.CoreV1Api) -> None:
    v1.create_namespaced_pod("default", pod_body("p"))
    with pytest.raises(ApiException) as dup:
        v1.create_namespaced_pod("default", pod_body("p"))
    assert dup.value.status == 409
    assert _status(dup)["reason"] == "AlreadyExists" and _status(dup)["kind"] == "Status"


def test_pods_get_server_owned_fields_and_pending_phase(double: ApiServerDouble, v1: client.CoreV1Api) -> None:
    first = v1.create_namespaced_pod("default", pod_body("a"))
    second = v1.create_namespaced_pod("ml", pod_body("b", namespace="ml"))

    assert first.status.phase == "Pending"
    assert first.metadata.uid != second.metadata.uid
    assert int(second.metadata.resource_version) > int(first.metadata.resource_version)
    pod_list = v1.list_pod_for_all_namespaces()
    assert int(pod_list.metadata.resource_version) == double.resource_version
    assert [(p.metadata.namespace, p.metadata.name) for p in pod_list.items] == [("default", "a"), ("ml", "b")]
    assert [p.metadata.name for p in v1.list_namespaced_pod("ml").items] == ["b"]


def test_pod_without_containers_is_invalid(v1: client.CoreV1Api) -> None:
    with pytest.raises(ApiException) as bad:
        v1.create_namespaced_pod("default", {"metadata": {"name": "p"}, "spec": {"containers": []}})
    assert bad.value.status == 422 and _status(bad)["reason"] == "Invalid"


def test_delete_pod_returns_it_and_removes_it(double: ApiServerDouble, v1: client.CoreV1Api) -> None:
    v1.create_namespaced_pod("default", pod_body("p"))
    deleted = v1.delete_namespaced_pod("p", "default")
    assert deleted.metadata.name == "p"
    assert double.get_pod("default", "p") is None
    with pytest.raises(ApiException) as gone:
        v1.delete_namespaced_pod("p", "default")
    assert gone.value.status == 404


def test_merge_and_strategic_patch_of_annotations(v1: client.CoreV1Api) -> None:
    v1.create_namespaced_pod("default", pod_body("p", annotations={"keep": "1", "drop": "x"}))

    v1.patch_namespaced_pod("p", "default", {"metadata": {"annotations": {"drop": None, "new": "2"}}},
                            _content_type="application/merge-patch+json")
    patched = v1.patch_namespaced_pod("p", "default", {"metadata": {"annotations": {"s": "3"}}})  # strategic

    assert patched.metadata.annotations == {"keep": "1", "new": "2", "s": "3"}


def test_strategic_patch_merges_containers_by_name(v1: client.CoreV1Api) -> None:
    body = pod_body("p")
    body["spec"]["containers"].append({"name": "side", "image": "old"})
    v1.create_namespaced_pod("default", body)

    patched = v1.patch_namespaced_pod("p", "default", {"spec": {"containers": [{"name": "side", "image": "new"}]}})

    assert [(c.name, c.image) for c in patched.spec.containers] == [("main", "vllm"), ("side", "new")]


def test_json_patch_ops(v1: client.CoreV1Api) -> None:
    v1.create_node(node_body("n", annotations={"a": "1"}))
    ops = [{"op": "test", "path": "/metadata/annotations/a", "value": "1"},
           {"op": "add", "path": "/metadata/annotations/vramshare.io~1gpu-inventory", "value": "{}"},
           {"op": "replace", "path": "/metadata/annotations/a", "value": "2"}]
    patched = v1.patch_node("n", ops)
    assert patched.metadata.annotations == {"a": "2", "vramshare.io/gpu-inventory": "{}"}

    with pytest.raises(ApiException) as failed:
        v1.patch_node("n", [{"op": "test", "path": "/metadata/annotations/a", "value": "1"}])
    assert failed.value.status == 422


def test_stale_resource_version_conflicts_on_patch_and_put(v1: client.CoreV1Api) -> None:
    old = v1.create_namespaced_pod("default", pod_body("p"))
    v1.patch_namespaced_pod("p", "default", {"metadata": {"labels": {"x": "1"}}})

    with pytest.raises(ApiException) as patch_conflict:
        v1.patch_namespaced_pod("p", "default", {"metadata": {"resourceVersion": old.metadata.resource_version,
                                                              "labels": {"x": "2"}}})
    old.metadata.labels = {"x": "3"}
    with pytest.raises(ApiException) as put_conflict:
        v1.replace_namespaced_pod("p", "default", old)

    for exc in (patch_conflict, put_conflict):
        assert exc.value.status == 409
        assert _status(exc)["reason"] == "Conflict" and _status(exc)["status"] == "Failure"
    assert v1.read_namespaced_pod("p", "default").metadata.labels == {"x": "1"}


def test_put_with_current_version_succeeds_and_noop_patch_keeps_version(v1: client.CoreV1Api) -> None:
    pod = v1.create_namespaced_pod("default", pod_body("p"))
    pod.metadata.labels = {"x": "1"}
    replaced = v1.replace_namespaced_pod("p", "default", pod)
    assert replaced.metadata.labels == {"x": "1"}

    again = v1.patch_namespaced_pod("p", "default", {"metadata": {"labels": {"x": "1"}}})
    assert again.metadata.resource_version == replaced.metadata.resource_version


def test_status_subresource_changes_status_only(v1: client.CoreV1Api) -> None:
    v1.create_namespaced_pod("default", pod_body("p"))
    v1.patch_namespaced_pod("p", "default", {"status": {"phase": "Running"}})  # ignored, as on a real server
    assert v1.read_namespaced_pod("p", "default").status.phase == "Pending"

    v1.patch_namespaced_pod_status("p", "default", {"status": {"phase": "Running"},
                                                    "metadata": {"labels": {"ignored": "yes"}}})
    pod = v1.read_namespaced_pod("p", "default")
    assert pod.status.phase == "Running" and pod.metadata.labels is None


def test_node_status_patch_sets_capacity(v1: client.CoreV1Api) -> None:
    v1.create_node(node_body("n"))
    v1.patch_node_status("n", {"status": {"capacity": {"vramshare.io/gpu-memory": "80"}}})
    assert v1.read_node("n").status.capacity == {"vramshare.io/gpu-memory": "80"}


def test_binding_sets_node_once(double: ApiServerDouble, v1: client.CoreV1Api) -> None:
    v1.create_namespaced_pod("default", pod_body("p"))
    bound = v1.create_namespaced_pod_binding("p", "default", binding("p", "gpu-1"), _preload_content=False)
    assert bound.status == 201 and json.loads(bound.data)["status"] == "Success"
    bound.release_conn()  # an unpreloaded response holds its connection until released

    with pytest.raises(ApiException) as second:
        v1.create_namespaced_pod_binding("p", "default", binding("p", "gpu-2"), _preload_content=False)
    assert second.value.status == 409 and "already assigned" in _status(second)["message"]

    pod = v1.read_namespaced_pod("p", "default")
    assert pod.spec.node_name == "gpu-1"
    assert [(c.type, c.status) for c in pod.status.conditions] == [("PodScheduled", "True")]
    assert double.count("POST", r"/binding$") == 2


def test_binding_a_missing_pod_is_not_found(v1: client.CoreV1Api) -> None:
    with pytest.raises(ApiException) as missing:
        v1.create_namespaced_pod_binding("ghost", "default", binding("ghost", "gpu-1"), _preload_content=False)
    assert missing.value.status == 404


def test_field_selectors(double: ApiServerDouble, v1: client.CoreV1Api) -> None:
    for name in ("bound-running", "bound-done", "unbound"):
        v1.create_namespaced_pod("default", pod_body(name))
    double.bind_pod("default", "bound-running", "gpu-1")
    double.bind_pod("default", "bound-done", "gpu-1")
    double.set_pod_phase("default", "bound-done", "Succeeded")

    def names(selector: str) -> list[str]:
        return [p.metadata.name for p in v1.list_pod_for_all_namespaces(field_selector=selector).items]

    assert names("spec.nodeName=") == ["unbound"]
    assert names("spec.nodeName=gpu-1") == ["bound-done", "bound-running"]
    assert names("spec.nodeName=gpu-1,status.phase!=Succeeded,status.phase!=Failed") == ["bound-running"]
    assert names("metadata.name=unbound") == ["unbound"]


def test_unknown_field_selector_is_bad_request(v1: client.CoreV1Api) -> None:
    with pytest.raises(ApiException) as bad:
        v1.list_pod_for_all_namespaces(field_selector="spec.hostNetwork=true")
    assert bad.value.status == 400 and _status(bad)["reason"] == "BadRequest"


def test_events_can_be_posted_and_listed(double: ApiServerDouble, v1: client.CoreV1Api) -> None:
    event = client.CoreV1Event(metadata=client.V1ObjectMeta(generate_name="p."), reason="FailedScheduling",
                               message="no GPU fits", involved_object=client.V1ObjectReference(kind="Pod", name="p"))
    v1.create_namespaced_event("default", event)
    assert [e.reason for e in v1.list_namespaced_event("default").items] == ["FailedScheduling"]
    assert double.events("default")[0]["message"] == "no GPU fits"


def test_injected_fault_fails_the_next_matching_request_only(double: ApiServerDouble, v1: client.CoreV1Api) -> None:
    v1.create_namespaced_pod("default", pod_body("p"))
    double.fail_next("POST", r"/pods/p/binding$", code=500)

    with pytest.raises(ApiException) as failed:
        v1.create_namespaced_pod_binding("p", "default", binding("p", "gpu-1"), _preload_content=False)
    assert failed.value.status == 500 and double.get_pod("default", "p")["spec"].get("nodeName") is None

    assert bind(v1, "p", "gpu-1") == 201
    assert double.get_pod("default", "p")["spec"]["nodeName"] == "gpu-1"


def test_list_pages_with_limit_and_continue(v1: client.CoreV1Api) -> None:
    for i in range(5):
        v1.create_namespaced_pod("default", pod_body(f"p{i}"))
    first = v1.list_namespaced_pod("default", limit=2)
    rest = v1.list_namespaced_pod("default", limit=10, _continue=first.metadata._continue)
    assert [p.metadata.name for p in first.items + rest.items] == [f"p{i}" for i in range(5)]
    assert first.metadata.remaining_item_count == 3 and rest.metadata._continue is None


def test_concurrent_patches_and_bindings_all_land(double: ApiServerDouble, v1: client.CoreV1Api) -> None:
    names = [f"p{i}" for i in range(40)]
    for name in names:
        double.create_pod(pod_body(name))
    errors: list[BaseException] = []

    def work(name: str) -> None:
        try:
            v1.patch_namespaced_pod(name, "default", {"metadata": {"annotations": {"vramshare.io/assignment": name}}})
            bind(v1, name, "gpu-1")
        except BaseException as error:  # surfaced below: a thread must not swallow a failure
            errors.append(error)

    threads = [threading.Thread(target=work, args=(name,)) for name in names]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert errors == []
    pods = double.pods("default")
    assert all(p["spec"]["nodeName"] == "gpu-1" for p in pods)
    assert sorted(p["metadata"]["annotations"]["vramshare.io/assignment"] for p in pods) == sorted(names)
    assert double.count("PATCH") == 40 and double.count("POST", r"/binding$") == 40
    assert len({p["metadata"]["resourceVersion"] for p in pods}) == 40


def test_label_selectors(v1: client.CoreV1Api) -> None:
    v1.create_namespaced_pod("default", pod_body("a", labels={"app": "vllm", "tier": "gpu"}))
    v1.create_namespaced_pod("default", pod_body("b", labels={"app": "web"}))
    v1.create_namespaced_pod("default", pod_body("c"))

    def names(selector: str) -> list[str]:
        return [p.metadata.name for p in v1.list_namespaced_pod("default", label_selector=selector).items]

    assert names("app=vllm") == ["a"]
    assert names("app!=vllm") == ["b", "c"]
    assert names("tier") == ["a"]
    assert names("!tier,app") == ["b"]


def test_generate_name_and_dry_run(double: ApiServerDouble, v1: client.CoreV1Api) -> None:
    made = v1.create_namespaced_pod("default", {"metadata": {"generateName": "vllm-"},
                                                "spec": {"containers": [{"name": "c"}]}})
    assert made.metadata.name.startswith("vllm-") and len(made.metadata.name) > len("vllm-")

    version = double.resource_version
    v1.create_namespaced_pod("default", pod_body("dry"), dry_run="All")
    v1.patch_namespaced_pod(made.metadata.name, "default", {"metadata": {"labels": {"x": "1"}}}, dry_run="All")
    assert double.get_pod("default", "dry") is None
    assert double.get_pod("default", made.metadata.name)["metadata"].get("labels") is None
    assert double.resource_version == version


def test_namespace_in_body_must_match_the_path(v1: client.CoreV1Api) -> None:
    with pytest.raises(ApiException) as bad:
        v1.create_namespaced_pod("default", pod_body("p", namespace="other"))
    assert bad.value.status == 400


def test_node_put_keeps_status_and_checks_version(v1: client.CoreV1Api) -> None:
    v1.create_node({"metadata": {"name": "n"}, "status": {"capacity": {"vramshare.io/gpu-memory": "80"}}})
    node = v1.read_node("n")
    node.metadata.annotations = {"vramshare.io/gpu-inventory": "{}"}
    node.status.capacity = {}
    replaced = v1.replace_node("n", node)

    assert replaced.metadata.annotations == {"vramshare.io/gpu-inventory": "{}"}
    assert replaced.status.capacity == {"vramshare.io/gpu-memory": "80"}
    with pytest.raises(ApiException) as stale:
        v1.replace_node("n", node)  # still carries the version from before the first replace
    assert stale.value.status == 409


def test_pod_spec_is_immutable_but_node_name_comes_from_binding(v1: client.CoreV1Api) -> None:
    v1.create_namespaced_pod("default", pod_body("p"))
    with pytest.raises(ApiException) as forbidden:
        v1.patch_namespaced_pod("p", "default", {"spec": {"nodeName": "gpu-1"}})
    assert forbidden.value.status == 422


def test_namespaced_bindings_collection_binds_too(v1: client.CoreV1Api) -> None:
    v1.create_namespaced_pod("default", pod_body("p"))
    response = v1.create_namespaced_binding("default", binding("p", "gpu-1"), _preload_content=False)
    try:
        assert response.status == 201
    finally:
        response.data  # noqa: B018 - drain it so the connection can go back to the pool
        response.release_conn()
    assert v1.read_namespaced_pod("p", "default").spec.node_name == "gpu-1"


def test_binding_copies_its_annotations_to_the_pod(v1: client.CoreV1Api) -> None:
    v1.create_namespaced_pod("default", pod_body("p", annotations={"keep": "1"}))
    body = binding("p", "gpu-1")
    body.metadata.annotations = {"vramshare.io/allocation-state": "assumed"}
    response = v1.create_namespaced_pod_binding("p", "default", body, _preload_content=False)
    response.data  # noqa: B018 - drain it so the connection can go back to the pool
    response.release_conn()
    assert v1.read_namespaced_pod("p", "default").metadata.annotations == {
        "keep": "1", "vramshare.io/allocation-state": "assumed"}


def test_delete_preconditions(v1: client.CoreV1Api) -> None:
    pod = v1.create_namespaced_pod("default", pod_body("p"))
    stale = client.V1DeleteOptions(preconditions=client.V1Preconditions(uid="not-the-uid"))
    with pytest.raises(ApiException) as conflict:
        v1.delete_namespaced_pod("p", "default", body=stale)
    assert conflict.value.status == 409
    fresh = client.V1DeleteOptions(preconditions=client.V1Preconditions(uid=pod.metadata.uid))
    assert v1.delete_namespaced_pod("p", "default", body=fresh).metadata.name == "p"


def test_graceful_deletion_keeps_bound_pods_until_the_kubelet_finishes() -> None:
    with ApiServerDouble(graceful_pod_deletion=True) as double, api_client_for(double.url) as http:
        v1 = client.CoreV1Api(http)
        for name in ("bound", "unbound"):
            v1.create_namespaced_pod("default", pod_body(name))
        double.bind_pod("default", "bound", "gpu-1")

        terminating = v1.delete_namespaced_pod("bound", "default", grace_period_seconds=5)
        v1.delete_namespaced_pod("unbound", "default")

        assert terminating.metadata.deletion_timestamp is not None
        assert terminating.metadata.deletion_grace_period_seconds == 5
        assert [p["metadata"]["name"] for p in double.pods()] == ["bound"]
        double.delete_pod("default", "bound")
        assert double.pods() == []


def test_unknown_resource_is_not_found(double: ApiServerDouble, v1: client.CoreV1Api) -> None:
    with pytest.raises(ApiException) as missing:
        v1.list_namespaced_persistent_volume_claim("default")
    assert missing.value.status == 404
    assert double.count("GET", r"/persistentvolumeclaims$") == 1


def test_after_commit_fault_loses_only_the_answer(double: ApiServerDouble, v1: client.CoreV1Api) -> None:
    v1.create_namespaced_pod("default", pod_body("p"))
    double.fail_next("POST", r"/binding$", code=504, after_commit=True)

    with pytest.raises(ApiException) as lost:
        bind(v1, "p", "gpu-1")
    with pytest.raises(ApiException) as retried:
        bind(v1, "p", "gpu-1")

    assert lost.value.status == 504 and retried.value.status == 409
    assert double.get_pod("default", "p")["spec"]["nodeName"] == "gpu-1"


def test_events_v1_and_configmaps_are_served(double: ApiServerDouble, v1: client.CoreV1Api) -> None:
    events = client.EventsV1Api(v1.api_client)
    events.create_namespaced_event("default", client.EventsV1Event(
        metadata=client.V1ObjectMeta(name="e1"), event_time="2026-01-01T00:00:00.000000Z", reason="Allocated",
        action="Allocate", reporting_controller="vramshare.io/device-plugin", reporting_instance="gpu-1"))
    v1.create_namespaced_config_map("kube-system", client.V1ConfigMap(
        metadata=client.V1ObjectMeta(name="vramshare-config"), data={"config.yaml": "version: v1"}))

    assert [e.reason for e in events.list_namespaced_event("default").items] == ["Allocated"]
    assert v1.read_namespaced_config_map("vramshare-config", "kube-system").data == {"config.yaml": "version: v1"}
    assert double.events() == []  # core/v1 Events are a separate resource from events.k8s.io


def test_a_malformed_json_patch_is_an_api_error_not_a_hang_up(v1: client.CoreV1Api) -> None:
    v1.create_node(node_body("n"))
    with pytest.raises(ApiException) as bad:
        v1.patch_node("n", [{"op": "add", "path": 7, "value": 1}])
    assert bad.value.status == 400 and _status(bad)["reason"] == "BadRequest"
