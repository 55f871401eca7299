"""Every ResourceSlice the DRA plugin can publish passes the API server's validation.

The rules are kubernetes ``pkg/apis/resource/validation/validation.go`` (``ValidateResourceSlice``,
``validateRequestPolicyRange``, the name, attribute, capacity and device-count limits), ported in
:mod:`deviceplugin.dra.validation` and enforced by the API server double where slices are stored.
A slice the server refuses takes every device in it off the node, so: a property over random
inventories and configs, the one-unit GPU of issue 17, and one bad device never hides the others.
"""
from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from kubernetes import client
from kubernetes.client.rest import ApiException

from deviceplugin import devices
from deviceplugin.backend import DiscoveredGpu, DiscoveredMig
from deviceplugin.dra import slices
from deviceplugin.dra.validation import validate_resource_slice
from standins.apiserver import ApiServerDouble
from standins.apiserver.resources import RESOURCESLICES
from vramshare.config import ConfigError, config_from_dict
from vramshare.kube import api_client_for

NODE_UID = "0b7e2c4e-1111-2222-3333-444455556666"
_LABEL = st.from_regex(r"\A[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?\Z")
_DOMAIN = st.lists(_LABEL, min_size=1, max_size=5).map(".".join).filter(lambda d: len(d) <= 253)
_PROFILES = ("1g.10gb", "1g.10gb+me", "2g.20gb", "3g.40gb", "7g.80gb", "1g.12gb", "4g.71gb")


@st.composite
def _gpu(draw, index: int) -> DiscoveredGpu:
    memory = draw(st.integers(1, 300_000))
    mig_enabled = draw(st.booleans())
    # NVML names each instance by a (GPU instance, compute instance) pair unique on its GPU, or by none
    pairs = draw(st.lists(st.tuples(st.integers(0, 14), st.integers(0, 7)), unique=True, max_size=7)
                 if mig_enabled else st.just([]))
    numbered = draw(st.booleans())
    migs = tuple(DiscoveredMig(uuid=f"MIG-{index}-{k}", profile=draw(st.sampled_from(_PROFILES)),
                               memory_mib=draw(st.integers(1, memory)),
                               gi=gi if numbered else None, ci=ci if numbered else None)
                 for k, (gi, ci) in enumerate(pairs))
    return DiscoveredGpu(index=index, uuid=f"GPU-{index:08d}-aaaa-bbbb-cccc-{index:012d}",
                         model=draw(st.text(st.characters(min_codepoint=32, max_codepoint=0x2FF), max_size=96)),
                         memory_mib=memory, reserved_mib=draw(st.integers(0, memory)),
                         numa_node=draw(st.none() | st.integers(0, 7)), mig_enabled=mig_enabled, mig=migs)


@st.composite
def _node(draw):
    """(node name, config, discovered GPUs, unhealthy UUIDs): what the plugin publishes from."""
    n = draw(st.integers(0, 12))
    copies = draw(st.sampled_from([1, 1, 1, 12]))  # sometimes > 128 devices: several slices
    kinds = [draw(_gpu(i)) for i in range(n)]
    gpus = [DiscoveredGpu(**{**g.__dict__, "index": g.index + n * c, "uuid": f"{g.uuid}-{c}",
                             "mig": tuple(DiscoveredMig(**{**m.__dict__, "uuid": f"{m.uuid}-{c}"}) for m in g.mig)})
            for c in range(copies) for g in kinds]
    modes = {str(g.index): draw(st.sampled_from(["shared", "exclusive"])) for g in gpus[:n]}
    raw = {"version": "v1", "resourceDomain": draw(st.just("vramshare.io") | _DOMAIN),
           "memoryUnitMiB": draw(st.sampled_from([1, 512, 1024, 4096, 40_960, 81_920]) | st.integers(1, 400_000)),
           "reservedMiBPerGPU": draw(st.integers(0, 100_000)), "gpuModes": modes,
           "defaultGpuMode": draw(st.sampled_from(["shared", "exclusive"])),
           "dra": {"gpus": "all", "deviceTaints": draw(st.booleans())}}
    try:
        config = config_from_dict(raw)
    except ConfigError:
        config = None  # refused at load: never published
    sick = {g.uuid for g in gpus if draw(st.booleans())} if gpus and draw(st.booleans()) else set()
    node = draw(st.just("gpu-node-1") | _DOMAIN)
    return node, config, gpus, sick


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(_node(), st.integers(0, 2**40))
def test_every_slice_the_plugin_can_publish_passes_validation(node, generation):
    name, config, gpus, sick = node
    if config is None:
        return
    inventory = devices.build_inventory(gpus, config, sick, dra=True)
    devs = slices.desired_devices(inventory, config.names, name, taints=config.dra.device_taints)
    ok, refused = slices.publishable(devs)
    assert refused == []  # no device of any inventory is left out
    published = slices.resource_slices(name, NODE_UID, ok, generation, config.names)
    for obj in published:
        assert validate_resource_slice(obj) == [], obj["metadata"]["name"]
    # the next publication (health flipped) is a valid update of each slice it keeps
    healed = devices.build_inventory(gpus, config, set(), dra=True)
    again = slices.resource_slices(name, NODE_UID, slices.publishable(slices.desired_devices(
        healed, config.names, name, taints=config.dra.device_taints))[0], generation + 1, config.names)
    before = {o["metadata"]["name"]: o for o in published}
    for obj in again:
        assert validate_resource_slice(obj, before.get(obj["metadata"]["name"])) == []


def _inventory(unit_mib: int, memory_mib: int = 81_920):
    config = config_from_dict({"version": "v1", "memoryUnitMiB": unit_mib, "dra": {"gpus": "all"}})
    gpus = [DiscoveredGpu(index=i, uuid=f"GPU-{i}", model="NVIDIA H100 80GB HBM3", memory_mib=memory_mib)
            for i in range(2)]
    return config, devices.build_inventory(gpus, config, dra=True)


@pytest.mark.parametrize("unit_mib", [81_920, 40_960 + 1, 60_000])
def test_a_shared_gpu_of_one_unit_publishes_a_valid_request_policy(unit_mib):
    """Issue 17 item 4: one memory unit per GPU (any memoryUnitMiB >= half the schedulable memory) made
    ``min + step > capacity``, which validateRequestPolicyRange refuses, and with it the whole slice."""
    config, inv = _inventory(unit_mib)
    assert {g.units for g in inv.gpus} == {1}
    devs = slices.desired_devices(inv, config.names, "n1", taints=False)
    [obj] = slices.resource_slices("n1", NODE_UID, devs, 1, config.names)
    assert validate_resource_slice(obj) == []
    policy = devs[0]["capacity"]["memory"]["requestPolicy"]
    assert policy == {"default": f"{unit_mib}Mi", "validValues": [f"{unit_mib}Mi"]}


def test_the_ported_rules_refuse_what_the_api_server_refuses():
    """validation.go messages, field by field (field.Error strings)."""
    config, inv = _inventory(1024)
    dev = slices.desired_devices(inv, config.names, "n1", taints=False)[0]
    [obj] = slices.resource_slices("n1", NODE_UID, [dev], 1, config.names)
    mem = dev["capacity"]["memory"]
    mem["requestPolicy"] = {"default": "80Gi", "validRange": {"min": "80Gi", "max": "80Gi", "step": "80Gi"}}
    assert validate_resource_slice(obj) == [
        'spec.devices[0].capacity[memory].requestPolicy.validRange.step: Invalid value: "80Gi": '
        'one step 160Gi is larger than capacity value: 80Gi']
    mem["requestPolicy"] = {"default": "1Gi", "validRange": {"min": "1Gi", "max": "80Gi", "step": "3Gi"}}
    assert validate_resource_slice(obj) == [
        'spec.devices[0].capacity[memory].requestPolicy.validRange.step: Invalid value: "80Gi": '
        'value is not a multiple of a given step (3Gi) from (1Gi)']
    mem["requestPolicy"] = {"default": "1Gi", "validValues": ["2Gi", "1Gi"], "validRange": {"min": "1Gi"}}
    assert validate_resource_slice(obj)[0].endswith('Forbidden: exactly one policy can be specified, cannot specify '
                                                    '"validValues" and "validRange" at the same time')
    dev.pop("allowMultipleAllocations")
    assert validate_resource_slice(obj) == [
        "spec.devices[0].capacity[memory].requestPolicy: Forbidden: allowMultipleAllocations must be true"]
    del mem["requestPolicy"]
    dev["attributes"]["model"] = {"string": "x" * 65}
    dev["attributes"]["bad/na/me"] = {"int": 1}
    assert validate_resource_slice(obj) == [
        'spec.devices[0].attributes: Invalid value: "bad/na/me": must not contain more than one slash',
        "spec.devices[0].attributes[model].string: Too long: may not be more than 64 bytes"]
    obj["spec"]["devices"] = [dict(dev, attributes={})] * 2
    assert validate_resource_slice(obj) == ['spec.devices[1]: Duplicate value: "gpu-0"']
    obj["spec"]["devices"] = [dict(dev, attributes={}, name=f"d{i}") for i in range(129)]
    assert validate_resource_slice(obj) == ["spec.devices: Too many: 129: must have at most 128 items"]
    obj["spec"]["devices"] = [dict(dev, attributes={}, name=f"d{i}",
                                   taints=[{"key": "k", "value": "v", "effect": "NoSchedule"}]) for i in range(65)]
    assert validate_resource_slice(obj) == ["spec.devices: Too many: 65: must have at most 64 items"]
    old = slices.resource_slices("n1", NODE_UID, [], 1, config.names)[0]
    moved = dict(old, spec={**old["spec"], "nodeName": "n2"})
    assert validate_resource_slice(moved, old) == ['spec.nodeName: Invalid value: "n2": field is immutable']


def test_one_invalid_device_is_left_out_and_the_others_published():
    config, inv = _inventory(1024)
    good = slices.desired_devices(inv, config.names, "n1", taints=False)
    bad = dict(good[1], attributes={**good[1]["attributes"], "model": {"string": "m" * 100}})
    ok, refused = slices.publishable([good[0], bad])
    assert ok == [good[0]]
    assert refused == [("gpu-1", ["device.attributes[model].string: Too long: may not be more than 64 bytes"])]


def test_the_api_server_double_refuses_an_invalid_slice_as_the_real_one_does():
    """422 Invalid, ``ResourceSlice.resource.k8s.io "<name>" is invalid: <field errors>``, nothing stored."""
    config, inv = _inventory(1024)
    dev = slices.desired_devices(inv, config.names, "n1", taints=False)[0]
    dev["capacity"]["memory"]["requestPolicy"]["validRange"]["step"] = "80Gi"
    [obj] = slices.resource_slices("n1", None, [dev], 1, config.names)
    with ApiServerDouble() as api, api_client_for(api.url) as http:
        with pytest.raises(ApiException) as refused:
            client.ResourceV1Api(http).create_resource_slice(obj)
        assert refused.value.status == 422
        assert (f'ResourceSlice.resource.k8s.io "{obj["metadata"]["name"]}" is invalid: '
                '[spec.devices[0].capacity[memory].requestPolicy.validRange.step') in json.loads(refused.value.body)["message"]
        assert api.objects(RESOURCESLICES) == []


def test_a_resource_domain_too_long_for_a_dra_driver_name_is_refused_at_load():
    """The driver ``gpu.<domain>`` must be a CSI-style name of at most 63 characters
    (validation.go validateDriverName); a longer one would have every slice refused."""
    domain = "a" * 30 + "." + "b" * 29  # 60 characters: gpu.<domain> is 64
    with pytest.raises(ConfigError, match="too long for DRA"):
        config_from_dict({"version": "v1", "resourceDomain": domain, "dra": {"gpus": "all"}})
    config_from_dict({"version": "v1", "resourceDomain": domain})  # no DRA: no driver name to publish
