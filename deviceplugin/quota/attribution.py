"""Join telemetry samples to tenants. Pure: samples and tenants in, MiB per (tenant, GPU) out.

Sources name processes differently (NVML: host PID -> pod UID + container ID via cgroups; DCGM:
namespace/pod/container labels), so a sample is matched by the most specific identity it carries:
container ID, then pod + container name, then pod UID or pod name alone (split evenly between that
pod's owners on the GPU, since nothing finer is known). Owners are tenants and the claims that are no
tenant but whose containers or pods are known (a DRA claim several pods share; a prepared claim whose
pod the pod cache does not show yet, or shows deleted, while the kubelet has not unprepared it): the
loop counts such a claim at its grant already, so what its processes hold within the grant is the
claim's, not counted a second time; beyond the grant it is foreign. A claim is matched by container ID
and by the UIDs of the pods it was reserved for (the checkpoint's), not by names: a pod recreated under
the same name is another pod. What matches nothing is "foreign": memory our scheduler did not hand out
(another device plugin's pod, a host process, a claim beyond its grant), which the loop takes off that
GPU's capacity so quotas never promise memory that is not there.

A tenant with no sample on a GPU is *unknown*, not idle: its process may be starting (vLLM profiles
free memory at start and fails if a peer's quota moves under it) or restarting, so the policy holds
its limit instead of cutting it.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from deviceplugin.quota.model import Claim, Tenant, TenantKey
from deviceplugin.quota.telemetry import UsageSample


@dataclass
class Attribution:
    used: dict[tuple[TenantKey, str], int] = field(default_factory=dict)  # (tenant, gpu uuid) -> MiB
    foreign: dict[str, int] = field(default_factory=dict)  # gpu uuid -> MiB held by no tenant
    claimed: dict[str, int] = field(default_factory=dict)  # gpu uuid -> MiB claims (no tenants) hold within grants


@dataclass(frozen=True, order=True)
class _ClaimOwner:
    """A claim that is no tenant, as an owner of samples beside the tenants (by its name)."""

    name: str


_Owner = TenantKey | _ClaimOwner


def _split(owners: Sequence[_Owner], gpu: str, mib: int, used: dict[tuple[TenantKey, str], int],
           held: dict[tuple[str, str], int]) -> None:
    """``mib`` split evenly between ``owners`` (tenants first, each kind by name: deterministic)."""
    owners = sorted(owners, key=lambda o: (isinstance(o, _ClaimOwner), o))
    share, rest = divmod(mib, len(owners))
    for i, o in enumerate(owners):
        part = share + (1 if i < rest else 0)
        if isinstance(o, _ClaimOwner):
            held[(o.name, gpu)] = held.get((o.name, gpu), 0) + part
        else:
            used[(o, gpu)] = used.get((o, gpu), 0) + part


def attribute(samples: Iterable[UsageSample], tenants: Iterable[Tenant], claims: Iterable[Claim] = ()) -> Attribution:
    """Sum each sample into the owner it belongs to on its GPU: a tenant, or one of the ``claims`` whose
    container or pod it is (up to the claim's grant there; beyond it foreign), else that GPU's foreign
    memory."""
    by_cid: dict[tuple[str, str], _Owner] = {}
    by_name: dict[tuple[str, str, str, str], TenantKey] = {}
    by_uid: dict[tuple[str, str], list[_Owner]] = defaultdict(list)
    by_pod: dict[tuple[str, str, str], list[TenantKey]] = defaultdict(list)
    for t in tenants:
        k = t.key
        for gpu, _req in t.gpus:
            for cid in t.container_ids:
                by_cid[(gpu, cid)] = k
            by_name[(gpu, k.namespace, k.pod, k.container)] = k
            if k.pod_uid:
                by_uid[(gpu, k.pod_uid)].append(k)
            by_pod[(gpu, k.namespace, k.pod)].append(k)
    grant: dict[tuple[str, str], int] = {}
    for c in claims:
        owner = _ClaimOwner(c.name)
        for gpu, mib in c.gpus:
            grant[(c.name, gpu)] = mib
            for cid in c.container_ids:
                by_cid.setdefault((gpu, cid), owner)  # a container of a tenant too is the tenant's
            for uid in sorted(c.pod_uids):
                by_uid[(gpu, uid)].append(owner)
    held: dict[tuple[str, str], int] = defaultdict(int)
    out = Attribution()
    for s in samples:
        g = s.gpu_uuid
        if s.container_id and (g, s.container_id) in by_cid:
            _split([by_cid[(g, s.container_id)]], g, s.used_mib, out.used, held)
        elif s.pod and s.container and (g, s.namespace or "", s.pod, s.container) in by_name:
            _split([by_name[(g, s.namespace or "", s.pod, s.container)]], g, s.used_mib, out.used, held)
        elif s.pod_uid and (g, s.pod_uid) in by_uid:
            _split(by_uid[(g, s.pod_uid)], g, s.used_mib, out.used, held)
        elif s.pod and (g, s.namespace or "", s.pod) in by_pod:
            _split(by_pod[(g, s.namespace or "", s.pod)], g, s.used_mib, out.used, held)
        else:
            out.foreign[g] = out.foreign.get(g, 0) + s.used_mib
    for (name, g), mib in sorted(held.items()):
        within = min(mib, grant[(name, g)])
        out.claimed[g] = out.claimed.get(g, 0) + within
        if mib > within:
            out.foreign[g] = out.foreign.get(g, 0) + mib - within
    return out
