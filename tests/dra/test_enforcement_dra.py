"""Enforcement modes on the DRA plugin (the device plugin's issue 9, on the DRA path): the DRA plugin
detects the node's mode as the device plugin does (``enforcement.detect``/``pin``, same config key,
same refusal), exports the same metrics, puts the fence in each claim's CDI spec (the values Allocate
sets for the same grant) and, in driver mode, its quota loop moves the claim's container's cgroup
limits through NVML. On 4b86459 the DRA plugin detected nothing: its loop ran cooperative, its CDI
specs carried no fence, and a named mode it could not honour was ignored.

Edges only: the API server double (real ``kubernetes`` client), the stand-in DRA scheduler and kubelet
(real gRPC Prepare), the fake NVML (limits per cgroup, as the R615 driver keeps them) and a cgroup
tree in a temporary directory. A node's facts are given the way a simulated node gives them
(``enforcement_facts`` on the backend), except for the refusal of an old driver, which the real probe
finds on the fake NVML.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import tempfile
from typing import Any, Iterator

import pytest
from prometheus_client import generate_latest

from deviceplugin import enforcement
from deviceplugin.allocation import GpuShare
from deviceplugin.dra import cdi
from deviceplugin.dra.claims import ClaimRef, our_shares, resolve
from deviceplugin.dra.main import DraPluginDaemon
from deviceplugin.enforcement import EnforcementRefused, NodeFacts
from deviceplugin.nvml_backend import NvmlBackend
from deviceplugin.simulated_backend import SimulatedBackend
from standins.apiserver import ApiServerDouble
from standins.apiserver.resources import PODS
from standins.dra_kubelet import DraKubelet
from standins.dra_scheduler import DraScheduler
from tests.dra.conftest import NODE, dra_config
from tests.dra.test_daemon import DRIVER, _apply_deploy, devices_of
from tests.fixtures.fake_nvml import H100_80GB, FakeNvml
from vramshare import contract
from vramshare.config import Config, EnforcementConfig
from vramshare.inventory import EnforcementMode
from vramshare.kube import api_client_for

GPU = H100_80GB.uuid
CID = "c" * 64
NO_MPS = "no MPS control pipe at /run/nvidia/mps/nvidia.com/gpu/pipe/control"
DRIVER_NODE = NodeFacts("615.20.01", True, None, NO_MPS)  # R615, cgroup v2, the grants: driver
MPS_NODE = NodeFacts(None, True, "no NVML", None)  # an MPS control daemon, no driver limits
BARE_NODE = NodeFacts(None, True, "no NVML", NO_MPS)  # nothing fences: cooperative
LACKING = NodeFacts("615.20.01", True, "not probed", NO_MPS, "this container lacks CAP_SYS_ADMIN")
FENCE_KEYS = (contract.ENV_GPU_MEMORY_REQUEST, contract.ENV_GPU_MEMORY_LIMIT, contract.ENV_MPS_PINNED_MEM_LIMIT,
              contract.ENV_MPS_PIPE_DIRECTORY)


def _driver_nvml(tmp_path, cgroups) -> NvmlBackend:
    """One H100 on an R615 driver (the fake NVML keeps limits per cgroup); the node's facts are what the
    real probe finds on it from inside the dra-driver-enforcement pod: CAP_SYS_ADMIN, the host's cgroup v2
    tree (this process's own capabilities and /sys/fs/cgroup are the test machine's, not the pod's)."""
    nv = FakeNvml([H100_80GB])
    nv.driver_version = "615.20.01"
    nv.nvmlInit()
    (cgroups / "cgroup.controllers").write_text("cpu memory dmem\n")
    (cgroups / "kubepods.slice").mkdir()
    status = tmp_path / "status"
    status.write_text(f"CapEff:\t{1 << enforcement.CAP_BITS[enforcement.DRIVER_CAPABILITY]:016x}\n")
    facts = enforcement.probe(nv, EnforcementConfig(), cgroup_root=str(cgroups), shared_uuids=[GPU],
                              proc_status=str(status))
    assert facts.driver_problem() is None, facts
    backend = NvmlBackend(nvml=nv, sysfs_root="/nonexistent")
    backend.enforcement_facts = facts
    return backend


def _simulated(facts: NodeFacts | None) -> SimulatedBackend:
    backend = SimulatedBackend.demo()
    backend.enforcement_facts = facts
    return backend


@contextlib.contextmanager
def _api() -> Iterator[tuple[ApiServerDouble, Any]]:
    with ApiServerDouble() as api, api_client_for(api.url) as http:
        api.create_node({"metadata": {"name": NODE}})
        _apply_deploy(http)
        yield api, http


def _daemon(http: Any, backend: Any, config: Config, sockets: str, **kw: Any) -> DraPluginDaemon:
    return DraPluginDaemon(backend, config, http, NODE, plugin_dir=f"{sockets}/plugins/{DRIVER}",
                           registry_dir=f"{sockets}/registry", retry_seconds=0.05, resync_seconds=0.2, **kw)


VLLM = {"name": "vllm", "image": "vllm", "resources": {"claims": [{"name": "gpu"}]}}


def _pod(api: ApiServerDouble, scheduler: DraScheduler, name: str, **spec: Any) -> dict:
    """A vLLM pod with a 22 GiB shared claim, scheduled on this node (``spec``: other containers)."""
    api.create_pod({"metadata": {"name": name, "namespace": "default"},
                    "spec": {"resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "vllm-22gi"}],
                             "containers": [VLLM], **spec}})
    placement = scheduler.schedule(scheduler.create_claims(api.get_pod("default", name)))
    assert placement is not None and placement.node == NODE
    return api.get_pod("default", name)


def _claim(http: Any, pod: dict) -> dict:
    from kubernetes import client

    from vramshare import kube
    [status] = pod["status"]["resourceClaimStatuses"]
    return kube.decode(client.ResourceV1Api(http).read_namespaced_resource_claim(
        status["resourceClaimName"], "default", _preload_content=False))


def _spec(daemon: DraPluginDaemon, claim: dict) -> dict:
    record = daemon.preparer.prepared()[claim["metadata"]["uid"]]
    with open(record.cdi_spec, encoding="utf-8") as fh:
        return json.load(fh)


def _env(spec: dict) -> dict[str, str]:
    return dict(e.split("=", 1) for e in spec["containerEdits"]["env"])


def _cgroup(root, pod_uid: str, cid: str) -> str:
    """The container's cgroup under the systemd driver, made in ``root``; its path as NVML names it."""
    path = (f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{pod_uid.replace('-', '_')}.slice/"
            f"cri-containerd-{cid}.scope")
    (root / path.lstrip("/")).mkdir(parents=True)
    return path


# -- driver, end to end ---------------------------------------------------------------------------------
def test_on_a_driver_node_the_claim_s_spec_carries_the_fence_and_the_loop_moves_its_cgroup(tmp_path):
    """The DRA plugin on an R615 node (auto) runs driver mode: the claim's CDI spec has the toolkit's
    variables at the grant (what Allocate sets for it), and a quota tick sets the claim's container's
    cgroup limits through NVML (soft = the request, hard = the loop's limit)."""
    cgroups = tmp_path / "cgroup"
    cgroups.mkdir()
    backend = _driver_nvml(tmp_path, cgroups)
    config = dra_config(tmp_path)
    config = dataclasses.replace(config, quota=dataclasses.replace(config.quota, interval_seconds=3600))
    sockets = tempfile.mkdtemp(prefix="dra", dir="/tmp")
    try:
        with _api() as (api, http), _daemon(http, backend, config, sockets, cgroup_root=str(cgroups)) as daemon:
            assert daemon.enforcement.mode is EnforcementMode.DRIVER
            assert daemon.state.snapshot.config.enforcement.resolved is EnforcementMode.DRIVER
            scrape = generate_latest(daemon.metrics.registry).decode()
            assert 'vramshare_enforcement_mode{mode="driver"} 1.0' in scrape
            assert 'vramshare_enforcement_mode{mode="cooperative"} 0.0' in scrape
            loop = daemon._quota_loop
            assert loop is not None and loop.mode is EnforcementMode.DRIVER
            assert api.wait_for(lambda a: len(devices_of(a)) >= 1, timeout=20)
            kubelet = DraKubelet(http, NODE, f"{sockets}/registry")
            assert kubelet.sync_plugins() == [DRIVER] and daemon.plugin.registration.registered.wait(5)
            pod = _pod(api, DraScheduler(http, [NODE], seed=1), "chat")
            kubelet.prepare_pod(pod)
            claim = _claim(http, pod)
            env = _env(_spec(daemon, claim))
            grant = daemon.preparer.prepared()[claim["metadata"]["uid"]].gpus[GPU]
            assert grant == 22 * 1024
            fence = enforcement.container_fence([GpuShare(GPU, grant)], daemon.state.snapshot.config.enforcement)
            assert {k: env[k] for k in fence.envs} == fence.envs == {
                "NVIDIA_GPU_MEMORY_REQUEST": "22528", "NVIDIA_GPU_MEMORY_LIMIT": "22528"}
            # the container runs: its runtime ID (pod status) and its cgroup (the host's tree)
            cgroup = _cgroup(cgroups, pod["metadata"]["uid"], CID)

            def running(p: dict) -> None:
                p.setdefault("status", {}).update(phase="Running", podIP="10.0.0.1", containerStatuses=[
                    {"name": "vllm", "containerID": f"containerd://{CID}", "ready": True}])
            api.update(PODS, "default", "chat", running)
            assert api.wait_for(lambda _: any(p["metadata"]["name"] == "chat" and (p.get("status") or {}).get(
                "containerStatuses") for p in daemon.pods.pods()))
            backend.nvml.allocate(GPU, cgroup, 4000)
            report = loop.run_once()
            assert report.skipped is None and not report.errors, (report.skipped, report.errors)
            [tenant] = loop.tenants_now
            assert tenant.container_ids == frozenset([CID])
            limit = loop.limits()[(tenant.key, GPU)]
            assert backend.nvml.limits[(GPU, cgroup)] == (min(limit, grant) << 20, limit << 20)
    finally:
        shutil.rmtree(sockets, ignore_errors=True)


# -- the CDI spec per mode ------------------------------------------------------------------------------
@contextlib.contextmanager
def _scheduled_claim(tmp_path, facts: NodeFacts | None, pod_spec: dict | None = None,
                     **enforcement_cfg: Any) -> Iterator[tuple[ApiServerDouble, DraPluginDaemon, dict, ClaimRef]]:
    """The demo node's DRA plugin with ``facts`` (no kubelet: the test prepares through the preparer) and
    one pod with a 22 GiB claim scheduled on it: ``(api, daemon, the claim as allocated, its ref)``."""
    config = dra_config(tmp_path)
    if enforcement_cfg:
        config = dataclasses.replace(config, enforcement=EnforcementConfig(**enforcement_cfg))
    sockets = tempfile.mkdtemp(prefix="dra", dir="/tmp")
    try:
        with _api() as (api, http):
            daemon = _daemon(http, _simulated(facts), config, sockets)
            try:
                daemon.publish_once()
                pod = _pod(api, DraScheduler(http, [NODE], seed=1), "chat", **(pod_spec or {}))
                claim = _claim(http, pod)
                meta = claim["metadata"]
                yield api, daemon, claim, ClaimRef(meta["namespace"], meta["name"], meta["uid"])
            finally:
                daemon.close()
    finally:
        shutil.rmtree(sockets, ignore_errors=True)


def _prepared_spec(tmp_path, facts: NodeFacts | None, pod_spec: dict | None = None,
                   **enforcement_cfg: Any) -> tuple[dict, DraPluginDaemon, dict]:
    """Prepare one 22 GiB claim on the demo node with ``facts`` and return its CDI spec, the daemon
    (closed) and the claim."""
    with _scheduled_claim(tmp_path, facts, pod_spec, **enforcement_cfg) as (_api_, daemon, claim, ref):
        result = daemon.preparer.prepare(ref)
        assert not result.error, result.error
        return _spec(daemon, claim), daemon, claim


def test_in_mps_mode_the_claim_s_spec_carries_the_mps_env_and_mounts(tmp_path):
    spec, daemon, claim = _prepared_spec(tmp_path, MPS_NODE)
    env = _env(spec)
    record = daemon.preparer.prepared()[claim["metadata"]["uid"]]
    [(uuid, mib)] = record.gpus.items()
    fence = enforcement.container_fence([GpuShare(uuid, mib)], daemon.state.snapshot.config.enforcement)
    assert {k: env[k] for k in fence.envs} == fence.envs
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"0={mib}M" and env["CUDA_MPS_PIPE_DIRECTORY"] == "/mps/pipe"
    assert "NVIDIA_GPU_MEMORY_LIMIT" not in env
    assert daemon.enforcement.mode is EnforcementMode.MPS
    mounts = {m["containerPath"]: m for m in spec["containerEdits"]["mounts"]}
    en = EnforcementConfig()
    # NVIDIA's DRA driver mounts the pipe directory and the daemon's shared memory rw, nosuid, nodev, bind
    assert mounts["/mps/pipe"] == {"hostPath": en.mps_pipe_directory, "containerPath": "/mps/pipe",
                                   "options": ["rw", "nosuid", "nodev", "bind"]}
    assert mounts["/dev/shm"] == {"hostPath": en.mps_shm_directory, "containerPath": "/dev/shm",
                                  "options": ["rw", "nosuid", "nodev", "bind"]}


SIDECAR = {"name": "proxy", "image": "envoy", "restartPolicy": "Always", "resources": {"claims": [{"name": "gpu"}]}}
WARMUP = {"name": "warmup", "image": "vllm", "resources": {"claims": [{"name": "gpu"}]}}
PLAIN = {"name": "logs", "image": "fluentbit"}


@pytest.mark.parametrize("facts, key, fmt", [(DRIVER_NODE, "NVIDIA_GPU_MEMORY_LIMIT", "{}"),
                                             (MPS_NODE, "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0={}M")])
@pytest.mark.parametrize("pod_spec, users", [
    ({"containers": [VLLM, PLAIN]}, 1),  # a container that does not name the claim gets none of it
    ({"containers": [VLLM, dict(VLLM, name="embed")]}, 2),
    # a sidecar runs beside the app containers; an ordinary init container runs before them, alone
    ({"containers": [VLLM, dict(VLLM, name="embed")], "initContainers": [WARMUP, SIDECAR]}, 3),
    ({"containers": [PLAIN], "initContainers": [SIDECAR, WARMUP]}, 2),
])
def test_a_claim_that_several_running_containers_name_fences_each_at_its_share(tmp_path, facts, key, fmt, pod_spec,
                                                                                users):
    """The CDI spec is one per claim and the runtime injects it into every container naming the claim,
    but the driver (per cgroup) and MPS (per client) fence each one: at the whole grant each, n containers
    could hold n times the claim. Each gets grant // n, n the most that run at once (kubelet's order:
    init containers one by one beside the sidecars started before them, then the app containers)."""
    spec, daemon, claim = _prepared_spec(tmp_path, facts, pod_spec)
    [(_uuid, mib)] = daemon.preparer.prepared()[claim["metadata"]["uid"]].gpus.items()
    assert _env(spec)[key] == fmt.format(mib // users)
    assert _env(spec)[contract.ENV_MEMORY_LIMIT_MIB] == str(mib)  # the claim's grant, as the quota file has it


def test_a_pod_that_cannot_be_read_refuses_the_prepare_with_the_reason_and_a_retry_prepares(tmp_path):
    """In driver mode the fence's split needs the claim's pods: a pod the plugin cannot read (the double
    answers the read 403, as the real API server answers a right no rule grants) refuses the Prepare,
    naming the pod, and the kubelet's retry prepares it; fencing each container at the whole grant could
    let them hold a multiple of it."""
    with _scheduled_claim(tmp_path, DRIVER_NODE, {"containers": [VLLM, dict(VLLM, name="embed")]}) as (
            api, daemon, claim, ref):
        api.fail_next("GET", "/api/v1/namespaces/default/pods/chat", code=403, times=1)
        result = daemon.preparer.prepare(ref)
        assert "cannot read its pod default/chat" in result.error and "403" in result.error
        assert ref.uid not in daemon.preparer.prepared()  # nothing half made
        assert not daemon.preparer.prepare(ref).error
        [(_u, mib)] = daemon.preparer.prepared()[ref.uid].gpus.items()
        assert _env(_spec(daemon, claim))["NVIDIA_GPU_MEMORY_LIMIT"] == str(mib // 2)


@pytest.mark.parametrize("facts, asked", [(BARE_NODE, {}), (DRIVER_NODE, {"mode": "cooperative"})])
def test_in_cooperative_mode_the_claim_s_spec_is_the_one_it_was(tmp_path, facts, asked):
    """Byte for byte the spec the cooperative-only plugin wrote (no enforcement pinned), whether the
    node has nothing better (auto) or the config asks for cooperative on a driver node."""
    spec, daemon, claim = _prepared_spec(tmp_path, facts, **asked)
    assert daemon.enforcement.mode is EnforcementMode.COOPERATIVE
    assert not {k for k in _env(spec) if k in FENCE_KEYS}
    config = daemon.state.snapshot.config
    unpinned = dataclasses.replace(config, enforcement=dataclasses.replace(config.enforcement, resolved=None))
    record = daemon.preparer.prepared()[claim["metadata"]["uid"]]
    where = f"claim default/{claim['metadata']['name']}"
    shares = resolve(our_shares(claim, config.names.dra_driver, NODE), daemon.devices(), where,
                     config.memory_unit_mib)
    before, _extra = cdi.claim_spec(claim["metadata"]["uid"], shares, unpinned, record.quota_dir)
    with open(record.cdi_spec, "rb") as fh:
        assert fh.read() == json.dumps(before, indent=1, sort_keys=True).encode()


# -- refusal and metrics --------------------------------------------------------------------------------
def test_a_named_mode_the_node_lacks_is_refused_with_its_reason(tmp_path):
    """enforcement.mode driver on an R580 node (the real probe on the fake NVML) and mps on a node with no
    MPS daemon: the plugin does not start, and says why (never a silent downgrade to cooperative)."""
    sockets = tempfile.mkdtemp(prefix="dra", dir="/tmp")
    try:
        with _api() as (_api_server, http):
            old = FakeNvml([H100_80GB])
            old.driver_version = "580.95.05"
            driver = dataclasses.replace(dra_config(tmp_path), enforcement=EnforcementConfig(mode="driver"))
            with pytest.raises(EnforcementRefused, match="enforcement.mode driver refused: driver 580.95.05 is older "
                                                         "than R615"):
                _daemon(http, NvmlBackend(nvml=old, sysfs_root="/nonexistent"), driver, sockets)
            mps = dataclasses.replace(dra_config(tmp_path), enforcement=EnforcementConfig(mode="mps"))
            with pytest.raises(EnforcementRefused, match="enforcement.mode mps refused: no MPS control pipe"):
                _daemon(http, _simulated(BARE_NODE), mps, sockets)
            with pytest.raises(EnforcementRefused, match="lacks CAP_SYS_ADMIN"):
                _daemon(http, _simulated(LACKING), driver, sockets)
    finally:
        shutil.rmtree(sockets, ignore_errors=True)


def test_the_fallback_and_its_reason_are_in_the_metrics_and_the_mode_survives_a_reload(tmp_path):
    sockets = tempfile.mkdtemp(prefix="dra", dir="/tmp")
    try:
        with _api() as (_api_server, http):
            daemon = _daemon(http, _simulated(LACKING), dra_config(tmp_path), sockets)
            try:
                scrape = generate_latest(daemon.metrics.registry).decode()
                assert 'vramshare_enforcement_mode{mode="cooperative"} 1.0' in scrape
                assert ('vramshare_enforcement_unavailable{mode="driver",reason="this container lacks '
                        'CAP_SYS_ADMIN"} 1.0') in scrape
                assert 'vramshare_enforcement_unavailable{mode="mps",reason="' + NO_MPS + '"} 1.0' in scrape
            finally:
                daemon.close()
            daemon = _daemon(http, _simulated(MPS_NODE), dra_config(tmp_path), sockets)
            try:
                running = daemon.state.snapshot.config
                daemon.reload(dataclasses.replace(running, enforcement=EnforcementConfig(mode="cooperative")))
                assert daemon.state.snapshot.config.enforcement.resolved is EnforcementMode.MPS  # until a restart
            finally:
                daemon.close()
    finally:
        shutil.rmtree(sockets, ignore_errors=True)


def test_the_command_refuses_a_named_mode_with_one_line(tmp_path):
    """``vramshare dra-plugin`` with VRAMSHARE_ENFORCEMENT_MODE=driver (as the dra-driver-enforcement
    DaemonSet sets it) on a node without NVML exits 1 with the reason; on 4b86459 it started cooperative."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sockets = tempfile.mkdtemp(prefix="dra", dir="/tmp")
    config = tmp_path / "config.yaml"
    config.write_text(f"version: v1\nquotaHostDir: {tmp_path}/quota\n"
                      f"dra: {{gpus: all, cdiRoot: {tmp_path}/cdi, stateDir: {tmp_path}/state}}\n")
    env = {k: v for k, v in os.environ.items() if k not in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST", "NODE_NAME")}
    env["VRAMSHARE_ENFORCEMENT_MODE"] = "driver"
    try:
        with ApiServerDouble() as api:
            api.create_node({"metadata": {"name": NODE}})
            kubeconfig = tmp_path / "kubeconfig"
            kubeconfig.write_text(f"apiVersion: v1\nkind: Config\ncurrent-context: double\n"
                                  f"clusters: [{{name: double, cluster: {{server: '{api.url}'}}}}]\n"
                                  f"users: [{{name: nobody, user: {{}}}}]\n"
                                  f"contexts: [{{name: double, context: {{cluster: double, user: nobody}}}}]\n")
            proc = subprocess.Popen(
                [sys.executable, "-m", "vramshare_cli.main", "dra-plugin", "--backend", "simulated", "--config",
                 str(config), "--kubeconfig", str(kubeconfig), "--node-name", NODE,
                 "--plugin-dir", f"{sockets}/plugins/{DRIVER}", "--registry-dir", f"{sockets}/registry",
                 "--metrics-port", "0"], cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            try:
                _out, err = proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
                pytest.fail("the plugin started although enforcement.mode driver cannot be honoured")
        assert proc.returncode == 1, err
        assert err.strip().splitlines()[-1] == ("vramshare dra-plugin: enforcement.mode driver refused: no NVIDIA "
                                                "driver (NVML not available)")
    finally:
        shutil.rmtree(sockets, ignore_errors=True)
