"""Conformance: the double records ``metadata.managedFields`` as the real API server does (issue 18).

Upstream: ``k8s.io/apimachinery/pkg/util/managedfields/internal/fieldmanager.go`` (Update, Apply,
``decodeLiveOrNew``, ``isResetManagedFields``), ``stripmeta.go``, ``managedfields.go``
(``sortEncodedManagedFields``), and ``k8s.io/apiserver/pkg/endpoints/handlers`` ``managerOrUserAgent``.
Driven through the official ``kubernetes`` client, as every writer of ours is.
"""
from __future__ import annotations

import json
import re

import pytest
from kubernetes.client import CoreV1Api
from kubernetes.client.rest import ApiException

from standins.apiserver import ApiServerDouble

MERGE = "application/merge-patch+json"
APPLY = "application/apply-patch+yaml"
KEY = "vramshare.io/assignment"
RFC3339 = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$")


def pod(name: str = "p", annotations: dict | None = None) -> dict:
    meta: dict = {"name": name, "namespace": "default"}
    if annotations is not None:
        meta["annotations"] = annotations
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta,
            "spec": {"containers": [{"name": "c0", "image": "x"}]}}


def entries(v1: CoreV1Api, name: str = "p") -> list[dict]:
    resp = v1.read_namespaced_pod(name, "default", _preload_content=False)
    try:
        return json.loads(resp.data)["metadata"].get("managedFields") or []
    finally:
        resp.release_conn()


def by_manager(v1: CoreV1Api, name: str = "p") -> dict[str, dict]:
    return {e["manager"]: e for e in entries(v1, name)}


def annotate(v1: CoreV1Api, manager: str | None, **values: str) -> None:
    body = {"metadata": {"annotations": {k.replace("_", "/", 1).replace("_", "-"): v for k, v in values.items()}}}
    kwargs = {"field_manager": manager} if manager else {}
    v1.patch_namespaced_pod("p", "default", body, _content_type=MERGE, **kwargs)


def test_create_records_the_creators_update_entry_in_the_upstream_shape(v1: CoreV1Api) -> None:
    v1.create_namespaced_pod("default", pod(annotations={"team": "a"}), field_manager="kubectl-create")
    [entry] = entries(v1)
    assert set(entry) == {"manager", "operation", "apiVersion", "time", "fieldsType", "fieldsV1"}
    assert (entry["manager"], entry["operation"], entry["apiVersion"], entry["fieldsType"]) == (
        "kubectl-create", "Update", "v1", "FieldsV1")
    assert RFC3339.match(entry["time"])
    meta = entry["fieldsV1"]["f:metadata"]
    assert meta == {"f:annotations": {".": {}, "f:team": {}}}  # name, namespace, uid... never tracked
    assert "f:containers" in entry["fieldsV1"]["f:spec"]


def test_a_patch_gives_the_writer_the_annotations_it_changed_and_takes_them_from_others(v1: CoreV1Api) -> None:
    v1.create_namespaced_pod("default", pod(annotations={"team": "a"}), field_manager="kubectl-create")
    v1.patch_namespaced_pod("p", "default", {"metadata": {"annotations": {KEY: "{}"}}}, _content_type=MERGE,
                            field_manager="vramshare-extender")
    ext = by_manager(v1)["vramshare-extender"]
    assert ext["operation"] == "Update"
    assert ext["fieldsV1"] == {"f:metadata": {"f:annotations": {f"f:{KEY}": {}}}}  # the map existed: no "."
    # a user rewrites the key: the user owns it now, and the extender's entry, empty, is gone
    v1.patch_namespaced_pod("p", "default", {"metadata": {"annotations": {KEY: '{"c0": []}'}}},
                            _content_type=MERGE, field_manager="kubectl-annotate")
    owners = by_manager(v1)
    assert "vramshare-extender" not in owners
    assert owners["kubectl-annotate"]["fieldsV1"] == {"f:metadata": {"f:annotations": {f"f:{KEY}": {}}}}
    # writing the same value again moves nothing
    v1.patch_namespaced_pod("p", "default", {"metadata": {"annotations": {KEY: '{"c0": []}'}}},
                            _content_type=MERGE, field_manager="vramshare-extender")
    assert "vramshare-extender" not in by_manager(v1)


def test_without_a_field_manager_the_user_agent_product_is_the_manager(v1: CoreV1Api) -> None:
    v1.create_namespaced_pod("default", pod())
    assert [e["manager"] for e in entries(v1)] == ["OpenAPI-Generator"]


def test_a_removed_annotation_leaves_every_entry(v1: CoreV1Api) -> None:
    v1.create_namespaced_pod("default", pod(), field_manager="creator")
    v1.patch_namespaced_pod("p", "default", {"metadata": {"annotations": {KEY: "x", "other": "y"}}},
                            _content_type=MERGE, field_manager="writer")
    assert by_manager(v1)["writer"]["fieldsV1"]["f:metadata"]["f:annotations"] == {
        ".": {}, f"f:{KEY}": {}, "f:other": {}}
    v1.patch_namespaced_pod("p", "default", {"metadata": {"annotations": {KEY: None}}}, _content_type=MERGE,
                            field_manager="remover")
    assert by_manager(v1)["writer"]["fieldsV1"]["f:metadata"]["f:annotations"] == {".": {}, "f:other": {}}
    assert "remover" not in by_manager(v1)  # it owns nothing


def test_server_side_apply_owns_what_it_applies_and_conflicts_without_force(v1: CoreV1Api) -> None:
    v1.create_namespaced_pod("default", pod(annotations={KEY: "user"}), field_manager="kubectl-create")
    body = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "annotations": {KEY: "plugin"}}}
    with pytest.raises(ApiException) as err:
        v1.patch_namespaced_pod("p", "default", body, _content_type=APPLY, field_manager="vramshare-device-plugin")
    assert err.value.status == 409
    assert json.loads(err.value.body)["message"] == ('Apply failed with 1 conflict: conflict with "kubectl-create": '
                                                     f'.metadata.annotations.{KEY}')
    v1.patch_namespaced_pod("p", "default", body, _content_type=APPLY, field_manager="vramshare-device-plugin",
                            force=True)
    owners = by_manager(v1)
    assert owners["vramshare-device-plugin"]["operation"] == "Apply"
    assert owners["vramshare-device-plugin"]["fieldsV1"] == {"f:metadata": {"f:annotations": {f"f:{KEY}": {}}}}
    assert f"f:{KEY}" not in owners["kubectl-create"]["fieldsV1"]["f:metadata"].get("f:annotations", {})
    assert v1.read_namespaced_pod("p", "default").spec.containers[0].name == "c0"  # a merge, not a replace
    # an apply of the same value by the owner changes nothing (not even the resourceVersion)
    rv = v1.read_namespaced_pod("p", "default").metadata.resource_version
    v1.patch_namespaced_pod("p", "default", body, _content_type=APPLY, field_manager="vramshare-device-plugin")
    assert v1.read_namespaced_pod("p", "default").metadata.resource_version == rv
    assert [e["operation"] for e in entries(v1)] == ["Apply", "Update"]  # sortEncodedManagedFields


def test_an_apply_of_an_equal_value_takes_ownership_of_a_field_another_manager_wrote(v1: CoreV1Api) -> None:
    """Equal values: no conflict, both own the field (structured-merge-diff shares it)."""
    v1.create_namespaced_pod("default", pod(annotations={KEY: "same"}), field_manager="kubectl-create")
    body = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "annotations": {KEY: "same"}}}
    v1.patch_namespaced_pod("p", "default", body, _content_type=APPLY, field_manager="vramshare-device-plugin")
    owners = by_manager(v1)
    assert f"f:{KEY}" in owners["vramshare-device-plugin"]["fieldsV1"]["f:metadata"]["f:annotations"]


def test_a_binding_records_no_entry(double: ApiServerDouble, v1: CoreV1Api) -> None:
    v1.create_namespaced_pod("default", pod(), field_manager="creator")
    double.create_node({"metadata": {"name": "n1"}})
    resp = v1.create_namespaced_pod_binding("p", "default", {"apiVersion": "v1", "kind": "Binding",
                                                             "metadata": {"name": "p"},
                                                             "target": {"kind": "Node", "name": "n1"}},
                                            _preload_content=False)
    resp.release_conn()
    assert [e["manager"] for e in entries(v1)] == ["creator"]


def test_a_status_write_is_its_own_entry(v1: CoreV1Api) -> None:
    v1.create_namespaced_pod("default", pod(), field_manager="creator")
    v1.patch_namespaced_pod_status("p", "default", {"status": {"phase": "Running"}}, _content_type=MERGE,
                                   field_manager="kubelet")
    kubelet = by_manager(v1)["kubelet"]
    assert kubelet["subresource"] == "status"
    assert kubelet["fieldsV1"] == {"f:status": {"f:phase": {}}}


def test_a_client_may_rewrite_or_reset_managed_fields_on_the_main_resource(v1: CoreV1Api) -> None:
    """decodeLiveOrNew keeps managedFields a request sets (upstream allows it on purpose); ``[{}]``
    resets them. So a manager name is a claim, not an identity: only admission can stop the claim."""
    v1.create_namespaced_pod("default", pod(annotations={KEY: "forged"}), field_manager="mallory")
    forged = [{"manager": "vramshare-extender", "operation": "Update", "apiVersion": "v1",
               "time": "2026-01-01T00:00:00Z", "fieldsType": "FieldsV1",
               "fieldsV1": {"f:metadata": {"f:annotations": {f"f:{KEY}": {}}}}}]
    v1.patch_namespaced_pod("p", "default", {"metadata": {"managedFields": forged}}, _content_type=MERGE,
                            field_manager="mallory")
    assert [e["manager"] for e in entries(v1)] == ["vramshare-extender"]
    v1.patch_namespaced_pod("p", "default", {"metadata": {"managedFields": [{}]}}, _content_type=MERGE,
                            field_manager="mallory")
    assert entries(v1) == []
