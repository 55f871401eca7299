"""The driver-mode fence as the quota loop sees it: per-container use in, hard limits out.

In ``driver`` mode (see ``deviceplugin.enforcement``) each tenant's cgroup is found from the runtime
ID of its container; :meth:`DriverFence.read_usage` reads ``currentUsed`` per cgroup and GPU (no host
PID namespace needed), plus what the whole GPU holds beyond them as foreign memory, and
:meth:`DriverFence.apply` moves the cgroup's limits after the loop decides:
soft = the part of the limit within the container's request (its guaranteed share), hard = the limit.
A tenant of several containers (a DRA claim that two containers of its pod name: the claim's CDI spec
is injected into each) has one limit and one cgroup per container: the limit is split among them
(:func:`split_limit`), each keeping what it holds, so the cgroups hold at most the limit together, never
the limit each; a container not started yet (``Tenant.sharers`` counts it; also one whose cgroup is not
found yet) counts as using its CDI spec's share, which the toolkit gives it at its start, and the others
are fenced at what is left.
The containers of a claim that is no tenant (a DRA claim several pods share, or one whose pod the pod
cache does not list yet or any more: counted at its grant, never lent) are held at that grant in sum
(:meth:`DriverFence.hold`): those the pod cache shows by container ID, the others by the cgroup of a pod
the claim was prepared for (:meth:`CgroupFinder.pod_cgroups`), whose use is read with the pod's UID so
attribution books it to the claim, as NVML's processes are on the other paths, and which keep no more
than the hard limit they had (a deleted pod's exiting containers are not raised to the grant). A tenant
none of whose cgroups is found yet (starting, restarting) counts at its CDI shares, its grant: that is
what it starts with.
Every write (:meth:`DriverFence.apply`, :meth:`DriverFence.hold`) goes through one place,
:meth:`DriverFence._set`, which fits it to the GPU's capacity less the hard limits in force of every other
cgroup there (:func:`fit_to_capacity`, over the fence's ledger): the sum of hard limits on a GPU is enforced,
not left to follow from the loop's write order and the engines' acknowledgements.
"""
from __future__ import annotations

from collections import Counter
from typing import Callable, Mapping, Sequence

from deviceplugin.nvml_limits import CgroupFinder, CgroupLimits, LimitError, NvmlMemoryLimits
from deviceplugin.quota.model import Claim, Decision, Tenant, TenantKey
from deviceplugin.quota.telemetry import TelemetryError, UsageSample, parse_cgroup
from vramshare import logs
from vramshare.inventory import EnforcementMode

log = logs.get("vramshare.quota.fence")


def split_limit(limit: int, uses: Sequence[int], pressed: Sequence[bool] | None = None) -> list[int]:
    """Pure: one limit shared by cgroups holding ``uses`` -> one limit each, adding up to at most ``limit``.

    Within the limit each keeps its use and the rest is split evenly (the first ones take the remainder),
    so nothing it holds is refused and nothing of the limit is lost; when some are ``pressed`` (they
    reached the hard limit they had: they want more) the rest goes to those only, else the rest a quiet
    sibling does not use fences a busy one while the claim as a whole looks below its limit. Beyond it
    (a shrink not applied yet), each gets its share of the limit in proportion to its use, so none may
    grow until the sum is back in."""
    total = sum(uses)
    if total > limit:
        return [limit * u // total for u in uses]
    rest = limit - total
    takers = [i for i, p in enumerate(pressed or ()) if p] or list(range(len(uses)))
    more = {i: rest // len(takers) + (1 if k < rest % len(takers) else 0) for k, i in enumerate(takers)}
    return [u + more.get(i, 0) for i, u in enumerate(uses)]


def split_slots(limit: int, uses: Sequence[int], pressed: Sequence[bool], once: Sequence[bool], share: int,
                unstarted: int) -> list[int]:
    """Pure: a claim's limit over its running cgroups, in the kubelet's start order
    (``kuberuntime_container.go`` ``computeInitContainerActions``: init containers one by one, each ordinary
    one (``once``) running alone beside the sidecars started before it and ending before the next one
    starts; sidecars stay; then the app containers). Each slot still to be filled starts at its CDI
    ``share`` on top of what the others hold, and the driver takes nothing back, so:

    * ``unstarted`` slots (not started, restarting, not seen yet) keep a share each out of the limit;
    * the rest is split (:func:`split_limit`); but the containers that stay (sidecars, apps) may hold
      together no more than the rest less one share per running ordinary init container, whose place the
      next container takes at its share when it ends (else a sidecar grown into the init container's part
      leaves no room for the app that follows); what they do not hold goes to the init containers.
    """
    room = limit - min(limit, share * unstarted)
    out = split_limit(room, uses, pressed)
    stay = [i for i, o in enumerate(once) if not o]
    ends = [i for i, o in enumerate(once) if o]
    cap = room - min(room, share * len(ends))
    if not ends or sum(out[i] for i in stay) <= cap:
        return out
    kept = split_limit(cap, [uses[i] for i in stay], [pressed[i] for i in stay])
    held = sum(max(k, uses[i]) for k, i in zip(kept, stay))  # cut below its use, one holds it all the same
    left = split_limit(room - min(room, held), [uses[i] for i in ends], [pressed[i] for i in ends])
    for i, v in zip(stay + ends, kept + left):
        out[i] = v
    return out


def restart_split(hards: Sequence[int], cuts: Sequence[int], uses: Sequence[int | None],
                  fresh: Sequence[bool], had: Sequence[int | None]) -> list[int]:
    """Pure: the restart rule, per container, while its tenant's shrink waits for the engine's
    acknowledgement (issue 19): ``hards`` split the bound that waits, ``cuts`` the decision, ``had`` is the
    hard limit each had at the last read (None: unknown or unlimited). A container started since the
    tenant's limits were last set (``fresh``) gets its cut at once while it uses no more (``uses``: None
    unread): the acknowledgement on record is an older instance's, and the new one holds nothing a lower
    hard limit refuses (no engine to protect). The others keep their split of the bound, but while a fresh
    one runs beside them no more than they had: the bound may hold a raise made for the fresh one's CDI
    share (counted at it before the loop saw it), which the borrowers' cuts, not acknowledged yet either,
    pay for; an old sibling grown into it over-commits the GPU. A tenant each of whose containers gets its
    cut so is restarted as a whole (:meth:`DriverFence.restarted`): the loop then sets and counts its hard
    limit at the decision."""
    held = any(fresh)
    return [min(h, c) if f and u is not None and u <= c else min(h, b) if held and b is not None else h
            for h, c, u, f, b in zip(hards, cuts, uses, fresh, had)]


def fit_to_capacity(room: int, wants: Sequence[int], in_force: Sequence[int | None],
                    uses: Sequence[int | None]) -> list[int]:
    """Pure: the hard limits ``wants`` of one write, lowered so they add up to at most ``room`` (the GPU's
    capacity less the hard limits in force of every other cgroup on it), so the sum of hard limits the fence
    writes on a GPU never passes its capacity, whatever order the loop writes in (a raise written while a
    borrower's unacknowledged cut still holds its old limit waits until the borrower lets go).

    Raises give back first: each is lowered toward the limit in force (``in_force``; None: unknown or
    unlimited) before anything is cut below it. No limit is lowered below its cgroup's use (``uses``; None:
    unread, then not below the limit in force, nor below the wanted one when that is unknown too): the
    driver takes nothing back, so such a cut frees nothing. When even that does not fit, the lowest allowed
    is returned (the caller sees the sum still over ``room``)."""
    floors = [w if u is None and h is None else min(w, h if u is None else u)
              for w, h, u in zip(wants, in_force, uses)]
    kept = [w if h is None else max(min(w, h), f) for w, h, f in zip(wants, in_force, floors)]
    out = list(wants)
    for lowest in (kept, floors):  # first the raises, then the cuts
        over = sum(out) - room
        if over <= 0:
            break
        out = [v - t for v, t in zip(out, _take(over, [v - lo for v, lo in zip(out, lowest)]))]
    return out


def _take(amount: int, rooms: Sequence[int]) -> list[int]:
    """Pure: ``amount`` taken from ``rooms`` in proportion (all of them when it is more), in whole MiB."""
    total = sum(rooms)
    if amount >= total:
        return list(rooms)
    takes = [amount * r // total for r in rooms]
    for i, r in enumerate(rooms):  # the remainder, one each to those with room left
        if sum(takes) >= amount:
            break
        takes[i] += 1 if takes[i] < r else 0
    return takes


def share_of(grant_mib: int, users: int) -> int:
    """What the CDI spec gives each of a claim's ``users`` containers (``enforcement.container_fence``:
    the grant // users, the toolkit's hook sets it at the container's start, before the loop sees it)."""
    return grant_mib // max(1, users)


class DriverFence:
    """The loop's use reader (first, before any :class:`telemetry.UsageReader`) and limit mover in driver
    mode, over NVML memory limits; both are given the tenants they act on."""

    name = "driver-limits"
    mode = EnforcementMode.DRIVER

    def __init__(self, limits: NvmlMemoryLimits, finder: CgroupFinder,
                 capacities: Callable[[], Mapping[str, int]] | None = None) -> None:
        """``capacities``: the loop's ``{gpu uuid: MiB}``; no write takes a GPU's hard limits in sum past it
        (:func:`fit_to_capacity`; None: unguarded, a unit test's bare fence)."""
        self._limits, self._finder, self._capacities = limits, finder, capacities
        # the ledger, (gpu, cgroup) -> the hard limit in force: read with the use (a cgroup gone by the next
        # read drops out), then what this fence wrote or held; what every write is fitted against
        self._force: dict[tuple[str, str], int] = {}
        self._short: set[TenantKey] = set()  # tenants whose last write was lowered to fit: written again
        self.clamps: Counter[tuple[str, str]] = Counter()  # (gpu, "fitted" | "over_capacity") -> writes lowered
        # (gpu, container id) -> its use at the last read: how a tenant's limit is split among its cgroups
        self._used: dict[tuple[str, str], int] = {}
        self._pressed: dict[tuple[str, str], bool] = {}  # (gpu, container id) -> at its hard limit at the last read
        self._had: dict[tuple[str, str], int | None] = {}  # (gpu, container id) -> its hard limit at the last read
        self._over: dict[TenantKey, tuple[str, ...]] = {}  # the cgroups each tenant's limits were last set over
        self._hard: dict[tuple[TenantKey, str], int | None] = {}  # (tenant, gpu) -> hard limits in sum, last read
        # (claim, gpu) -> (pod uid, cgroup, use, hard limit) of its pods' containers the pod cache does not show,
        # last read
        self._pod_found: dict[tuple[str, str], list[tuple[str, str, int, int]]] = {}
        # tenant -> its cgroups that started while a shrink waited for its engine's acknowledgement: held at
        # their split of the decision until nothing waits (the engine's acknowledgement is the old instance's)
        self._fresh: dict[TenantKey, frozenset[str]] = {}
        self.whole_gpus: frozenset[str] = frozenset()  # GPUs whose whole use the last read saw (foreign known)

    def _cgroups(self, container_ids: frozenset[str]) -> list[tuple[str, str]]:
        """(container id, cgroup) of those found: a container not started yet has none."""
        return [(cid, cg) for cid in sorted(container_ids) if (cg := self._finder.find(cid))]

    def _split(self, gpu: str, cgroups: Sequence[tuple[str, str]], limit: int, uses: Sequence[int],
               once: frozenset[str] = frozenset(), share: int = 0, unstarted: int = 0) -> list[int]:
        """``limit`` over ``cgroups`` holding ``uses``, by :func:`split_slots` (the rest to those at their hard
        limit at the last read; a share kept for each slot still to be filled, ``unstarted`` or after one of
        the ordinary init containers ``once``)."""
        pressed = [self._pressed.get((gpu, cid), False) for cid, _cg in cgroups]
        ends = [cid in once for cid, _cg in cgroups]
        return split_slots(limit, uses, pressed, ends, share, unstarted)

    def _set(self, gpu: str, cgroups: Sequence[tuple[str, str]], softs: Sequence[int], hards: Sequence[int],
             uses: Sequence[int | None], errors: list[str], who: dict[str, str]) -> bool:
        """Each cgroup's soft and hard limit, the one place limits are written: the hard limits fitted to the
        GPU's capacity less the others' in force (:func:`fit_to_capacity`, ``uses`` each cgroup's use, None
        unread), the ledger updated; failures go to ``errors``. Returns whether they were lowered to fit
        (the loop sees the lower limit in force and the rest comes at a later write, once others let go).
        ``who``: the tenant or claim, for the log."""
        fitted = list(hards)
        cap = (self._capacities() if self._capacities else {}).get(gpu)
        if cap is not None:
            mine = {cg for _cid, cg in cgroups}
            room = cap - sum(h for (g, cg), h in self._force.items() if g == gpu and cg not in mine)
            fitted = fit_to_capacity(room, hards, [self._force.get((gpu, cg)) for _cid, cg in cgroups], uses)
            if fitted != list(hards):
                over = sum(fitted) > room
                self.clamps[(gpu, "over_capacity" if over else "fitted")] += 1
                (log.error if over else log.info)(
                    "hard limits over the GPU's capacity even at their cgroups' use" if over else
                    "hard limits lowered to fit the GPU's capacity, the rest once others release",
                    gpu=gpu, capacity_mib=cap, room_mib=room, wanted_mib=list(hards), hard_mib=fitted, **who)
        for (_cid, cgroup), s_, h_ in zip(cgroups, softs, fitted):
            try:
                self._limits.set(gpu, cgroup, s_, h_)
            except LimitError as exc:
                errors.append(str(exc))
                continue
            self._force[(gpu, cgroup)] = h_
        return fitted != list(hards)

    def _fresh_of(self, key: TenantKey, cgroups: Sequence[tuple[str, str]]) -> frozenset[str]:
        """The tenant's cgroups started since its limits were last set (none before they ever were: after a
        loop restart no container is known new), and those that started while its shrink still waits."""
        before = self._over.get(key)
        return frozenset(cg for _cid, cg in cgroups
                         if cg in self._fresh.get(key, ()) or (before is not None and cg not in before))

    def _tenant_split(self, tenant: Tenant, cgroups: Sequence[tuple[str, str]], gpu: str, limit: int,
                      request: int) -> list[int]:
        """``limit`` over the tenant's ``cgroups`` (:meth:`_split`; unread use counts as nothing): each one
        not started yet, or to follow an ordinary init container, will start at its CDI spec's share (of
        ``request``), so that much is kept for it."""
        uses = [self._used.get((gpu, cid), 0) for cid, _ in cgroups]
        return self._split(gpu, cgroups, limit, uses, tenant.init_ids, share_of(request, tenant.sharers),
                           max(0, tenant.sharers - len(cgroups)))

    def _hards(self, tenant: Tenant, cgroups: Sequence[tuple[str, str]], gpu: str, limit: int, top: int,
               request: int, fresh: frozenset[str]) -> tuple[list[int], list[int]]:
        """(each cgroup's hard limit, its split of the decision ``limit``) while the hard limit ``top``
        waits for the engine: its split of ``top``, or of ``limit`` by the restart rule
        (:func:`restart_split`; unread use is no fresh cgroup's proof)."""
        cuts = self._tenant_split(tenant, cgroups, gpu, limit, request)
        if top <= limit:
            return cuts, cuts
        hards = self._tenant_split(tenant, cgroups, gpu, top, request)
        read = [self._used.get((gpu, cid)) for cid, _ in cgroups]
        had = [self._had.get((gpu, cid)) for cid, _ in cgroups]
        return restart_split(hards, cuts, read, [cg in fresh for _cid, cg in cgroups], had), cuts

    def moved(self, tenant: Tenant) -> bool:
        """Whether the tenant's split is stale: its cgroups are not those its limits were last set over (a
        new one: a restart, the app after an init container, a sibling starting, holds its CDI spec's share,
        not its split), or one is at its hard limit while a sibling has room (the rest goes to the busy), or
        its last write was lowered to fit the GPU's capacity (:meth:`_set`)."""
        found = self._cgroups(tenant.container_ids)
        if tuple(cg for _cid, cg in found) != self._over.get(tenant.key) or tenant.key in self._short:
            return True  # its last write was lowered to fit the GPU: the rest may fit now
        pressed = {self._pressed.get((gpu, cid), False) for gpu, _ in tenant.gpus for cid, _cg in found}
        return len(pressed) > 1

    def restarted(self, tenant: Tenant, gpu: str, limit: int, top: int) -> bool:
        """Whether the tenant restarted as a whole: while its hard limit ``top`` waits for the engine, every
        cgroup of it found gets its split of the decision ``limit`` by the restart rule
        (:func:`restart_split`: each started since its limits were last set and uses no more). The loop then
        sets its hard limit at the decision (:meth:`QuotaLoop._hard_of`) and counts it there; the rule's one
        home is this fence's, per cgroup."""
        cgroups = self._cgroups(tenant.container_ids)
        fresh = self._fresh_of(tenant.key, cgroups)
        if not cgroups or any(cg not in fresh for _cid, cg in cgroups):
            return False
        hards, cuts = self._hards(tenant, cgroups, gpu, limit, top, dict(tenant.gpus).get(gpu, limit), fresh)
        return hards == cuts

    def tracked(self) -> set[TenantKey]:
        """Every tenant this fence keeps records for across ticks (tests: a departed tenant leaves none)."""
        return set(self._over) | set(self._fresh) | self._short

    def hard_in_force(self, key: TenantKey, gpu: str) -> int | None:
        """The tenant's cgroups' hard limits on ``gpu`` in sum as the last :meth:`read_usage` found them
        (a restarted loop's bound on what an engine may hold, whatever file it follows), with the CDI share
        of each container not found (restarting, its new ID not in the status yet, or not started: the
        toolkit sets that share; without it the restarted loop bounded the engine by the old file's ceiling
        and a sibling grew past the claim); None when one is unlimited or unread."""
        return self._hard.get((key, gpu))

    def read_usage(self, tenants: Sequence[Tenant], claims: Sequence[Claim] = ()) -> list[UsageSample]:
        """Per tenant cgroup and GPU, its use; the loop passes the tenants of its tick (issue 21; the records
        of any other are dropped: departed), and the claims whose containers it holds (:meth:`hold`): their
        cgroups' use comes by container ID, which attribution books to the claim within its grant (the loop
        counts it at the grant), not foreign memory counted a second time."""
        out: list[UsageSample] = []
        failures: list[str] = []
        self._used, self._hard, self._pressed, self._had, self._pod_found = {}, {}, {}, {}, {}
        # the ledger afresh: a cgroup not found now departed; one found but unread keeps its last entry
        ledger, self._force = self._force, {}
        self._forget({t.key for t in tenants})
        found_of: dict[TenantKey, list[tuple[str, str]]] = {}
        for t in tenants:
            found = found_of[t.key] = self._cgroups(t.container_ids)
            missing = max(0, t.sharers - len(found))
            for gpu, req in t.gpus:  # one not found holds (or starts at) its CDI share: on top of those found
                self._hard[(t.key, gpu)] = share_of(req, t.sharers) * missing
            for cid, cgroup in found:
                for gpu, _req in t.gpus:
                    try:
                        got = self._limits.get(gpu, cgroup)
                    except LimitError as exc:
                        failures.append(str(exc))
                        self._hard[(t.key, gpu)] = None
                        self._keep(ledger, gpu, cgroup, None)
                        continue
                    self._keep(ledger, gpu, cgroup, got)
                    self._used[(gpu, cid)] = got.used_mib
                    self._had[(gpu, cid)] = got.hard_mib
                    self._pressed[(gpu, cid)] = got.hard_mib is not None and got.used_mib >= got.hard_mib
                    held = self._hard.get((t.key, gpu), 0)
                    self._hard[(t.key, gpu)] = None if held is None or got.hard_mib is None else held + got.hard_mib
                    out.append(UsageSample(gpu_uuid=gpu, used_mib=got.used_mib, pod_uid=t.key.pod_uid or None,
                                           namespace=t.key.namespace, pod=t.key.pod, container=t.key.container,
                                           container_id=cid))
        if failures and not out:
            raise TelemetryError(f"driver limits: {failures[0]}")
        out.extend(self._claims_use(claims, tenants, {cg for found in found_of.values() for _cid, cg in found},
                                    ledger))
        out.extend(self._foreign(tenants, out))
        out.extend(self._unstarted(tenants, found_of))
        for f in failures:
            log.warning("cgroup use unreadable", error=f)
        return out

    def _forget(self, alive: set[TenantKey]) -> None:
        """Drop the records of tenants not in the tick (departed): else they grow with every pod that ever
        ran here. One that comes back counts as if its limits were never set (none of its cgroups is known
        new, :meth:`moved` sets them again): cautious."""
        self._over = {k: v for k, v in self._over.items() if k in alive}
        self._fresh = {k: v for k, v in self._fresh.items() if k in alive}
        self._short &= alive

    def _unstarted(self, tenants: Sequence[Tenant],
                   found_of: Mapping[TenantKey, list[tuple[str, str]]]) -> list[UsageSample]:
        """Per tenant and GPU, the share of each of its containers whose cgroup is not found (not started,
        restarting, or its ID not in the pod's status yet), counted as used: the toolkit gives it its CDI
        spec's share when it starts (:func:`share_of`), so the tenant must not be cut below it (a tenant
        whose one container restarts comes back at its whole grant, whatever it was cut to), and its
        running siblings are fenced at what is left (:meth:`apply`). ``found_of``: the cgroups
        :meth:`read_usage` found this tick (a container not found is searched for once, not twice)."""
        out = []
        for t in tenants:
            found = found_of.get(t.key, [])
            missing = max(0, t.sharers - len(found))
            for gpu, req in t.gpus:
                share = share_of(req, t.sharers)
                # a running ordinary init container's place is taken at the share when it ends
                after = sum(max(0, share - self._used.get((gpu, cid), 0)) for cid, _cg in found if cid in t.init_ids)
                if share * missing + after > 0:
                    out.append(UsageSample(gpu_uuid=gpu, used_mib=share * missing + after,
                                           pod_uid=t.key.pod_uid or None, namespace=t.key.namespace, pod=t.key.pod,
                                           container=t.key.container))
        return out

    def _keep(self, ledger: Mapping[tuple[str, str], int], gpu: str, cgroup: str, got: CgroupLimits | None) -> None:
        """The ledger's entry for a cgroup found at this read: the hard limit read (unlimited: none), or
        when its limits were unreadable (``got`` None) the entry the last ledger had for it."""
        if got is not None and got.hard_mib is not None:
            self._force[(gpu, cgroup)] = got.hard_mib
        elif got is None and (gpu, cgroup) in ledger:
            self._force[(gpu, cgroup)] = ledger[(gpu, cgroup)]

    def _claims_use(self, claims: Sequence[Claim], tenants: Sequence[Tenant], read: set[str],
                    ledger: Mapping[tuple[str, str], int]) -> list[UsageSample]:
        """Per cgroup of the containers of ``claims`` and GPU, its use (a cgroup in ``read``, a tenant's,
        is read already): attribution books it to its claim up to the grant (beyond it: foreign, held by
        nobody the loop may cut), as NVML's processes on the other paths. First those the pod cache shows
        (by container ID); then every other cgroup of the pods each claim was prepared for (its pod's UID,
        :meth:`CgroupFinder.pod_cgroups`) that no tenant is of: a pod the cache does not list yet, or
        lists no more while its containers exit, runs the claim's containers all the same (by pod UID, the
        rule attribution applies on every path). Those of a pod no other claim names are held with the
        claim's (:meth:`hold`)."""
        out: list[UsageSample] = []
        read = set(read)
        theirs = {cid for t in tenants for cid in t.container_ids}
        for c in claims:
            for cid, cgroup in self._cgroups(c.container_ids - theirs):
                if cgroup in read:
                    continue
                read.add(cgroup)
                for gpu, _mib in c.gpus:
                    try:
                        got = self._limits.get(gpu, cgroup)
                    except LimitError as exc:  # unread: foreign, as before
                        log.warning("claim's cgroup use unreadable", claim=c.name, error=str(exc))
                        self._keep(ledger, gpu, cgroup, None)
                        continue
                    self._keep(ledger, gpu, cgroup, got)
                    out.append(UsageSample(gpu_uuid=gpu, used_mib=got.used_mib, container_id=cid))
        tenant_pods = {t.key.pod_uid for t in tenants if t.key.pod_uid}
        named = Counter(uid for c in claims for uid in c.pod_uids)
        for c in claims:
            for uid in sorted(c.pod_uids - tenant_pods):
                for cgroup in self._finder.pod_cgroups(uid):
                    if cgroup in read:
                        continue
                    read.add(cgroup)
                    for gpu, _mib in c.gpus:
                        try:
                            got = self._limits.get(gpu, cgroup)
                        except LimitError as exc:
                            log.warning("claim's pod cgroup use unreadable", claim=c.name, pod_uid=uid, error=str(exc))
                            self._keep(ledger, gpu, cgroup, None)
                            continue
                        self._keep(ledger, gpu, cgroup, got)
                        out.append(UsageSample(gpu_uuid=gpu, used_mib=got.used_mib, pod_uid=uid))
                        # limited: the toolkit applied a CDI spec's limits on this GPU, so a container of the
                        # claim if its pod has no other (a sandbox or a plain container has none)
                        if named[uid] == 1 and got.hard_mib is not None:
                            self._pod_found.setdefault((c.name, gpu), []).append((uid, cgroup, got.used_mib,
                                                                                   got.hard_mib))
        return out

    def _foreign(self, tenants: Sequence[Tenant], ours: list[UsageSample]) -> list[UsageSample]:
        """Per GPU, memory in use that no cgroup read holds (another plugin's pod, a host process): an
        anonymous sample, which attribution books as foreign so quotas never promise it. Every shared
        GPU is read, tenants or not (the node reports it to the scheduler, :mod:`vramshare.foreign`);
        :attr:`whole_gpus` names those read this time."""
        mine: dict[str, int] = {}
        for s in ours:
            mine[s.gpu_uuid] = mine.get(s.gpu_uuid, 0) + s.used_mib
        out = []
        read = set()
        shared = set(self._capacities()) if self._capacities else set()
        for gpu in sorted({g for t in tenants for g, _ in t.gpus} | shared):
            try:
                other = self._limits.gpu_used_mib(gpu) - mine.get(gpu, 0)
            except LimitError as exc:
                log.warning("gpu memory unreadable, foreign use unknown this tick", gpu=gpu, error=str(exc))
                continue
            read.add(gpu)
            if other > 0:
                out.append(UsageSample(gpu_uuid=gpu, used_mib=other))
        self.whole_gpus = frozenset(read)
        return out

    def apply(self, tenant: Tenant, decisions: Sequence[Decision], requests: dict[str, int],
              hard: Mapping[str, int] | None = None) -> list[str]:
        """Move the tenant's cgroup limits to ``decisions``; returns the errors (logged by the loop).
        ``hard`` overrides the hard limit per GPU: the loop keeps a shrink's old hard limit until the
        engine acknowledged it (issue 19), the soft limit follows the decision at once; a cgroup started
        since the tenant's limits were last set gets its split of the decision by the restart rule
        (:func:`restart_split`), remembered while the shrink waits."""
        errors: list[str] = []
        cgroups = self._cgroups(tenant.container_ids)
        waits = any((hard or {}).get(d.gpu_uuid, d.limit_mib) > d.limit_mib for d in decisions)
        # the cgroups started since a shrink began to wait for the engine (none when nothing waits)
        fresh = self._fresh_of(tenant.key, cgroups) if waits else frozenset()
        self._fresh = {k: v for k, v in self._fresh.items() if k != tenant.key}
        if fresh:
            self._fresh[tenant.key] = fresh
        short = False
        for d in decisions:
            top = max(d.limit_mib, (hard or {}).get(d.gpu_uuid, d.limit_mib))
            request = requests.get(d.gpu_uuid, d.limit_mib)
            softs = self._tenant_split(tenant, cgroups, d.gpu_uuid, min(d.limit_mib, request), request)
            hards, _cuts = self._hards(tenant, cgroups, d.gpu_uuid, d.limit_mib, top, request, fresh)
            uses = [self._used.get((d.gpu_uuid, cid)) for cid, _cg in cgroups]
            short |= self._set(d.gpu_uuid, cgroups, softs, hards, uses, errors,
                               {"pod": f"{tenant.key.namespace}/{tenant.key.pod}", "container": tenant.key.container})
        self._short.discard(tenant.key)
        if short:
            self._short.add(tenant.key)
        self._over = {k: v for k, v in self._over.items() if k != tenant.key}
        if not errors:
            self._over[tenant.key] = tuple(cg for _cid, cg in cgroups)
        return errors

    def hold(self, claim: Claim) -> list[str]:
        """Hold the containers of a claim that is no tenant (a DRA claim several pods share, or one whose
        pod the pod cache does not list) at its grant in sum, soft = hard (nothing of it is lent), split as
        a tenant's limit is: each keeps what it holds (the driver takes nothing back: a pod that joins
        beside one holding the whole grant waits for it to release), and each one not found yet keeps its
        CDI spec's share (per pod: :meth:`_missing`). The containers of the claim's pods that the pod cache
        does not show, found by their pod's cgroup at the last :meth:`read_usage`, are held with the rest:
        which of them is an ordinary init container is not known, so each keeps the share of one that
        may follow it (``split_slots``), and none gets more than the hard limit it had (a deleted pod's was
        its tenant's, maybe a loan's cut still paid for by borrowers' unacknowledged cuts); returns the
        errors."""
        errors: list[str] = []
        known = self._cgroups(claim.container_ids)
        for gpu, mib in claim.gpus:
            cgroups, uses, pods = [], [], []
            read: list[int | None] = []  # each one's use, None unread (not lowered below its limit in force)
            for cid, cgroup in known:
                cgroups.append((cid, cgroup))
                pods.append(parse_cgroup(cgroup)[0])
                try:
                    got = self._limits.get(gpu, cgroup)
                except LimitError as exc:  # its limit is set below all the same; counted as holding nothing
                    errors.append(str(exc))
                    uses.append(0)
                    read.append(None)
                    continue
                uses.append(got.used_mib)
                read.append(got.used_mib)
                self._pressed[(gpu, cid)] = got.hard_mib is not None and got.used_mib >= got.hard_mib
            seen = {cg for _cid, cg in known}
            unlisted = [f for f in self._pod_found.get((claim.name, gpu), []) if f[1] not in seen]
            for uid, cgroup, used, _had in unlisted:  # keyed by the cgroup: no container ID is known
                cgroups.append((cgroup, cgroup))
                pods.append(uid)
                uses.append(used)
                read.append(used)
            once = claim.init_ids | {cg for _uid, cg, _used, _had in unlisted}
            split = self._split(gpu, cgroups, mib, uses, once, share_of(mib, claim.sharers), self._missing(claim, pods))
            # an unlisted pod's container keeps no more than it had: a new pod's, its CDI share; a deleted one's,
            # exiting, what it had as a tenant's, which may be a loan's cut whose borrowers have not let go yet
            caps = [None] * len(known) + [had for _uid, _cg, _used, had in unlisted]
            split = [v if cap is None else min(v, cap) for v, cap in zip(split, caps)]
            self._set(gpu, cgroups, split, split, read, errors, {"claim": claim.name})
        return errors

    @staticmethod
    def _missing(claim: Claim, pods: Sequence[str | None]) -> int:
        """How many of the claim's containers are not found (``pods``: the pod UID of each one found):
        per pod that may still start them (``Claim.pod_slots``), its count less those found in it; a pod
        that departed keeps none (what it still runs is held as found). Without pod slots, the claim's
        ``sharers`` less all found."""
        if not claim.pod_slots:
            return max(0, claim.sharers - len(pods))
        found = Counter(pods)
        return sum(max(0, n - found[uid]) for uid, n in claim.pod_slots)
