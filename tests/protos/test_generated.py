"""The vendored kubelet APIs: checked-in generated code matches the .proto sources and the wire names.

Covers: no drift between ``python -m protos.generate`` output and the checked-in files; the generated
code imports under the installed protobuf runtime; the published field numbers and method paths.
"""
from __future__ import annotations

import filecmp
import os

import pytest

from protos import generate
from protos.deviceplugin.v1beta1 import api_pb2 as dp
from protos.deviceplugin.v1beta1 import api_pb2_grpc as dp_grpc
from protos.podresources.v1 import api_pb2 as pr
from protos.podresources.v1 import api_pb2_grpc as pr_grpc


def test_checked_in_code_matches_a_fresh_generation(tmp_path):
    written = generate.generate(str(tmp_path))
    assert len(written) == 3 * len(generate.PROTO_FILES)
    drift = [p for p in written
             if not filecmp.cmp(tmp_path / p, os.path.join(generate.ROOT, p), shallow=False)]
    assert drift == [], f"generated code is stale, run: python -m protos.generate ({drift})"


@pytest.mark.parametrize("message, fields", [
    (dp.DevicePluginOptions, {"pre_start_required": 1, "get_preferred_allocation_available": 2}),
    (dp.RegisterRequest, {"version": 1, "endpoint": 2, "resource_name": 3, "options": 4}),
    (dp.Device, {"ID": 1, "health": 2, "topology": 3}),
    (dp.NUMANode, {"ID": 1}),
    (dp.ContainerPreferredAllocationRequest,
     {"available_deviceIDs": 1, "must_include_deviceIDs": 2, "allocation_size": 3}),
    (dp.ContainerAllocateRequest, {"devices_ids": 1}),
    (dp.ContainerAllocateResponse, {"envs": 1, "mounts": 2, "devices": 3, "annotations": 4, "cdi_devices": 5}),
    (dp.Mount, {"container_path": 1, "host_path": 2, "read_only": 3}),
    (dp.DeviceSpec, {"container_path": 1, "host_path": 2, "permissions": 3}),
    (pr.PodResources, {"name": 1, "namespace": 2, "containers": 3, "cpu_ids": 4, "memory": 5}),
    (pr.ContainerResources, {"name": 1, "devices": 2, "cpu_ids": 3, "memory": 4, "dynamic_resources": 5}),
    (pr.ContainerDevices, {"resource_name": 1, "device_ids": 2, "topology": 3}),
], ids=lambda v: getattr(v, "__name__", ""))
def test_published_field_numbers(message, fields):
    assert {f.name: f.number for f in message.DESCRIPTOR.fields} == fields


def test_wire_names_keep_the_kubelet_packages():
    assert dp.DESCRIPTOR.package == "v1beta1"
    assert pr.DESCRIPTOR.package == "v1"
    assert [m.name for m in dp.DESCRIPTOR.services_by_name["DevicePlugin"].methods] == [
        "GetDevicePluginOptions", "ListAndWatch", "GetPreferredAllocation", "Allocate", "PreStartContainer"]
    assert [m.name for m in pr.DESCRIPTOR.services_by_name["PodResourcesLister"].methods] == [
        "List", "GetAllocatableResources", "Get"]
    assert hasattr(dp_grpc, "RegistrationServicer") and hasattr(pr_grpc, "PodResourcesListerStub")
