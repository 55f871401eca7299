"""The quota loop: read telemetry -> policy per GPU -> write quota files -> fence -> mirror annotations.

Imperative shell around :func:`policy.rebalance`. Each tick (:meth:`QuotaLoop.run_once`) is
independent and keeps going past bad input: a failed tenant listing or usage read skips the tick
(the files on disk stay as they were, i.e. the last good quotas); a failed vLLM scrape only drops
that tenant's pressure signals; a failed write is retried next tick because the loop only records
what it managed to write. Files are written only when a limit changes, so readers are not woken
for nothing, and the generation on disk grows with each write (see ``writer``).

Per tenant it also keeps what the pure parts need from the past, in one :class:`TenantBook` dropped
whole when the tenant departs: a window of recent use (the policy's headroom reaches its peak), the
limits and generations on disk, what its engine acknowledged; its warmth (``warmth``) and, on nodes
where nothing fences, how long it has been above its limit (``overlimit``) are pruned with it. In ``driver`` mode the fence moves
the container's cgroup limits after each written change. Settings reload live (:meth:`reconfigure`).
"""
from __future__ import annotations

import dataclasses
import threading
import time
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol, Sequence

from deviceplugin.quota import classes as qclasses
from deviceplugin.quota.attribution import attribute
from deviceplugin.quota.claims import file_claim, merge_claims, unowned_quota_files
from deviceplugin.quota.model import (Bounds, Claim, Decision, GpuState, Phase, PolicyParams, Signals, Tenant, TenantKey,
                                      TenantState)
from deviceplugin.quota.overlimit import Breach, OverLimitWatch
from deviceplugin.quota.policy import node_excess, rebalance
from deviceplugin.quota.warm import WarmBroker
from deviceplugin.quota.warmth import Warmth
from deviceplugin.quota.telemetry import SignalReader, TelemetryError, UsageReader, UsageSample
from deviceplugin.serve import wait_poked
from deviceplugin.quota.writer import (GpuQuota, QuotaFile, QuotaFileError, container_dir, read_quota,
                                       write_quota)
from vramshare import contract, logs
from vramshare.foreign import SettledForeign
from vramshare.config import DEFAULT_CLASS, EnforcementConfig, OverLimitAction, QuotaClass, QuotaConfig
from vramshare.inventory import EnforcementMode

log = logs.get("vramshare.quota.loop")
_HISTORY = 32  # files remembered per tenant (an engine that lags more is assumed to follow any of them)


class TenantSource(Protocol):
    """The containers holding our memory on this node (from the device plugin's allocations).

    A source may also have ``list_pending() -> list[Claim]``: the containers promised memory here
    that are not tenants yet (``kube.NodeTenantSource``: pods bound here with an assignment vramshare
    wrote that the reconciler has not found holding their devices, from the same look at the pod
    cache; ``dra.tenants.ClaimTenantSource``: claims this node prepared, or is preparing, that are no
    tenant); the loop counts them at their request (issue 19)."""

    def list_tenants(self) -> list[Tenant]:
        """Raises any exception on failure; the loop logs it and skips the tick."""
        ...


class QuotaMirror(Protocol):
    """Mirrors a pod's quotas into its ``vramshare.io/quota-mib`` annotation."""

    def mirror(self, key: TenantKey, quotas: Mapping[str, Mapping[str, int]],
               states: Mapping[str, str] | None = None,
               details: Mapping[str, Mapping[str, Mapping[str, object]]] | None = None) -> None:
        """``quotas`` = {container: {gpu uuid: limit MiB}} for every tenant container of the pod;
        ``states`` = {container: hot / warm / waking / cold}; ``details`` = {container: {gpu uuid:
        {class, req, floor, used, why}}} (what ``vramshare inspect`` shows)."""
        ...


class OverLimitActor(Protocol):
    """Tells Kubernetes about a breach: an event and annotation, or that plus eviction."""

    def act(self, breach: Breach, action: OverLimitAction) -> None:
        """Raises any exception on failure; the loop logs it and tries again next episode."""
        ...


class HintReporter(Protocol):
    """Tells a pod that a hint annotation its owner wrote is ignored (a Warning event on the pod)."""

    def hint_ignored(self, key: TenantKey, annotation: str, why: str) -> None:
        """``annotation``: the name after the domain (``model``, ``quota-class``). Raises on failure."""
        ...


class Fence(Protocol):
    """Reads the tenants' use and moves their enforced limits (driver mode): ``fence.DriverFence``.
    Both are given the tenants of the tick (issue 21: no closure reading the loop back)."""

    name: str
    clamps: Mapping[tuple[str, str], int]  # (gpu, "fitted" | "over_capacity") -> writes lowered to fit the GPU

    def read_usage(self, tenants: Sequence[Tenant], claims: Sequence[Claim] = ()) -> list[UsageSample]:
        """Raises :class:`TelemetryError`; the loop then tries its other readers. What the containers of
        ``claims`` (no tenants, counted at their grant) hold within their grant is not foreign."""
        ...

    def apply(self, tenant: Tenant, decisions: Sequence[Decision], requests: dict[str, int],
              hard: Mapping[str, int] | None = None) -> list[str]:
        """``hard``: per GPU, the hard limit to set where it differs from the decision's limit (a
        shrink the engine has not acknowledged yet keeps the hard limit it had)."""
        ...

    def hold(self, claim: Claim) -> list[str]:
        """Fence the containers of a claim that is no tenant at its grant in sum (``Claim.container_ids``)."""
        ...

    def moved(self, tenant: Tenant) -> bool:
        """Whether the tenant's containers changed since its limits were last set (set them again)."""
        ...

    def hard_in_force(self, key: TenantKey, gpu: str) -> int | None:
        """The tenant's hard limits on ``gpu`` in sum as the last use read found them; None if unknown."""
        ...

    def restarted(self, tenant: Tenant, gpu: str, limit: int, top: int) -> bool:
        """Whether, while its hard limit ``top`` waits for its engine, every container of the tenant gets its
        split of ``limit`` at once by the restart rule (each started since its limits were last set and uses
        no more): the tenant restarted, its hard limit is the decision's."""
        ...


@dataclass(frozen=True)
class LoopSettings:
    """Everything the loop reads from the config; swapped whole by :meth:`QuotaLoop.reconfigure`."""

    params: PolicyParams = field(default_factory=PolicyParams)
    peak_window_ticks: int = 60
    idle_seconds: float = 300.0
    grace_seconds: float = 60.0
    action: OverLimitAction = OverLimitAction.EVENT
    interval_seconds: float | None = None  # None: what ``run`` was started with
    enabled: bool = True  # false: ``run`` pauses (the files keep the last quotas)
    classes: tuple[QuotaClass, ...] = ()  # quota.classes; pods none selects are in ``default``
    # a new container (its quota file still Allocate's when first listed) counts at its request for
    # this many ticks: its engine loads weights and allocates its KV pool in the meantime (issue 19)
    startup_ticks: int = 30

    @classmethod
    def from_config(cls, quota: QuotaConfig, enforcement: EnforcementConfig | None = None) -> "LoopSettings":
        en = enforcement or EnforcementConfig()
        return cls(PolicyParams.from_config(quota), quota.peak_window_ticks, quota.idle_seconds,
                   en.over_limit_grace_seconds, en.over_limit_action, quota.interval_seconds, quota.enabled,
                   quota.classes, quota.startup_ticks)

    def default_terms(self) -> qclasses.ClassTerms:
        """The ``default`` class: the global keys (what every tenant got before classes)."""
        p = self.params
        return qclasses.ClassTerms(DEFAULT_CLASS, p.floor_fraction, None, p.ceiling_fraction, None, p.margin_mib,
                                   self.idle_seconds, 0, self.action)

    def class_names(self) -> set[str]:
        return {DEFAULT_CLASS} | {c.name for c in self.classes}


@dataclass(frozen=True)
class TenantView:
    """One tenant on one GPU as the latest tick saw it (metrics, the quota-mib mirror, inspect)."""

    qclass: str
    request_mib: int
    floor_mib: int
    used_mib: int | None
    reason: str  # of the last change of its limit (or of this tick's decision when none changed yet)


@dataclass
class GpuBook:
    """What the loop remembers of one tenant on one GPU between ticks."""

    limit_mib: int | None = None  # on disk, as this process wrote or read it
    line: GpuQuota | None = None  # its line of quota.json as on disk
    window: deque[int] = field(default_factory=deque)  # recent use (the headroom's peak)
    view: TenantView | None = None  # as the latest tick saw it (metrics, the mirror, inspect)
    fenced: bool = False  # its cgroup limits were set by this process
    hard_mib: int | None = None  # the hard limit as this process set it


@dataclass
class TenantBook:
    """Everything the loop remembers of one tenant between ticks, in one object (issue 21): created when
    it is first listed and dropped whole, in :meth:`QuotaLoop._prune`, the first tick it is not."""

    first_tick: int  # the tick it was first listed (its age, for ``starting``)
    gpus: dict[str, GpuBook] = field(default_factory=dict)
    preemptions_total: float | None = None  # the engine's counter as last read
    finished_total: float | None = None  # vllm:request_success_total as last read
    phase: Phase | None = None  # as last written to its file
    qclass: str | None = None  # its quota class as of the latest tick
    orphan_of: str | None = None  # the class a reload removed: its limits are held until the next one
    generation: int | None = None  # of its quota file as last written or read
    applied: int | None = None  # generation its engine reported applied (latest)
    # the files this process wrote lately: (generation, {gpu: limit}), to tell which limit an engine
    # follows from the generation it reports applied
    history: deque[tuple[int, dict[str, int]]] = field(default_factory=lambda: deque(maxlen=_HISTORY))
    managed: bool = False  # its file was written by a quota loop when first listed
    # per GPU, the most a file older than any remembered may have given its engine: found written by
    # an earlier loop (a restart), the ceiling on its line, since that loop's files are not known
    before: dict[str, int] = field(default_factory=dict)

    def gpu(self, uuid: str) -> GpuBook:
        return self.gpus.setdefault(uuid, GpuBook())


@dataclass
class TickReport:
    """What one tick did; tests and the bench read it, the daemon only logs."""

    decisions: list[Decision] = field(default_factory=list)
    written: list[TenantKey] = field(default_factory=list)
    skipped: str | None = None  # why the whole tick was skipped
    errors: list[str] = field(default_factory=list)
    breaches: list[Breach] = field(default_factory=list)
    reserved: dict[str, int] = field(default_factory=dict)  # per GPU: claims of containers not tenants yet
    # per GPU: MiB by which limits, held memory and claims exceed the capacity at the node level
    # (sum over every container with a quota file or a claim of max(limit, held)); held memory that
    # is already over the capacity (lent before a claim came) is not counted as this tick's fault
    overcommitted: dict[str, int] = field(default_factory=dict)


class QuotaLoop:
    def __init__(self, tenants: TenantSource, capacities: Callable[[], Mapping[str, int]],
                 usage: Sequence[UsageReader], params: PolicyParams, host_root: str,
                 signals: SignalReader | None = None, mirror: QuotaMirror | None = None, *,
                 settings: LoopSettings | None = None, mode: EnforcementMode = EnforcementMode.COOPERATIVE,
                 fence: Fence | None = None, actor: OverLimitActor | None = None,
                 clock: Callable[[], float] = time.monotonic, warm: WarmBroker | None = None,
                 hints: HintReporter | None = None) -> None:
        """``usage`` readers are tried in order (driver limits or NVML first, dcgm-exporter as the
        fallback). ``settings`` (default: ``params`` with default windows) can be swapped live."""
        self._tenants, self._capacities, self._usage = tenants, capacities, list(usage)
        self._root, self._signals, self._mirror = host_root, signals, mirror
        self.settings = settings or LoopSettings(params=params)
        self.mode, self._fence, self._actor, self._clock = mode, fence, actor, clock
        self._books: dict[TenantKey, TenantBook] = {}  # per tenant, all it remembers between ticks
        self._warmth = Warmth()
        self._watch = OverLimitWatch(self.settings.grace_seconds)
        self.capacities: dict[str, int] = {}  # per GPU, what the latest tick divided (after foreign memory)
        self.class_counts: dict[tuple[str, str], int] = defaultdict(int)  # (class, changes | breaches)
        self.tenants_now: list[Tenant] = []  # this tick's tenants (the warm channel, residency, a replay)
        self._claim_req: dict[str, dict[str, int]] = {}  # unowned quota files: what Allocate granted
        self._named: set[str] = set()  # the quota files of the source's pending claims (each its claim's own)
        self.last = TickReport()  # the latest tick, for the metrics collector
        self.counts: dict[str, int] = defaultdict(int)  # ticks, skipped, changes, errors, writes, breaches
        self.warm = warm  # the warm tier (issue 23): sleeping engines lend, waking ones are granted first
        self._poked = threading.Event()
        self._hints = hints
        self._hinted: set[str] = set()  # pods told about an ignored hint (once each; pruned with the books)
        #: per shared GPU, memory no tenant or claim holds, settled over ticks (vramshare.foreign); the node
        #: agent publishes it for the extender, told by ``on_foreign`` whenever the settled figures change
        self.foreign = SettledForeign()
        self.on_foreign: Callable[[Mapping[str, int]], None] | None = None
        self._settled: dict[str, int] = {}
        self._whole: frozenset[str] = frozenset()  # the GPUs whose every process the tick's reader saw

    @property
    def _params(self) -> PolicyParams:
        return self.settings.params

    def reconfigure(self, quota: QuotaConfig, enforcement: EnforcementConfig | None = None) -> None:
        """Take a new (already validated) config from the next tick on; the mode needs a restart."""
        new = LoopSettings.from_config(quota, enforcement)
        if new != self.settings:
            # a tenant whose class is gone keeps its limits until the next valid config (issue 14):
            # dropping it into another class's bounds mid-flight is a change nobody asked for; the
            # next reload after that re-resolves it
            names = new.class_names()
            for _k, b in self._snapshot():  # an orphan of the previous reload is resolved again now
                b.orphan_of = b.qclass if b.orphan_of is None and b.qclass not in (None, *names) else None
            for k, c in sorted((k, b.orphan_of) for k, b in self._snapshot() if b.orphan_of is not None):
                log.warning("quota class removed by a reload, tenant keeps its limits until the next valid config",
                            pod=f"{k.namespace}/{k.pod}", container=k.container, quota_class=c)
            log.info("quota settings reloaded", step_mib=new.params.step_mib, margin_mib=new.params.margin_mib,
                     floor_fraction=new.params.floor_fraction, idle_s=new.idle_seconds,
                     grace_s=new.grace_seconds, action=new.action.value)
        self.settings = new
        self._watch.grace = new.grace_seconds
        if self.warm is not None:  # the broker bounds sleepers and wakes by the same fractions
            self.warm.params = new.params

    def _snapshot(self) -> list[tuple[TenantKey, TenantBook]]:
        """The books as a list, taken in one step: the metrics thread reads while a tick runs."""
        return list(self._books.items())

    def tracked(self) -> set[TenantKey]:
        """Every tenant the loop keeps state for (tests: a departed pod leaves none behind)."""
        return set(self._books) | self._warmth.keys() | self._watch.keys()

    def phases(self) -> dict[TenantKey, Phase]:
        """Each tenant's warmth as of the latest tick (metrics, inspect)."""
        return {k: b.phase for k, b in self._snapshot() if b.phase is not None}

    def classes(self) -> dict[TenantKey, str]:
        """Each tenant's quota class as of the latest tick (metrics, inspect)."""
        return {k: b.qclass for k, b in self._snapshot() if b.qclass is not None}

    def views(self) -> dict[tuple[TenantKey, str], TenantView]:
        """Per tenant and GPU: class, request, floor, use and the reason of the last change."""
        return {(k, g): gb.view for k, b in self._snapshot() for g, gb in list(b.gpus.items()) if gb.view is not None}

    def _book(self, key: TenantKey) -> TenantBook:
        return self._books.setdefault(key, TenantBook(first_tick=self.counts["ticks"]))

    def _terms(self, t: Tenant) -> qclasses.ClassTerms | None:
        """The tenant's class made concrete; ``None`` for a tenant whose class a reload removed."""
        b = self._book(t.key)
        if b.orphan_of is not None:
            return None
        st = self.settings
        res = qclasses.resolve(t.meta or qclasses.PodMeta(t.key.namespace), st.classes)
        if res.note and b.qclass != res.qclass.name:
            log.info("quota-class annotation ignored", pod=f"{t.key.namespace}/{t.key.pod}",
                     container=t.key.container, reason=res.note, quota_class=res.qclass.name)
        self._tell_ignored_hints(t, res.note, res.qclass.name)
        b.qclass = res.qclass.name
        base = st.default_terms()
        return base if res.qclass.name == DEFAULT_CLASS else qclasses.terms(res.qclass, base)

    def _tell_ignored_hints(self, t: Tenant, class_note: str, qclass: str) -> None:
        """Once per pod, a Warning event for each hint annotation the pod's owner wrote that nothing
        uses: a quota-class that is unknown or not selectable, a model that does not parse. The pod runs
        either way, so without the event only the node agent's and the extender's logs would say so."""
        pod = t.key.pod_uid or f"{t.key.namespace}/{t.key.pod}"
        if self._hints is None or pod in self._hinted:
            return
        ignored = [("quota-class", f"{class_note}; the pod is in class {qclass!r}")] if class_note else []
        model = t.meta.model if t.meta is not None else ""
        if model:
            try:
                contract.parse_model_ref(model)
            except contract.ModelRefError as exc:
                ignored.append(("model", f"{exc}; write <name>[@<revision>], e.g. "
                                         "meta-llama/Meta-Llama-3-8B-Instruct@main"))
        try:
            for annotation, why in ignored:
                self._hints.hint_ignored(t.key, annotation, why)
        except Exception as exc:  # the API may be down: the logs say it, the next tick tries again
            log.warning("could not report an ignored hint", pod=f"{t.key.namespace}/{t.key.pod}", error=str(exc))
            return
        self._hinted.add(pod)

    def limits(self) -> dict[tuple[TenantKey, str], int]:
        """The limits on disk as this loop knows them: ``{(tenant, gpu uuid): MiB}``."""
        return {(k, g): gb.limit_mib for k, b in self._snapshot() for g, gb in list(b.gpus.items())
                if gb.limit_mib is not None}

    # -- inputs ------------------------------------------------------------------------------
    def _read_usage(self, tenants: Sequence[Tenant], report: TickReport,
                    claims: Sequence[Claim] = ()) -> list[UsageSample] | None:
        """The fence first (driver mode: per-cgroup use of exactly these tenants, and of the ``claims`` it
        holds), then the readers."""
        fence = self._fence
        readers: list[tuple[Any, Callable[[], list[UsageSample]]]] = (
            [(fence, lambda: fence.read_usage(tenants, claims))] if fence is not None else [])
        readers += [(r, r.read_usage) for r in self._usage]
        for source, read in readers:
            try:
                samples = read()
            except TelemetryError as exc:
                log.warning("usage source failed", source=source.name, error=str(exc))
                report.errors.append(str(exc))
                continue
            self._whole = frozenset(getattr(source, "whole_gpus", None) or ())
            return samples
        return None

    def keep_foreign(self, figures: Mapping[str, int], interval_s: float) -> dict[str, int]:
        """A restarted node agent's settled foreign memory of its last run (the device plugin's inventory read
        back, :func:`vramshare.foreign.settled_from_booked`; the DRA plugin's kept file), kept per GPU until
        this loop's own readings of it settle, two ticks (``interval_s``) at most after the window: no restart
        unbooks memory a stuck process still holds. Returns the figures in force now; ``on_foreign`` is told
        when they change, as ever (also when a kept one ends)."""
        now = self._clock()
        self.foreign.keep(figures, now + self.foreign.settle_s + 2 * interval_s)
        self._settled = self.foreign.settled(now)
        return dict(self._settled)

    def _observe_foreign(self, now: float, foreign: Mapping[str, int], capacities: Mapping[str, int]) -> None:
        """Feed the tick's foreign memory of each shared GPU its reader saw whole to the settled figures,
        and tell ``on_foreign`` when they change (a reader that sees only our processes, dcgm-exporter or
        a replay, reports none: unmatched is not the same as foreign there)."""
        self.foreign.observe(now, {g: foreign.get(g, 0) for g in sorted(self._whole) if g in capacities})
        self.foreign.forget(capacities)
        settled = self.foreign.settled(now)
        if settled != self._settled:
            for gpu in sorted(set(settled) | set(self._settled)):
                log.info("memory held outside our pods, settled", gpu=gpu, mib=settled.get(gpu, 0),
                         was_mib=self._settled.get(gpu, 0))
            self._settled = settled
            if self.on_foreign is not None:
                self.on_foreign(settled)

    def _read_signals(self, t: Tenant, report: TickReport) -> Signals:
        if self._signals is None or not t.metrics_url:
            return Signals()
        try:
            s = self._signals.read_signals(t.metrics_url)
        except TelemetryError as exc:
            log.warning("vllm metrics unreadable, no pressure signals this tick", pod=str(t.key),
                        url=t.metrics_url, error=str(exc))
            report.errors.append(str(exc))
            return Signals()
        b = self._book(t.key)
        delta, b.preemptions_total = _increase(s.preemptions_total, b.preemptions_total)
        finished, b.finished_total = _increase(s.finished_total, b.finished_total)
        if s.generation_applied is not None:
            b.applied = s.generation_applied
        return Signals(kv_usage=s.kv_usage, waiting=s.waiting, preemptions=delta, running=s.running, finished=finished,
                       release_mode=s.release_mode, kv_held_mib=_mib(s.kv_held_bytes),
                       kv_demand_mib=_mib(s.kv_demand_bytes), generation_applied=s.generation_applied)

    def _current(self, t: Tenant, gpu: str) -> int | None:
        """The limit in force: ours, else the file Allocate wrote, else None (= the request)."""
        b = self._book(t.key)
        if b.gpu(gpu).limit_mib is None:
            try:
                on_disk = read_quota(self._dir(t))
            except (QuotaFileError, OSError) as exc:
                log.warning("quota file unreadable", pod=str(t.key), gpu=gpu, error=str(exc))
                on_disk = None
            if on_disk is not None:
                if b.generation is None:
                    b.generation = on_disk.generation
                    # the file it found is one its engine may still follow (Allocate's, or a previous
                    # loop's): remembered like its own, so a cut is not lent before it is acknowledged
                    b.history.append((on_disk.generation, on_disk.limits()))
                    if on_disk.state:
                        b.before = {line.uuid: max(line.limit_mib, line.ceiling_mib) for line in on_disk.gpus}
                if on_disk.state:  # the loop wrote it before (Allocate's first file has no state)
                    b.managed = True
                for g, mib in on_disk.limits().items():
                    if b.gpu(g).limit_mib is None:
                        b.gpu(g).limit_mib = mib
                for line in on_disk.gpus:
                    if b.gpu(line.uuid).line is None:
                        b.gpu(line.uuid).line = line
        return b.gpu(gpu).limit_mib

    # -- one tick ----------------------------------------------------------------------------
    def run_once(self) -> TickReport:
        """One tick: read, decide, write. Never raises for bad input; see :class:`TickReport`."""
        report = self._tick()
        self.last = report
        self.counts["ticks"] += 1
        self.counts["skipped"] += report.skipped is not None
        self.counts["errors"] += len(report.errors)
        self.counts["writes"] += len(report.written)
        self.counts["changes"] += sum(d.changed for d in report.decisions)
        self.counts["breaches"] += len(report.breaches)
        return report

    def _tick(self) -> TickReport:
        report = TickReport()
        try:
            tenants = sorted(self._tenants.list_tenants(), key=lambda t: t.key)
            capacities = dict(self._capacities())
        except Exception as exc:  # an API/cache failure must not kill the DaemonSet thread
            report.skipped = f"cannot list tenants: {exc}"
            log.error("quota tick skipped, keeping last quotas", reason=report.skipped)
            return report
        self.tenants_now = tenants
        for t in tenants:
            self._book(t.key)
        pending, files, listed = self._claims(tenants)
        # the fence reads and holds their containers: those the pod cache shows, and their pods' cgroups
        shared = [c for c in listed if c.container_ids or c.pod_uids]
        samples = self._read_usage(tenants, report, shared)
        if samples is None:
            report.skipped = "no usage source answered"
            log.error("quota tick skipped, keeping last quotas", reason=report.skipped)
            return report
        # a claim's memory (its known containers', its pods') is its own within its grant: not foreign
        seen = attribute(samples, tenants, listed)
        now, st = self._clock(), self.settings
        self._observe_foreign(now, seen.foreign, capacities)
        per_gpu: dict[str, list[TenantState]] = defaultdict(list)
        unknown: set[tuple[TenantKey, str]] = set()  # engines on a file this process never saw: never raised
        phases: dict[TenantKey, Phase] = {}
        base = st.default_terms()
        for t in tenants:
            sig = self._read_signals(t, report)
            used = [seen.used.get((t.key, g)) for g, _ in t.gpus]
            total = sum(u for u in used if u is not None) if any(u is not None for u in used) else None
            ct = self._terms(t)
            idle = (ct or base).idle_seconds
            phase = self._warmth.update(t.key, total, sig, now, idle, st.params.step_mib)
            for (gpu, req), u in zip(t.gpus, used):
                peak = self._remember(t.key, gpu, u, st.peak_window_ticks)
                cur = self._current(t, gpu)
                acked, unacked, follows = self._acked(t.key, gpu, req if cur is None else cur, req)
                # an engine on a file this process never saw (after a restart) may hold up to a bound
                # it cannot know exactly: its limit is held, as for a tenant without telemetry, and
                # the bound is counted as held, until it acknowledges a file this process knows
                seen_u = None if unacked is not None and follows is None and not acked else u
                if seen_u is None and u is not None:
                    unknown.add((t.key, gpu))
                ts = TenantState(t.key, req, cur, seen_u, sig, peak_mib=peak,
                                 phase=phase if seen_u is not None else Phase.HOT,
                                 bounds=self._bounds(ct, req, cur),
                                 rank=self._rank(t.key, ct),
                                 recent_mib=tuple(self._book(t.key).gpu(gpu).window),
                                 demand_mib=_demand(seen_u, sig) if len(t.gpus) == 1 else None,
                                 starting=self._starting(t.key),
                                 shrink_acked=acked, unacked_mib=unacked,
                                 engine_mib=follows, unreported_mib=self._unreported(t.key, gpu, cur, req))
                per_gpu[gpu].append(self.warm.prepare(ts, gpu, ct or base) if self.warm else ts)
                self._check_limit(t.key, gpu, req, u, now, report, (ct or base).over_limit_action)
            phases[t.key] = phase if total is not None else Phase.COLD
        decided: dict[tuple[TenantKey, str], Decision] = {}
        reserved = report.reserved = self._reserved(pending, files)
        self._hold_claims(shared, report)
        committed: dict[str, int] = {}
        for gpu, states in sorted(per_gpu.items()):
            if gpu not in capacities:
                log.warning("GPU not in inventory, its tenants keep their quotas", gpu=gpu)
                continue
            cap = capacities[gpu] - seen.foreign.get(gpu, 0)
            self.capacities[gpu] = cap
            if self.warm is not None:  # issue 23 item 5: a wake beyond the reserve waits, no awake request is cut
                states = self.warm.hold_wakes(gpu, cap, states, reserved.get(gpu, 0))
            used_of = {ts.key: ts.used_mib for ts in states}
            req_of = {ts.key: ts.request_mib for ts in states}
            out = rebalance(GpuState(gpu, cap, tuple(states), reserved_mib=reserved.get(gpu, 0)), st.params)
            committed[gpu] = cap - sum(d.held_mib for d in out)
            self._check_node(gpu, cap, out, states, reserved.get(gpu, 0), report)
            for d in out:
                b = self._book(d.key)
                if (d.key, gpu) in unknown and d.limit_mib > d.previous_mib:  # a raise only ever frees nothing
                    d = dataclasses.replace(d, limit_mib=d.previous_mib, reason="hold: its engine follows a file "
                                            "this loop never saw (a restart), not raised until it acknowledges one")
                if b.orphan_of is not None:
                    d = dataclasses.replace(d, reason=f"hold: class {b.orphan_of!r} removed from the "
                                            f"config, limits kept until the next valid config")
                decided[(d.key, gpu)] = d
                report.decisions.append(d)
                if d.changed:
                    self.class_counts[(b.qclass or DEFAULT_CLASS, "changes")] += 1
                last = b.gpu(gpu).view
                why = d.reason if d.changed or last is None else last.reason
                cls = b.orphan_of or b.qclass or DEFAULT_CLASS
                b.gpu(gpu).view = TenantView(cls, req_of[d.key], d.floor_mib, used_of[d.key], why)
        if self.warm is not None:
            self.warm.note(decided)  # what sleeping engines lend, for the mirror written next
        self._write(tenants, decided, phases, report)
        self._fit_claims(files, committed, report)
        if self.warm is not None:  # after the files: a grant follows the quota that carries it
            self.warm.after_tick(phases, decided, now)
        self._prune({t.key for t in tenants})
        return report

    def fence_clamps(self) -> dict[tuple[str, str], int]:
        """Per (GPU, outcome), the fence's writes lowered to fit the GPU's capacity (metrics); none unfenced."""
        return dict(self._fence.clamps) if self._fence is not None else {}

    def _prune(self, alive: set[TenantKey]) -> None:
        """The one place a departed tenant is forgotten: its book, warmth, breach watch and warm entry."""
        self._books = {k: b for k, b in self._books.items() if k in alive}
        self._hinted &= {k.pod_uid or f"{k.namespace}/{k.pod}" for k in alive}
        self._warmth.forget(alive)
        self._watch.forget(alive)
        if self.warm is not None:
            self.warm.forget(alive)

    def _bounds(self, ct: qclasses.ClassTerms | None, request: int, current: int | None) -> Bounds | None:
        """The class's bounds for this request; ``None`` (PolicyParams) for the default class; the
        limit in force, pinned, for a tenant whose class a reload removed."""
        if ct is None:
            pinned = request if current is None else current
            return Bounds(pinned, pinned, self.settings.params.margin_mib)
        if ct.name == DEFAULT_CLASS:
            return None
        return Bounds(ct.floor_of(request), ct.ceiling_of(request), ct.margin_mib)

    def _rank(self, key: TenantKey, ct: qclasses.ClassTerms | None) -> int:
        if ct is not None:
            return ct.lending_priority
        gone = qclasses.class_named(self.settings.classes, self._book(key).orphan_of or "")
        return gone.lending_priority if gone else 0

    def _remember(self, key: TenantKey, gpu: str, used: int | None, ticks: int) -> int | None:
        """The peak of the last ``ticks`` uses seen (the policy's headroom), this one included."""
        gb = self._book(key).gpu(gpu)
        win = gb.window
        if win.maxlen != ticks:
            win = gb.window = deque(win, maxlen=ticks)
        if used is not None:
            win.append(used)
        return max(win) if win else None

    def _check_limit(self, key: TenantKey, gpu: str, request: int, used: int | None, now: float,
                     report: TickReport, action: OverLimitAction) -> None:
        """Nodes where nothing fences: act on a container above its limit past the grace period. A
        container within its request (what the scheduler reserved for it) is never named, even when
        the loop cut its limit below that: memory vLLM allocated up front is not released by a cap."""
        limit = self._book(key).gpu(gpu).limit_mib
        if self.mode is EnforcementMode.DRIVER or limit is None:
            return
        breach = self._watch.observe(key, gpu, used, max(limit, request), now)
        if breach is None:
            return
        report.breaches.append(breach)
        qclass = self._book(key).qclass or DEFAULT_CLASS
        self.class_counts[(qclass, "breaches")] += 1
        log.warning("container above its memory limit", pod=f"{key.namespace}/{key.pod}", container=key.container,
                    gpu=gpu, used_mib=breach.used_mib, limit_mib=breach.limit_mib, seconds=round(breach.seconds),
                    action=action.value, quota_class=qclass)
        if self._actor is not None:
            try:
                self._actor.act(breach, action)
            except Exception as exc:  # the API may be down; the breach is in the log and the metrics
                log.error("over-limit action failed", pod=f"{key.namespace}/{key.pod}", error=str(exc))
                report.errors.append(str(exc))

    def _write(self, tenants: list[Tenant], decided: Mapping[tuple[TenantKey, str], Decision],
               phases: Mapping[TenantKey, Phase], report: TickReport) -> None:
        changed_pods: set[str] = set()
        for t in sorted(tenants, key=lambda t: self._give_back(t, decided)):  # who gives back writes first
            ds = [decided[(t.key, g)] for g, _ in t.gpus if (t.key, g) in decided]
            self._fence_first(t, ds, report)
            phase, b = phases.get(t.key, Phase.HOT), self._book(t.key)
            if not ds or (all(b.gpu(d.gpu_uuid).limit_mib == d.limit_mib for d in ds)
                          and (b.phase or phase) == phase
                          and all(b.gpu(d.gpu_uuid).line in (None, self._entry(t.key, d.gpu_uuid, 0, d))
                                  for d in ds)):  # a class change moves floor/ceiling without the limit
                if b.phase is None:
                    b.phase = phase
                continue
            gpus = tuple(self._entry(t.key, g, req, decided.get((t.key, g))) for g, req in t.gpus)
            try:
                written = write_quota(self._dir(t),
                                      QuotaFile(gpus=gpus, state=phase.value, enforcement=self.mode.value),
                                      root=self._root)  # a link out of the quota root is never written through
            except (OSError, ValueError) as exc:
                log.error("quota write failed, will retry", pod=str(t.key), error=str(exc))
                report.errors.append(str(exc))
                continue
            for line in gpus:
                b.gpu(line.uuid).line = line
            b.generation = written.generation
            b.history.append((written.generation, {line.uuid: line.limit_mib for line in gpus}))
            for d in ds:
                if b.gpu(d.gpu_uuid).limit_mib != d.limit_mib:
                    log.info("quota changed", pod=f"{t.key.namespace}/{t.key.pod}", container=t.key.container,
                             gpu=d.gpu_uuid, old_mib=d.previous_mib, new_mib=d.limit_mib, reason=d.reason,
                             generation=written.generation)
                b.gpu(d.gpu_uuid).limit_mib = d.limit_mib
            b.phase = phase
            report.written.append(t.key)
            changed_pods.add(t.key.pod_uid)
            self._apply_fence(t, ds, report)
        if self._mirror is not None:
            self._mirror_pods(tenants, changed_pods, report)

    def _give_back(self, t: Tenant, decided: Mapping[tuple[TenantKey, str], Decision]) -> int:
        """The order of a tick's writes: most given back first (the decision's limit below the hard limit this
        process set), raises last, so a lender's cut is in force before the raise it pays for and the driver
        fence need not hold the raise for a tick (it fits every write to the GPU either way)."""
        b = self._book(t.key)
        return min((d.limit_mib - _or(b.gpu(g).hard_mib, d.limit_mib)
                    for g, _ in t.gpus if (d := decided.get((t.key, g))) is not None), default=0)

    def quota_dir(self, t: Tenant) -> str:
        """Where ``t``'s quota.json (and the warm tier's socket) live."""
        return self._dir(t)

    def _dir(self, t: Tenant) -> str:
        """The tenant's quota directory: its own when the source names one (an allocation-keyed dir),
        else ``<quotaHostDir>/<pod-uid>/<container>``."""
        return t.quota_dir or container_dir(self._root, t.key.pod_uid, t.key.container)

    def _fence_first(self, t: Tenant, ds: list[Decision], report: TickReport) -> None:
        """A tenant this process has not fenced yet (new, or after a restart) gets its limits set; one
        whose hard limit waits for its engine's acknowledgement gets it lowered once acknowledged; one
        whose containers changed since (a new cgroup starts at its CDI spec's share, not at the split
        of the tenant's limit) gets them set again."""
        if self._fence is None or not ds:
            return
        b = self._book(t.key)
        if any(not b.gpu(d.gpu_uuid).fenced for d in ds):
            if all(b.gpu(d.gpu_uuid).limit_mib == d.limit_mib for d in ds):
                self._apply_fence(t, ds, report)
        elif self._fence.moved(t) or \
                any(_or(b.gpu(d.gpu_uuid).hard_mib, d.limit_mib) != self._hard_of(t, d) for d in ds):
            self._apply_fence(t, ds, report)

    def _hard_of(self, t: Tenant, d: Decision) -> int:
        """The hard limit to set (issue 19, acknowledged shrinks): a shrink is enforced by the driver
        only once the engine reports it applied the file that carried it (its generation), so the
        driver never fails an allocation for memory the engine was about to give back. Engines that
        report no generation are fenced at once, as before. Until then the hard limit is the most the
        engine may still grow to (:meth:`_acked`: the file it follows or any written since), which is
        what the policy counts it at; the hard limit set before is not kept beyond that (an engine
        acknowledging late while the loop writes every tick never caught up, and the hard limit only
        rose: the driver let it hold more than the GPU had left). A tenant that restarted as a whole, by the
        fence's per-container restart rule (:meth:`Fence.restarted`), is fenced and counted at the decision
        at once."""
        b = self._book(t.key)
        if b.applied is None or b.applied >= (b.generation or 0):
            return d.limit_mib
        _ok, top, _follows = self._acked(t.key, d.gpu_uuid, d.limit_mib, dict(t.gpus).get(d.gpu_uuid, d.limit_mib))
        hard = max(d.limit_mib, _or(top, d.limit_mib))
        if hard <= d.limit_mib or self._fence is None or not self._fence.restarted(t, d.gpu_uuid, d.limit_mib, hard):
            return hard
        log.info("restarted: hard limit lowered without waiting for its engine", pod=str(t.key), gpu=d.gpu_uuid,
                 limit_mib=d.limit_mib, waited_mib=hard)
        return d.limit_mib

    def _apply_fence(self, t: Tenant, ds: list[Decision], report: TickReport) -> None:
        if self._fence is None:
            return
        hard = {d.gpu_uuid: self._hard_of(t, d) for d in ds}
        for d in ds:
            if hard[d.gpu_uuid] > d.limit_mib:
                log.info("hard limit kept until the engine acknowledges the shrink", pod=str(t.key),
                         gpu=d.gpu_uuid, limit_mib=d.limit_mib, hard_mib=hard[d.gpu_uuid],
                         generation=self._book(t.key).generation, applied=self._book(t.key).applied)
        errors = self._fence.apply(t, ds, dict(t.gpus), hard)
        for e in errors:
            log.error("cgroup memory limit not moved, will retry", pod=f"{t.key.namespace}/{t.key.pod}", error=e)
        report.errors.extend(errors)
        if not errors:
            b = self._book(t.key)
            for d in ds:
                b.gpu(d.gpu_uuid).fenced = True
            for g, h in hard.items():
                b.gpu(g).hard_mib = h

    def _starting(self, key: TenantKey) -> bool:
        """New on this node: first listed less than ``startup_ticks`` ticks ago with the quota file
        Allocate wrote (a loop restart finds the files of its old tenants rewritten: not new)."""
        b = self._book(key)
        return not b.managed and self.counts["ticks"] - b.first_tick < self.settings.startup_ticks

    def _acked(self, key: TenantKey, gpu: str, cur: int, request: int) -> tuple[bool, int | None, int | None]:
        """For an engine that reports the generation it applied: (it applied the file carrying its
        current limit, the highest limit it may still grow to, the limit it follows now). Until it
        acknowledges a shrink the memory cut is not anyone else's; "at its limit" is measured
        against the limit it follows. Engines that report none: (False, None, None): their use
        shows what they hold, and they follow the file in force. The history starts with the file
        the loop first found (Allocate's: the request); an engine on a file older than every one
        remembered may follow any of them, its request, or, when the file found was an earlier
        loop's (a restart), up to that file's ceiling. Where the driver fences it, no more than the
        hard limit this process set (an engine whose first report names an older file than the one
        whose shrink the driver already enforces is not counted, nor fenced, above it again)."""
        b = self._book(key)
        applied = b.applied
        if applied is None:
            return False, None, None
        hist = [(g, lim[gpu]) for g, lim in b.history if gpu in lim]
        follows = next((lim for g, lim in reversed(hist) if g <= applied), None)
        if applied >= (b.generation or 0):
            return True, cur, cur
        later = [lim for g, lim in hist if g > applied]
        # an older file than the history holds: it may follow any limit this process remembers,
        # Allocate's (its request), or one of an earlier loop's (issue 19: never lent twice)
        older = [lim for _, lim in hist] + [request, b.before.get(gpu, 0)]
        top = max(later + [cur] + ([follows] if follows is not None else older))
        hard = b.gpu(gpu).hard_mib  # driver mode: whatever file it follows, it holds no more than that
        if hard is None and self._fence is not None:  # not set by this process yet (a restart): the driver's
            hard = self._fence.hard_in_force(key, gpu)
        return False, top if hard is None else min(top, max(hard, cur)), follows

    def _unreported(self, key: TenantKey, gpu: str, cur: int | None, request: int) -> int | None:
        """A starting engine that has reported no generation yet: the highest limit it may have read (any
        file written since Allocate's, its request), no more than the hard limit this process set; None
        once it reports one or is no longer starting (engines that never report: their use shows it)."""
        b = self._book(key)
        if b.applied is not None or not self._starting(key):
            return None
        top = max([lim[gpu] for _, lim in b.history if gpu in lim] + [request, _or(cur, request)])
        hard = b.gpu(gpu).hard_mib
        return top if hard is None else min(top, max(hard, _or(cur, request)))

    def _claims(self, tenants: Sequence[Tenant]) -> tuple[list[Claim], list[Claim], list[Claim]]:
        """The claims of containers that are not tenants yet: the source's pending ones (``list_pending``)
        and the quota files they or Allocate wrote. A pending claim whose file is there is counted as
        that file, at what its source granted (a restarted loop knows it too), so it can be fitted; such
        a file is its claim's own (``self._named``), never taken for another pending claim of the same
        size (:meth:`_reserved`). Third: the source's claims as it listed them (their containers and pods
        own their memory in attribution; those whose containers it knows are fenced, :meth:`_hold_claims`)."""
        pending_of = getattr(self._tenants, "list_pending", None)
        listed = list(pending_of()) if pending_of is not None else []
        pending, files = [], unowned_quota_files(self._root, [self._dir(t) for t in tenants])
        self._named = set()
        for c in listed:
            f = file_claim(c.quota_dir) if c.quota_dir else None
            if f is None:
                pending.append(c)
            else:
                self._claim_req[f.name] = dict(c.gpus)
                self._named.add(f.name)
                files.append(f)
        return pending, files, listed

    def _hold_claims(self, shared: list[Claim], report: TickReport) -> None:
        """Driver mode: a claim that is no tenant but whose containers or pods are known (several pods share
        it; its pod is not listed yet, or any more) is fenced at its grant in sum, every tick (a pod that
        joins it gets its share at the next)."""
        if self._fence is None:
            return
        for c in shared:
            for error in self._fence.hold(c):
                log.error("shared claim's containers not fenced, will retry", claim=c.name, error=error)
                report.errors.append(error)

    def _reserved(self, pending: list[Claim], files: list[Claim]) -> dict[str, int]:
        """Per GPU, MiB promised to containers that are not tenants yet (``claims``): counted at their
        request from the moment they exist, so the policy never lends it (issue 19)."""
        for f in files:  # a file the loop lowered still claims what Allocate granted
            self._claim_req.setdefault(f.name, dict(f.gpus))
        files = [Claim(f.name, tuple((g, self._claim_req[f.name].get(g, m)) for g, m in f.gpus)) for f in files]
        # only a file no source names (Allocate's) may be the container of a pending pod (merge_claims); a
        # DRA claim's own file matched with another claim allocated here of the same size counted the two once
        own = [f for f in files if f.name in self._named]
        out: dict[str, int] = defaultdict(int)
        for c in merge_claims(pending, [f for f in files if f.name not in self._named]) + own:
            for gpu, mib in c.gpus:
                out[gpu] += mib
        return dict(out)

    def _fit_claims(self, files: list[Claim], free: Mapping[str, int], report: TickReport) -> None:
        """A quota file no tenant owns yet says what Allocate granted; while co-tenants still hold
        memory they were lent, that much is not there: the file is lowered to what is free and grows
        back to the grant as they release (the newcomer's engine reads it from its first start)."""
        left = dict(free)
        for f in sorted(files, key=lambda c: c.name):
            grant = self._claim_req.get(f.name, dict(f.gpus))
            want = {g: max(0, min(grant.get(g, m), left.get(g, grant.get(g, m)))) for g, m in f.gpus}
            for g in want:
                if g in left:
                    left[g] -= want[g]
            if want == dict(f.gpus):
                continue
            try:
                q = read_quota(f.name)
                if q is None:
                    continue
                gpus = tuple(GpuQuota(x.uuid, want.get(x.uuid, x.limit_mib), min(x.floor_mib, want.get(x.uuid, x.limit_mib)),
                                      max(x.ceiling_mib, want.get(x.uuid, x.limit_mib))) for x in q.gpus)
                write_quota(f.name, QuotaFile(gpus=gpus, state=q.state, enforcement=q.enforcement))
            except (QuotaFileError, OSError, ValueError) as exc:
                log.error("claim's quota file not fitted, will retry", dir=f.name, error=str(exc))
                report.errors.append(str(exc))
                continue
            log.info("newcomer's quota fitted to free memory", dir=f.name, limits=want, granted=grant)
        self._claim_req = {k: v for k, v in self._claim_req.items() if k in {f.name for f in files}}

    def _check_node(self, gpu: str, cap: int, out: Sequence[Decision], states: Sequence[TenantState],
                    reserved: int, report: TickReport) -> None:
        """The node-level invariant (:func:`policy.node_excess`): every container with a quota file or a
        claim, at max(limit, held), fits the GPU; beyond what was already held, it is this tick's fault:
        logged and counted."""
        over, fault = node_excess(out, states, cap, reserved)
        if over:
            report.overcommitted[gpu] = over
        if fault:
            self.counts["node_overcommit"] += 1
            log.error("node-level quota invariant broken", gpu=gpu, committed_mib=cap + over, capacity_mib=cap,
                      reserved_mib=reserved)

    def _entry(self, key: TenantKey, gpu: str, request: int, d: Decision | None) -> GpuQuota:
        """One GPU's line of the file. A GPU skipped this tick keeps its limit (a multi-GPU file is
        rewritten whole). Floors above the limit happen only when a GPU cannot hold the floors
        (capacity lost to foreign memory); the file must still read floor <= limit <= ceiling."""
        if d is not None:
            return GpuQuota(gpu, d.limit_mib, min(d.floor_mib, d.limit_mib), d.ceiling_mib)
        limit = _or(self._book(key).gpu(gpu).limit_mib, request)
        return GpuQuota(gpu, limit, min(self._params.floor_of(request), limit),
                        max(self._params.ceiling_of(request), limit))

    def _mirror_pods(self, tenants: list[Tenant], pods: set[str], report: TickReport) -> None:
        for uid in sorted(pods):
            members = [t for t in tenants if t.key.pod_uid == uid]
            books = {t.key: self._book(t.key) for t in members}
            quotas = {t.key.container: {g: lim for g, _ in t.gpus if (lim := books[t.key].gpu(g).limit_mib) is not None}
                      for t in members}
            try:
                states = {t.key.container: books[t.key].phase.value for t in members  # type: ignore[union-attr]
                          if books[t.key].phase is not None}
                warm = self.warm.views() if self.warm is not None else {}
                details = {t.key.container: {g: {**_detail(v), **_warm_detail(warm.get(t.key))}
                                             for g, _ in t.gpus if (v := books[t.key].gpu(g).view) is not None}
                           for t in members}
                self._mirror.mirror(members[0].key, quotas, states, details)  # type: ignore[union-attr]
            except Exception as exc:  # the file is the contract; the annotation is only a mirror
                log.warning("quota annotation not mirrored", pod=f"{members[0].key.namespace}/"
                            f"{members[0].key.pod}", error=str(exc))
                report.errors.append(str(exc))

    def run(self, stop: threading.Event, interval_seconds: float) -> None:
        """Tick every ``interval_seconds`` (or the reloaded ``quota.intervalSeconds``) until ``stop`` is
        set (the DaemonSet's quota thread); ``quota.enabled: false`` reloaded pauses it."""
        while not stop.is_set():
            try:
                if self.settings.enabled:
                    self.run_once()
                elif self._settled:  # paused: nothing measures foreign memory, so none is reported
                    self.foreign, self._settled = SettledForeign(), {}
                    if self.on_foreign is not None:
                        self.on_foreign({})
            except Exception:  # never let one bad tick end the loop
                log.error("quota tick crashed, keeping last quotas", exc_info=True)
            wait = self.settings.interval_seconds or interval_seconds
            if self.warm is None:
                stop.wait(wait)
                continue
            if self.warm.wake_pending():
                wait = min(wait, self.warm.fast_tick_s)  # a wake waits for memory: look again soon
            wait_poked(stop, self._poked, wait)

    def poke(self) -> None:
        """Tick now (a wake request arrived on the warm channel): :meth:`run` stops waiting."""
        self._poked.set()


REASON_CHARS = 120  # the mirrored reason is cut here: annotations count against the pod object's size


def _warm_detail(e: object) -> dict[str, object]:
    """The warm tier's fields of the mirror (issue 23): engine state, MiB lent while asleep, last wake (s)."""
    if e is None or not getattr(e, "can_sleep", False):
        return {}
    out: dict[str, object] = {"sleep": e.state.value}  # type: ignore[attr-defined]
    if e.lent_mib:  # type: ignore[attr-defined]
        out["lent"] = e.lent_mib  # type: ignore[attr-defined]
    if e.last_wake_s is not None:  # type: ignore[attr-defined]
        out["wakeS"] = round(e.last_wake_s, 3)  # type: ignore[attr-defined]
    return out


def _or(value: int | None, default: int) -> int:
    return default if value is None else value


def _increase(now: float | None, last: float | None) -> tuple[int | None, float | None]:
    """A Prometheus counter's increase since it was ``last`` read (None at the first reading), and what
    to remember: a counter below its last value was reset (the engine restarted), counted from zero."""
    if now is None:
        return None, last
    if last is None:
        return None, now
    return int(now - last if now >= last else now), now


def _mib(value: float | None) -> int | None:
    return None if value is None else int(value) // (1 << 20)


def _demand(used: int | None, sig: Signals) -> int | None:
    """What it would use if unfenced (issue 19): its use beyond its KV memory plus the KV its
    engine says it needs (``vramshare_vllm_kv_demand_bytes``); None where the engine does not say."""
    if used is None or sig.kv_demand_mib is None or sig.kv_held_mib is None:
        return None
    return max(used, used - sig.kv_held_mib + sig.kv_demand_mib)


def _detail(v: TenantView) -> dict[str, object]:
    """One GPU's extra fields in the ``quota-mib`` mirror (short keys: it is on every pod)."""
    out: dict[str, object] = {"class": v.qclass, "req": v.request_mib, "floor": v.floor_mib,
                              "why": v.reason[:REASON_CHARS]}
    if v.used_mib is not None:
        out["used"] = v.used_mib
    return out
