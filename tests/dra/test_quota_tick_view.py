"""Issue 21 (the quota tick without a round trip) on the DRA path, through the whole DRA plugin: the API
server double (real kubernetes client), the stand-in DRA scheduler and kubelet (real gRPC Prepare) and
the simulated GPU backend with replayed use at the edges; the daemon's own preparer, pod cache and quota
loop inside.

* A quota tick makes no LIST call: its tenants are the preparer's prepared claims (in-process), the
  claim pods' metadata comes from the watch-fed pod cache and follows a change at watch speed. On
  954fe28 every tick LISTed the node's pods (``dra/tenants.py ClaimTenantSource``), and the loop did
  not run on a simulated node at all.
* A claim whose pod was deleted (the kubelet has not unprepared it yet) leaves no state in the loop,
  from the next tick on.
* A reloaded config reaches the loop (it kept its start settings until a restart).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import tempfile
from typing import Iterator

import pytest

from deviceplugin.allocation import GpuShare
from deviceplugin.dra.checkpoint import PreparedClaim
from deviceplugin.dra.main import DraPluginDaemon
from deviceplugin.dra.slices import DeviceRef
from deviceplugin.dra.tenants import (AllocatedClaims, ClaimTenantSource, PodCacheNotSynced, departed_claims,
                                       pending_from_claims,
                                      unprepared_claims)
from deviceplugin.quota.loop import LoopSettings, QuotaLoop
from deviceplugin.quota.model import Claim, PolicyParams
from deviceplugin.quota.telemetry import UsageSample, VllmSample
from deviceplugin.quota.writer import read_quota
from deviceplugin.quota_files import QuotaFiles
from deviceplugin.simulated_backend import SimulatedBackend
from deviceplugin.simulated_usage import UsageReplay
from standins.apiserver import ApiServerDouble
from standins.apiserver.resources import RESOURCECLAIMS
from standins.dra_kubelet import DraKubelet
from standins.dra_scheduler import DraScheduler
from tests.dra.conftest import NODE, dra_config
from tests.dra.test_daemon import DRIVER, _apply_deploy, devices_of
from vramshare import podspec
from vramshare.config import Config, QuotaConfig
from vramshare.inventory import Gpu
from vramshare.kube import api_client_for


@contextlib.contextmanager
def demo_cluster(annotations: dict | None = None) -> Iterator[tuple]:
    """The API server double with the demo node (its Node created with ``annotations``) and the deploy
    applied, a client of it, and a directory for the plugin's and kubelet's sockets: ``(api, http, sockets)``."""
    sockets = tempfile.mkdtemp(prefix="dra", dir="/tmp")
    try:
        with ApiServerDouble() as api, api_client_for(api.url) as http:
            api.create_node({"metadata": {"name": NODE, "annotations": dict(annotations or {})}})
            _apply_deploy(http)
            yield api, http, sockets
    finally:
        shutil.rmtree(sockets, ignore_errors=True)


@contextlib.contextmanager
def plugin_on(api: ApiServerDouble, http, sockets: str, config: Config, used_mib: int = 2000,
              devices: int = 7) -> Iterator[DraPluginDaemon]:
    """A DRA plugin running on the demo node of :func:`demo_cluster` whose use is replayed (``used_mib``
    per tenant, so its quota loop runs), once its slices hold ``devices`` devices; stopped on exit (a
    restart is a second one on the same config: its checkpoint is in ``dra.stateDir``)."""
    backend = SimulatedBackend.demo()
    backend.usage_replay = UsageReplay([[used_mib]])
    daemon = DraPluginDaemon(backend, config, http, NODE, plugin_dir=f"{sockets}/plugins/{DRIVER}",
                             registry_dir=f"{sockets}/registry", retry_seconds=0.05, resync_seconds=0.2)
    with daemon:
        assert api.wait_for(lambda a: len(devices_of(a)) == devices, timeout=20)
        yield daemon


@contextlib.contextmanager
def running_plugin(config: Config, used_mib: int = 2000, annotations: dict | None = None) -> Iterator[tuple]:
    """A running DRA plugin on the demo node (:func:`plugin_on`), with a registered kubelet and scheduler:
    ``(api, daemon, scheduler, kubelet)``."""
    with demo_cluster(annotations) as (api, http, sockets), plugin_on(api, http, sockets, config, used_mib) as daemon:
        kubelet = DraKubelet(http, NODE, f"{sockets}/registry")
        assert kubelet.sync_plugins() == [DRIVER] and daemon.plugin.registration.registered.wait(5)
        yield api, daemon, DraScheduler(http, [NODE], seed=1), kubelet


@pytest.fixture
def node(tmp_path):
    """The plugin's quota loop ticking only when the test says (driven tick by tick)."""
    config = dra_config(tmp_path)
    config = dataclasses.replace(config, quota=dataclasses.replace(config.quota, interval_seconds=3600))
    with running_plugin(config) as (api, daemon, scheduler, kubelet):
        loop = getattr(daemon, "_quota_loop", None)  # the daemon's own loop, driven tick by tick
        assert loop is not None, "the DRA plugin's quota loop runs on a node with replayed use"
        yield api, daemon, loop, scheduler, kubelet


def _running(api: ApiServerDouble, scheduler: DraScheduler, name: str) -> dict:
    """A vLLM pod with a 22 GiB shared claim, scheduled here and given a pod IP (its metrics URL)."""
    api.create_pod({"metadata": {"name": name, "namespace": "default",
                                 "annotations": {"prometheus.io/port": "8000"}},
                    "spec": {"resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "vllm-22gi"}],
                             "containers": [{"name": "vllm", "image": "vllm",
                                             "resources": {"claims": [{"name": "gpu"}]}}]}})
    placement = scheduler.schedule(scheduler.create_claims(api.get_pod("default", name)))
    assert placement is not None and placement.node == NODE
    _ip(api, name, "10.0.0.1")
    return api.get_pod("default", name)


def _ip(api: ApiServerDouble, name: str, ip: str) -> None:
    from standins.apiserver.resources import PODS

    def set_ip(pod: dict) -> None:
        pod.setdefault("status", {}).update(phase="Running", podIP=ip)
    api.update(PODS, "default", name, set_ip)


def _cached(daemon, api: ApiServerDouble, name: str) -> None:
    """The plugin's pod cache has the API's current version of the pod (watch events are asynchronous)."""
    rv = api.get_pod("default", name)["metadata"]["resourceVersion"]
    assert api.wait_for(lambda _: any(p["metadata"]["name"] == name and p["metadata"]["resourceVersion"] == rv
                                      for p in daemon.pods.pods()))


def _lists(api: ApiServerDouble) -> int:
    return sum(1 for r in api.requests("GET", r"/pods$") if "watch" not in r.query)


def test_a_tick_makes_no_list_call_and_a_deleted_pods_claim_leaves_no_state(node):
    api, daemon, loop, scheduler, kubelet = node
    pod = _running(api, scheduler, "chat")
    kubelet.prepare_pod(pod)
    assert len(daemon.preparer.prepared()) == 1
    _cached(daemon, api, "chat")
    api.clear_requests()
    for _ in range(3):
        report = loop.run_once()
        assert report.skipped is None, report.skipped
    assert _lists(api) == 0, "a quota tick read the node's pods back from the API server"
    [tenant] = loop.tenants_now
    assert tenant.key.pod == "chat" and tenant.key.container.startswith("claim-")
    assert tenant.metrics_url == "http://10.0.0.1:8000/metrics"
    assert [k.pod for k, _gpu in loop.views()] == ["chat"] and loop.limits()
    _ip(api, "chat", "10.0.0.2")  # the pod's metadata changes: the next tick sees it, at watch speed
    _cached(daemon, api, "chat")
    assert loop.run_once().skipped is None
    assert [t.metrics_url for t in loop.tenants_now] == ["http://10.0.0.2:8000/metrics"]
    api.delete_pod("default", "chat")  # gone from the API; the kubelet has not unprepared its claim yet
    assert api.wait_for(lambda _: all(p["metadata"]["name"] != "chat" for p in daemon.pods.pods()))
    assert len(daemon.preparer.prepared()) == 1
    report = loop.run_once()
    assert report.skipped is None, report.skipped
    assert loop.tenants_now == []
    assert loop.limits() == {} and loop.views() == {} and loop.phases() == {} and loop.classes() == {}
    assert loop.tracked() == set()  # every per-tenant state, in one place
    assert _lists(api) == 0


def test_before_the_pod_cache_has_listed_a_tick_is_skipped_not_emptied():
    """Every claim would look departed (and lose its state) if an empty, never-listed cache were believed."""
    source = ClaimTenantSource(dict, list, lambda: False)
    with pytest.raises(PodCacheNotSynced):
        source.list_tenants()
    assert ClaimTenantSource(dict, list, lambda: True).list_tenants() == []


def test_a_reloaded_config_reaches_the_dra_plugins_quota_loop(node):
    """Admins tune quotas in the ConfigMap: the device plugin's loop took each reload from the next tick
    on, the DRA plugin's kept the settings it started with until a restart."""
    api, daemon, loop, scheduler, kubelet = node
    running = daemon.state.snapshot.config
    assert loop.settings.idle_seconds == running.quota.idle_seconds
    tuned = dataclasses.replace(running.quota, idle_seconds=77.0, step_mib=256, floor_fraction=0.25)
    daemon.reload(dataclasses.replace(running, quota=tuned))
    assert loop.settings.idle_seconds == 77.0
    assert loop.settings.params.step_mib == 256 and loop.settings.params.floor_fraction == 0.25


def _claim(name: str, pod: str, mib: int, state: str = "prepared") -> PreparedClaim:
    return PreparedClaim(uid=f"cuid-{name}", namespace="default", name=name, state=state, cdi_spec="/x",
                         pod_uids=(f"uid-{pod}",), pod_names=(pod,), gpus={"GPU-0": mib})


def _pod(name: str) -> dict:
    return {"metadata": {"name": name, "namespace": "default", "uid": f"uid-{name}",
                        "annotations": {"prometheus.io/port": "8000"}},
            "status": {"phase": "Running", "podIP": "10.0.0.9"}}


class BusyGpu:
    """The GPU's edge for the loop: the ``busy`` claim's engine uses ``used["busy"]`` MiB and would take
    all it is given (KV full, requests waiting), and gives memory back when cut (``unmap``)."""

    name = "gpu"

    def __init__(self, used_mib: int = 23552) -> None:
        self.used = {"busy": used_mib}

    def read_usage(self) -> list[UsageSample]:
        return [UsageSample("GPU-0", self.used["busy"], pod_uid="uid-busy")]

    def read_signals(self, url: str) -> VllmSample:
        return VllmSample(kv_usage=0.99, waiting=4, running=8, release_mode="unmap")


def _source(claims: dict, pods: list[dict]) -> ClaimTenantSource:
    """The DRA plugin's tenant source over literal prepared claims and a synced pod cache of ``pods``."""
    return ClaimTenantSource(lambda: claims, lambda: pods, lambda: True)


def _claim_loop(source: ClaimTenantSource, root: str, gpu: BusyGpu, cap: int = 49152) -> QuotaLoop:
    """The real loop over ``source`` on one GPU of ``cap`` MiB (no startup ticks)."""
    return QuotaLoop(source, lambda: {"GPU-0": cap}, [gpu], PolicyParams(), root, signals=gpu,
                     settings=LoopSettings(params=PolicyParams(), startup_ticks=0))


def _busy_limit(report) -> int:
    return next(d.limit_mib for d in report.decisions if d.key.pod == "busy")


def test_a_claim_that_is_no_tenant_yet_is_never_lent(tmp_path):
    """Issue 19's first rule on the DRA path: a prepared claim whose pod the watch has not delivered
    yet (or a claim still being prepared) was no tenant and no pending claim, so the loop lent its
    memory to a busy co-tenant: with 24 GiB granted to each of two claims on a 48 GiB GPU, the busy
    one was raised past its request into the newcomer's grant. It now counts at its grant until it
    becomes a tenant."""
    cap, grant = 49152, 24576
    for newcomer in (_claim("new", "newpod", grant), _claim("new", "newpod", grant, state="preparing")):
        claims = {"cuid-busy": _claim("busy", "busy", grant), "cuid-new": newcomer}
        source = _source(claims, [_pod("busy")])  # newpod not seen yet
        loop = _claim_loop(source, str(tmp_path / newcomer.state), BusyGpu())
        for _ in range(5):
            report = loop.run_once()
            assert report.skipped is None, report.skipped
            [busy] = [d for d in report.decisions if d.key.pod == "busy"]
            assert busy.limit_mib <= cap - grant, f"lent the newcomer's grant: {busy.limit_mib} MiB ({busy.reason})"
        assert source.list_pending() == [Claim("default/new", (("GPU-0", grant),), pod_uids=frozenset({"uid-newpod"}))]
    seen = _source(claims, [_pod("busy"), _pod("newpod")])
    assert len(seen.list_tenants()) == 1
    assert seen.list_pending() == [Claim("default/new", (("GPU-0", grant),), pod_uids=frozenset({"uid-newpod"}))]
    claims["cuid-new"] = _claim("new", "newpod", grant)  # prepared, its pod seen: a tenant, counted once
    tenants = seen.list_tenants()
    assert len(tenants) == 2 and seen.list_pending() == [] and pending_from_claims(claims.values(), tenants) == []


def test_a_newcomers_claim_file_is_fitted_to_what_lenders_have_released(tmp_path):
    """The other half of issue 19's first fault, on the DRA path: the busy tenant was raised past its
    request while the GPU had room; then a claim is prepared next to it and the preparer writes its full
    grant. Until the lender has released, its file is lowered to what is free (Σ max(limit, held) stays
    within the GPU), and it grows back to the grant as the lender releases. On the kubelet path the same
    holds for Allocate's file (``QuotaLoop._fit_claims``); the DRA claim's file was never fitted."""
    cap, grant, root = 49152, 24576, str(tmp_path / "quota")
    claims = {"cuid-busy": _claim("busy", "busy", grant)}
    gpu = BusyGpu()  # the busy engine takes what it is given (and gives back what its limit drops below)
    used = gpu.used
    loop = _claim_loop(_source(claims, [_pod("busy")]), root, gpu, cap)

    for _ in range(8):  # alone, the busy tenant borrows and uses it
        used["busy"] = _busy_limit(loop.run_once())
    assert used["busy"] > grant + 4096, "the scenario needs a lender"
    new_dir = str(tmp_path / "quota" / "uid-newpod" / "claim-new")
    QuotaFiles(root, QuotaConfig()).write_initial(new_dir, [GpuShare("GPU-0", grant)])  # the preparer, at Prepare
    claims["cuid-new"] = dataclasses.replace(_claim("new", "newpod", grant), quota_dir=new_dir)  # pod not seen yet
    grown = []
    for _ in range(12):
        report = loop.run_once()
        new_limit = read_quota(new_dir).gpus[0].limit_mib
        assert max(_busy_limit(report), used["busy"]) + new_limit <= cap, (used["busy"], new_limit)
        grown.append(new_limit)
        used["busy"] = min(used["busy"], _busy_limit(report))  # the engine releases down to its new limit
    assert grown[0] < grant and grown[-1] == grant, grown  # lowered to what is free, back to the grant


def test_a_pending_claims_unreadable_file_still_counts_at_its_grant(tmp_path):
    """Bad input loses nothing: a pending claim whose quota file is garbage (or a FIFO) is not fitted, but
    still counts at what the preparer granted, and the tick goes on."""
    cap, grant, root = 49152, 24576, tmp_path / "quota"
    for junk in ("garbage", "fifo"):
        new_dir = root / junk / "claim-new"
        new_dir.mkdir(parents=True)
        if junk == "fifo":
            os.mkfifo(new_dir / "quota.json")
        else:
            (new_dir / "quota.json").write_text("{not json")
        claims = {"cuid-busy": _claim("busy", "busy", grant),
                  "cuid-new": dataclasses.replace(_claim("new", "newpod", grant), quota_dir=str(new_dir))}

        loop = _claim_loop(_source(claims, [_pod("busy")]), str(root / junk), BusyGpu(), cap)
        for _ in range(4):
            report = loop.run_once()
            assert report.skipped is None and report.reserved == {"GPU-0": grant}, (junk, report.reserved)
            [busy] = [d for d in report.decisions if d.key.pod == "busy"]
            assert busy.limit_mib <= cap - grant


def _claim_reads(api: ApiServerDouble) -> int:
    return len(api.requests("GET", r"/resourceclaims/[^/]+$"))


def test_a_claim_allocated_here_counts_from_the_bind_not_from_prepare(node):
    """Issue 19 on the DRA path, through the whole plugin: the stand-in scheduler allocates a 22 GiB
    claim here and binds its pod; until the kubelet prepares it, the quota loop counts it at its
    consumed capacity on the GPU the allocation names (before, it was in no checkpoint and the loop lent
    it). It reads the claim from the API server once, not once per tick; once prepared and running it
    is a tenant and no longer a reservation; a pod deleted before Prepare leaves nothing counted."""
    api, daemon, loop, scheduler, kubelet = node
    api.create_pod({"metadata": {"name": "next", "namespace": "default"},
                    "spec": {"resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "vllm-22gi"}],
                             "containers": [{"name": "vllm", "image": "vllm",
                                             "resources": {"claims": [{"name": "gpu"}]}}]}})
    placement = scheduler.schedule(scheduler.create_claims(api.get_pod("default", "next")))
    assert placement is not None and placement.node == NODE
    _cached(daemon, api, "next")
    [claim] = api.objects(RESOURCECLAIMS, "default")
    [result] = claim["status"]["allocation"]["devices"]["results"]
    gpu = daemon.devices()[result["device"]].gpu.uuid
    api.clear_requests()
    for _ in range(3):
        report = loop.run_once()
        assert report.skipped is None, report.skipped
        assert report.reserved == {gpu: 22528}, report.reserved
    assert _claim_reads(api) == 1, "the claim was read from the API server on every tick"
    kubelet.prepare_pod(api.get_pod("default", "next"))
    _ip(api, "next", "10.0.0.3")
    _cached(daemon, api, "next")
    api.clear_requests()
    report = loop.run_once()
    assert [t.key.pod for t in loop.tenants_now] == ["next"] and not any(report.reserved.values()), report.reserved
    assert _claim_reads(api) == 0

    api.create_pod({"metadata": {"name": "gone", "namespace": "default"},
                    "spec": {"resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "vllm-22gi"}],
                             "containers": [{"name": "vllm", "image": "vllm",
                                             "resources": {"claims": [{"name": "gpu"}]}}]}})
    assert scheduler.schedule(scheduler.create_claims(api.get_pod("default", "gone"))) is not None
    _cached(daemon, api, "gone")
    assert sum(loop.run_once().reserved.values()) == 22528
    api.delete_pod("default", "gone")
    assert api.wait_for(lambda _: all(p["metadata"]["name"] != "gone" for p in daemon.pods.pods()))
    assert not any(loop.run_once().reserved.values())


def _bound(name: str, *claims: str, phase: str = "Pending", deleting: bool = False) -> dict:
    """A pod bound here using ``claims``: ``ref:<name>`` by direct reference, else from a template the
    claim controller made ``<pod>-<name>`` for (``status.resourceClaimStatuses``)."""
    spec = [{"name": c[4:], "resourceClaimName": c[4:]} if c.startswith("ref:") else
            {"name": c, "resourceClaimTemplateName": "t"} for c in claims]
    made = [{"name": c, "resourceClaimName": f"{name}-{c}"} for c in claims if not c.startswith("ref:")]
    meta = {"name": name, "namespace": "default", "uid": f"uid-{name}"}
    if deleting:
        meta["deletionTimestamp"] = "2026-12-02T00:00:00Z"
    return {"metadata": meta, "spec": {"resourceClaims": spec},
            "status": {"phase": phase, "resourceClaimStatuses": made}}


def test_unprepared_claims_are_those_of_live_pods_bound_here_the_preparer_has_no_record_of():
    pods = [_bound("a", "gpu"), _bound("b", "ref:shared"), _bound("c", "ref:shared", "gpu"),
            _bound("done", "gpu", phase="Succeeded"), _bound("dying", "gpu", deleting=True),
            {"metadata": {"name": "made-not-yet", "namespace": "default", "uid": "u"},
             "spec": {"resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "t"}]}},
            {"metadata": {"name": "junk", "namespace": "default", "uid": "j"},
             "spec": {"resourceClaims": ["x", {"name": 3}]}, "status": {"resourceClaimStatuses": [7]}}]
    prepared = [_claim("c-gpu", "c", 1024)]
    assert unprepared_claims(pods, prepared) == [("default", "a-gpu"), ("default", "shared")]
    assert podspec.claim_names(pods[2]) == ["shared", "c-gpu"]  # spec order


def test_an_allocated_claim_is_read_once_and_a_failed_read_or_a_refused_one_counts_nothing():
    """Bad input loses nothing: a read that fails is retried at the next tick, with the claims after it
    (until then they are fitted at Prepare, as before); a claim of another driver, or one Prepare would refuse (a device this
    pool does not have), counts for nothing and is not read again while its pod waits."""
    config = Config()
    gpu = Gpu(0, "GPU-0", "H100", 81920, units=80)
    reads: list[str] = []
    fail = {"flaky"}

    def read(ns: str, name: str) -> dict:
        reads.append(name)
        if name in fail:
            fail.discard(name)
            raise LookupError("503 Service Unavailable")
        driver, device = {"other": ("gpu.example.com", "gpu-0"), "alien": (config.names.dra_driver, "gpu-9")}.get(
            name, (config.names.dra_driver, "gpu-0"))
        result = {"request": "gpu", "driver": driver, "pool": NODE, "device": device, "shareID": "s",
                  "consumedCapacity": {"memory": "8Gi"}}
        return {"metadata": {"name": name, "namespace": ns, "uid": f"cuid-{name}"},
                "status": {"allocation": {"devices": {"results": [result]}}}}

    allocated = AllocatedClaims(read, NODE, lambda: config, lambda: {"gpu-0": DeviceRef("gpu-0", gpu)})
    keys = [("default", n) for n in ("alien", "flaky", "other", "ok")]
    assert allocated.pending(keys) == []  # alien refused; flaky's read failed: the tick reads no more
    assert allocated.pending(keys) == [Claim("default/flaky", (("GPU-0", 8192),)),
                                       Claim("default/ok", (("GPU-0", 8192),))]
    assert sorted(reads) == ["alien", "flaky", "flaky", "ok", "other"]
    assert allocated.pending(keys[:1]) == [] and allocated.pending(keys) and len(reads) == 8  # forgotten, read again


def test_a_tick_reads_a_bounded_number_of_claims_and_none_after_the_api_server_failed():
    """A burst of pods bound at once is read over a few ticks (16 a tick), and after a read that failed
    the tick reads no more: it never stalls behind an API server that does not answer."""
    config = Config()
    reads: list[str] = []
    down = [True]

    def read(ns: str, name: str) -> dict:
        reads.append(name)
        if down[0]:
            raise LookupError("timed out")
        result = {"request": "gpu", "driver": config.names.dra_driver, "pool": NODE, "device": "gpu-0",
                  "shareID": "s", "consumedCapacity": {"memory": "1Gi"}}
        return {"metadata": {"name": name}, "status": {"allocation": {"devices": {"results": [result]}}}}

    gpu = Gpu(0, "GPU-0", "H100", 81920, units=80)
    allocated = AllocatedClaims(read, NODE, lambda: config, lambda: {"gpu-0": DeviceRef("gpu-0", gpu)})
    keys = [("default", f"c{i:02d}") for i in range(40)]
    assert allocated.pending(keys) == [] and reads == ["c00"]
    down[0] = False
    counted = [len(allocated.pending(keys)) for _ in range(3)]
    assert counted == [16, 32, 40] and len(reads) == 41


def test_a_claim_tenants_containers_are_those_that_name_its_claim():
    """A DRA tenant's use and fence are the containers its claim's devices are injected into: before, every
    container of the pod was the tenant's, so a sidecar's GPU processes (another claim's, say) counted
    as the claim's use, and in driver mode the sidecar's cgroup got the claim's limit too."""
    pod = {**_pod("busy"),
           "spec": {"resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "t"},
                                       {"name": "other", "resourceClaimName": "someone-elses"}],
                    "initContainers": [{"name": "warm", "resources": {"claims": [{"name": "gpu"}]}}],
                    "containers": [{"name": "vllm", "resources": {"claims": [{"name": "gpu"}]}},
                                   {"name": "proxy", "resources": {"claims": [{"name": "other"}]}},
                                   {"name": "log"}]}}
    pod["status"] = {**pod["status"], "resourceClaimStatuses": [{"name": "gpu", "resourceClaimName": "busy"}],
                     "containerStatuses": [{"name": n, "containerID": f"containerd://{n}-id"}
                                           for n in ("vllm", "proxy", "log")]}
    assert podspec.claim_containers(pod, "busy") == {"warm", "vllm"}
    assert podspec.claim_refs(pod) == {"gpu": "busy", "other": "someone-elses"}
    [tenant] = _source({"cuid-busy": _claim("busy", "busy", 24576)}, [pod]).list_tenants()
    assert tenant.container_ids == frozenset({"vllm-id"})
    assert tenant.sharers == 1  # "warm" runs before "vllm", alone: one at a time shares the claim's limit
    pod["spec"]["initContainers"][0]["restartPolicy"] = "Always"  # a sidecar: beside "vllm"
    [tenant] = _source({"cuid-busy": _claim("busy", "busy", 24576)}, [pod]).list_tenants()
    assert tenant.sharers == 2


def test_a_claim_two_pods_share_comes_with_both_pods_containers_to_fence():
    """A claim several pods share is no tenant; its pending claim names the containers of every running
    pod that names it, and how many run at once, so the driver fence can hold them at its grant in sum."""
    def sharer(name: str, containers: list[dict]) -> dict:
        pod = _pod(name)
        pod["spec"] = {"resourceClaims": [{"name": "gpu", "resourceClaimName": "shared"}], "containers": containers}
        pod["status"]["containerStatuses"] = [{"name": c["name"], "containerID": f"containerd://{name}-{c['name']}"}
                                              for c in containers]
        return pod
    uses = {"resources": {"claims": [{"name": "gpu"}]}}
    pods = [sharer("a", [{"name": "vllm", **uses}]), sharer("b", [{"name": "vllm", **uses}, {"name": "log"}])]
    done = sharer("c", [{"name": "vllm", **uses}])
    done["status"]["phase"] = "Succeeded"
    claim = PreparedClaim(uid="cuid-shared", namespace="default", name="shared", state="prepared", cdi_spec="/x",
                          pod_uids=("uid-a", "uid-b"), pod_names=("a", "b"), gpus={"GPU-0": 24576})
    source = _source({"cuid-shared": claim}, pods + [done])
    assert source.list_tenants() == []
    [pending] = source.list_pending()
    assert pending.container_ids == frozenset({"a-vllm", "b-vllm"}) and pending.sharers == 2
    assert pending.gpus == (("GPU-0", 24576),)


def test_a_claim_s_ordinary_init_containers_are_named_to_the_fence():
    """The kubelet runs an ordinary init container alone beside the sidecars started before it and starts
    the next container in its place when it ends, at the claim's CDI share: the tenant (and a shared
    claim's pending claim) names which of its IDs are such init containers, read from the pod's spec, so
    the driver fence keeps that share out of what a sidecar may grow to (``fence.split_slots``)."""
    uses = {"resources": {"claims": [{"name": "gpu"}]}}
    pod = {**_pod("busy"),
           "spec": {"resourceClaims": [{"name": "gpu", "resourceClaimName": "busy"}],
                    "initContainers": [{"name": "fetch", **uses}, {"name": "proxy", "restartPolicy": "Always", **uses},
                                       {"name": "warm", **uses}],
                    "containers": [{"name": "vllm", **uses}]}}
    pod["status"] = {**pod["status"],
                     "initContainerStatuses": [{"name": n, "containerID": f"containerd://{n}-id"}
                                               for n in ("fetch", "proxy", "warm")]}
    [tenant] = _source({"cuid-busy": _claim("busy", "busy", 24576)}, [pod]).list_tenants()
    assert tenant.container_ids == frozenset({"fetch-id", "proxy-id", "warm-id"}) and tenant.sharers == 2
    assert tenant.init_ids == frozenset({"fetch-id", "warm-id"})  # the sidecar stays: not one of them
    claim = PreparedClaim(uid="cuid-busy", namespace="default", name="busy", state="prepared", cdi_spec="/x",
                          pod_uids=("uid-a", "uid-b"), pod_names=("a", "b"), gpus={"GPU-0": 24576})
    source = _source({"cuid-busy": claim}, [pod])
    assert source.list_tenants() == []
    [pending] = source.list_pending()
    assert pending.init_ids == frozenset({"fetch-id", "warm-id"}) and pending.sharers == 2


def _user(name: str, claim: str, phase: str = "Running") -> dict:
    """A running pod of ``default`` whose one container names ``claim`` (its ID in the status)."""
    pod = _pod(name)
    pod["spec"] = {"containers": [{"name": "vllm", "resources": {"claims": [{"name": "gpu"}]}}],
                   "resourceClaims": [{"name": "gpu", "resourceClaimName": claim}]}
    pod["status"] = {**pod["status"], "phase": phase,
                     "containerStatuses": [{"name": "vllm", "containerID": f"containerd://cid-{name}"}]}
    return pod


def test_a_shared_claim_s_sharers_are_the_pods_it_was_prepared_for_listed_or_not():
    """The driver fence keeps a CDI share for each container of a claim it does not find: counted from
    the pods the claim was prepared for (Prepare's count per pod, in the checkpoint), not only from those
    the pod cache lists. On the base a pod not listed yet counted for nothing, so the listed pod's
    container was held at the whole grant while the other ran at its CDI share beside it."""
    shared = dataclasses.replace(_claim("s", "a", 2048), pod_uids=("uid-a", "uid-b"), pod_names=("a", "b"),
                                 pod_users=(1, 2))
    [c] = pending_from_claims([shared], [], [_user("a", "s")])
    assert (c.sharers, c.pod_slots, c.container_ids) == (3, (("uid-a", 1), ("uid-b", 2)), frozenset({"cid-a"}))
    # a pod it was prepared for that the cache lists done has departed: no share kept for it (the divisor
    # stays Prepare's, what each container got)
    [c] = pending_from_claims([shared], [], [_user("a", "s"), _user("b", "s", phase="Succeeded")])
    assert (c.sharers, c.pod_slots) == (3, (("uid-a", 1),))
    # a pod that joined after Prepare counts from its spec beside them
    [c] = pending_from_claims([shared], [], [_user("a", "s"), _user("j", "s")])
    assert c.pod_slots == (("uid-a", 1), ("uid-b", 2), ("uid-j", 1))
    # an older checkpoint recorded no counts: as before, the listed pods' containers only
    old = dataclasses.replace(shared, pod_users=())
    [c] = pending_from_claims([old], [], [_user("a", "s")])
    assert (c.sharers, c.pod_slots) == (1, ())


def test_a_claim_has_departed_only_once_every_pod_it_was_prepared_for_was_deleted():
    """``departed_claims``: a prepared claim whose pods the watch all saw deleted (a forced deletion: the
    kubelet unprepares before a graceful one ends) holds its grant outside the allocator's books."""
    shared = dataclasses.replace(_claim("s", "a", 2048), pod_uids=("uid-a", "uid-b"), pod_names=("a", "b"))
    alone, preparing = _claim("one", "c", 1024), _claim("new", "d", 512, state="preparing")
    orphan = dataclasses.replace(_claim("orphan", "e", 256), pod_uids=(), pod_names=())
    claims = [shared, alone, preparing, orphan]
    assert departed_claims(claims, {"uid-a"}) == []  # b still runs
    assert departed_claims(claims, {"uid-a", "uid-b", "uid-c"}) == [alone, shared]
    assert departed_claims(claims, {"uid-d", "uid-e"}) == []  # not prepared yet; no pod recorded
    # a running pod that joined the claim after Prepare (the checkpoint does not name it) keeps it allocated
    assert departed_claims(claims, {"uid-a", "uid-b", "uid-c"}, [_user("j", "s")]) == [alone]
    assert departed_claims(claims, {"uid-a", "uid-b", "uid-c"}, [_user("j", "s", phase="Succeeded")]) == [alone, shared]
