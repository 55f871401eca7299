"""Issue 24 with ``deviceListStrategy: cdi-cri``: a MIG instance made at Allocate gets a CDI entry that
resolves, and loses it when reaped.

Through the real daemon over real gRPC to the stand-in kubelet; the stand-in CDI registry
(:mod:`standins.cdi_registry`, the runtime's ``pkg/cdi`` cache) resolves the names Allocate returns as
the runtime would at container creation. The node spec is what ``nvidia-ctk cdi generate
--device-name-strategy=uuid`` writes for the GPUs and the instances that existed at start. On main a made
instance's ``nvidia.com/gpu=MIG-<uuid>`` resolved nowhere: the container would fail to start.
"""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deviceplugin.kubelet import mig_cdi
from deviceplugin.simulated_backend import SimulatedBackend
from standins.cdi_registry import CdiError, Registry
from tests.deviceplugin.mig_node import A100, NODE, pid, with_dynamic_mig
from vramshare import mig_plan
from vramshare.config import Config, DeviceListStrategy
from vramshare.mig_plan import MigPlacement

R1G, R2G, R3G = (f"vramshare.io/mig-{p}" for p in ("1g.10gb", "2g.20gb", "3g.40gb"))
LIBS = {"hostPath": "/usr/lib/x86_64-linux-gnu/libcuda.so.1",
        "containerPath": "/usr/lib/x86_64-linux-gnu/libcuda.so.1", "options": ["ro", "nosuid", "nodev", "bind"]}
MINORS = "gpu1/gi1/access 12\ngpu1/gi1/ci0/access 13\ngpu1/gi2/access 21\ngpu1/gi2/ci0/access 22\n"


@pytest.fixture
def backend() -> SimulatedBackend:
    return SimulatedBackend.from_dict(NODE)


@pytest.fixture
def roots(tmp_path):
    """/etc/cdi (empty) and /var/run/cdi holding nvidia-ctk's node spec for what exists at start."""
    static, dynamic = tmp_path / "etc-cdi", tmp_path / "run-cdi"
    static.mkdir()
    dynamic.mkdir()
    devices = [{"name": "GPU-aaaa", "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia0"}]}},
               {"name": A100, "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia1"}]}}]
    spec = {"cdiVersion": "0.5.0", "kind": "nvidia.com/gpu", "devices": devices,
            "containerEdits": {"env": ["NVIDIA_CTK_LIBCUDA_DIR=/usr/lib/x86_64-linux-gnu"],
                               "deviceNodes": [{"path": "/dev/nvidiactl"}], "mounts": [LIBS]}}
    (dynamic / "nvidia.yaml").write_text(json.dumps(spec))
    (tmp_path / "mig-minors").write_text(MINORS)
    return str(static), str(dynamic)


@pytest.fixture
def cdi_config(config: Config) -> Config:
    return dataclasses.replace(with_dynamic_mig(config), device_list_strategy=DeviceListStrategy.CDI_CRI)


def start(start_plugin, cfg, roots, tmp_path, **kw):
    daemon = start_plugin(cfg, cdi_roots=roots, **kw)
    if getattr(daemon.mig, "cdi", None) is not None:  # the host's /proc/driver/nvidia-caps/mig-minors
        daemon.mig.cdi._mig_minors = str(tmp_path / "mig-minors")
    return daemon


def ours(root: str) -> list[str]:
    return sorted(e for e in os.listdir(root) if e.startswith(mig_cdi.FILE_PREFIX))


def test_a_made_instance_resolves_with_cdi_cri(start_plugin, kubelet, cdi_config, roots, tmp_path):
    daemon = start(start_plugin, cdi_config, roots, tmp_path)
    resp = kubelet.allocate(R2G, [pid("2g.20gb", 4)])
    names = [d.name for d in resp.cdi_devices]
    assert len(names) == 1 and names[0].startswith("nvidia.com/gpu=MIG-")
    got = Registry(roots).inject(names)  # what the runtime does at container creation
    assert got.env["NVIDIA_CTK_LIBCUDA_DIR"] == "/usr/lib/x86_64-linux-gnu" and LIBS in got.mounts
    [made] = ours(roots[1])
    doc = json.loads(pathlib.Path(os.path.join(roots[1], made)).read_text())
    nodes = [n["path"] for n in doc["devices"][0]["containerEdits"]["deviceNodes"]]
    assert nodes[0] == "/dev/nvidia1" and all(p.startswith("/dev/nvidia-caps/nvidia-cap") for p in nodes[1:])
    assert len(nodes) == 3  # the GPU instance's and compute instance's access nodes (gi 2 here)
    # idempotent: a retried Allocate adopts the instance and rewrites the same one file
    again = kubelet.allocate(R2G, [pid("2g.20gb", 4)])
    assert [d.name for d in again.cdi_devices] == names and ours(roots[1]) == [made]
    assert daemon.mig is not None


def test_a_reaped_instance_loses_its_cdi_name(start_plugin, kubelet, cdi_config, roots, tmp_path, backend):
    daemon = start(start_plugin, cdi_config, roots, tmp_path)
    names = [d.name for d in kubelet.allocate(R1G, [pid("1g.10gb", 4)]).cdi_devices]
    Registry(roots).inject(names)
    daemon.mig.fresh_seconds = daemon.mig.dynamic.grace_seconds = 0.0
    daemon.reconciler.run_once()  # nobody holds it: destroyed, and its spec goes with it
    assert all(p.profile != "1g.10gb" for p in backend.mig_nvml.layout(A100))
    assert ours(roots[1]) == []
    with pytest.raises(CdiError, match="unresolvable"):
        Registry(roots).inject(names)


def test_a_crash_between_the_spec_and_the_answer_leaves_nothing_dangling(start_plugin, kubelet, cdi_config,
                                                                          roots, tmp_path, backend):
    """The specs were written, the plugin died before answering, with a half-written temporary left: the
    new process drops the temporary, adopts the instance on the kubelet's retry (same name, resolves),
    drops each entry with its reaped instance, and a later Allocate of the same placement resolves."""
    first = start(start_plugin, cdi_config, roots, tmp_path)
    made = [d.name for d in kubelet.allocate(R2G, [pid("2g.20gb", 4)]).cdi_devices]
    gone = [d.name for d in kubelet.allocate(R1G, [pid("1g.10gb", 6)]).cdi_devices]
    first.close()
    half = os.path.join(roots[1], mig_cdi.file_name("MIG-half") + ".tmp")
    pathlib.Path(half).write_text('{"cdiVersion": "0.5.0", "kind": "nvidia.com/gpu", "dev')
    second = start(start_plugin, cdi_config, roots, tmp_path, gpus=backend.restarted())
    assert not os.path.exists(half)
    assert [d.name for d in kubelet.allocate(R2G, [pid("2g.20gb", 4)]).cdi_devices] == made
    Registry(roots).inject(made)
    second.mig.fresh_seconds = second.mig.dynamic.grace_seconds = 0.0
    second.reconciler.run_once()  # nobody holds either: both destroyed, both entries dropped
    assert ours(roots[1]) == []
    for names in (made, gone):
        with pytest.raises(CdiError):
            Registry(roots).inject(names)
    # a later Allocate of the same placement makes a new instance whose fresh entry resolves
    again = [d.name for d in kubelet.allocate(R2G, [pid("2g.20gb", 4)]).cdi_devices]
    Registry(roots).inject(again)
    assert len(ours(roots[1])) == 1


def test_a_name_the_node_spec_already_defines_is_left_to_it(start_plugin, kubelet, cdi_config, roots, tmp_path):
    """Two specs of one directory defining one name conflict and neither resolves (``pkg/cdi/cache.go``):
    the admin's instance 3g@0 is in nvidia-ctk's spec, so adopting it writes nothing."""
    daemon = start(start_plugin, cdi_config, roots, tmp_path)
    admin = daemon.state.snapshot.inventory.gpus[1].mig[0].uuid
    path = os.path.join(roots[1], "nvidia.yaml")
    spec = json.loads(pathlib.Path(path).read_text())
    spec["devices"].append({"name": admin, "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia1"}]}})
    pathlib.Path(path).write_text(json.dumps(spec))
    names = [d.name for d in kubelet.allocate(R3G, [pid("3g.40gb", 0)]).cdi_devices]
    assert names == [f"nvidia.com/gpu={admin}"] and ours(roots[1]) == []
    Registry(roots).inject(names)


def test_no_parent_gpu_in_any_spec_refuses_with_the_fix(start_plugin, kubelet, cdi_config, roots, tmp_path):
    import grpc
    os.unlink(os.path.join(roots[1], "nvidia.yaml"))
    start(start_plugin, cdi_config, roots, tmp_path)
    with pytest.raises(grpc.RpcError) as err:
        kubelet.allocate(R1G, [pid("1g.10gb", 4)])
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "nvidia-ctk cdi generate" in err.value.details() and ours(roots[1]) == []


def test_instance_spec_is_valid_cdi_and_pure():
    node = [{"cdiVersion": "0.5.0", "kind": "nvidia.com/gpu",
             "devices": [{"name": "GPU-x", "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia3"},
                                                                             {"path": "/dev/dri/card3"}]}}]}]
    doc = mig_cdi.instance_spec("MIG-y", "GPU-x", 5, 0, node, mig_cdi.parse_mig_minors(
        "gpu3/gi5/access 48\ngpu3/gi5/ci0/access 49\n"))
    from standins.cdi_registry import validate_spec
    validate_spec(doc, "made")
    assert [n["path"] for n in doc["devices"][0]["containerEdits"]["deviceNodes"]] == [
        "/dev/nvidia3", "/dev/nvidia-caps/nvidia-cap48", "/dev/nvidia-caps/nvidia-cap49"]


@pytest.mark.parametrize("mig_uuid,node,why", [
    ("MIG-GPU-x/5/0", {"path": "/dev/nvidia3"}, "no valid CDI device name"),
    ("MIG-y", {"path": "/dev/dri/card3"}, "no /dev/nvidia<minor> device node"),
])
def test_an_entry_that_would_not_work_is_refused_with_the_reason(mig_uuid, node, why):
    spec = [{"cdiVersion": "0.5.0", "kind": "nvidia.com/gpu",
             "devices": [{"name": "GPU-x", "containerEdits": {"deviceNodes": [node]}}]}]
    with pytest.raises(mig_cdi.MigCdiError, match=why):
        mig_cdi.instance_spec(mig_uuid, "GPU-x", 5, 0, spec, {})


def test_an_isolated_memory_ask_gets_a_partition_whose_cdi_name_resolves(
        api, http, kubelet, start_plugin, cdi_config, roots, tmp_path):
    """``isolation: mig`` (m24iso): the gpu-memory units are served as the planned partition, made at
    Allocate; with cdi-cri its name must resolve too, and go with the reaped instance."""
    from tests.deviceplugin.test_mig_isolation_plugin import MEM, pod, synced
    daemon = start(start_plugin, cdi_config, roots, tmp_path, api=http)
    pod(api, "iso", 15, [(mig_plan.encode(MigPlacement(A100, "1g.20gb", 4)), 20480)])
    synced(daemon, api, "iso")
    ids = kubelet.preferred(MEM, kubelet.healthy_ids(MEM), 15)
    names = [d.name for d in kubelet.allocate(MEM, ids, pod=("default", "iso", "c")).cdi_devices]
    assert len(names) == 1 and names[0].startswith("nvidia.com/gpu=MIG-")
    Registry(roots).inject(names)
    daemon.mig.fresh_seconds = daemon.mig.dynamic.grace_seconds = 0.0
    daemon.reconciler.run_once()
    Registry(roots).inject(names)  # still held by the units' allocation: kept
    kubelet.forget_pod("default", "iso")
    daemon.reconciler.run_once()
    assert ours(roots[1]) == []
    with pytest.raises(CdiError, match="unresolvable"):
        Registry(roots).inject(names)


def test_the_cdi_registry_standin_resolves_conflicts_as_the_runtime(tmp_path):
    """``pkg/cdi/cache.go`` ``resolveConflict``: roots have rising priority (``/etc/cdi`` then
    ``/var/run/cdi``); a name two roots define is the later root's, two specs of one root make it
    unusable. On main the stand-in made every double definition a conflict."""
    low, high = tmp_path / "etc", tmp_path / "run"
    low.mkdir()
    high.mkdir()

    def spec(env: str) -> str:
        return json.dumps({"cdiVersion": "0.5.0", "kind": "nvidia.com/gpu",
                           "devices": [{"name": "MIG-x", "containerEdits": {"env": [env]}}]})
    (low / "a.json").write_text(spec("FROM=etc"))
    (high / "b.json").write_text(spec("FROM=run"))
    assert Registry([str(low), str(high)]).inject(["nvidia.com/gpu=MIG-x"]).env == {"FROM": "run"}
    (high / "c.json").write_text(spec("FROM=run2"))
    with pytest.raises(CdiError, match="more than one spec"):
        Registry([str(low), str(high)]).inject(["nvidia.com/gpu=MIG-x"])


_UUIDS = ("MIG-a", "MIG-b", "MIG-c")
_OPS = st.lists(st.tuples(st.sampled_from(("write", "crash", "sync", "theirs")), st.sampled_from(_UUIDS),
                          st.frozensets(st.sampled_from(_UUIDS))), max_size=12)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=_OPS, live=st.frozensets(st.sampled_from(_UUIDS)))
def test_after_any_interleaving_a_sweep_leaves_exactly_the_live_entries(tmp_path_factory, ops, live):
    """Writes, crashes mid-write (a temporary left), sweeps and the admin's spec gaining a name, in any
    order: after a sweep with ``live`` every live name resolves exactly once (ours, or theirs alone), no
    temporary and no gone instance's file is left, and the admin's spec is never touched."""
    root = tmp_path_factory.mktemp("cdi")
    node = {"cdiVersion": "0.5.0", "kind": "nvidia.com/gpu",
            "devices": [{"name": "GPU-x", "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia0"}]}}]}
    (root / "nvidia.json").write_text(json.dumps(node))
    cdi = mig_cdi.MigCdi([str(root)], mig_minors=str(root / "absent"))
    for op, uuid, subset in ops:
        if op == "write":
            cdi.write(uuid, "GPU-x", 1, 0)
        elif op == "crash":  # died between opening the temporary and the rename
            (root / (mig_cdi.file_name(uuid) + ".tmp")).write_text('{"cdiVersion": "0.5.0", "ki')
        elif op == "sync":
            cdi.sync(subset)
        elif all(d["name"] != uuid for d in node["devices"]):  # the admin regenerates the node spec with it
            node["devices"].append({"name": uuid, "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia0"}]}})
            (root / "nvidia.json").write_text(json.dumps(node))
    for uuid in live:
        cdi.write(uuid, "GPU-x", 1, 0)
    cdi.sync(live)
    registry = Registry([str(root)])
    assert registry.errors == {}
    for uuid in live:
        registry.inject([f"nvidia.com/gpu={uuid}"])
    theirs = {d["name"] for d in node["devices"]}
    assert set(ours(str(root))) == {mig_cdi.file_name(u) for u in live - theirs}
    assert json.loads((root / "nvidia.json").read_text()) == node


def test_a_root_the_plugin_cannot_write_is_named_at_start_with_the_fix(start_plugin, cdi_config, roots, tmp_path,
                                                                       caplog):
    """Issue 24 leftover: without the host's /var/run/cdi mounted read-write (deploy/components/cdi-cri) the
    plugin's root is its own read-only filesystem: every made instance's Allocate would fail. Said at start,
    with the fix; a writable root says nothing and is left as it was."""
    blocked = tmp_path / "not-a-directory"
    blocked.write_text("")
    why = mig_cdi.MigCdi([roots[0], str(blocked / "cdi")]).problem()
    assert why is not None and "deploy/components/cdi-cri" in why
    before = sorted(os.listdir(roots[1]))
    assert mig_cdi.MigCdi(roots).problem() is None and sorted(os.listdir(roots[1])) == before
    start(start_plugin, cdi_config, (roots[0], str(blocked / "cdi")), tmp_path)
    assert any("CDI specs cannot be written" in r.getMessage() and "components/cdi-cri" in str(r.__dict__)
               for r in caplog.records), [r.getMessage() for r in caplog.records]
