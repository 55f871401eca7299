"""The DRA and plugin-registration APIs: published field numbers and the wire names the kubelet dials.

The drift test in test_generated.py covers these files too (they are in ``protos.generate.PROTO_FILES``).
"""
from __future__ import annotations

import pytest

from protos import generate
from protos.dra.v1 import api_pb2 as dra_v1
from protos.dra.v1beta1 import api_pb2 as dra_v1beta1
from protos.pluginregistration.v1 import api_pb2 as reg


def test_generator_covers_the_dra_apis():
    assert {"protos/dra/v1/api.proto", "protos/dra/v1beta1/api.proto",
            "protos/pluginregistration/v1/api.proto"} <= set(generate.PROTO_FILES)


@pytest.mark.parametrize("api", [dra_v1, dra_v1beta1], ids=["v1", "v1beta1"])
@pytest.mark.parametrize("name, fields", [
    ("NodePrepareResourcesRequest", {"claims": 1}),
    ("NodePrepareResourcesResponse", {"claims": 1}),
    ("NodePrepareResourceResponse", {"devices": 1, "error": 2}),
    ("Device", {"request_names": 1, "pool_name": 2, "device_name": 3, "cdi_device_ids": 4}),
    ("NodeUnprepareResourcesRequest", {"claims": 1}),
    ("NodeUnprepareResourcesResponse", {"claims": 1}),
    ("NodeUnprepareResourceResponse", {"error": 1}),
    ("Claim", {"namespace": 1, "uid": 2, "name": 3}),
])
def test_dra_field_numbers(api, name, fields):
    message = getattr(api, name)
    assert {f.name: f.number for f in message.DESCRIPTOR.fields} == fields


@pytest.mark.parametrize("name, fields", [
    ("PluginInfo", {"type": 1, "name": 2, "endpoint": 3, "supported_versions": 4}),
    ("RegistrationStatus", {"plugin_registered": 1, "error": 2}),
    ("RegistrationStatusResponse", {}),
    ("InfoRequest", {}),
])
def test_registration_field_numbers(name, fields):
    assert {f.name: f.number for f in getattr(reg, name).DESCRIPTOR.fields} == fields


def test_method_paths_the_kubelet_dials():
    for api, version in ((dra_v1, "v1"), (dra_v1beta1, "v1beta1")):
        service = api.DESCRIPTOR.services_by_name["DRAPlugin"]
        assert service.full_name == f"k8s.io.kubelet.pkg.apis.dra.{version}.DRAPlugin"
        assert [m.name for m in service.methods] == ["NodePrepareResources", "NodeUnprepareResources"]
    registration = reg.DESCRIPTOR.services_by_name["Registration"]
    assert registration.full_name == "pluginregistration.Registration"
    assert [m.name for m in registration.methods] == ["GetInfo", "NotifyRegistrationStatus"]
