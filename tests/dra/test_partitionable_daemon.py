"""``vramshare dra-plugin`` with dynamic MIG against the API server double: partitionable devices where
the server keeps counters, today's devices where it drops them (DRAPartitionableDevices off), and an
admin's instance withholding the placements it takes."""
from __future__ import annotations

import shutil
import tempfile

import pytest

from deviceplugin.dra.claims import ClaimRef
from deviceplugin.dra.main import DraPluginDaemon
from deviceplugin.mig_dynamic import DynamicMig, MigPlan
from deviceplugin.mig_nvml import NvmlMig
from deviceplugin.nvml_backend import NvmlBackend
from standins.apiserver import ApiServerDouble
from standins.apiserver.resources import RESOURCESLICES
from tests.dra.conftest import NODE, dra_config
from tests.fixtures.fake_nvml_mig import H100_MIG, MigFakeNvml
from vramshare.kube import api_client_for

DRIVER = "gpu.vramshare.io"


def _daemon(http, tmp, sockets, fake, **dra) -> DraPluginDaemon:
    return DraPluginDaemon(NvmlBackend(nvml=fake), dra_config(tmp, dynamic_mig=("all",), **dra), http, NODE,
                           plugin_dir=f"{sockets}/plugins/{DRIVER}", registry_dir=f"{sockets}/registry")


def _published(api):
    mine = [s for s in api.objects(RESOURCESLICES) if s["spec"]["nodeName"] == NODE]
    newest = max(s["spec"]["pool"]["generation"] for s in mine)
    mine = [s for s in mine if s["spec"]["pool"]["generation"] == newest]
    return ([d for s in mine for d in s["spec"].get("devices") or ()],
            [c for s in mine for c in s["spec"].get("sharedCounters") or ()])


@pytest.fixture
def sockets():
    path = tempfile.mkdtemp(prefix="dra", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize("gate", [True, False])
def test_partitions_where_the_server_keeps_counters_else_todays_devices(tmp_path, sockets, gate):
    fake = MigFakeNvml()
    with ApiServerDouble(partitionable_devices=gate) as api, api_client_for(api.url) as http:
        api.create_node({"metadata": {"name": NODE}})
        daemon = _daemon(http, tmp_path, sockets, fake)
        try:
            daemon.publish_once()
            devices, counters = _published(api)
            if gate:
                assert daemon.partitionable and len(devices) == 25 and [c["name"] for c in counters] == [
                    "gpu-0-counter-set"]
                assert all(d["consumesCounters"][0]["counterSet"] == "gpu-0-counter-set" for d in devices)
            else:  # the counter slice came back without its counters: no partition was ever applied
                assert not daemon.partitionable and devices == [] and counters == []
        finally:
            daemon.close()


def test_without_the_gate_the_instances_as_they_are_are_published_and_preparable(tmp_path, sockets):
    fake = MigFakeNvml()
    with ApiServerDouble(partitionable_devices=False) as api, api_client_for(api.url) as http:
        api.create_node({"metadata": {"name": NODE}})
        # an admin's instance, made before the plugin starts
        fake.nvmlInit()
        handle = fake.nvmlDeviceGetHandleByIndex(0)
        DynamicMig(NvmlMig(fake), {H100_MIG.uuid: (handle, H100_MIG.name, H100_MIG.total_mib)}).ensure(
            MigPlan(H100_MIG.uuid, "3g.40gb", 4))
        daemon = _daemon(http, tmp_path, sockets, fake)
        try:
            daemon.publish_once()
            devices, counters = _published(api)
            assert not daemon.partitionable and counters == [] and len(devices) == 1
            assert not devices[0].get("consumesCounters") and devices[0]["name"] in daemon.devices()
        finally:
            daemon.close()


def test_an_admins_instance_withholds_the_placements_it_takes(tmp_path, sockets):
    fake = MigFakeNvml()
    with ApiServerDouble() as api, api_client_for(api.url) as http:
        api.create_node({"metadata": {"name": NODE}})
        daemon = _daemon(http, tmp_path, sockets, fake)
        try:
            assert daemon.mig is not None
            daemon.mig.ensure(MigPlan(H100_MIG.uuid, "3g.40gb", 4))  # made by hand: not a claim's
            daemon.publish_once()
            names = {d["name"] for d in _published(api)[0]}
            assert "gpu-0-mig-3g40gb-9-4" not in names and "gpu-0-mig-7g80gb-0-0" not in names
            assert "gpu-0-mig-4g40gb-5-0" in names and len(names) == 14
        finally:
            daemon.close()


def test_a_claims_own_partition_stays_published(tmp_path, sockets):
    """The allocated device must stay in the slice: the allocator charges its counters from there."""
    fake = MigFakeNvml()
    with ApiServerDouble() as api, api_client_for(api.url) as http:
        api.create_node({"metadata": {"name": NODE}})
        claim = api.create({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": "c", "namespace": "default"}, "spec": {"devices": {"requests": []}},
            "status": {"allocation": {"devices": {"results": [
                {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": "gpu-0-mig-3g40gb-9-4"}]}},
                "reservedFor": [{"resource": "pods", "name": "p", "uid": "pod-1"}]}})
        daemon = _daemon(http, tmp_path, sockets, fake)
        try:
            got = daemon.preparer.prepare(ClaimRef("default", "c", claim["metadata"]["uid"]))
            assert got.error == "" and len(fake.instances[0]) == 1
            assert daemon.metrics.registry.get_sample_value("vramshare_mig_instances_created_total",
                                                            {"gpu": H100_MIG.uuid}) == 1  # on :9403
            daemon.publish_once()
            assert len(_published(api)[0]) == 25
        finally:
            daemon.close()
