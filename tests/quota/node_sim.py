"""A node for the quota loop's soundness tests (issue 19): the real QuotaLoop, policy, writer, kube
parsers and quota-file layout; doubles only at the edges (pod listing, per-container use, each engine's
/metrics page).

Each container goes through what it does on a real node: the extender binds its pod (``assumed``,
with its assignment; the node's pod cache sees it ``list_lag`` ticks later), the device plugin's
Allocate writes its first quota file under ``_alloc/<key>`` (its request), the reconciler links
``<uid>/<container>`` to it and holds it in its in-process view (the loop's tenants, issue 21), and its engine starts using memory
``startup`` ticks after the bind. Its engine follows its quota file ``ack_lag`` ticks after each write
(then reports ``vramshare_vllm_quota_generation_applied``); a releasing engine (``unmap``) gives back
what is above its cap when it applies it, a throttling one only as its demand drops.
"""
from __future__ import annotations

import os
import dataclasses
from dataclasses import dataclass, field

from deviceplugin.allocation import GpuShare
from deviceplugin.assignment import AssignedGpu
from deviceplugin.dra.checkpoint import PREPARED, PreparedClaim
from deviceplugin.dra.preparer import tenant_container
from deviceplugin.dra.slices import DeviceRef
from deviceplugin.dra.tenants import AllocatedClaims, ClaimTenantSource
from deviceplugin.kubelet.reconcile import Holding, Owner
from deviceplugin.quota.kube import NodeTenantSource
from deviceplugin.quota.loop import LoopSettings, QuotaLoop
from deviceplugin.quota.model import PolicyParams
from deviceplugin.quota.telemetry import UsageSample, VllmSample
from deviceplugin.quota.writer import container_dir, read_quota
from deviceplugin.quota_files import QuotaFiles
from vramshare import contract
from vramshare.config import Config, QuotaConfig
from vramshare.inventory import Gpu

NAMES = contract.Names()
GPU = "GPU-node"
MIB = 1 << 20


@dataclass
class Engine:
    name: str
    request: int
    mode: str  # unmap | throttle
    bind: int  # tick the extender binds it
    demand: list[int]  # MiB it would use if unfenced, per tick from its start on
    list_lag: int = 0  # ticks before the loop's listing shows the bind
    alloc_after: int = 1  # ticks from the bind to Allocate
    link_after: int = 1  # ticks from Allocate to "allocated" (+ link)
    startup: int = 6  # ticks from the bind to its first use
    ack_lag: int = 1  # ticks from a quota write to the engine applying it
    use: int = 0
    applied: tuple[int, int] | None = None  # (generation, limit) it follows
    seen: list[tuple[int, int, int]] = field(default_factory=list)  # (tick seen, generation, limit)

    @property
    def uid(self) -> str:
        return f"uid-{self.name}"

    @property
    def alloc_key(self) -> str:
        return f"alloc-{self.name}"

    def limit(self) -> int:
        return self.applied[1] if self.applied else self.request

    def demand_at(self, t: int) -> int:
        i = t - self.bind - self.startup
        return 0 if i < 0 else self.demand[min(i, len(self.demand) - 1)]


class Node:
    """The node's edges as one object: tenant source, usage reader and signal reader of the loop."""

    name = "node-sim"

    def __init__(self, root: str, capacity: int, engines: list[Engine], params: PolicyParams | None = None) -> None:
        self.root, self.capacity, self.engines, self.t = root, capacity, engines, 0
        self.files = QuotaFiles(root, QuotaConfig())
        self.source = NodeTenantSource(self._holdings, self._listed, NAMES)
        self.params = params or PolicyParams()
        self.restart()

    def restart(self) -> None:
        """A new quota loop on the same files (the DaemonSet restarted): it remembers nothing."""
        self.loop = QuotaLoop(self, lambda: {GPU: self.capacity}, [self], self.params, self.root, signals=self,
                              settings=LoopSettings(params=self.params))

    # -- the world ---------------------------------------------------------------------------
    def _state(self, e: Engine, t: int) -> str | None:
        if t < e.bind:
            return None
        if t >= e.bind + e.alloc_after + e.link_after:
            return contract.STATE_ALLOCATED
        return contract.STATE_ASSUMED

    def _pod(self, e: Engine, state: str) -> dict:
        ann = {NAMES.allocation_state: state, NAMES.assignment: f'{{"vllm":[{{"uuid":"{GPU}","mib":{e.request}}}]}}',
               "prometheus.io/port": "8000"}
        mine = {"manager": contract.FIELD_MANAGER_EXTENDER, "operation": "Update", "fieldsType": "FieldsV1",
                "fieldsV1": {"f:metadata": {"f:annotations": {f"f:{NAMES.assignment}": {}}}}}
        return {"metadata": {"name": e.name, "namespace": "llm", "uid": e.uid, "annotations": ann,
                             "managedFields": [mine]},
                "status": {"phase": "Running", "podIP": e.name}}

    def _listed(self) -> list[dict]:
        out = []
        for e in self.engines:
            st = self._state(e, self.t - e.list_lag)
            if st is not None:
                out.append(self._pod(e, st))
        return out

    def _holdings(self) -> list[Holding]:
        """The reconciler's view (in-process, no lag): containers linked to their allocation and whose
        pod its cache has (it cannot reconcile a pod the cache has not seen)."""
        return [Holding(Owner(e.uid, "llm", e.name, "vllm"), (AssignedGpu(GPU, e.request),)) for e in self.engines
                if self.t >= e.bind + e.alloc_after + e.link_after and self.t - e.list_lag >= e.bind]

    def list_tenants(self):
        return self.source.list_tenants()

    def list_pending(self):
        pending = getattr(self.source, "list_pending", None)  # (a source without pending claims: none)
        return pending() if pending is not None else []

    def read_usage(self):
        return [UsageSample(GPU, e.use, pod_uid=e.uid) for e in self.engines
                if self.t >= e.bind + e.alloc_after]  # its container exists from Allocate on

    def read_signals(self, url: str) -> VllmSample:
        e = next(e for e in self.engines if f"//{e.name}:" in url)
        fenced = e.demand_at(self.t) > e.use  # its engine queues what the cap does not let it hold
        sig = dict(kv_usage=None, waiting=3 if fenced else 0, running=1, release_mode=e.mode, kv_held_bytes=float(e.use * MIB),
                   generation_applied=e.applied[0] if e.applied else None)
        known = {f.name for f in dataclasses.fields(VllmSample)}  # (before issue 19 it had fewer fields)
        return VllmSample(**{k: v for k, v in sig.items() if k in known})

    def _events(self, t: int) -> None:
        """The device plugin's: Allocate writes the first quota file, the reconciler links it."""
        for e in self.engines:
            if t == e.bind + e.alloc_after:
                self.files.write_initial(self._alloc_dir(e), [GpuShare(GPU, e.request)])
            if t == e.bind + e.alloc_after + e.link_after:
                self.files.link(e.uid, "vllm", e.alloc_key)

    def _alloc_dir(self, e: Engine) -> str:
        return os.path.join(self.root, "_alloc", e.alloc_key)

    def step(self) -> None:
        """One tick: the cluster's events, the loop's tick, then every engine applies and uses."""
        t = self.t
        self._events(t)
        self.loop.run_once()
        for e in self.engines:
            if t < e.bind + e.alloc_after:
                continue
            q = read_quota(self._alloc_dir(e))
            if q is not None and (not e.seen or e.seen[-1][1] != q.generation):
                e.seen.append((t, q.generation, q.gpus[0].limit_mib))
            ready = [s for s in e.seen if s[0] <= t - e.ack_lag]
            if ready:
                e.applied = ready[-1][1:]
            d, cap = e.demand_at(t), e.limit()
            if e.mode == "throttle":  # the cap stops growth; memory above it goes only as demand drops
                e.use = max(min(d, cap), min(e.use, d))
            else:  # releasing: what is above the applied cap is given back
                e.use = min(d, cap)
        self.t += 1

    # -- what the tests check ------------------------------------------------------------------
    def committed(self) -> int:
        """Sum over every container with a quota file of max(limit on disk, use)."""
        total = 0
        for e in self.engines:
            if self.t - 1 >= e.bind + e.alloc_after:
                q = read_quota(self._alloc_dir(e))
                total += max(q.gpus[0].limit_mib if q else 0, e.use)
        return total


class DraNode(Node):
    """The same node on the DRA path: the scheduler allocates the engine's claim at ``bind`` (readable
    from the API from then on), the kubelet prepares it ``alloc_after`` ticks later (the preparer writes
    its quota file, the full grant, in ``<uid>/claim-<name>`` and records it prepared), and the pod, which
    names its claim, reaches the plugin's pod cache ``list_lag`` ticks after the bind. The tenants are
    :class:`ClaimTenantSource`'s: prepared claims whose pod the cache shows; the others, and the claims
    of listed pods allocated here but not prepared yet (``allocated``, the daemon's
    :class:`AllocatedClaims`), are its pending claims. ``link_after`` plays no part."""

    def __init__(self, root: str, capacity: int, engines: list[Engine], params: PolicyParams | None = None,
                 allocated: bool = True) -> None:
        self.prepared: dict = {}
        super().__init__(root, capacity, engines, params)
        config = Config()
        self.device = DeviceRef("gpu-0", Gpu(0, GPU, "H100", capacity, units=capacity // config.memory_unit_mib))
        self.claims = AllocatedClaims(self._read_claim, "node", lambda: config, lambda: {"gpu-0": self.device})
        self.source = ClaimTenantSource(lambda: self.prepared, self._listed, lambda: True, NAMES,
                                        self.claims if allocated else None)

    def _pod(self, e: Engine, state: str) -> dict:
        return {"metadata": {"name": e.name, "namespace": "llm", "uid": e.uid,
                             "annotations": {"prometheus.io/port": "8000"}},
                "spec": {"resourceClaims": [{"name": "gpu", "resourceClaimName": f"{e.name}-gpu"}]},
                "status": {"phase": "Running", "podIP": e.name}}

    def _read_claim(self, namespace: str, name: str) -> dict:
        """The API server's ResourceClaim (resource.k8s.io/v1), allocated by the scheduler at the bind."""
        e = next((e for e in self.engines if f"{e.name}-gpu" == name and self.t >= e.bind), None)
        if e is None:
            raise LookupError("404 Not Found")
        result = {"request": "gpu", "driver": NAMES.dra_driver, "pool": "node", "device": "gpu-0",
                  "shareID": f"share-{e.name}", "consumedCapacity": {"memory": f"{e.request}Mi"}}
        return {"metadata": {"name": name, "namespace": namespace, "uid": f"cuid-{e.name}"},
                "status": {"allocation": {"devices": {"results": [result]}}}}

    def _alloc_dir(self, e: Engine) -> str:
        return container_dir(self.root, e.uid, tenant_container(f"{e.name}-gpu"))

    def _events(self, t: int) -> None:
        for e in self.engines:
            if t == e.bind + e.alloc_after:  # NodePrepareResources
                self.files.write_initial(self._alloc_dir(e), [GpuShare(GPU, e.request)])
                self.prepared[f"cuid-{e.name}"] = PreparedClaim(
                    uid=f"cuid-{e.name}", namespace="llm", name=f"{e.name}-gpu", state=PREPARED, cdi_spec="/cdi",
                    quota_dir=self._alloc_dir(e), pod_uids=(e.uid,), pod_names=(e.name,), gpus={GPU: e.request})
