"""A DRA node in driver (or MPS, or cooperative) mode for the fence properties
(tests/dra/test_driver_fence_soundness.py).

Real: the preparer (:class:`ClaimPreparer`: reads the claim and its pods, writes the quota file and the CDI
spec with each container's share), the tenant source (:class:`ClaimTenantSource` over the preparer's
checkpoint and the pod cache), the quota loop, policy and writer, and the driver fence
(:class:`DriverFence` over :class:`NvmlMemoryLimits` and :class:`CgroupFinder`). Doubles only at the edges:

* the API server's claims and pods (plain dicts in the v1 shape: ``status.reservedFor``, the pod's
  ``spec.resourceClaims``, its containers' ``resources.claims``, ``status.containerStatuses``);
* the kubelet: it prepares a claim when its first pod starts, with ``reservedFor`` as the scheduler left
  it then, and never again for a pod that joins later (``pkg/kubelet/cm/dra/manager.go``
  ``prepareResources``: a claim already prepared only gets the pod's reference; no NodePrepareResources);
  it starts a pod's init containers one by one (sidecars stay), then its app containers; it unprepares a
  claim once none of its pods runs;
* the container runtime and toolkit: a container gets a new cgroup (directory in a temporary cgroup tree)
  and, as ``apply-cuda-memory-limits`` does, the limits its CDI spec's ``NVIDIA_GPU_MEMORY_REQUEST`` /
  ``_LIMIT`` say; a restart is a new container (new ID, new cgroup, limits from the spec again); a
  container that exits frees its memory and its cgroup;
* the GPU: the fake NVML (limits per cgroup; an allocation past the hard limit fails);
* each container's process: once its ID is in the pod's status (an engine loads before it allocates;
  the kubelet posts the ID meanwhile) it tries to grow to its demand (allocations past its hard limit fail), a
  releasing one (``unmap``) gives back what is above its hard limit, a throttling one only as its demand
  drops; the pod's engine (first app container naming the claim) reports on /metrics its release mode and
  the quota generation it applied, ``ack_lag`` ticks after the loop wrote it.

In cooperative mode nothing fences (no limits per cgroup; the loop has no fence) and the loop reads use
as it does there, from NVML's processes (:class:`NvmlProcessReader`: each container's process, its host
PID tied to the container through ``/proc/<pid>/cgroup``, so its container IDs are 64 hex digits, as the
runtime's are); its engines hold their demand (give them demands within their claims). MPS mode reads use
the same way (the daemon's ``quota.processAttribution: true``; NVML lists each MPS client process), and
each client's allocations stop at its pinned limit (``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``, fixed at its start).

The pod cache may list a pod late (``SimPod.cache_lag``: after the kubelet started it) and drop it while
its containers still run (``SimPod.linger``: force-deleted): the windows in which a prepared claim's
processes run while the loop knows no container of it.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import uuid
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from deviceplugin.dra.claims import ClaimRef
from deviceplugin.dra.preparer import ClaimPreparer, tenant_container
from deviceplugin.dra.slices import DeviceRef
from deviceplugin.dra.tenants import AllocatedClaims, ClaimTenantSource
from deviceplugin.nvml_limits import CgroupFinder, NvmlMemoryLimits
from deviceplugin.quota.fence import DriverFence
from deviceplugin.quota.loop import LoopSettings, QuotaLoop
from deviceplugin.quota.model import PolicyParams
from deviceplugin.quota.telemetry import NvmlProcessReader, VllmSample
from deviceplugin.quota.writer import read_quota
from tests.fixtures.fake_nvml import H100_80GB, FakeNvml, OutOfMemory
from vramshare import contract
from vramshare.config import Config, DraConfig, EnforcementConfig
from vramshare.inventory import EnforcementMode, Gpu

GPU = H100_80GB.uuid
CAP = 80896  # what the node's slice offers on the GPU (whole units) and the loop divides
MIB = 1 << 20
NS = "llm"
NAMES = contract.Names()


@dataclass
class Ctr:
    """One container of a pod. ``kind``: ``app``, ``init`` (runs ``init_ticks`` alone, then exits) or
    ``sidecar`` (an init container with restartPolicy Always: runs from its turn on)."""

    name: str
    kind: str
    gpu: bool  # names the pod's claim in resources.claims
    demand: list[int]  # MiB it would use, per tick from its start
    restarts: tuple[int, ...] = ()  # ticks (from its first start) at which it restarts
    init_ticks: int = 2
    # runtime
    cid: str | None = None
    generation: int = 0
    started: int | None = None  # tick its current instance started
    first_start: int | None = None
    done: bool = False  # an init container that finished
    label: str = ""  # how the demand was made (a counterexample's repr stays short)

    def __repr__(self) -> str:
        demand = self.label or repr(self.demand)
        return (f"Ctr({self.name!r}, {self.kind!r}, {self.gpu}, {demand}, {self.restarts}, "
                f"init_ticks={self.init_ticks})")

    def demand_at(self, t: int) -> int:
        if self.started is None or self.cid is None:
            return 0
        i = t - self.started
        return self.demand[min(i, len(self.demand) - 1)] if i >= 0 else 0


@dataclass
class SimPod:
    name: str
    claim: str
    bind: int  # the scheduler reserves the claim for it (reservedFor) and binds it
    start: int  # the kubelet starts it (Prepare for the claim's first pod)
    stop: int | None  # deleted at this tick (its containers stop, it leaves the pod cache)
    containers: list[Ctr]
    mode: str = "unmap"  # its engine's release mode
    ack_lag: int = 1
    status_lag: int = 0  # ticks before the pod cache shows a container's new ID
    # ticks after its start before this node's pod cache lists the pod at all (0: from its bind): its watch
    # lags the kubelet's, so the claim is prepared and its processes run while the loop knows no pod of it
    cache_lag: int = 0
    # ticks its containers run on after it left the pod cache at ``stop`` (force-deleted): the kubelet
    # unprepares its claim only once they exited; meanwhile they hold what they had and grow no more
    linger: int = 0
    # runtime
    seen: list[tuple[int, int]] = field(default_factory=list)  # (tick, generation) of the quota files seen
    statuses: list[tuple[int, dict[str, str]]] = field(default_factory=list)  # (tick, name -> cid)

    def __repr__(self) -> str:
        return (f"SimPod({self.name!r}, {self.claim!r}, {self.bind}, {self.start}, {self.stop}, {self.containers}, "
                f"mode={self.mode!r}, ack_lag={self.ack_lag}, status_lag={self.status_lag}, "
                f"cache_lag={self.cache_lag}, linger={self.linger})")

    @property
    def uid(self) -> str:
        return str(uuid.uuid5(uuid.NAMESPACE_DNS, f"pod-{self.name}"))  # as the API server's: NVML's path parses it

    def inits(self) -> list[Ctr]:
        return [c for c in self.containers if c.kind != "app"]

    def apps(self) -> list[Ctr]:
        return [c for c in self.containers if c.kind == "app"]

    def engine(self) -> Ctr | None:
        return next((c for c in self.apps() if c.gpu), None)

    def spec(self) -> dict:
        def one(c: Ctr) -> dict:
            out: dict[str, Any] = {"name": c.name, "image": "vllm"}
            if c.gpu:
                out["resources"] = {"claims": [{"name": "gpu"}]}
            if c.kind == "sidecar":
                out["restartPolicy"] = "Always"
            return out
        return {"containers": [one(c) for c in self.apps()], "initContainers": [one(c) for c in self.inits()],
                "resourceClaims": [{"name": "gpu", "resourceClaimName": self.claim}]}


@dataclass
class SimClaim:
    name: str
    grant: int
    unprepare_lag: int = 0  # ticks the kubelet takes to unprepare it once none of its pods' containers runs

    @property
    def uid(self) -> str:
        return f"cuid-{self.name}"


class GpuNvml(FakeNvml):
    """The fake NVML whose GPU memory in use is what its cgroups hold (as NVML's ``used`` counts every
    process): the driver fence books what no tenant cgroup holds as foreign."""

    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: int | None = None) -> Any:
        info = super().nvmlDeviceGetMemoryInfo(handle, version)
        uuid = self.gpus[handle.gpu].uuid
        info.used += sum(b for (g, _cg), b in self.used.items() if g == uuid)
        return info

    pids: dict[str, int]  # cgroup -> the host PID of its process (the node sets it)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> list[Any]:
        """One process per cgroup holding memory on the GPU (``usedGpuMemory`` in bytes, as pynvml's)."""
        self._enter("nvmlDeviceGetComputeRunningProcesses", handle)
        uuid_ = self.gpus[handle.gpu].uuid
        return [SimpleNamespace(pid=self.pids[cg], usedGpuMemory=b)
                for (g, cg), b in sorted(self.used.items()) if g == uuid_ and b and cg in self.pids]


class DriverDraNode:
    """One GPU, the claims and pods given, ``mode`` driver (the loop fences) or mps (fixed at start)."""

    def __init__(self, root: str, claims: list[SimClaim], pods: list[SimPod], params: PolicyParams | None = None,
                 mode: EnforcementMode = EnforcementMode.DRIVER) -> None:
        self.root, self.claims, self.pods, self.mode, self.t = root, claims, pods, mode, 0
        self.cgroot = os.path.join(root, "cgroup")
        os.makedirs(os.path.join(self.cgroot, "kubepods.slice"), exist_ok=True)
        self.nv = GpuNvml([H100_80GB])
        self.nv.pids = {}
        self.proc_root = os.path.join(root, "proc")
        self.nv.driver_version = "615.20.01"
        self.nv.nvmlInit()
        base = Config(quota_host_dir=os.path.join(root, "quota"),
                      dra=DraConfig(gpus=("all",), cdi_root=os.path.join(root, "cdi"),
                                    state_dir=os.path.join(root, "state")))
        self.config = dataclasses.replace(base, enforcement=EnforcementConfig(resolved=mode))
        self.device = DeviceRef("gpu-0", Gpu(0, GPU, "H100", CAP, units=CAP // self.config.memory_unit_mib))
        self.preparer = ClaimPreparer("node", lambda: self.config, lambda: {"gpu-0": self.device}, self._read_claim,
                                      read_pod=self._read_pod)
        self.allocated = AllocatedClaims(self._read_claim, "node", lambda: self.config, lambda: {"gpu-0": self.device})
        self.source = ClaimTenantSource(self.preparer.prepared, self._listed, lambda: True, NAMES, self.allocated)
        self.params = params or PolicyParams()
        self.restart_loop()
        self.use: dict[tuple[str, str], int] = {}  # (pod, container) -> MiB its live instance holds
        self.lent: dict[str, list[int]] = {c.name: [] for c in claims}  # quota-file limit per tick

    def restart_loop(self) -> None:
        """A new quota loop and fence on the same files and cgroups (the DaemonSet restarted)."""
        self.fence = DriverFence(NvmlMemoryLimits(self.nv), CgroupFinder(self.cgroot), lambda: {GPU: CAP})
        readers = [NvmlProcessReader(self.nv, proc_root=self.proc_root)] if self._per_process() else []
        self.loop = QuotaLoop(self.source, lambda: {GPU: CAP}, readers, self.params, self.config.quota_host_dir,
                              signals=self, mode=self.mode,
                              fence=self.fence if self.mode is EnforcementMode.DRIVER else None,
                              settings=LoopSettings(params=self.params, startup_ticks=3))

    def _per_process(self) -> bool:
        """Whether the loop reads NVML's processes (cooperative and MPS modes; driver mode reads cgroups)."""
        return self.mode in (EnforcementMode.COOPERATIVE, EnforcementMode.MPS)

    # -- the API server --------------------------------------------------------------------------
    def claim(self, name: str) -> SimClaim:
        return next(c for c in self.claims if c.name == name)

    def pods_of(self, claim: str) -> list[SimPod]:
        return [p for p in self.pods if p.claim == claim]

    def _read_claim(self, namespace: str, name: str) -> dict:
        c = next((c for c in self.claims if c.name == name), None)
        bound = [p for p in self.pods_of(name) if p.bind <= self.t and not self._gone(p)]
        if c is None or not bound:
            raise LookupError("404 Not Found")
        result = {"request": "gpu", "driver": NAMES.dra_driver, "pool": "node", "device": "gpu-0",
                  "shareID": f"share-{c.name}", "consumedCapacity": {"memory": f"{c.grant}Mi"}}
        return {"metadata": {"name": name, "namespace": namespace, "uid": c.uid},
                "status": {"allocation": {"devices": {"results": [result]}},
                           "reservedFor": [{"resource": "pods", "name": p.name, "uid": p.uid} for p in bound]}}

    def _read_pod(self, namespace: str, name: str) -> dict:
        p = next((p for p in self.pods if p.name == name and p.bind <= self.t and not self._gone(p)), None)
        if p is None:
            raise LookupError("404 Not Found")
        return self._pod(p)

    def _gone(self, p: SimPod, t: int | None = None) -> bool:
        """Deleted: gone from the API server and the pod cache (its containers may linger)."""
        return p.stop is not None and (self.t if t is None else t) >= p.stop

    def stopped(self, p: SimPod, since: int = 0) -> bool:
        """Its containers have exited (``linger`` ticks after it was deleted), ``since`` ticks ago at least."""
        return p.stop is not None and self.t >= p.stop + p.linger + since

    def cached(self, p: SimPod, t: int | None = None) -> bool:
        """Whether this node's pod cache (what the tenant source reads) lists the pod at tick ``t``."""
        t = self.t if t is None else t
        return p.bind <= t and not self._gone(p, t) and (p.cache_lag == 0 or t >= p.start + p.cache_lag)

    def _pod(self, p: SimPod) -> dict:
        ids = next((ids for at, ids in reversed(p.statuses) if at <= self.t - p.status_lag), {})
        apps = {c.name for c in p.apps()}

        def statuses(app: bool) -> list[dict]:  # init containers (sidecars too) in initContainerStatuses
            return [{"name": n, "containerID": f"containerd://{cid}"} for n, cid in sorted(ids.items())
                    if (n in apps) == app]
        return {"metadata": {"name": p.name, "namespace": NS, "uid": p.uid,
                             "annotations": {"prometheus.io/port": "8000"}},
                "spec": p.spec(),
                "status": {"phase": "Running", "podIP": p.name, "containerStatuses": statuses(True),
                           "initContainerStatuses": statuses(False)}}

    def _listed(self) -> list[dict]:
        return [self._pod(p) for p in self.pods if self.cached(p)]

    # -- the engines' /metrics -------------------------------------------------------------------
    def read_signals(self, url: str) -> VllmSample:
        p = next(p for p in self.pods if f"//{p.name}:" in url)
        ready = [g for at, g in p.seen if at <= self.t - p.ack_lag]
        e = p.engine()
        fenced = e is not None and e.demand_at(self.t) > self.use.get((p.name, e.name), 0)
        return VllmSample(waiting=3 if fenced else 0, running=1, release_mode=p.mode,
                          generation_applied=ready[-1] if ready else None)

    # -- the kubelet and the runtime -------------------------------------------------------------
    def quota_dir(self, claim: str) -> str | None:
        rec = self.preparer.prepared().get(self.claim(claim).uid)
        return rec.quota_dir if rec is not None else None

    def spec_env(self, claim: str) -> dict[str, str]:
        rec = self.preparer.prepared()[self.claim(claim).uid]
        with open(rec.cdi_spec, encoding="utf-8") as fh:
            doc = json.load(fh)
        return dict(e.split("=", 1) for e in doc["containerEdits"]["env"])

    def cgroup(self, p: SimPod, c: Ctr) -> str:
        return (f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{p.uid.replace('-', '_')}.slice/"
                f"cri-containerd-{c.cid}.scope")

    def _create(self, p: SimPod, c: Ctr) -> None:
        """The runtime creates the container: a new cgroup, the toolkit's hook sets the CDI spec's limits."""
        c.generation += 1
        c.cid = f"{p.name}-{c.name}-{c.generation}".ljust(24, "x")
        c.started = self.t
        c.first_start = self.t if c.first_start is None else c.first_start
        if self._per_process():  # its process, as NVML and /proc show it
            c.cid = hashlib.sha256(c.cid.encode()).hexdigest()
            pid = self.nv.pids[self.cgroup(p, c)] = 1000 + len(self.nv.pids)
            os.makedirs(os.path.join(self.proc_root, str(pid)))
            with open(os.path.join(self.proc_root, str(pid), "cgroup"), "w", encoding="utf-8") as fh:
                fh.write(f"0::{self.cgroup(p, c)}\n")
        os.makedirs(os.path.join(self.cgroot, self.cgroup(p, c).lstrip("/")))
        self.use[(p.name, c.name)] = 0
        if c.gpu and self.mode is EnforcementMode.DRIVER:
            env = self.spec_env(p.claim)
            req, lim = int(env[contract.ENV_GPU_MEMORY_REQUEST]), int(env[contract.ENV_GPU_MEMORY_LIMIT])
            self.nv.limits[(GPU, self.cgroup(p, c))] = (req * MIB, lim * MIB)
        elif c.gpu and self.mode is EnforcementMode.MPS:  # the MPS server refuses allocations past the pin
            self.nv.limits[(GPU, self.cgroup(p, c))] = (0, self.hard(p, c) * MIB)

    def _exit(self, p: SimPod, c: Ctr) -> None:
        """The container's processes end: the driver frees their memory, the cgroup goes."""
        if c.cid is None:
            return
        cg = self.cgroup(p, c)
        self.nv.used.pop((GPU, cg), None)
        self.nv.limits.pop((GPU, cg), None)
        shutil.rmtree(os.path.join(self.cgroot, cg.lstrip("/")), ignore_errors=True)
        self.use.pop((p.name, c.name), None)
        c.cid, c.started = None, None

    def posted(self, p: SimPod, c: Ctr, t: int | None = None) -> bool:
        """Whether the container's current ID is in the pod's status ``status_lag`` ticks before ``t``."""
        t = self.t if t is None else t
        ids = next((ids for at, ids in reversed(p.statuses) if at <= t - p.status_lag), {})
        return c.cid is not None and ids.get(c.name) == c.cid

    def visible(self, p: SimPod, c: Ctr, t: int | None = None) -> bool:
        """Whether the pod cache (what the loop reads) shows the container's current ID at tick ``t``."""
        return self.posted(p, c, t) and self.cached(p, t)

    def joined_late(self, p: SimPod) -> bool:
        """The pod reserved its claim after the claim's Prepare: its containers got the CDI share made
        for the pods reserved then (the kubelet does not prepare a claim twice)."""
        rec = self.preparer.prepared().get(self.claim(p.claim).uid)
        return rec is not None and p.uid not in rec.pod_uids

    def live(self, p: SimPod) -> list[Ctr]:
        return [c for c in p.containers if c.cid is not None]

    def _kubelet(self) -> None:
        t = self.t
        for p in self.pods:
            if p.stop is not None and t == p.stop + p.linger:
                for c in p.containers:
                    self._exit(p, c)
            if t < p.start or self._gone(p):
                continue
            if t == p.start:
                rec = self.preparer.prepared().get(self.claim(p.claim).uid)
                if rec is None:  # the claim's first pod: NodePrepareResources
                    c = self.claim(p.claim)
                    res = self.preparer.prepare(ClaimRef(NS, c.name, c.uid))
                    assert not res.error, res.error
            self._run_containers(p)
        for c in self.claims:  # a claim none of whose pods runs any more is unprepared
            rec = self.preparer.prepared().get(c.uid)
            mine = self.pods_of(c.name)
            if rec is not None and all(self.stopped(p, c.unprepare_lag) for p in mine):
                assert self.preparer.unprepare(ClaimRef(NS, c.name, c.uid)) == ""
        for p in self.pods:
            if not self._gone(p) and t >= p.start:
                ids = {c.name: c.cid for c in self.live(p)}
                if not p.statuses or p.statuses[-1][1] != ids:
                    p.statuses.append((t, ids))

    def _run_containers(self, p: SimPod) -> None:
        """The kubelet's order: init containers one by one (a sidecar stays), then the app containers."""
        t = self.t
        for c in p.inits():
            if c.done:
                continue
            if c.cid is None:
                self._create(p, c)
                return
            if c.kind == "init":
                if t - c.started >= c.init_ticks:
                    self._exit(p, c)
                    c.done = True
                    continue
                return
        for c in p.apps():
            if c.cid is None and c.first_start is None:
                self._create(p, c)
        for c in p.containers:  # restarts: a new container, a new cgroup
            if c.cid is not None and c.kind != "init" and c.first_start is not None and \
                    t - c.first_start in c.restarts and c.started != t:
                self._exit(p, c)
                self._create(p, c)

    def _processes(self) -> None:
        """Each live container allocates toward its demand (the driver refuses past its hard limit);
        a releasing one gives back what is above its hard limit, a throttling one only what it no longer wants."""
        t = self.t
        for p in self.pods:
            q = read_quota(self.quota_dir(p.claim)) if self.quota_dir(p.claim) else None
            if q is not None and (not p.seen or p.seen[-1][1] != q.generation):
                p.seen.append((t, q.generation))
            for c in self.live(p):
                if not c.gpu:
                    continue
                if self._gone(p):  # deleted, its containers on their way out: they hold what they had
                    continue
                key, cg = (p.name, c.name), self.cgroup(p, c)
                have, want = self.use[key], c.demand_at(t)
                hard = self.hard(p, c)
                keep = min(have, want) if p.mode == "throttle" else min(have, want, hard)
                if keep < have:
                    self.nv.release(GPU, cg, have - keep)
                    have = keep
                if want > have and self.posted(p, c):  # an engine loads before it allocates: by then
                    try:                                  # the kubelet has posted its container's ID
                        self.nv.allocate(GPU, cg, want - have)
                        have = want
                    except OutOfMemory:
                        room = max(0, min(want, hard) - have)
                        if room:
                            self.nv.allocate(GPU, cg, room)
                            have += room
                self.use[key] = have

    def hard(self, p: SimPod, c: Ctr) -> int:
        """The container's hard limit in force (MiB); a cgroup without one is unlimited."""
        if self.mode is EnforcementMode.COOPERATIVE:
            return CAP * 4  # nothing fences
        if self.mode is not EnforcementMode.DRIVER:
            env = self.spec_env(p.claim)
            return int(env[contract.ENV_MPS_PINNED_MEM_LIMIT].split("=")[1].rstrip("M"))
        lim = self.nv.limits.get((GPU, self.cgroup(p, c)))
        return CAP * 4 if lim is None else lim[1] // MIB

    def step(self) -> None:
        """One tick: the kubelet and runtime, the loop, then every process."""
        self._kubelet()
        self.loop.run_once()
        self._processes()
        for c in self.claims:
            d = self.quota_dir(c.name)
            q = read_quota(d) if d else None
            self.lent[c.name].append(q.gpus[0].limit_mib if q is not None and q.gpus else c.grant)
        self.t += 1
