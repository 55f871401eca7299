"""The quota loop's tenants on the DRA path: the prepared claims of this node, with no API call per tick.

Each prepared claim reserved by one pod is a tenant: key (namespace, pod, ``claim-<name>``, pod UID),
its GPUs and granted MiB from the preparer's checkpoint (this process's own view: which claim, which
pod reserved it, which devices and MiB). What only the pod says, its vLLM metrics URL, the runtime
IDs of its containers (so NVML's per-process memory is attributed to it) and its quota-class
metadata, comes from this node's watch-fed pod cache (:class:`deviceplugin.pod_cache.NodePodCache`),
as on the kubelet path (``quota.kube.NodeTenantSource``, issue 21). The loop then writes
``<quotaHostDir>/<pod-uid>/claim-<name>/quota.json``, the directory the claim's CDI spec mounts, and
floors, ceilings, rebalancing and enforcement apply unchanged. A claim with devices here that is no
tenant (being prepared, its pod not in the cache yet or departed, or shared) is a pending claim at its
grant, so the loop never lends it (:func:`pending_from_claims`, issue 19), and what the processes of its
pods hold is its memory within that grant, not foreign as well; so is a claim the scheduler allocated here
for a pod bound to this node before the kubelet asks to prepare it (:func:`unprepared_claims`,
:class:`AllocatedClaims`: one API read per such claim, not per tick).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Collection, Iterable, Mapping

from deviceplugin.dra import cdi
from deviceplugin.dra.checkpoint import PREPARED, PreparedClaim
from deviceplugin.dra.claims import ClaimError, our_shares, resolve
from deviceplugin.dra.preparer import ClaimReader, tenant_container
from deviceplugin.dra.slices import DeviceRef
from deviceplugin.quota.kube import container_ids, metrics_url, pod_meta, running_pods_by_uid
from deviceplugin.quota.model import Claim, Tenant, TenantKey
from vramshare import contract, logs, podspec
from vramshare.config import Config

log = logs.get(__name__)
ClaimKey = tuple[str, str]  # (namespace, name) of a ResourceClaim


def tenants_from_claims(claims: Iterable[PreparedClaim], pods: Iterable[Mapping[str, Any]],
                        names: contract.Names | None = None) -> list[Tenant]:
    """Pure: prepared claims joined with this node's pods (by UID) -> tenants. A tenant's containers are
    those that name its claim (a sidecar's processes are not its use, nor is its cgroup fenced at the
    claim's limit). A claim shared by several pods (also one a pod joined after Prepare) is left alone; a claim whose pod is gone from the pods
    (deleted) or done has departed and is no tenant, even while the kubelet has not unprepared it yet. The pod's metadata (labels,
    priorityClassName, quota-class annotation) picks its quota class."""
    names = names or contract.Names(contract.DEFAULT_DOMAIN)
    running = running_pods_by_uid(pods)
    out = []
    for c in sorted(claims, key=lambda c: (c.namespace, c.name)):
        if c.state != PREPARED or len(c.pod_uids) != 1 or not c.gpus:
            continue
        uid = c.pod_uids[0]
        pod = running.get(uid)
        if pod is None or _joined(c, uid, running.values()):
            continue
        pod_name = c.pod_names[0] if c.pod_names else str((pod.get("metadata") or {}).get("name") or "")
        users = _claim_users(pod, c.name)  # its devices are in these: use and fence are theirs
        out.append(Tenant(key=TenantKey(c.namespace, pod_name, tenant_container(c.name), pod_uid=uid),
                          gpus=tuple(sorted(c.gpus.items())), metrics_url=metrics_url(pod),
                          container_ids=users.ids, meta=pod_meta(pod, names), sharers=max(1, users.sharers),
                          init_ids=users.init_ids))
    return out


def _joined(c: PreparedClaim, uid: str, running: Iterable[Mapping[str, Any]]) -> bool:
    """Another running pod of the claim's namespace uses it: a pod that reserved it after Prepare (the
    kubelet prepares a claim once, ``prepareResources`` only adds the next pod's reference), so the
    checkpoint names one pod while several share it. Such a claim is shared, not that pod's tenant: its
    joiner's containers are fenced with the rest at the grant in sum (:func:`pending_from_claims`)."""
    for pod in running:
        meta = pod.get("metadata") or {}
        if meta.get("uid") != uid and meta.get("namespace") == c.namespace and c.name in podspec.claim_names(pod):
            return True
    return False


@dataclass(frozen=True)
class ClaimUsers:
    """A pod's containers that name a claim, read once from its spec and status: their runtime IDs, how
    many of them run at once (the CDI spec's divisor), and which IDs are ordinary init containers (each
    ends and the next container starts in its place at its CDI share: ``fence.split_slots``)."""

    ids: frozenset[str] = frozenset()
    sharers: int = 0
    init_ids: frozenset[str] = frozenset()


def _claim_users(pod: Mapping[str, Any], claim: str) -> ClaimUsers:
    """The pod's containers that name ``claim`` (:class:`ClaimUsers`)."""
    users = podspec.claim_containers(pod, claim)
    if not users:
        return ClaimUsers()
    ids = {n: cid for n, cid in container_ids(pod).items() if n in users}
    once = podspec.run_once_init_containers(pod)
    return ClaimUsers(frozenset(ids.values()), podspec.claim_users(pod, claim),
                      frozenset(cid for n, cid in ids.items() if n in once))


def pending_from_claims(claims: Iterable[PreparedClaim], tenants: Iterable[Tenant],
                        pods: Iterable[Mapping[str, Any]] = (), departed: Collection[str] = ()) -> list[Claim]:
    """Pure: memory this node promised to claims that are not quota tenants (issue 19: lent memory is
    never promised twice), each at what it was granted: a claim being prepared, one whose pod the cache
    does not show yet or shows departed (its containers may run until the kubelet unprepares it), one
    several pods share. The kubelet path counts the same gap from the extender's assignment
    (``quota.kube.pending_from_pods``); here the preparer's own checkpoint says it. The containers of
    the running ``pods`` that name such a claim come with it, so the driver fence holds them at its grant
    in sum (a pod that joined a shared claim after Prepare got the split known then), and so do the UIDs
    of the pods it was prepared for: a process of one of them is the claim's memory even while the cache
    shows no container of it (not listed yet, or deleted while its containers still exit), not foreign
    memory counted beside the grant (``quota.attribution``), and the driver fence finds and holds those
    containers by their pod's cgroup. Its sharers are counted per pod (``Claim.pod_slots``) from Prepare's
    count in the checkpoint for the pods it was prepared for, listed or not (one not listed may start its
    containers at their CDI share at any time; one listed done has departed), and from the spec for a
    running pod that joined it; ``sharers`` is then Prepare's divisor, what each container starts with.
    ``departed``: UIDs of pods the cache listed once and lists no more (deleted: they start nothing
    again). A checkpoint from before the count counts the listed pods only, as before."""
    owned = {(t.key.namespace, t.key.container) for t in tenants}
    pods = list(pods)
    listed = {str((p.get("metadata") or {}).get("uid") or "") for p in pods}
    running = running_pods_by_uid(pods)
    out = []
    for c in sorted(claims, key=lambda c: (c.namespace, c.name)):
        if not c.gpus or (c.namespace, tenant_container(c.name)) in owned:
            continue
        ids: set[str] = set()
        once: set[str] = set()
        slots: dict[str, int] = {}
        for uid, pod in sorted(running.items()):
            if (pod.get("metadata") or {}).get("namespace") == c.namespace:
                users = _claim_users(pod, c.name)
                ids |= users.ids
                once |= users.init_ids
                if users.sharers:
                    slots[uid] = users.sharers
        sharers = sum(slots.values())
        counted = len(c.pod_users) == len(c.pod_uids) > 0  # an older checkpoint did not record them
        if counted:
            # a pod it was prepared for that the cache does not list yet may start its containers at their
            # CDI share at any time; one listed done, or listed once and gone (deleted), has departed
            for uid, n in zip(c.pod_uids, c.pod_users):
                if uid and uid not in listed and uid not in departed and n:
                    slots[uid] = n
            sharers = sum(c.pod_users)  # the CDI spec's divisor: what each container starts with
        out.append(Claim(f"{c.namespace}/{c.name}", tuple(sorted(c.gpus.items())), c.quota_dir,
                         container_ids=frozenset(ids), sharers=max(1, sharers), init_ids=frozenset(once),
                         pod_uids=frozenset(u for u in c.pod_uids if u),
                         pod_slots=tuple(sorted(slots.items())) if counted else ()))
    return out


def departed_claims(claims: Iterable[PreparedClaim], gone: Collection[str],
                    pods: Iterable[Mapping[str, Any]] = ()) -> list[PreparedClaim]:
    """Pure: the prepared claims every pod of which was deleted from the API (``gone``: pod UIDs the pod
    watch saw leave) and that no running pod of ``pods`` uses (one that joined it after Prepare keeps it
    allocated), sorted. The kubelet unprepares a pod's claims after its containers stopped and before its
    status or deletion reaches the API server (``SyncTerminatingPod``), so a gracefully deleted pod's claim
    is unprepared by the time the pod is gone: only a forced deletion leaves one prepared. The claim
    controller then deallocates it at once while its containers may still run
    (kubernetes/kubernetes#141471): the node still holds its grant, the allocator no longer books it."""
    gone = set(gone)
    used = {(str((p.get("metadata") or {}).get("namespace") or ""), name)
            for p in running_pods_by_uid(pods).values() for name in podspec.claim_names(p)}
    return sorted((c for c in claims if c.state == PREPARED and c.pod_uids and all(u in gone for u in c.pod_uids)
                   and (c.namespace, c.name) not in used), key=lambda c: (c.namespace, c.name))


def unprepared_claims(pods: Iterable[Mapping[str, Any]], claims: Iterable[PreparedClaim]) -> list[ClaimKey]:
    """Pure: the claims the pods bound to this node use that the preparer has no record of, sorted. The
    scheduler allocates a pod's claims before it binds the pod, and the kubelet prepares them only when
    it starts the pod, so in between such a claim holds memory here that no tenant and no checkpoint
    shows (issue 19: every pod bound here counts from the moment it exists; the kubelet path counts the
    extender's assignment, ``quota.kube.pending_from_pods``). A pod that is done or being deleted is
    left out: the kubelet never prepares its claims."""
    known = {(c.namespace, c.name) for c in claims}
    out: set[ClaimKey] = set()
    for pod in running_pods_by_uid(pods).values():
        meta = pod.get("metadata") or {}
        if meta.get("deletionTimestamp"):
            continue
        ns = str(meta.get("namespace") or "")
        out.update((ns, n) for n in podspec.claim_names(pod) if (ns, n) not in known)
    return sorted(out)


class AllocatedClaims:
    """What each unprepared claim of :func:`unprepared_claims` was allocated here, read once from the API
    server (the preparer's own reader: a GET per claim, kept while a pod still uses it unprepared) and
    resolved to GPUs as Prepare will (``claims.our_shares`` + ``resolve``): a shared GPU at its consumed
    memory, an exclusive one whole; a dynamic-MIG partition not made yet holds no shared memory. A claim
    that is not ours, or one Prepare would refuse, counts for nothing (Prepare writes no quota for it);
    a read that fails is retried at the next tick, and until then the claim is fitted at Prepare as
    before."""

    #: reads one tick may make: a burst of pods bound at once is read over a few ticks, and a tick never
    #: stalls for long behind an API server that does not answer (the first failed read ends the round)
    MAX_READS_PER_TICK = 16

    def __init__(self, read_claim: ClaimReader, node: str, config: Callable[[], Config],
                 devices: Callable[[], Mapping[str, DeviceRef]]) -> None:
        self._read, self._node, self._config, self._devices = read_claim, node, config, devices
        self._known: dict[ClaimKey, tuple[tuple[str, int], ...]] = {}
        self.reads = 0  # API reads made, for tests and logs: one per claim, not per tick

    def pending(self, keys: Iterable[ClaimKey]) -> list[Claim]:
        keys = list(keys)
        budget = self.MAX_READS_PER_TICK
        for key in keys:
            if key not in self._known and budget > 0:
                budget -= 1
                try:
                    gpus = self._look(key)
                except LookupError as exc:
                    log.warning("allocated claim not read, not counted before Prepare", claim="/".join(key),
                                error=str(exc))
                    budget = 0
                    continue
                if gpus is not None:
                    self._known[key] = gpus
        wanted = set(keys)
        self._known = {k: v for k, v in self._known.items() if k in wanted}
        return [Claim(f"{ns}/{name}", self._known[(ns, name)]) for ns, name in keys
                if self._known.get((ns, name))]

    def _look(self, key: ClaimKey) -> tuple[tuple[str, int], ...] | None:
        """The claim's GPUs and MiB here; ``()`` for a claim that takes nothing here; None to ask again;
        raises LookupError when the API server did not answer."""
        ns, name = key
        where = f"claim {ns}/{name}"
        self.reads += 1
        claim = self._read(ns, name)
        if not (claim.get("status") or {}).get("allocation"):
            return None  # not allocated yet (the pod is bound only after): ask again
        config, known = self._config(), self._devices()
        try:
            shares = resolve(our_shares(claim, config.names.dra_driver, self._node), known, where,
                             config.memory_unit_mib)
        except ClaimError as exc:
            log.warning("allocated claim Prepare would refuse, not counted", claim=f"{ns}/{name}", error=str(exc))
            return ()
        gpus = tuple((g.uuid, g.mib) for g in cdi.gpu_shares([s for s in shares if known[s.share.device].partition is None]))
        if gpus:
            log.info("claim allocated here counted before Prepare", claim=f"{ns}/{name}",
                     gpus=",".join(f"{u}:{m}MiB" for u, m in gpus))
        return gpus


class PodCacheNotSynced(RuntimeError):
    """The pod cache has not listed yet: every claim would look departed, so the tick is skipped."""


class ClaimTenantSource:
    """:class:`deviceplugin.quota.loop.TenantSource` over the preparer's checkpoint (``prepared``) and the
    node's pod cache (``pods``, ``synced``): reads no API server, but for each claim allocated here
    before Prepare, once (``allocated``)."""

    def __init__(self, prepared: Callable[[], Mapping[str, PreparedClaim]],
                 pods: Callable[[], Iterable[Mapping[str, Any]]], synced: Callable[[], bool],
                 names: contract.Names | None = None, allocated: AllocatedClaims | None = None) -> None:
        self._prepared, self._pods, self._synced, self._names = prepared, pods, synced, names
        self._allocated = allocated  # claims allocated here before Prepare; None: not counted
        self._pending: list[Claim] = []
        # UIDs of the checkpoint's pods the cache has listed: one it lists no more was deleted. After a
        # restart nothing is known: a pod not listed counts as not listed yet (cautious, never unsound)
        self._listed_once: set[str] = set()

    def list_tenants(self) -> list[Tenant]:
        if not self._synced():  # the loop logs this and keeps the last quotas
            raise PodCacheNotSynced("this node's pod cache has not listed yet")
        claims = list(self._prepared().values())
        pods = list(self._pods())
        tenants = tenants_from_claims(claims, pods, self._names)
        listed = {str((p.get("metadata") or {}).get("uid") or "") for p in pods}
        ours = {u for c in claims for u in c.pod_uids}
        self._listed_once = (self._listed_once | listed) & ours
        self._pending = pending_from_claims(claims, tenants, pods, self._listed_once - listed)
        if self._allocated is not None:
            self._pending += self._allocated.pending(unprepared_claims(pods, claims))
        return tenants

    def list_pending(self) -> list[Claim]:
        """The claims of the latest :meth:`list_tenants` that are no tenant (one look serves both)."""
        return list(self._pending)
