"""Driver mode end to end: the real loop, policy, writer and DriverFence over the fake NVML's memory
limits per cgroup (which fails allocations beyond the hard limit, as the R615 driver does)."""
from __future__ import annotations

import dataclasses

import pytest

from deviceplugin.nvml_limits import CgroupFinder, LimitError, NvmlMemoryLimits
from deviceplugin.quota.fence import DriverFence
from deviceplugin.quota.loop import LoopSettings, QuotaLoop
from deviceplugin.quota.model import Decision, PolicyParams, Tenant, TenantKey
from deviceplugin.quota.telemetry import VllmSample
from deviceplugin.quota.writer import container_dir, read_quota
from tests.fixtures.fake_nvml import H100_80GB, FakeNvml, OutOfMemory
from vramshare.inventory import EnforcementMode

GPU = H100_80GB.uuid
P = PolicyParams(floor_fraction=0.25, ceiling_fraction=2.0, step_mib=512, margin_mib=1024, share_spare=False,
                 loans="any")  # lending mechanics; the loan rule of issue 19 has its own tests
CID_A, CID_B = "a" * 64, "b" * 64
A = TenantKey("llm", "a", "vllm", pod_uid="11111111-2222-3333-4444-555555555555")
B = TenantKey("llm", "b", "vllm", pod_uid="66666666-7777-8888-9999-000000000000")


def cgroup_of(uid: str, cid: str) -> str:
    return (f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{uid.replace('-', '_')}.slice/"
            f"cri-containerd-{cid}.scope")


@pytest.fixture
def node(tmp_path):
    root = tmp_path / "cgroup"
    for key, cid in ((A, CID_A), (B, CID_B)):
        (root / cgroup_of(key.pod_uid, cid).lstrip("/")).mkdir(parents=True)
    nv = FakeNvml([H100_80GB])
    nv.driver_version = "615.20.01"
    nv.nvmlInit()
    return nv, str(root), tmp_path / "quota"


class Tenants:
    def __init__(self, tenants):
        self.tenants = tenants

    def list_tenants(self):
        return self.tenants


def make_loop(nv, cgroot, qroot):
    tenants = Tenants([Tenant(A, ((GPU, 30000),), container_ids=frozenset([CID_A])),
                       Tenant(B, ((GPU, 30000),), container_ids=frozenset([CID_B]))])
    fence = DriverFence(NvmlMemoryLimits(nv), CgroupFinder(cgroot))
    loop = QuotaLoop(tenants, lambda: {GPU: 60000}, [], P, str(qroot), mode=EnforcementMode.DRIVER, fence=fence,
                     settings=LoopSettings(params=P, startup_ticks=0))  # not newcomers (test_claims.py)
    return loop


def test_finder_names_the_cgroup_as_proc_would(node):
    _nv, cgroot, _q = node
    assert CgroupFinder(cgroot).find(CID_A) == cgroup_of(A.pod_uid, CID_A)
    assert CgroupFinder(cgroot).find("c" * 64) is None


def test_finder_lists_a_pod_s_container_cgroups_by_its_uid_under_either_cgroup_driver(tmp_path):
    """The kubelet's pod cgroup is ``pod<uid>`` under its QoS class's (``GetPodContainerName``; a
    Guaranteed pod's directly under kubepods); the systemd driver escapes ``-`` as ``_`` and joins the
    parts into one slice name. The driver fence finds the containers of a pod the pod cache does not list
    by it; a pod with no cgroup here (not started, or gone) has none."""
    uid, other = A.pod_uid, B.pod_uid
    u = uid.replace("-", "_")
    layouts = {
        "systemd": [f"kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{u}.slice/cri-containerd-{c}.scope"
                    for c in (CID_A, CID_B)],
        "guaranteed": [f"kubepods.slice/kubepods-pod{u}.slice/cri-containerd-{CID_A}.scope"],
        "cgroupfs": [f"kubepods/besteffort/pod{uid}/{CID_A}"],
    }
    finders = {}
    for name, paths in layouts.items():
        root = tmp_path / name
        for p in paths + [f"kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{other}.slice/x.scope"]:
            (root / p).mkdir(parents=True)
        finders[name] = finder = CgroupFinder(str(root))
        assert finder.pod_cgroups(uid) == sorted("/" + p for p in paths), name
        assert finder.pod_cgroups("99999999-2222-3333-4444-555555555555") == [], name
    (tmp_path / "systemd" / layouts["systemd"][0]).rmdir()  # a container gone: the cached pod cgroup is listed again
    assert finders["systemd"].pod_cgroups(uid) == ["/" + layouts["systemd"][1]]


def test_use_comes_from_current_used_and_limits_follow_the_loop(node):
    nv, cgroot, qroot = node
    ca, cb = cgroup_of(A.pod_uid, CID_A), cgroup_of(B.pod_uid, CID_B)
    loop = make_loop(nv, cgroot, qroot)
    nv.allocate(GPU, ca, 29000)
    nv.allocate(GPU, cb, 4000)
    report = loop.run_once()
    assert not report.errors and report.skipped is None
    limits = {d.key.pod: d.limit_mib for d in report.decisions}
    assert limits["a"] > 30000 > limits["b"] >= 4000 + 1024  # a grows into what b does not use
    # the fence moved both cgroups: hard = the limit, soft = the part within the request
    assert nv.limits[(GPU, ca)] == (30000 << 20, limits["a"] << 20)
    assert nv.limits[(GPU, cb)] == (limits["b"] << 20, limits["b"] << 20)
    assert read_quota(container_dir(str(qroot), A.pod_uid, "vllm")).enforcement == "driver"
    # the driver fences: b cannot allocate beyond its new hard limit, a can grow up to its own
    with pytest.raises(OutOfMemory):
        nv.allocate(GPU, cb, limits["b"] - 4000 + 1)
    nv.allocate(GPU, ca, limits["a"] - 29000)


def test_a_shrink_is_granted_only_after_the_driver_shows_it_released(node):
    nv, cgroot, qroot = node
    ca, cb = cgroup_of(A.pod_uid, CID_A), cgroup_of(B.pod_uid, CID_B)
    loop = make_loop(nv, cgroot, qroot)
    def grow(cg, upto):  # allocate as far as the hard limit lets it, up to ``upto`` MiB in all
        room = min(nv.limits.get((GPU, cg), (0, 1 << 60))[1] >> 20, upto) - (nv.used.get((GPU, cg), 0) >> 20)
        if room > 0:
            nv.allocate(GPU, cg, room)

    grow(ca, 10000)
    grow(cb, 30000)
    for _ in range(20):  # b borrows beyond its request while a is quiet, a step per tick
        loop.run_once()
        grow(cb, 48000)
    for _ in range(6):  # a grows by what its hard limit lets it take each tick: it wants its 30000 back
        grow(ca, 30000)
        report = loop.run_once()
        used = {"a": nv.used[(GPU, ca)] >> 20, "b": nv.used[(GPU, cb)] >> 20}
        d = {x.key.pod: x for x in report.decisions}
        assert sum(max(d[p].limit_mib, used[p]) for p in d) <= 60000  # never a MiB b still holds
    assert d["b"].limit_mib < used["b"] and "not granted" in d["a"].reason  # cut, not yet released
    nv.release(GPU, cb, used["b"] - d["b"].limit_mib)  # b honours its cut (vLLM drained, kvcached freed)
    d2 = {x.key.pod: x for x in loop.run_once().decisions}
    assert d2["a"].limit_mib > d["a"].limit_mib


def test_limit_errors_are_reported_and_retried(node):
    nv, cgroot, qroot = node
    nv.allocate(GPU, cgroup_of(A.pod_uid, CID_A), 29000)
    loop = make_loop(nv, cgroot, qroot)
    nv.privileged = False
    report = loop.run_once()
    assert any("NoPermission" in e for e in report.errors)
    nv.privileged = True
    assert not loop.run_once().errors  # the first fence is retried until it lands
    assert (GPU, cgroup_of(A.pod_uid, CID_A)) in nv.limits


def test_nvml_limits_name_the_gpu_and_cgroup_on_failure(node):
    nv, _cg, _q = node
    nv.driver_version = "580.95.05"
    with pytest.raises(LimitError, match=r"/x on GPU-.*NVMLError_FunctionNotFound"):
        NvmlMemoryLimits(nv).set(GPU, "/x", 1, 2)


def test_memory_outside_every_tenant_cgroup_is_foreign(node):
    nv, cgroot, qroot = node
    nv.allocate(GPU, cgroup_of(A.pod_uid, CID_A), 10000)
    nv.allocate(GPU, cgroup_of(B.pod_uid, CID_B), 10000)
    real = nv.nvmlDeviceGetMemoryInfo

    def with_a_stranger(handle, version=None):  # another device plugin's pod holds 25000 MiB
        info = real(handle, version)
        info.used = sum(nv.used.values()) + 25000 * (1 << 20)
        return info

    nv.nvmlDeviceGetMemoryInfo = with_a_stranger
    report = make_loop(nv, cgroot, qroot).run_once()
    assert sum(d.limit_mib for d in report.decisions) <= 60000 - 25000


class Engines:
    """Each engine's /metrics as the quota loop reads it: a releasing engine (unmap) and the quota
    generation it has applied (``vramshare_vllm_quota_generation_applied``, SIGNALS.md)."""

    def __init__(self):
        self.applied = {"a": 0, "b": 0}

    def read_signals(self, url):
        pod = url.split("//")[1].split(":")[0]
        return VllmSample(release_mode="unmap", generation_applied=self.applied[pod])


def _acknowledging_loop(node, engines: "Engines", guarded: bool = False) -> tuple[QuotaLoop, Tenants]:
    """Two 30,000 MiB tenants a (using 29,500) and b (using 4,000) on a 60,000 MiB GPU in driver mode, their
    engines' acknowledgements read from ``engines`` (issue 19's acknowledged shrinks); the tenant source
    too, to change. ``guarded``: the fence is given the loop's capacities, as ``build_loop`` gives it."""
    nv, cgroot, qroot = node
    nv.allocate(GPU, cgroup_of(A.pod_uid, CID_A), 29500)
    nv.allocate(GPU, cgroup_of(B.pod_uid, CID_B), 4000)
    tenants = Tenants([Tenant(A, ((GPU, 30000),), metrics_url="http://a:8000/metrics", container_ids=frozenset([CID_A])),
                       Tenant(B, ((GPU, 30000),), metrics_url="http://b:8000/metrics", container_ids=frozenset([CID_B]))])
    fence = DriverFence(NvmlMemoryLimits(nv), CgroupFinder(cgroot), (lambda: {GPU: 60000}) if guarded else None)
    p = PolicyParams(floor_fraction=0.25, ceiling_fraction=2.0, step_mib=512, margin_mib=1024, share_spare=False)
    return QuotaLoop(tenants, lambda: {GPU: 60000}, [], p, str(qroot), signals=engines, mode=EnforcementMode.DRIVER,
                     fence=fence, settings=LoopSettings(params=p, startup_ticks=0)), tenants


def test_a_hard_limit_is_lowered_only_after_the_engine_acknowledged_the_shrink(node):
    """Issue 19: the driver never fails an allocation for memory the engine was about to give back.
    b's shrink is written at once, its hard limit stays until b reports the generation that carried
    it; the memory is not granted to a before that either (b may still use it)."""
    nv, cgroot, qroot = node
    ca, cb = cgroup_of(A.pod_uid, CID_A), cgroup_of(B.pod_uid, CID_B)
    engines = Engines()
    loop, tenants = _acknowledging_loop(node, engines)
    d = {x.key.pod: x for x in loop.run_once().decisions}
    gen_b = read_quota(container_dir(str(qroot), B.pod_uid, "vllm")).generation
    assert d["b"].limit_mib < 30000  # b is cut in its quota file at once
    assert nv.limits[(GPU, cb)] == (d["b"].limit_mib << 20, 30000 << 20)  # soft follows, hard waits for b
    assert d["a"].limit_mib <= 30000  # nothing b may still use is granted
    engines.applied["b"] = gen_b - 1
    loop.run_once()
    assert nv.limits[(GPU, cb)][1] == 30000 << 20  # an older generation is no acknowledgement
    for _ in range(3):  # b (and a) acknowledge whatever the loop wrote last, one tick later
        engines.applied = {k.pod: read_quota(container_dir(str(qroot), k.pod_uid, "vllm")).generation for k in (A, B)}
        d = {x.key.pod: x for x in loop.run_once().decisions}
    file_b = read_quota(container_dir(str(qroot), B.pod_uid, "vllm"))
    assert engines.applied["b"] == file_b.generation  # b's limit settled and acknowledged
    assert nv.limits[(GPU, cb)][1] == file_b.gpus[0].limit_mib << 20 < 30000 << 20  # the driver enforces it
    assert d["b"].held_mib == max(d["b"].limit_mib, 4000)  # and what b gave back is free for a to borrow


def _restart(nv, cgroot, key, old: str, new: str, mib: int) -> str:
    """The runtime restarts ``key``'s container: the old cgroup's memory is freed and it goes; the new
    one starts with the toolkit's limits from the CDI spec (``mib``), holding nothing. Returns its cgroup."""
    import pathlib
    import shutil
    nv.used.pop((GPU, cgroup_of(key.pod_uid, old)), None)
    nv.limits.pop((GPU, cgroup_of(key.pod_uid, old)), None)
    shutil.rmtree(pathlib.Path(cgroot) / cgroup_of(key.pod_uid, old).lstrip("/"))
    cg = cgroup_of(key.pod_uid, new)
    (pathlib.Path(cgroot) / cg.lstrip("/")).mkdir(parents=True)
    nv.limits[(GPU, cg)] = (mib << 20, mib << 20)
    return cg


def test_a_restarted_container_is_fenced_at_its_cut_without_waiting_for_its_engine(node):
    """drarestart (the DRA hunt's restart-while-lent over-commit): b was cut for a, and its hard limit
    waits for b's engine to acknowledge (issue 19). b's container restarts and comes back at its CDI
    spec's share, its grant. The acknowledgement on record is the old instance's; the new one holds
    nothing a lower hard limit would refuse, so the driver enforces b's limit at once, not its grant
    beside a's loan until the engine acknowledges, and the loop counts b at that limit from the next tick
    (the fence's own per-container rule would lower the new cgroup's limit without the loop's, so only this
    count fails without it). A tenant not restarted keeps waiting."""
    nv, cgroot, qroot = node
    ca, cb = cgroup_of(A.pod_uid, CID_A), cgroup_of(B.pod_uid, CID_B)
    engines = Engines()
    loop, tenants = _acknowledging_loop(node, engines)
    loop.run_once()
    assert nv.limits[(GPU, cb)][1] == 30000 << 20  # b's cut waits for its engine
    loop.run_once()
    assert nv.limits[(GPU, cb)][1] == 30000 << 20  # still: nothing acknowledged, nothing restarted
    new = _restart(nv, cgroot, B, CID_B, "f" * 64, 30000)
    tenants.tenants[1] = dataclasses.replace(tenants.tenants[1], container_ids=frozenset(["f" * 64]))
    assert not loop.run_once().errors
    file_b = read_quota(container_dir(str(qroot), B.pod_uid, "vllm"))
    assert engines.applied["b"] < file_b.generation  # still nothing acknowledged
    assert nv.limits[(GPU, new)][1] == file_b.gpus[0].limit_mib << 20 < 30000 << 20
    assert (nv.limits[(GPU, ca)][1] >> 20) + file_b.gpus[0].limit_mib <= 60000
    d = {x.key.pod: x for x in loop.run_once().decisions}  # and counted there: the rest is a's again
    assert d["b"].held_mib == max(d["b"].limit_mib, 4000) < 30000, d["b"]


def test_a_container_restarted_while_its_tenant_s_shrink_waits_is_held_at_its_split_and_its_sibling_does_not_grow(node):
    """drarestart (the focused hunt's case): b's claim is named by two containers and cut for a; the hard
    limit waits for b's engine. One container restarts: the new cgroup holds nothing any file promised, so
    it is held at its split of b's limit at once; the other, there before, keeps its hard limit, but does
    not grow into the memory the restarted one gave back (drarestart2: its split of the bound that waits
    was 16,000, 1,000 more than it had; in the DRA hunt's world such a bound held a raise made for the
    restarting container's CDI share, and the old sibling that took it over-committed the GPU)."""
    import pathlib
    nv, cgroot, qroot = node
    cb, cb2 = cgroup_of(B.pod_uid, CID_B), cgroup_of(B.pod_uid, "d" * 64)
    (pathlib.Path(cgroot) / cb2.lstrip("/")).mkdir(parents=True)
    engines = Engines()
    tenants = Tenants([Tenant(A, ((GPU, 30000),), metrics_url="http://a:8000/metrics", container_ids=frozenset([CID_A])),
                       Tenant(B, ((GPU, 30000),), metrics_url="http://b:8000/metrics",
                              container_ids=frozenset([CID_B, "d" * 64]), sharers=2)])
    p = PolicyParams(floor_fraction=0.25, ceiling_fraction=2.0, step_mib=512, margin_mib=1024, share_spare=False)
    loop = QuotaLoop(tenants, lambda: {GPU: 60000}, [], p, str(qroot), signals=engines, mode=EnforcementMode.DRIVER,
                     fence=DriverFence(NvmlMemoryLimits(nv), CgroupFinder(cgroot)),
                     settings=LoopSettings(params=p, startup_ticks=0))
    nv.allocate(GPU, cgroup_of(A.pod_uid, CID_A), 29500)
    nv.allocate(GPU, cb, 2000)
    nv.allocate(GPU, cb2, 2000)
    loop.run_once()
    loop.run_once()
    assert sum(nv.limits[(GPU, c)][1] >> 20 for c in (cb, cb2)) == 30000  # b's cut waits for its engine
    new = _restart(nv, cgroot, B, "d" * 64, "9" * 64, 15000)
    tenants.tenants[1] = dataclasses.replace(tenants.tenants[1], container_ids=frozenset([CID_B, "9" * 64]))
    assert not loop.run_once().errors
    limit = read_quota(container_dir(str(qroot), B.pod_uid, "vllm")).gpus[0].limit_mib
    assert limit < 30000  # b is cut, and nothing is acknowledged
    assert nv.limits[(GPU, new)][1] >> 20 <= (limit - 2000) // 2 + 1  # its split of b's limit, not of 30,000
    assert nv.limits[(GPU, cb)][1] >> 20 == 15000  # what the old one had (its split before), not more


def test_only_a_tenant_whose_every_cgroup_is_new_counts_as_restarted(node):
    """``DriverFence.restarted``: a tenant restarted as a whole, by the per-container restart rule, when each
    of its cgroups started since its limits were last set and uses no more than its split of the decision;
    not before they were first set (a restarted loop cannot tell), nor while a sibling that was there
    before runs (its engine may follow an older file), nor when a new one holds more than its split."""
    nv, cgroot, qroot = node
    import pathlib
    (pathlib.Path(cgroot) / cgroup_of(A.pod_uid, CID_A2).lstrip("/")).mkdir(parents=True)
    a = Tenant(A, ((GPU, 30000),), container_ids=frozenset([CID_A, CID_A2]))
    fence = DriverFence(NvmlMemoryLimits(nv), CgroupFinder(cgroot))
    loop = QuotaLoop(Tenants([a]), lambda: {GPU: 60000}, [], P, str(qroot), mode=EnforcementMode.DRIVER, fence=fence,
                     settings=LoopSettings(params=P, startup_ticks=0))
    fence.read_usage([a])
    assert not fence.restarted(a, GPU, 10000, 30000)  # never set: not known new
    loop.run_once()
    _restart(nv, cgroot, A, CID_A2, "e" * 64, 15000)
    half = dataclasses.replace(a, container_ids=frozenset([CID_A, "e" * 64]))
    fence.read_usage([half])
    assert not fence.restarted(half, GPU, 10000, 30000)  # CID_A was there before
    _restart(nv, cgroot, A, CID_A, "c" * 64, 15000)
    nv.allocate(GPU, cgroup_of(A.pod_uid, "c" * 64), 700)
    both = dataclasses.replace(a, container_ids=frozenset(["c" * 64, "e" * 64]))
    fence.read_usage([both])
    assert fence.restarted(both, GPU, 10000, 30000)
    assert not fence.restarted(both, GPU, 600, 30000)  # the one holding 700 is above its split of 600
    gone = dataclasses.replace(a, container_ids=frozenset(["f" * 64]))  # restarting: no cgroup found yet
    fence.read_usage([gone])
    assert not fence.restarted(gone, GPU, 10000, 30000)  # it will start at its CDI share, not its cut


def test_the_fence_forgets_departed_tenants(node):
    """The fence's records that outlive a tick (the cgroups each tenant's limits were last set over, those
    that started while its shrink waits) are kept for the tenants of the tick only: months of pods coming
    and going leave nothing behind."""
    nv, cgroot, _q = node
    import pathlib
    fence = DriverFence(NvmlMemoryLimits(nv), CgroupFinder(cgroot))
    live = Tenant(A, ((GPU, 30000),), container_ids=frozenset([CID_A]))
    for i in range(20):
        key = TenantKey("llm", f"p{i}", "vllm", pod_uid=f"00000000-0000-0000-0000-{i:012d}")
        old, new = f"{i:064x}", f"{i + 100:064x}"
        (pathlib.Path(cgroot) / cgroup_of(key.pod_uid, old).lstrip("/")).mkdir(parents=True)
        t = Tenant(key, ((GPU, 10000),), container_ids=frozenset([old]))
        fence.read_usage([live, t])
        assert not fence.apply(t, [Decision(key, GPU, 10000, 10000, 2500, 20000, "t")], {GPU: 10000})
        assert not fence.apply(live, [Decision(A, GPU, 30000, 30000, 7500, 60000, "t")], {GPU: 30000})
        _restart(nv, cgroot, key, old, new, 10000)  # a new cgroup while its shrink waits: remembered as fresh
        t = dataclasses.replace(t, container_ids=frozenset([new]))
        fence.read_usage([live, t])
        assert not fence.apply(t, [Decision(key, GPU, 8000, 10000, 2500, 20000, "t")], {GPU: 10000}, {GPU: 10000})
        assert fence.tracked() == {A, key}
    fence.read_usage([live])
    assert fence.tracked() == {A}


# -- a tenant of several containers (a DRA claim that two containers of its pod name) -------------------
CID_A2 = "d" * 64


def two_container_loop(nv, cgroot, qroot):
    """Tenant A's claim is named by two of its pod's containers (two cgroups); B is alone."""
    import pathlib
    (pathlib.Path(cgroot) / cgroup_of(A.pod_uid, CID_A2).lstrip("/")).mkdir(parents=True)
    tenants = Tenants([Tenant(A, ((GPU, 30000),), container_ids=frozenset([CID_A, CID_A2])),
                       Tenant(B, ((GPU, 30000),), container_ids=frozenset([CID_B]))])
    fence = DriverFence(NvmlMemoryLimits(nv), CgroupFinder(cgroot))
    return QuotaLoop(tenants, lambda: {GPU: 60000}, [], P, str(qroot), mode=EnforcementMode.DRIVER, fence=fence,
                     settings=LoopSettings(params=P, startup_ticks=0))


def test_a_tenant_of_two_containers_is_fenced_at_its_limit_in_sum_not_each(node):
    """The CDI spec (and the loop) is one per claim, but the driver fences per cgroup: each of the two
    containers fenced at the tenant's whole limit would let the pair hold twice it."""
    nv, cgroot, qroot = node
    loop = two_container_loop(nv, cgroot, qroot)
    ca, ca2, cb = cgroup_of(A.pod_uid, CID_A), cgroup_of(A.pod_uid, CID_A2), cgroup_of(B.pod_uid, CID_B)
    nv.allocate(GPU, ca, 12000)
    nv.allocate(GPU, ca2, 3000)
    nv.allocate(GPU, cb, 20000)
    report = loop.run_once()
    assert not report.errors
    limit = {d.key.pod: d.limit_mib for d in report.decisions}["a"]
    hard = [nv.limits[(GPU, c)][1] >> 20 for c in (ca, ca2)]
    soft = [nv.limits[(GPU, c)][0] >> 20 for c in (ca, ca2)]
    assert sum(hard) <= limit and sum(soft) <= min(limit, 30000)
    assert hard[0] >= 12000 and hard[1] >= 3000  # each keeps what it holds: nothing it holds is refused
    with pytest.raises(OutOfMemory):  # together they cannot pass the tenant's limit
        nv.allocate(GPU, ca, hard[0] - 12000 + 1)
    nv.allocate(GPU, ca, hard[0] - 12000)
    nv.allocate(GPU, ca2, hard[1] - 3000)


def test_split_limit_keeps_each_use_and_never_exceeds_the_limit():
    from hypothesis import given, strategies as st

    from deviceplugin.quota.fence import split_limit

    @given(st.integers(0, 200_000), st.lists(st.integers(0, 100_000), min_size=1, max_size=6))
    def prop(limit, uses):
        out = split_limit(limit, uses)
        assert len(out) == len(uses) and all(x >= 0 for x in out)
        assert sum(out) <= limit
        if sum(uses) <= limit:
            assert all(x >= u for x, u in zip(out, uses))  # nobody is cut below what it holds
            assert sum(out) == limit  # and nothing of the limit is lost
        else:
            assert all(x <= u for x, u in zip(out, uses))  # over: nobody may grow
    prop()
    assert split_limit(30000, [12000, 3000]) == [19500, 10500]
    assert split_limit(10000, [9000, 3000]) == [7500, 2500]
    assert split_limit(7, [0, 0]) == [4, 3]


def test_a_container_not_started_yet_keeps_its_share_of_the_tenant_s_limit(node):
    """The claim's second container has no cgroup yet (starting): the first is not fenced at the whole
    limit meanwhile, else the second would start (at its CDI share) on top of it. What is kept for the
    second is its CDI share (grant // 2: the toolkit's hook sets it when it starts), counted as used so the
    claim is not cut below it; before the hunt (tests/dra/test_driver_fence_soundness.py) it was half of
    what the first did not use, less than the share when the limit was low: together above the limit."""
    nv, cgroot, qroot = node
    tenants = Tenants([Tenant(A, ((GPU, 30000),), container_ids=frozenset([CID_A]), sharers=2),
                       Tenant(B, ((GPU, 30000),), container_ids=frozenset([CID_B]))])
    fence = DriverFence(NvmlMemoryLimits(nv), CgroupFinder(cgroot))
    loop = QuotaLoop(tenants, lambda: {GPU: 60000}, [], P, str(qroot), mode=EnforcementMode.DRIVER, fence=fence,
                     settings=LoopSettings(params=P, startup_ticks=0))
    ca = cgroup_of(A.pod_uid, CID_A)
    nv.allocate(GPU, ca, 10000)
    nv.allocate(GPU, cgroup_of(B.pod_uid, CID_B), 20000)
    report = loop.run_once()
    limit = {d.key.pod: d.limit_mib for d in report.decisions}["a"]
    assert limit >= 10000 + 15000  # what it holds and what its second container starts with
    assert nv.limits[(GPU, ca)][1] >> 20 == limit - 15000
    with pytest.raises(OutOfMemory):  # the first cannot take what the second starts with
        nv.allocate(GPU, ca, limit - 15000 - 10000 + 1)


def test_a_claim_several_pods_share_is_held_at_its_grant_in_sum_by_the_fence(node):
    """A DRA claim that two pods share is no tenant (the loop does not lend it; it counts at its grant),
    but in driver mode its containers were fenced only by the CDI spec, which a pod joining after Prepare
    got at the split known then: the pair could hold twice the grant. The loop now holds each container
    of such a claim at its share of the grant, every tick."""
    from deviceplugin.quota.model import Claim
    nv, cgroot, qroot = node
    ca, cb = cgroup_of(A.pod_uid, CID_A), cgroup_of(B.pod_uid, CID_B)

    class Source(Tenants):
        def list_pending(self):
            return [Claim("llm/shared", ((GPU, 24000),), container_ids=frozenset([CID_A, CID_B]), sharers=2)]
    fence = DriverFence(NvmlMemoryLimits(nv), CgroupFinder(cgroot))
    loop = QuotaLoop(Source([]), lambda: {GPU: 60000}, [], P, str(qroot), mode=EnforcementMode.DRIVER, fence=fence,
                     settings=LoopSettings(params=P, startup_ticks=0))
    nv.allocate(GPU, ca, 5000)
    report = loop.run_once()
    assert not report.errors, report.errors
    # split as a tenant's limit: a keeps its 5,000, the rest halved (the hunt: an even split gave b its half
    # while a still held more than its own, and the driver takes nothing back)
    assert nv.limits[(GPU, ca)] == (14500 << 20, 14500 << 20) and nv.limits[(GPU, cb)] == (9500 << 20, 9500 << 20)
    with pytest.raises(OutOfMemory):
        nv.allocate(GPU, cb, 9501)
    # b reaches its hard limit exactly (the driver lets it no further): it wants more, so the rest goes to it
    nv.allocate(GPU, cb, 9500)
    assert not loop.run_once().errors
    assert nv.limits[(GPU, ca)][1] == 5000 << 20 and nv.limits[(GPU, cb)][1] == 19000 << 20


def test_an_unlisted_pod_s_containers_are_read_by_its_uid_and_held_only_by_its_one_claim(node):
    """A claim's pod the pod cache does not list: its containers are found by the pod's cgroup, their use
    read with the pod's UID (attribution books it to the claim, not foreign), and held with the claim's,
    each keeping the CDI share of a container that may follow it. A pod two such claims name is read but
    held by neither: which container is whose is not known, and two holds would move the same cgroups."""
    from deviceplugin.quota.model import Claim
    nv, cgroot, _q = node
    ca, cb = cgroup_of(A.pod_uid, CID_A), cgroup_of(B.pod_uid, CID_B)
    for cg, used in ((ca, 1000), (cb, 3000)):  # the toolkit applied each one's CDI spec at its start; lent since
        nv.limits[(GPU, cg)] = (6000 << 20, 6000 << 20)
        nv.allocate(GPU, cg, used)
    one = Claim("llm/one", ((GPU, 8000),), pod_uids=frozenset([A.pod_uid]), sharers=2,
                pod_slots=((A.pod_uid, 2),))  # A runs one of its two containers
    x, y = (Claim(f"llm/{n}", ((GPU, 4000),), pod_uids=frozenset([B.pod_uid]), sharers=1,
                  pod_slots=((B.pod_uid, 1),)) for n in "xy")
    fence = DriverFence(NvmlMemoryLimits(nv), CgroupFinder(cgroot))
    samples = fence.read_usage([], [one, x, y])
    assert sorted((s.pod_uid, s.container_id, s.used_mib) for s in samples) == [(A.pod_uid, None, 1000),
                                                                                   (B.pod_uid, None, 3000)]
    assert [fence.hold(c) for c in (one, x, y)] == [[], [], []]
    # one's: the grant less the share kept for its container not started (8,000 - 4,000)
    assert nv.limits[(GPU, ca)] == (4000 << 20, 4000 << 20)
    assert nv.limits[(GPU, cb)] == (6000 << 20, 6000 << 20)  # untouched


def test_the_rest_of_a_tenant_s_limit_goes_to_its_containers_at_their_hard_limit(node):
    """Found by tests/dra/test_driver_fence_soundness.py (headroom ``peak``): a claim of two containers,
    one busy at its hard limit (it wants more), one quiet. Halving the unused rest left the busy one
    fenced while the claim as a whole looked below its limit, and the loop raised a borrower instead
    (the claim sat below its grant for 8 ticks). The rest goes to those at their hard limit."""
    nv, cgroot, qroot = node
    loop = two_container_loop(nv, cgroot, qroot)
    ca, ca2, cb = cgroup_of(A.pod_uid, CID_A), cgroup_of(A.pod_uid, CID_A2), cgroup_of(B.pod_uid, CID_B)
    nv.allocate(GPU, ca, 8000)
    nv.allocate(GPU, ca2, 3000)
    nv.allocate(GPU, cb, 20000)
    loop.run_once()
    hard = nv.limits[(GPU, ca)][1] >> 20
    nv.allocate(GPU, ca, hard - 8000)  # the busy one reaches its hard limit; its sibling stays at 3000
    report = loop.run_once()
    limit = {d.key.pod: d.limit_mib for d in report.decisions}["a"]
    assert nv.limits[(GPU, ca2)][1] >> 20 == 3000  # the quiet one keeps what it holds
    assert nv.limits[(GPU, ca)][1] >> 20 == limit - 3000  # the busy one gets the whole rest


def test_a_tenant_whose_cgroups_are_not_found_counts_at_its_cdi_shares(node):
    """Found by tests/dra/test_driver_fence_soundness.py: a tenant's container restarts (a new cgroup, the
    toolkit sets its CDI spec's share: here the whole grant) and the pod's status names the new ID a tick
    later. Meanwhile no cgroup of the tenant is found: it gave no sample, the policy held its limit (cut
    below the grant for a borrower) and lent the rest while the new cgroup could take the whole grant. It
    counts as using its CDI shares; a tenant with a cgroup found and one missing counts that one's share."""
    nv, cgroot, _q = node
    fence = DriverFence(NvmlMemoryLimits(nv), CgroupFinder(cgroot))
    gone = Tenant(A, ((GPU, 30000),), container_ids=frozenset(["e" * 64]))  # its new ID not in the status yet
    half = Tenant(B, ((GPU, 30000),), container_ids=frozenset([CID_B]), sharers=2)
    nv.allocate(GPU, cgroup_of(B.pod_uid, CID_B), 1000)
    used = {(s.pod, s.container_id): s.used_mib for s in fence.read_usage([gone, half])}
    assert used[("a", None)] == 30000 and used[("b", CID_B)] == 1000 and used[("b", None)] == 15000


def test_a_running_init_container_keeps_the_share_of_the_container_that_follows_it(node):
    """An ordinary init container runs alone; when it ends the kubelet starts the next container at its CDI
    share, which the driver gives whatever the limits say. So while the init container holds 1,000 of its
    30,000 share, the rest of the share counts as used (the tenant is not cut below it); one holding more
    than the share leaves nothing more to count."""
    nv, cgroot, _q = node
    fence = DriverFence(NvmlMemoryLimits(nv), CgroupFinder(cgroot))
    init = Tenant(A, ((GPU, 30000),), container_ids=frozenset([CID_A]), init_ids=frozenset([CID_A]))
    nv.allocate(GPU, cgroup_of(A.pod_uid, CID_A), 1000)
    used = {s.container_id: s.used_mib for s in fence.read_usage([init])}
    assert used == {CID_A: 1000, None: 29000}
    nv.allocate(GPU, cgroup_of(A.pod_uid, CID_A), 30000)
    assert {s.container_id: s.used_mib for s in fence.read_usage([init])} == {CID_A: 31000}


def test_the_hard_limits_in_force_are_read_with_the_use(node):
    """A restarted quota loop bounds what an engine on a file it never saw may hold by the driver's hard
    limits in force (not that file's ceiling): the fence reads them with the use, in sum per tenant, and
    knows none for a tenant with a container not found (its CDI share comes on top)."""
    nv, cgroot, qroot = node
    fence = DriverFence(NvmlMemoryLimits(nv), CgroupFinder(cgroot))
    nv.limits[(GPU, cgroup_of(A.pod_uid, CID_A))] = (20000 << 20, 25000 << 20)
    a = Tenant(A, ((GPU, 30000),), container_ids=frozenset([CID_A]))
    b = Tenant(B, ((GPU, 30000),), container_ids=frozenset([CID_B]), sharers=2)
    fence.read_usage([a, b])
    assert fence.hard_in_force(A, GPU) == 25000 and fence.hard_in_force(B, GPU) is None  # b's is unlimited
    # a container not found (restarting, its new ID not in the status yet) holds its CDI share on top (the
    # wide hunt: with None, a restarted loop bounded the engine by the old file's ceiling)
    nv.limits[(GPU, cgroup_of(B.pod_uid, CID_B))] = (10000 << 20, 12000 << 20)
    fence.read_usage([a, b])
    assert fence.hard_in_force(B, GPU) == 12000 + 15000


def test_a_sidecar_keeps_room_for_the_container_that_follows_an_init_container(node):
    """Found by tests/dra/test_driver_fence_soundness.py (open in drahunt, fixed in drasplit): a claim named
    by a sidecar and an ordinary init container (two at once: the CDI share is half the grant). When the
    init container ends, the kubelet starts the next container (the app) at that share, and the driver takes
    nothing back from the sidecar: the sidecar may grow to the limit less that share, never into the init
    container's part. The init container's slot counts as used at the share, so the claim is not cut
    below what the app starts with."""
    import pathlib
    nv, cgroot, qroot = node
    (pathlib.Path(cgroot) / cgroup_of(A.pod_uid, CID_A2).lstrip("/")).mkdir(parents=True)
    a = Tenant(A, ((GPU, 30000),), container_ids=frozenset([CID_A, CID_A2]), sharers=2, init_ids=frozenset([CID_A2]))
    b = Tenant(B, ((GPU, 30000),), container_ids=frozenset([CID_B]))
    fence = DriverFence(NvmlMemoryLimits(nv), CgroupFinder(cgroot))
    loop = QuotaLoop(Tenants([a, b]), lambda: {GPU: 60000}, [], P, str(qroot), mode=EnforcementMode.DRIVER,
                     fence=fence, settings=LoopSettings(params=P, startup_ticks=0))
    side, init = cgroup_of(A.pod_uid, CID_A), cgroup_of(A.pod_uid, CID_A2)
    nv.allocate(GPU, side, 12000)
    nv.allocate(GPU, init, 1000)
    nv.allocate(GPU, cgroup_of(B.pod_uid, CID_B), 20000)
    used = {(s.pod, s.container_id): s.used_mib for s in fence.read_usage([a, b])}
    assert used[("a", None)] == 15000 - 1000  # the app's share, less what the init container holds already
    report = loop.run_once()
    assert not report.errors, report.errors
    limit = {d.key.pod: d.limit_mib for d in report.decisions}["a"]
    assert limit >= 12000 + 15000  # the sidecar's use and the app's share
    hard = {cg: nv.limits[(GPU, cg)][1] >> 20 for cg in (side, init)}
    assert hard[side] == limit - 15000 and hard[side] + hard[init] == limit
    with pytest.raises(OutOfMemory):  # the sidecar cannot take what the app will start with
        nv.allocate(GPU, side, hard[side] - 12000 + 1)
    nv.allocate(GPU, init, hard[init] - 1000)  # the init container may: its memory goes when it ends


def test_split_slots_leaves_a_share_for_each_slot_to_be_filled():
    """Pure: whatever the uses, the containers that stay never hold more (hard limit or use) than the limit
    less a share per slot still to be filled when that is possible, and all together never more than the
    limit less the unstarted shares; nobody is cut below what it holds when everything fits."""
    from hypothesis import given, strategies as st

    from deviceplugin.quota.fence import split_slots

    @given(st.integers(0, 100_000), st.lists(st.tuples(st.integers(0, 60_000), st.booleans(), st.booleans()),
                                             min_size=1, max_size=5), st.integers(0, 30_000), st.integers(0, 2))
    def prop(limit, cs, share, unstarted):
        uses, pressed, once = [u for u, _, _ in cs], [p for _, p, _ in cs], [o for _, _, o in cs]
        out = split_slots(limit, uses, pressed, once, share, unstarted)
        room = limit - min(limit, share * unstarted)
        assert len(out) == len(uses) and all(x >= 0 for x in out) and sum(out) <= room
        held = [max(x, u) for x, u in zip(out, uses)]
        stay = sum(u for u, o in zip(uses, once) if not o)
        if stay + share * sum(once) <= room:  # the slots after the init containers fit beside the rest
            assert sum(h for h, o in zip(held, once) if not o) + share * sum(once) <= room
        if sum(uses) <= room and stay + share * sum(once) <= room:
            assert all(x >= u for x, u in zip(out, uses))
            assert sum(held) <= room
    prop()
    # the drahunt's case: a 68,608 MiB lent limit, a busy sidecar and an init container (share 23,040)
    assert split_slots(68608, [40000, 1000], [True, False], [False, True], 23040, 0) == [45568, 23040]
    assert split_slots(68608, [40000, 1000], [True, False], [False, False], 23040, 0) == [67608, 1000]
    # a sidecar that holds more than its part already (cut): it may not grow; the init gets what is left
    assert split_slots(30000, [20000, 1000], [False, False], [False, True], 15000, 0) == [15000, 10000]


def test_fit_to_capacity_gives_back_raises_first_and_never_cuts_below_use():
    """Pure: the hard limits of one write lowered to the room the GPU has left beside the others' in force:
    raises down to the limit in force first, then cuts, never below a cgroup's use (unread: not below its
    limit in force); the lowest allowed when even that does not fit."""
    from hypothesis import given, strategies as st

    from deviceplugin.quota.fence import fit_to_capacity

    assert fit_to_capacity(30000, [40000], [30000], [29000]) == [30000]  # the raise given back, no more
    assert fit_to_capacity(40000, [40000], [30000], [29000]) == [40000]  # it fits: untouched
    # raises first (to 30,000 + 10,000), then the cuts share the rest in proportion to what each may give
    assert fit_to_capacity(35000, [40000, 10000], [30000, 10000], [20000, 5000]) == [26666, 8334]
    assert fit_to_capacity(10000, [40000, 10000], [30000, 10000], [20000, None]) == [20000, 10000]  # lowest
    assert fit_to_capacity(0, [5000], [None], [None]) == [5000]  # nothing known: not lowered

    @given(st.integers(-10_000, 100_000),
           st.lists(st.tuples(st.integers(0, 50_000), st.one_of(st.none(), st.integers(0, 50_000)),
                              st.one_of(st.none(), st.integers(0, 50_000))), min_size=1, max_size=5))
    def prop(room, cs):
        wants, force, uses = [w for w, _, _ in cs], [h for _, h, _ in cs], [u for _, _, u in cs]
        out = fit_to_capacity(room, wants, force, uses)
        floors = [w if u is None and h is None else min(w, h if u is None else u) for w, h, u in cs]
        kept = [w if h is None else max(min(w, h), f) for w, h, f in zip(wants, force, floors)]
        assert all(f <= o <= w for f, o, w in zip(floors, out, wants))
        assert sum(out) <= room or out == floors  # it fits, or nothing is left to lower
        if sum(kept) <= room:  # the raises alone make the room: nobody is cut below its limit in force
            assert all(o >= k for o, k in zip(out, kept))
        if sum(wants) <= room:
            assert out == wants
    prop()


def test_fit_to_capacity_fits_to_the_mib_and_takes_nothing_from_a_cgroup_at_its_use():
    """The edges of the proportional cut: 1 MiB over is still taken (the sum lands on the room exactly),
    and the remainder of a proportional cut skips a cgroup with no room left above its use."""
    from deviceplugin.quota.fence import fit_to_capacity

    assert fit_to_capacity(19, [10, 10], [None, None], [0, 0]) == [9, 10]
    assert fit_to_capacity(13, [4, 7, 7], [None] * 3, [4, 4, 4]) == [4, 4, 5]


def test_restart_split_cuts_at_once_only_a_fresh_container_using_no_more_than_its_cut():
    """Pure (the restart rule): a fresh container using exactly its cut gets it at once; an old one keeps
    its split of the bound that waits, however little it uses, while no fresh one runs beside it; beside a
    fresh one it keeps no more than it had."""
    from deviceplugin.quota.fence import restart_split

    assert restart_split([8000], [6000], [6000], [True], [None]) == [6000]
    assert restart_split([8000], [6000], [6001], [True], [None]) == [8000]  # it holds more: no proof
    assert restart_split([8000], [6000], [None], [True], [None]) == [8000]  # unread: no proof either
    assert restart_split([8000, 8000], [6000, 6000], [1000, 1000], [False, False], [7000, None]) == [8000, 8000]
    assert restart_split([8000, 8000], [6000, 6000], [1000, 1000], [True, False], [None, 7000]) == [6000, 7000]


class HungryA(Engines):
    """a's engine has 4 requests waiting and demands 40,000 MiB of KV beside its 9,500 of weights: it wants
    49,500."""

    def read_signals(self, url):
        if url.split("//")[1].split(":")[0] != "a":
            return super().read_signals(url)
        return VllmSample(release_mode="unmap", generation_applied=self.applied["a"], waiting=4,
                          kv_held_bytes=20000 * 2**20, kv_demand_bytes=40000 * 2**20)


def test_the_loop_writes_a_lender_s_acknowledged_cut_before_the_raise_it_pays_for(node):
    """At tick 1, a's raise to 49,500 is paid for by memory b acknowledged giving back. Written in key order
    (a before b), the raise came before b's hard limit came down from 30,000: unguarded, the driver held
    79,500 MiB of hard limits on the 60,000 MiB GPU until b's write later in the tick; with the fence's guard
    alone, a's raise was lowered to fit and came a tick later. The loop now writes who gives back first
    (``QuotaLoop._give_back``): checked at every write the driver sees (the fake NVML's edge), the sum never
    passes the GPU, and a has its raise in the tick it was decided, with nothing lowered to fit."""
    nv, _cgroot, qroot = node
    ca, cb = cgroup_of(A.pod_uid, CID_A), cgroup_of(B.pod_uid, CID_B)
    engines = HungryA()
    loop, _tenants = _acknowledging_loop(node, engines, guarded=True)
    sums: list[int] = []
    real_set = nv.nvmlDeviceSetMemoryLimits_v1

    def set_and_sum(handle, limits):
        real_set(handle, limits)
        sums.append(sum(nv.limits.get((GPU, cg), (0, 0))[1] for cg in (ca, cb)) >> 20)
    nv.nvmlDeviceSetMemoryLimits_v1 = set_and_sum
    hards = []
    for _ in range(4):  # both acknowledge whatever the loop wrote last, one tick later
        decided = {d.key.pod: d.limit_mib for d in loop.run_once().decisions}
        hards.append((nv.limits[(GPU, ca)][1] >> 20, nv.limits[(GPU, cb)][1] >> 20))
        engines.applied = {k.pod: read_quota(container_dir(str(qroot), k.pod_uid, "vllm")).generation for k in (A, B)}
    assert max(sums) <= 60000, sums
    assert decided["a"] == 49500 and hards[1:] == [(49500, decided["b"])] * 3
    assert not loop.fence_clamps()


def _capped_fence(node, cap: int) -> tuple[DriverFence, Tenant, Tenant, str, str]:
    """a and b at their CDI shares (30,000 each) on a GPU the loop divides 60,000 of; a holds 20,000, b
    29,000; the fence is given that capacity."""
    nv, cgroot, _q = node
    ca, cb = cgroup_of(A.pod_uid, CID_A), cgroup_of(B.pod_uid, CID_B)
    for cg, used in ((ca, 20000), (cb, 29000)):
        nv.limits[(GPU, cg)] = (30000 << 20, 30000 << 20)
        nv.allocate(GPU, cg, used)
    fence = DriverFence(NvmlMemoryLimits(nv), CgroupFinder(cgroot), lambda: {GPU: cap})
    a = Tenant(A, ((GPU, 30000),), container_ids=frozenset([CID_A]))
    b = Tenant(B, ((GPU, 30000),), container_ids=frozenset([CID_B]))
    return fence, a, b, ca, cb


def test_a_raise_written_before_the_lender_s_cut_is_in_force_is_lowered_to_fit_the_gpu(node):
    """The invariant every driver hunt counterexample broke, enforced where hard limits are written: b is
    raised to 40,000 for a's 10,000 while a's hard limit still is 30,000 (its cut waits for its engine, or is
    simply written after b's). The raise is given back to fit the GPU (30,000 + 30,000), b is written again
    once a's cut is in force, and gets it then: lenders shrink first, the borrower grows as they release."""
    nv, _cgroot, _q = node
    fence, a, b, ca, cb = _capped_fence(node, 60000)
    fence.read_usage([a, b])
    assert not fence.apply(b, [Decision(B, GPU, 40000, 30000, 7500, 60000, "raise")], {GPU: 30000})
    assert nv.limits[(GPU, cb)][1] == 30000 << 20  # not 40,000 beside a's 30,000 on a 60,000 GPU
    assert fence.moved(b)  # written again at the next tick
    assert not fence.apply(a, [Decision(A, GPU, 20000, 30000, 7500, 60000, "lend")], {GPU: 30000})
    fence.read_usage([a, b])
    assert fence.moved(b)
    assert not fence.apply(b, [Decision(B, GPU, 40000, 30000, 7500, 60000, "raise")], {GPU: 30000})
    assert (nv.limits[(GPU, ca)][1] >> 20, nv.limits[(GPU, cb)][1] >> 20) == (20000, 40000)
    assert not fence.moved(b)
    assert fence.clamps == {(GPU, "fitted"): 1}


def test_a_departed_container_s_hard_limit_drops_out_of_what_writes_are_fitted_against(node):
    """The ledger is read afresh with the use: a container gone by the next read (its tenant departed, its
    cgroup removed) no longer counts against the GPU, so the raise its memory was lent for is written whole."""
    import pathlib
    import shutil
    nv, cgroot, _q = node
    fence, a, b, ca, cb = _capped_fence(node, 60000)
    fence.read_usage([a, b])
    assert not fence.apply(b, [Decision(B, GPU, 50000, 30000, 7500, 60000, "raise")], {GPU: 30000})
    assert nv.limits[(GPU, cb)][1] == 30000 << 20  # a still holds its 30,000
    nv.used.pop((GPU, ca))
    shutil.rmtree(pathlib.Path(cgroot) / ca.lstrip("/"))
    fence.read_usage([b])
    assert not fence.apply(b, [Decision(B, GPU, 50000, 30000, 7500, 60000, "raise")], {GPU: 30000})
    assert nv.limits[(GPU, cb)][1] == 50000 << 20


def test_a_cgroup_whose_limits_cannot_be_read_keeps_its_hard_limit_in_the_ledger(node):
    """A read that fails for a's cgroup does not make its hard limit vanish from what writes are fitted
    against: the ledger keeps the last one read (30,000), so b's raise stays within the GPU's 60,000.
    When no cgroup can be read at all, the read fails as a whole (the loop keeps its last good state)
    rather than saying that nobody uses anything."""
    import pynvml

    from deviceplugin.quota.telemetry import TelemetryError
    nv, _cgroot, _q = node
    fence, a, b, _ca, cb = _capped_fence(node, 60000)
    fence.read_usage([a, b])
    nv.fail("nvmlDeviceGetMemoryLimits_v1", pynvml.NVMLError_Unknown, times=1)  # a's read, this time only
    assert [s.pod for s in fence.read_usage([a, b]) if s.container_id] == ["b"]
    fence.apply(b, [Decision(B, GPU, 50000, 30000, 7500, 60000, "raise")], {GPU: 30000})
    assert nv.limits[(GPU, cb)][1] == 30000 << 20
    nv.fail("nvmlDeviceGetMemoryLimits_v1", pynvml.NVMLError_Unknown, times=None)
    with pytest.raises(TelemetryError, match="driver limits"):
        fence.read_usage([a, b])


def test_a_write_that_cannot_fit_even_at_use_is_written_at_use_and_counted(node):
    """Where the others' limits in force and this cgroup's use pass the GPU (lent before a claim came), the
    write is lowered to the use, no further (the driver takes nothing back: a cut below it frees nothing),
    logged and counted as over capacity."""
    nv, _cgroot, _q = node
    fence, a, b, _ca, cb = _capped_fence(node, 50000)
    fence.read_usage([a, b])
    assert not fence.apply(b, [Decision(B, GPU, 30000, 30000, 7500, 60000, "hold")], {GPU: 30000})
    assert nv.limits[(GPU, cb)][1] == 29000 << 20
    assert fence.clamps == {(GPU, "over_capacity"): 1}
    from deviceplugin.quota.service import QuotaCollector
    loop = QuotaLoop(Tenants([a, b]), lambda: {GPU: 50000}, [], P, str(node[2]), mode=EnforcementMode.DRIVER,
                     fence=fence)
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for m in QuotaCollector(loop).collect()
               for s in m.samples}
    assert samples[("vramshare_quota_fence_clamped_total", (("gpu", GPU), ("outcome", "over_capacity")))] == 1


def test_the_fence_s_hard_limits_never_pass_the_gpu_whatever_order_they_are_written_in(tmp_path):
    """Property: tenants on one GPU, random uses (within each one's hard limit, in sum within the GPU) read
    each round, then random decisions and waiting hard limits written in random order, held claims
    among them: after every write the hard limits in force add up to at most the GPU's capacity."""
    import pathlib
    import random as rnd
    import tempfile

    from hypothesis import HealthCheck, given, settings, strategies as st

    from deviceplugin.quota.model import Claim

    cap, n = 60000, 4
    keys = [TenantKey("llm", f"p{i}", "vllm", pod_uid=f"{i:08d}-0000-0000-0000-000000000000") for i in range(n)]
    cids = [f"{i}" * 64 for i in range(n)]

    @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(st.integers(0, 2**32 - 1))
    def prop(seed):
        r = rnd.Random(seed)
        root = tempfile.mkdtemp(dir=tmp_path)
        nv = FakeNvml([H100_80GB])
        nv.driver_version = "615.20.01"
        nv.nvmlInit()
        cgs = [cgroup_of(k.pod_uid, c) for k, c in zip(keys, cids)]
        for cg in cgs:
            (pathlib.Path(root) / cg.lstrip("/")).mkdir(parents=True)
            nv.limits[(GPU, cg)] = (cap // n << 20, cap // n << 20)  # the CDI shares fit
        fence = DriverFence(NvmlMemoryLimits(nv), CgroupFinder(str(root)), lambda: {GPU: cap})
        tenants = [Tenant(k, ((GPU, cap // n),), container_ids=frozenset([c])) for k, c in zip(keys, cids)]
        held = Claim("shared", ((GPU, cap // n),), container_ids=frozenset([cids[-1]]))
        for _round in range(8):
            for cg in cgs:  # each grows or releases within its hard limit, the GPU's sum within its capacity
                hard = nv.limits[(GPU, cg)][1] >> 20
                others = sum(v for (g, c), v in nv.used.items() if c != cg) >> 20
                nv.used[(GPU, cg)] = r.randint(0, max(0, min(hard, cap - others))) << 20
            fence.read_usage(tenants[:-1], [held])
            for i in r.sample(range(n), n):
                if i == n - 1:
                    fence.hold(held)
                else:
                    limit = r.randint(1000, cap)
                    top = max(limit, r.randint(1000, cap))  # a shrink that waits for its engine
                    fence.apply(tenants[i], [Decision(keys[i], GPU, limit, 0, 0, cap, "t")], {GPU: cap // n},
                                {GPU: top})
                assert sum(nv.limits[(GPU, cg)][1] for cg in cgs) >> 20 <= cap
    prop()


def test_a_claim_s_containers_not_found_are_counted_per_pod_or_by_its_sharers():
    """``DriverFence._missing`` (each keeps its CDI share out of what the others may hold): per pod slot,
    its count less those found in it (a departed pod keeps none); where the source gives no slots, the
    claim's sharers less every container found."""
    from deviceplugin.quota.model import Claim
    plain = Claim("c", ((GPU, 30000),), sharers=3)
    assert DriverFence._missing(plain, ["p1"]) == 2 and DriverFence._missing(plain, ["p1"] * 4) == 0
    slotted = dataclasses.replace(plain, pod_slots=(("p1", 2), ("p2", 1)))
    assert DriverFence._missing(slotted, ["p1", "p3"]) == 2  # one more of p1, p2's one; p3 keeps none
