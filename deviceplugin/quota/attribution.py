"""Join telemetry samples to tenants. Pure: samples and tenants in, MiB per (tenant, GPU) out.

Sources name processes differently (NVML: host PID -> pod UID + container ID via cgroups; DCGM:
namespace/pod/container labels), so a sample is matched by the most specific identity it carries:
container ID, then pod + container name, then pod UID or pod name alone (split evenly between that
pod's containers on the GPU, since nothing finer is known). A sample of a container of a claim that is
no tenant but whose containers are known (a DRA claim several pods share) is that claim's, up to its
grant: the loop counts such a claim at its grant already, so its memory is not counted a second time.
What matches nothing is "foreign": memory our scheduler did not hand out (another device plugin's pod, a
host process, a shared claim beyond its grant), which the loop takes off that GPU's capacity so quotas
never promise memory that is not there.

A tenant with no sample on a GPU is *unknown*, not idle: its process may be starting (vLLM profiles
free memory at start and fails if a peer's quota moves under it) or restarting, so the policy holds
its limit instead of cutting it.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterable

from deviceplugin.quota.model import Claim, Tenant, TenantKey
from deviceplugin.quota.telemetry import UsageSample


@dataclass
class Attribution:
    used: dict[tuple[TenantKey, str], int] = field(default_factory=dict)  # (tenant, gpu uuid) -> MiB
    foreign: dict[str, int] = field(default_factory=dict)  # gpu uuid -> MiB held by no tenant
    claimed: dict[str, int] = field(default_factory=dict)  # gpu uuid -> MiB shared claims hold within their grants


def _split(keys: list[TenantKey], gpu: str, mib: int, used: dict[tuple[TenantKey, str], int]) -> None:
    keys = sorted(keys)
    share, rest = divmod(mib, len(keys))
    for i, k in enumerate(keys):
        used[(k, gpu)] = used.get((k, gpu), 0) + share + (1 if i < rest else 0)


def attribute(samples: Iterable[UsageSample], tenants: Iterable[Tenant], claims: Iterable[Claim] = ()) -> Attribution:
    """Sum each sample into the tenant it belongs to on its GPU, else into the ``claims`` whose container
    it is (up to the claim's grant there), else into that GPU's foreign memory."""
    grant: dict[tuple[str, str], int] = {}
    by_claim: dict[tuple[str, str], str] = {}
    for c in claims:
        for gpu, mib in c.gpus:
            grant[(c.name, gpu)] = mib
            by_claim.update({(gpu, cid): c.name for cid in c.container_ids})
    held: dict[tuple[str, str], int] = defaultdict(int)
    by_cid: dict[tuple[str, str], TenantKey] = {}
    by_name: dict[tuple[str, str, str, str], TenantKey] = {}
    by_uid: dict[tuple[str, str], list[TenantKey]] = defaultdict(list)
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
    out = Attribution()
    for s in samples:
        g = s.gpu_uuid
        if s.container_id and (g, s.container_id) in by_cid:
            _split([by_cid[(g, s.container_id)]], g, s.used_mib, out.used)
        elif s.pod and s.container and (g, s.namespace or "", s.pod, s.container) in by_name:
            _split([by_name[(g, s.namespace or "", s.pod, s.container)]], g, s.used_mib, out.used)
        elif s.pod_uid and (g, s.pod_uid) in by_uid:
            _split(by_uid[(g, s.pod_uid)], g, s.used_mib, out.used)
        elif s.pod and (g, s.namespace or "", s.pod) in by_pod:
            _split(by_pod[(g, s.namespace or "", s.pod)], g, s.used_mib, out.used)
        elif s.container_id and (g, s.container_id) in by_claim:
            held[(by_claim[(g, s.container_id)], g)] += s.used_mib
        else:
            out.foreign[g] = out.foreign.get(g, 0) + s.used_mib
    for (name, g), mib in sorted(held.items()):
        within = min(mib, grant[(name, g)])
        out.claimed[g] = out.claimed.get(g, 0) + within
        if mib > within:
            out.foreign[g] = out.foreign.get(g, 0) + mib - within
    return out
