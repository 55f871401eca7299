"""Cooperative mode: a container above its limit past the grace period is reported (event +
annotation) or evicted through the real client against the API double; never one within its quota."""
from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st
from kubernetes import client

from deviceplugin.quota.kube import ApiOverLimitActor
from deviceplugin.quota.loop import LoopSettings, QuotaLoop
from deviceplugin.quota.model import PolicyParams, Tenant, TenantKey
from deviceplugin.quota.overlimit import OverLimitWatch
from deviceplugin.quota.telemetry import UsageSample
from deviceplugin.quota.writer import GpuQuota, QuotaFile, container_dir, write_quota
from standins.apiserver import ApiServerDouble
from vramshare import contract, kube
from vramshare.config import OverLimitAction
from vramshare.inventory import EnforcementMode

NAMES = contract.Names()
GREEDY = TenantKey("llm", "greedy", "vllm", pod_uid="")
POLITE = TenantKey("llm", "polite", "vllm", pod_uid="")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 50000), st.integers(1000, 40000), st.floats(0, 30)), min_size=1, max_size=40),
       st.floats(0, 120))
def test_never_names_a_tenant_within_its_quota(readings, grace):
    watch, now = OverLimitWatch(grace), 0.0
    over_since = None
    for used, limit, dt in readings:
        now += dt
        b = watch.observe(GREEDY, "GPU-0", used, limit, now)
        over_since = (over_since if over_since is not None else now) if used > limit else None
        if b is not None:
            assert used > limit and now - over_since >= grace and b.used_mib == used


def test_acts_once_per_episode():
    watch = OverLimitWatch(60)
    assert watch.observe(GREEDY, "g", 30, 20, 0) is None
    assert watch.observe(GREEDY, "g", 30, 20, 59) is None
    assert watch.observe(GREEDY, "g", 30, 20, 60) is not None
    assert watch.observe(GREEDY, "g", 30, 20, 600) is None  # already acted
    assert watch.observe(GREEDY, "g", 10, 20, 601) is None  # back within: the episode ends
    assert watch.observe(GREEDY, "g", None, 20, 602) is None  # no telemetry is never a breach
    assert watch.observe(GREEDY, "g", 30, 20, 700) is None
    assert watch.observe(GREEDY, "g", 30, 20, 760) is not None


class Source:
    name = "fake"

    def __init__(self, tenants, samples):
        self.tenants, self.samples = tenants, samples

    def list_tenants(self):
        return self.tenants

    def read_usage(self):
        return self.samples


def _run(tmp_path, action: OverLimitAction, mode=EnforcementMode.COOPERATIVE):
    with ApiServerDouble() as api:
        pods = {}
        for k in (GREEDY, POLITE):
            pods[k.pod] = api.create_pod({"metadata": {"name": k.pod, "namespace": "llm"},
                                          "spec": {"nodeName": "gpu-1", "containers": [{"name": "vllm"}]}})
        keys = {k.pod: TenantKey("llm", k.pod, "vllm", pod_uid=pods[k.pod]["metadata"]["uid"]) for k in (GREEDY, POLITE)}
        tenants = [Tenant(k, (("GPU-0", 20000),)) for k in keys.values()]
        for k in keys.values():  # the file Allocate wrote: 20000 each
            write_quota(container_dir(str(tmp_path), k.pod_uid, "vllm"), QuotaFile(gpus=(GpuQuota("GPU-0", 20000, 10000, 30000),)))
        src = Source(tenants, [UsageSample("GPU-0", 39000, pod_uid=keys["greedy"].pod_uid),   # ignores its quota
                               UsageSample("GPU-0", 20000, pod_uid=keys["polite"].pod_uid)])  # exactly at it
        clock = [0.0]
        v1 = client.CoreV1Api(kube.api_client_for(api.url))
        loop = QuotaLoop(src, lambda: {"GPU-0": 40000}, [src], PolicyParams(), str(tmp_path),
                         settings=LoopSettings(PolicyParams(), grace_seconds=30, action=action), mode=mode,
                         actor=ApiOverLimitActor(v1, NAMES, "gpu-1"), clock=lambda: clock[0])
        reports = []
        for t in range(0, 70, 10):
            clock[0] = float(t)
            reports.append(loop.run_once())
        return api, reports, [api.get_pod("llm", p) for p in ("greedy", "polite")], list(api.events("llm"))


def test_cooperative_reports_the_container_above_its_limit(tmp_path):
    _api, reports, (greedy, polite), events = _run(tmp_path, OverLimitAction.EVENT)
    breaches = [b for r in reports for b in r.breaches]
    assert [b.key.pod for b in breaches] == ["greedy"]  # once, and never the polite one
    ann = json.loads(greedy["metadata"]["annotations"][NAMES.over_limit])
    assert ann["container"] == "vllm" and ann["usedMiB"] == 39000 and ann["limitMiB"] < 39000
    assert NAMES.over_limit not in (polite["metadata"].get("annotations") or {})
    assert [(e["reason"], e["involvedObject"]["name"], e["type"]) for e in events] == \
        [("GpuMemoryOverLimit", "greedy", "Warning")]


def test_cooperative_evicts_only_the_offender_when_configured(tmp_path):
    _api, _reports, (greedy, polite), events = _run(tmp_path, OverLimitAction.EVICT)
    assert greedy is None and polite is not None  # evicted through pods/eviction
    assert "evicting" in events[0]["message"]


def test_driver_mode_leaves_it_to_the_driver(tmp_path):
    _api, reports, (greedy, _polite), events = _run(tmp_path, OverLimitAction.EVICT, EnforcementMode.DRIVER)
    assert greedy is not None and not events and not any(r.breaches for r in reports)


def test_a_container_cut_below_its_use_but_within_its_request_is_never_named(tmp_path):
    """Overload: the loop cuts a borrower's limit; the owner within its request may sit above its own
    cut limit for a while (vLLM's memory is allocated up front): it is within its reservation."""
    owner = TenantKey("llm", "owner", "vllm", pod_uid="uid-owner")
    src = Source([Tenant(owner, (("GPU-0", 20000),))], [UsageSample("GPU-0", 18000, pod_uid="uid-owner")])
    write_quota(container_dir(str(tmp_path), "uid-owner", "vllm"), QuotaFile(gpus=(GpuQuota("GPU-0", 12000, 10000, 30000),)))
    clock = [0.0]
    loop = QuotaLoop(src, lambda: {"GPU-0": 12000}, [src], PolicyParams(), str(tmp_path),  # the GPU shrank
                     settings=LoopSettings(PolicyParams(), grace_seconds=0), clock=lambda: clock[0])
    for t in range(5):
        clock[0] = 100.0 * t
        assert not loop.run_once().breaches


def test_a_hint_nothing_uses_is_told_to_the_pod_once(tmp_path):
    """A model annotation that does not parse (a bad revision) or a quota-class nobody defined is ignored
    by design: the pod runs. On main only the extender's and the node agent's logs said so; now the pod
    gets one Warning event per pod, where its owner looks (``kubectl describe pod``)."""
    from deviceplugin.quota.classes import PodMeta
    from deviceplugin.quota.kube import HINT_IGNORED

    with ApiServerDouble() as api:
        metas = {"bad-rev": PodMeta.of("llm", model="meta-llama/Meta-Llama-3-8B@main branch"),
                 "no-class": PodMeta.of("llm", requested_class="gold"),
                 "fine": PodMeta.of("llm", model="meta-llama/Meta-Llama-3-8B@main")}
        tenants = []
        for name, meta in metas.items():
            pod = api.create_pod({"metadata": {"name": name, "namespace": "llm"},
                                  "spec": {"nodeName": "gpu-1", "containers": [{"name": "vllm"}, {"name": "side"}]}})
            for container in ("vllm", "side"):
                key = TenantKey("llm", name, container, pod_uid=pod["metadata"]["uid"])
                tenants.append(Tenant(key, (("GPU-0", 10000),), meta=meta))
        src = Source(tenants, [])
        actor = ApiOverLimitActor(client.CoreV1Api(kube.api_client_for(api.url)), NAMES, "gpu-1")
        loop = QuotaLoop(src, lambda: {"GPU-0": 80000}, [src], PolicyParams(), str(tmp_path), actor=actor,
                         hints=actor)
        for _ in range(3):
            loop.run_once()
        events = [(e["reason"], e["involvedObject"]["name"], e["type"], e["message"]) for e in api.events("llm")]
    assert sorted(e[:3] for e in events) == [(HINT_IGNORED, "bad-rev", "Warning"), (HINT_IGNORED, "no-class", "Warning")]
    said = {name: message for _, name, _, message in events}
    assert said["bad-rev"].startswith(f"annotation {NAMES.model} ignored: model ")
    assert "revision after '@'" in said["bad-rev"] and "write <name>[@<revision>]" in said["bad-rev"]
    assert said["no-class"] == (f"annotation {NAMES.quota_class} ignored: annotation names unknown class 'gold'; "
                                "the pod is in class 'default'")
