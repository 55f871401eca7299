"""The double's resource.k8s.io/v1 kinds and server-side apply, through the real client's ResourceV1Api."""
from __future__ import annotations

import pytest
from kubernetes import client, watch
from kubernetes.client.rest import ApiException

from standins.apiserver import RESOURCESLICES
from vramshare.kube import api_client_for

APPLY = "application/apply-patch+yaml"


def slice_obj(node: str, generation: int = 1) -> dict:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": f"{node}-s"},
            "spec": {"driver": "gpu.vramshare.io", "nodeName": node,
                     "pool": {"name": node, "generation": generation, "resourceSliceCount": 1}}}


@pytest.fixture
def resource(double):
    with api_client_for(double.url) as http:
        yield client.ResourceV1Api(http)


def test_apply_creates_then_replaces_and_needs_a_field_manager(double, resource):
    with pytest.raises(ApiException) as err:
        resource.patch_resource_slice("a-s", slice_obj("a"), _content_type=APPLY)
    assert err.value.status == 400 and "fieldManager" in err.value.body
    created = resource.patch_resource_slice("a-s", slice_obj("a"), field_manager="m", force=True, _content_type=APPLY)
    assert created.spec.pool.generation == 1 and created.metadata.uid
    updated = resource.patch_resource_slice("a-s", slice_obj("a", 2), field_manager="m", force=True,
                                            _content_type=APPLY)
    assert updated.spec.pool.generation == 2 and updated.metadata.uid == created.metadata.uid
    same = resource.patch_resource_slice("a-s", slice_obj("a", 2), field_manager="m", force=True, _content_type=APPLY)
    assert same.metadata.resource_version == updated.metadata.resource_version  # a no-op apply changes nothing
    with pytest.raises(ApiException) as err:
        resource.patch_resource_slice("other", slice_obj("a"), field_manager="m", _content_type=APPLY)
    assert err.value.status == 400  # name in the body and in the URL differ
    assert [o["metadata"]["name"] for o in double.objects(RESOURCESLICES)] == ["a-s"]


def test_slices_filter_by_node_and_driver_and_watch(double, resource):
    for node in ("a", "b"):
        resource.patch_resource_slice(f"{node}-s", slice_obj(node), field_manager="m", _content_type=APPLY)
    listed = resource.list_resource_slice(field_selector="spec.nodeName=b,spec.driver=gpu.vramshare.io")
    assert [s.metadata.name for s in listed.items] == ["b-s"]
    events = [e["type"] for e in watch.Watch().stream(resource.list_resource_slice, resource_version="0",
                                                      timeout_seconds=1)]
    assert events.count("ADDED") == 2


def test_claim_status_is_a_subresource(double, resource):
    claim = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": "c"},
             "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.vramshare.io"}}]}}}
    made = resource.create_namespaced_resource_claim("default", claim)
    body = resource.api_client.sanitize_for_serialization(made)
    body["status"] = {"reservedFor": [{"resource": "pods", "name": "p", "uid": "u"}]}
    body["spec"]["devices"]["requests"][0]["name"] = "changed"
    after = resource.replace_namespaced_resource_claim_status("c", "default", body)
    assert after.status.reserved_for[0].uid == "u" and after.spec.devices.requests[0].name == "gpu"
