"""The plugin as the kubelet sees it, over real unix sockets via the fake kubelet: registration,
options, ListAndWatch (full list, resent on health changes both ways), kubelet restart, a lost socket,
a broken stream, GetPreferredAllocation and every Allocate outcome."""
from __future__ import annotations

import json
import os

import grpc
import pytest

from deviceplugin.inventory_file import load
from protos.deviceplugin.v1beta1 import api_pb2 as pb

from .conftest import MEM, MIG_RESOURCES, MIXED

H100, A100 = load(MIXED)


def test_registers_every_resource_with_the_options_it_serves(kubelet, start_plugin):
    start_plugin()
    assert kubelet.resources == sorted([MEM] + MIG_RESOURCES)
    for resource in kubelet.resources:
        conn = kubelet.plugin(resource)
        assert conn.options == pb.DevicePluginOptions(get_preferred_allocation_available=True)
        assert conn.endpoint == f"vramshare-{resource.split('/')[1]}.sock"
        assert os.path.exists(os.path.join(kubelet.plugin_dir, conn.endpoint))


def test_list_and_watch_sends_every_device_with_its_numa_node(kubelet, start_plugin):
    start_plugin()
    units = kubelet.devices(MEM)
    assert len(units) == 79
    assert {(d.health, tuple(n.ID for n in d.topology.nodes)) for d in units} == {("Healthy", (0,))}
    assert all(len(d.ID) <= 63 for r in kubelet.resources for d in kubelet.devices(r))
    (mig,) = kubelet.devices("vramshare.io/mig-1g.10gb")
    assert mig.ID == A100.mig[2].uuid and [n.ID for n in mig.topology.nodes] == [1]


def test_unhealthy_and_healthy_again_are_both_resent(kubelet, backend, start_plugin):
    start_plugin()
    conn = kubelet.plugin(MEM)
    backend.inject_xid(H100.uuid, 79)
    kubelet.wait_for(lambda: {d.health for d in conn.devices} == {"Unhealthy"}, what="units unhealthy")
    backend.recover(H100.uuid)
    kubelet.wait_for(lambda: {d.health for d in conn.devices} == {"Healthy"}, what="units healthy again")
    assert conn.updates == 3 and conn.connected
    assert {d.health for d in kubelet.devices("vramshare.io/mig-1g.10gb")} == {"Healthy"}


def test_one_mig_instance_goes_unhealthy_alone(kubelet, backend, start_plugin):
    start_plugin()
    backend.inject_xid(A100.uuid, 94, mig_uuid=A100.mig[0].uuid)  # 3g.40gb
    conn = kubelet.plugin("vramshare.io/mig-3g.40gb")
    kubelet.wait_for(lambda: conn.devices[0].health == "Unhealthy", what="3g.40gb unhealthy")
    assert kubelet.devices("vramshare.io/mig-1g.10gb")[0].health == "Healthy"


def test_kubelet_restart_wipes_the_sockets_and_the_plugin_registers_again(kubelet, start_plugin):
    daemon = start_plugin()
    before = dict(kubelet.registrations)
    took = kubelet.restart(timeout=5)
    assert took < 5
    assert all(kubelet.registrations[r] == before[r] + 1 for r in before)
    assert len(kubelet.healthy_ids(MEM)) == 79
    assert all(os.path.exists(s) for s in daemon.lifecycle.sockets)


def test_a_removed_plugin_socket_is_served_and_registered_again(kubelet, start_plugin):
    start_plugin()
    before = kubelet.registrations[MEM]
    os.unlink(os.path.join(kubelet.plugin_dir, "vramshare-gpu-memory.sock"))
    kubelet.wait_for(lambda: kubelet.registrations[MEM] > before and kubelet.plugin(MEM).updates > 0,
                     what="re-registration after socket loss")
    assert len(kubelet.healthy_ids(MEM)) == 79


def test_a_broken_stream_is_repaired_by_registering_again(kubelet, start_plugin):
    start_plugin()
    before = kubelet.registrations[MEM]
    kubelet.break_stream(MEM)
    assert {d.health for d in kubelet.devices(MEM)} == {"Unhealthy"}  # what the kubelet does meanwhile
    kubelet.wait_for(lambda: kubelet.registrations[MEM] > before and kubelet.plugin(MEM).connected
                     and kubelet.plugin(MEM).updates > 0, what="re-registration after a broken stream")
    assert len(kubelet.healthy_ids(MEM)) == 79


def test_preferred_allocation_packs_onto_one_gpu_and_keeps_must_include(kubelet, start_plugin):
    start_plugin()
    ids = kubelet.healthy_ids(MEM)
    got = kubelet.preferred(MEM, ids, 8, must_include=[ids[40]])
    assert len(got) == 8 and got[0] == ids[40] and len(set(got)) == 8
    assert kubelet.preferred(MEM, ids, 8, must_include=[ids[40]]) == got  # no side effects: same answer


def test_allocate_grants_the_gpu_the_ids_name_and_writes_the_quota_file(kubelet, start_plugin, config):
    start_plugin()
    ids = kubelet.preferred(MEM, kubelet.healthy_ids(MEM), 20)
    resp = kubelet.allocate(MEM, ids)
    assert resp.envs["NVIDIA_VISIBLE_DEVICES"] == H100.uuid
    assert resp.envs["VRAMSHARE_GPU_UUIDS"] == H100.uuid
    assert resp.envs["VRAMSHARE_MEMORY_LIMIT_MIB"] == "20480"
    (mount,) = resp.mounts
    assert (mount.container_path, mount.read_only) == ("/var/run/vramshare", True)
    assert mount.host_path.startswith(config.quota_host_dir)
    with open(os.path.join(mount.host_path, "quota.json"), encoding="utf-8") as fh:
        quota = json.load(fh)
    assert quota["generation"] == 1 and quota["updated"]
    assert quota["gpus"] == [{"uuid": H100.uuid, "limitMiB": 20480, "floorMiB": 10240, "ceilingMiB": 30720}]


def test_allocate_a_mig_instance(kubelet, start_plugin):
    start_plugin()
    resp = kubelet.allocate("vramshare.io/mig-2g.20gb", [A100.mig[1].uuid])
    assert resp.envs["NVIDIA_VISIBLE_DEVICES"] == A100.mig[1].uuid
    assert resp.envs["VRAMSHARE_MEMORY_LIMIT_MIB"] == str(A100.mig[1].memory_mib)


@pytest.mark.parametrize("resource, ids, code, message", [
    (MEM, ["GPU-nope::0"], grpc.StatusCode.INVALID_ARGUMENT, "is not a vramshare.io/gpu-memory device"),
    (MEM, [A100.mig[0].uuid], grpc.StatusCode.INVALID_ARGUMENT, "belongs to vramshare.io/mig-3g.40gb"),
    (MEM, [], grpc.StatusCode.INVALID_ARGUMENT, "named no devices"),
    (MEM, [f"{H100.uuid}::1", f"{H100.uuid}::1"], grpc.StatusCode.INVALID_ARGUMENT, "more than once"),
], ids=["unknown", "wrong-resource", "empty", "duplicate"])
def test_allocate_refuses_bad_ids_with_a_grpc_error(kubelet, start_plugin, resource, ids, code, message):
    start_plugin()
    with pytest.raises(grpc.RpcError) as err:
        kubelet.allocate(resource, ids)
    assert err.value.code() == code and message in err.value.details()


def test_allocate_on_an_unhealthy_gpu_fails_the_precondition(kubelet, backend, start_plugin):
    start_plugin()
    backend.lose_gpu(H100.uuid)
    kubelet.wait_for(lambda: kubelet.healthy_ids(MEM) == [], what="units unhealthy")
    with pytest.raises(grpc.RpcError) as err:
        kubelet.allocate(MEM, [f"{H100.uuid}::0"])
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "unhealthy" in err.value.details()


def test_servers_that_cannot_start_are_retried_not_fatal(kubelet, start_plugin):
    daemon = start_plugin()
    rounds = daemon.lifecycle.registered_rounds
    kubelet.stop()
    for name in os.listdir(kubelet.plugin_dir):
        os.unlink(os.path.join(kubelet.plugin_dir, name))
    blocker = os.path.join(kubelet.plugin_dir, "vramshare-gpu-memory.sock")
    os.mkdir(blocker)  # a directory where the socket must go: serving fails until it is gone
    kubelet.start()
    assert daemon.lifecycle.wait_for(lambda: daemon.lifecycle.failed_starts >= 1, timeout=5)
    os.rmdir(blocker)
    assert daemon.lifecycle.wait_registered(rounds + 1, timeout=5)  # after a 1 s backoff
    kubelet.wait_registered([MEM])
    assert daemon.failed is None
