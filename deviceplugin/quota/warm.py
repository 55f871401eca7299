"""The warm tier, loop side (issue 23 item 2): idle -> sleep -> lend; wake request -> take back -> grant.

Pure (no I/O: messages go out through the ``send`` callable the adapter gives it,
:mod:`deviceplugin.quota.warm_channel`). The quota loop calls it twice per tick:

* :meth:`WarmBroker.prepare` on each tenant state before :func:`~deviceplugin.quota.policy.rebalance`:
  a *sleeping* engine's tenant is ``WARM`` with floor 0, so the policy shrinks its limit to its measured
  use (the residual a sleeping engine keeps) plus margin and lends the rest to co-tenants; a *waking*
  one is ``WAKING`` with its request as demand, so the policy restores it ahead of everybody and shrinks
  co-tenants that borrowed;
* :meth:`WarmBroker.after_tick` with the tick's phases and decisions: it sends ``sleep`` to engines the
  loop found idle (the class's ``idleSeconds``) that said they can sleep, and ``grant`` to a waking
  engine once the decision gives it its whole reserve on every GPU. The policy's grant layer raises a
  limit only out of memory nobody holds (measured use), so a grant is never memory a co-tenant has not
  released: the wake never finds its memory taken, and with books at the requests (no overcommit) it
  always comes (co-tenants are cut back to their requests first), it only waits.

Overcommit (issue 23 item 5, :mod:`vramshare.overcommit`): a tenant whose class sets
``sleepBookedFraction`` lends its sleeping gap to the scheduler's books beyond the GPU's wake reserve;
:meth:`WarmBroker.sleep_credits` is that credit per GPU, handed to ``on_credits`` after each tick (the
node's inventory and kubelet units follow; a wake withdraws it at once). More wakes at once than the
reserve covers find no memory: such a wake is never refused, it waits for its grant, held asleep by
:meth:`WarmBroker.hold_wakes` while its request does not fit beside the awake pods' requests (as the
replay's rule, :mod:`vramshare.coldstart`, always had it: never out of an awake co-tenant's request); after
``displace_after_ticks`` ungranted ticks the broker asks awake engines of *strictly lower* classes
(``lendingPriority``) on its GPUs to sleep, lowest first, one per tick (an engine that is serving
refuses, the next is asked). Equal or higher classes are never displaced: the wake waits for them to
sleep on their own idle timer, or to leave.

Wake ahead (issue 23, opt-in per class: ``wakeAhead``): after an engine of such a class sleeps, the
broker forecasts its next request from its own timestamps with the replay's one rule
(:meth:`vramshare.coldstart.WakeAhead.due`: the median of its last 8 quiet gaps, a gap being a wake's
time minus the sleep's minus ``idleSeconds``). From the forecast minus its last wake's seconds it books
the engine awake (``WAKING`` to the policy, no credit to the books) when each of its GPUs has the memory
it takes back measured free beyond the largest other sleeper's wake, with no wake waiting there; once
the quota is restored it sends ``prewake``. An engine that answers ``awake`` is up early; one that does
not within ``prewake_answer_s`` declined. A real wake on that GPU that lacks memory first cancels a
booking and sends ``sleep`` to an early-woken engine with no request; with no request by the hold's
end (the forecast plus ``idleSeconds``) it is sent ``sleep`` again: that early wake was wasted.

A wake request pokes the loop (the adapter's ``poke``) so it ticks at once and again every
``fast_tick_s`` while a wake is pending: the wake path never waits for the regular interval.
"""
from __future__ import annotations

import dataclasses
import enum
import math
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

from deviceplugin.quota.model import Bounds, Decision, Phase, PolicyParams, TenantKey, TenantState
from vramshare import contract, logs, overcommit
from vramshare.coldstart import WakeAhead

log = logs.get(__name__)

MIB = 1 << 20


class Sleep(str, enum.Enum):
    AWAKE = "awake"
    SLEEPING = "sleeping"
    WAKING = "waking"


@dataclass(frozen=True)
class _Terms:
    """What a tenant's quota class says to the broker: wake it ahead (``wakeAhead``), its ``idleSeconds``
    (the early wake's hold), and how many sleepers' wakes its GPU keeps room for (``wakeReserve``)."""

    wake_ahead: bool = False
    idle_s: float = 0.0
    wake_reserve: int = 1


_NO_TERMS = _Terms()


@dataclass
class EngineView:
    """What the broker knows of one tenant's engine (metrics, inspect)."""

    can_sleep: bool = False
    model: str = ""  # what the engine serves, as it said (<name>[@<revision>])
    reason: str = ""  # why it cannot sleep, as the engine said
    weights_bytes: int = 0
    state: Sleep = Sleep.AWAKE
    sleep_seq: int = 0  # the last sleep sent
    sleep_pending: bool = False
    sleep_sent_at: float | None = None
    wake_seq: int | None = None  # the wake being served
    wake_since: float | None = None
    freed_bytes: int = 0  # what the last sleep gave back
    lent_mib: int = 0  # request minus limit while asleep: memory co-tenants may use
    last_wake_s: float | None = None  # request arrival to serving, as the engine measured it
    wakes: int = 0
    sleeps: int = 0
    refusals: int = 0
    displaced: int = 0  # sleeps asked of it to make room for a higher class's wake
    ungranted_ticks: int = 0  # ticks a wake has waited for its memory
    waited: int = 0  # wakes that found no memory for a tick or more (the reserve ran out)
    # wake ahead (issue 23): the forecast and the early wake's state
    gaps: list[float] = field(default_factory=list)  # its quiet gaps (last request to the next one), s
    quiet_from: float | None = None  # its last request as the broker dates it (a sleep's time - idleSeconds)
    due: float | None = None  # the forecast next request of this quiet spell
    ahead: str = ""  # "" | "booked" (quota being restored) | "sent" (prewake unanswered)
    ahead_seq: int | None = None  # the prewake's seq
    ahead_at: float | None = None  # when the prewake was sent
    prewoken_until: float | None = None  # woken ahead, no request yet: the hold's end
    request_seen: bool = False  # a running, waiting or finished request since it was woken ahead
    wasted_seq: int | None = None  # the sleep that ends a wasted early wake
    prewakes_used: int = 0
    prewakes_wasted: int = 0
    prewakes_declined: int = 0


def _resident(e: EngineView | None) -> tuple[str, bool] | None:
    """What the node reports of an engine (:meth:`WarmBroker.engines`): its model, and whether it sleeps."""
    return None if e is None else (e.model, e.state is Sleep.SLEEPING)


@dataclass
class WarmBroker:
    send: Callable[[TenantKey, contract.WarmMessage], bool]
    poke: Callable[[], None] = lambda: None
    fast_tick_s: float = 0.2
    sleep_answer_s: float = 60.0  # an engine sleeps in seconds; no answer by then: the message was lost
    params: PolicyParams = field(default_factory=PolicyParams)
    on_credits: Callable[[dict[str, int]], None] | None = None  # the node's inventory/units (item 5)
    # an engine came, went, or slept or woke: what the node reports as resident changed (its residency
    # report follows at once instead of at its next round)
    on_engines: Callable[[], None] = lambda: None
    displace_after_ticks: int = 1  # a wake first lets the policy take back loans, then displaces
    ahead_rule: WakeAhead = field(default_factory=WakeAhead)  # the replay's forecast rule (one rule)
    prewake_answer_s: float = 10.0  # no ``awake`` by the first tick this long after a prewake: declined
    _terms: dict[TenantKey, _Terms] = field(default_factory=dict)  # per tenant, what its class says
    _room: dict[str, tuple[int, dict[TenantKey, tuple[int, int]]]] = field(default_factory=dict)
    _overcommit: dict[tuple[TenantKey, str], tuple[int, int | None, float, int]] = field(default_factory=dict)
    _rank: dict[TenantKey, int] = field(default_factory=dict)
    _credits: dict[str, int] = field(default_factory=dict)
    _reserve: dict[tuple[TenantKey, str], int] = field(default_factory=dict)
    _engines: dict[TenantKey, EngineView] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    # -- messages from the engines (the channel thread) ---------------------------------------------
    def receive(self, key: TenantKey, msg: contract.WarmMessage, now: float) -> None:
        with self._lock:
            before = _resident(self._engines.get(key))
            self._receive(key, msg, now)
            changed = _resident(self._engines.get(key)) != before
        if changed:
            self.on_engines()
        if msg.op == contract.WARM_WAKE:
            self.poke()

    def _receive(self, key: TenantKey, msg: contract.WarmMessage, now: float) -> None:
        """:meth:`receive`'s state change (lock held)."""
        e = self._engines.setdefault(key, EngineView())
        op = msg.op
        if op == contract.WARM_HELLO:
            e.can_sleep = bool(msg.get("canSleep", False))
            e.reason = str(msg.get("reason", "") or "")
            e.model = str(msg.get("model", "") or "")
            e.weights_bytes = int(msg.get("weightsBytes", 0) or 0)  # type: ignore[arg-type]
            # a reconnecting engine (a new process, or a restarted agent) says where it is
            try:
                e.state = Sleep(str(msg.get("state", Sleep.AWAKE.value)))
            except ValueError:
                e.state = Sleep.AWAKE
            e.sleep_pending, e.wake_seq = False, None
            log.info("warm channel: engine said hello", tenant=str(key), can_sleep=e.can_sleep,
                     reason=e.reason or None)
        elif op == contract.WARM_SLEPT and msg.get("seq") == e.sleep_seq and e.sleep_pending:
            e.state, e.sleep_pending = Sleep.SLEEPING, False
            e.freed_bytes = int(msg.get("freedBytes", 0) or 0)  # type: ignore[arg-type]
            e.sleeps += 1
            self._slept(key, e, msg.get("seq") == e.wasted_seq, now)
            log.info("engine asleep, memory lent", tenant=str(key), freed_mib=e.freed_bytes // MIB)
        elif op == contract.WARM_REFUSED and msg.get("seq") == e.sleep_seq:
            e.sleep_pending = False
            e.refusals += 1
            if msg.get("seq") == e.wasted_seq and e.prewoken_until is not None:
                e.request_seen = e.request_seen or msg.get("reason") == "busy"
                e.wasted_seq = None
            log.info("engine did not sleep", tenant=str(key), reason=msg.get("reason"))
        elif op == contract.WARM_WAKE:
            e.state, e.wake_seq, e.sleep_pending = Sleep.WAKING, int(msg.get("seq", 0)), False  # type: ignore[arg-type]
            e.wake_since = now
            if e.ahead == "sent":  # it took a request before the early wake: that prewake was ignored
                e.prewakes_declined += 1
            e.ahead, e.due = "", None
            if e.quiet_from is not None:
                e.gaps.append(now - e.quiet_from)
                e.quiet_from = None
            log.info("wake requested: taking memory back", tenant=str(key), seq=e.wake_seq)
        elif (op == contract.WARM_AWAKE and e.state is Sleep.SLEEPING and e.ahead_seq is not None
              and msg.get("seq") == e.ahead_seq):  # up ahead of its forecast request (a late one too)
            hold = self.ahead_rule.hold_s
            hold = self._terms.get(key, _NO_TERMS).idle_s if hold is None else hold
            e.state, e.lent_mib, e.ahead_seq, e.request_seen = Sleep.AWAKE, 0, None, False
            e.prewoken_until = max(now, e.due if e.due is not None else now) + hold
            e.ahead = ""
            log.info("engine woken ahead of its forecast request", tenant=str(key),
                     hold_s=round(e.prewoken_until - now, 3))
        elif op == contract.WARM_AWAKE:
            e.state, e.wake_seq, e.wake_since, e.lent_mib = Sleep.AWAKE, None, None, 0
            e.last_wake_s = float(msg.get("seconds", 0.0) or 0.0)  # type: ignore[arg-type]
            e.wakes += 1

    def _slept(self, key: TenantKey, e: EngineView, wasted: bool, now: float) -> None:
        """After a confirmed sleep (lock held): date its last request and arm one forecast per quiet
        spell; a sleep that ends an early wake with no request counts it wasted and arms nothing."""
        terms = self._terms.get(key, _NO_TERMS)
        ahead, idle_s = terms.wake_ahead, terms.idle_s
        e.ahead, e.ahead_seq, e.wasted_seq = "", None, None
        if e.prewoken_until is not None:
            e.prewoken_until = None
            if wasted or not e.request_seen:
                e.prewakes_wasted += 1
                e.due = None
                log.info("early wake wasted: no request came", tenant=str(key))
                return
        sent = e.sleep_sent_at if e.sleep_sent_at is not None else now
        e.quiet_from = sent - idle_s
        e.due = self.ahead_rule.due(e.gaps, e.quiet_from) if ahead else None

    def forget(self, alive: Iterable[TenantKey]) -> None:
        keep = set(alive)
        with self._lock:
            gone = not self._engines.keys() <= keep
            self._engines = {k: v for k, v in self._engines.items() if k in keep}
            self._reserve = {k: v for k, v in self._reserve.items() if k[0] in keep}
            self._overcommit = {k: v for k, v in self._overcommit.items() if k[0] in keep}
            self._rank = {k: v for k, v in self._rank.items() if k in keep}
            self._terms = {k: v for k, v in self._terms.items() if k in keep}
        if gone:
            self.on_engines()

    def disconnected(self, key: TenantKey) -> None:
        """The engine's connection closed (process gone): its memory is no longer asleep or waking."""
        with self._lock:
            gone = self._engines.pop(key, None) is not None
        if gone:
            self.on_engines()

    # -- the loop's tick --------------------------------------------------------------------------------
    def prepare(self, t: TenantState, gpu: str, terms: Any = None) -> TenantState:
        """The tenant as the policy should see it: asleep -> WARM at floor 0; waking -> WAKING, demand =
        its request. Awake engines (and tenants without one) are left as the loop saw them. ``terms``
        (its class, :class:`~deviceplugin.quota.classes.ClassTerms`) says whether it may be overcommitted."""
        with self._lock:
            e = self._engines.get(t.key)
            state = e.state if e else Sleep.AWAKE
        b = t.bounds or self.params.bounds_of(t.request_mib)
        fraction = getattr(terms, "sleep_booked_fraction", None)
        with self._lock:
            self._reserve[(t.key, gpu)] = b.clamp(t.request_mib)
            self._rank[t.key] = t.rank
            self._terms[t.key] = _Terms(bool(getattr(terms, "wake_ahead", False)),
                                        float(getattr(terms, "idle_seconds", 0.0) or 0.0),
                                        max(1, int(getattr(terms, "wake_reserve", 1) or 1)))
            if e is not None and e.prewoken_until is not None and (t.signals.running or t.signals.waiting
                                                                   or t.signals.finished):
                e.request_seen = True
            ahead = e is not None and e.state is Sleep.SLEEPING and e.ahead != ""
            if ahead and e is not None and e.ahead == "booked" and self._wake_on(gpu):
                e.ahead = ""  # a real wake came first: it has the memory
                log.info("wake ahead cancelled: a wake waits on its GPU", tenant=str(t.key), gpu=gpu)
                ahead = False
            if fraction is None:
                self._overcommit.pop((t.key, gpu), None)
            else:
                self._overcommit[(t.key, gpu)] = (t.request_mib, t.used_mib, float(fraction),
                                                  int(getattr(terms, "wake_reserve", 1)))
        if ahead and t.used_mib is not None:  # booked awake: its request restored, as a wake's
            return dataclasses.replace(t, phase=Phase.WAKING, demand_mib=max(t.request_mib, t.used_mib))
        if state is Sleep.AWAKE or t.used_mib is None:
            return t
        if state is Sleep.SLEEPING or not self._first_waking(t.key, gpu):
            # a wake queued behind an earlier one on this GPU waits asleep: wakes that compete for the same
            # memory are restored one whole request at a time, never each a part that reaches none
            return dataclasses.replace(t, phase=Phase.WARM, bounds=Bounds(0, b.ceiling_mib, b.margin_mib))
        return dataclasses.replace(t, phase=Phase.WAKING, demand_mib=max(t.request_mib, t.used_mib))

    def hold_wakes(self, gpu: str, capacity: int, states: Sequence[TenantState],
                   reserved_mib: int = 0) -> list[TenantState]:
        """The GPU's prepared tenants, with a wake of an overcommit class's sleeper held asleep (``WARM``
        at floor 0, as a queued wake) while its request does not fit beside every other tenant's request
        (sleepers at what they hold; a sleeper without a reading, or an awake idle one, at its request)
        and the pending claims (``reserved_mib``). Within the wake reserve
        it fits, by the books' rule (:mod:`vramshare.overcommit`); beyond it (more wakes at once than the
        reserve, or a reserve a placement used) the policy would restore it ahead of everybody out of
        awake pods' requests, cutting a co-tenant below what the books promised it. Held, it waits for
        its grant and displaces lower classes (:meth:`after_tick`); it is never refused. Books at the
        requests (no overcommit class) always fit: nothing is held."""
        out = list(states)
        with self._lock:
            # what wake ahead may use (after_tick): the GPU's memory measured free, and each tenant's
            # reserve and use (a tenant without a reading counts at its reserve)
            held = {s.key: (self._reserve.get((s.key, gpu), s.request_mib),
                            s.used_mib if s.used_mib is not None else self._reserve.get((s.key, gpu), s.request_mib))
                    for s in out}
            self._room[gpu] = (capacity - reserved_mib - sum(u for _, u in held.values()), held)
            asleep = {k for k, e in self._engines.items() if e.state is not Sleep.AWAKE}
            for i, t in enumerate(out):
                e = self._engines.get(t.key)
                if (t.phase is not Phase.WAKING or e is None or e.state is not Sleep.WAKING
                        or (t.key, gpu) not in self._overcommit):
                    continue
                b = t.bounds or self.params.bounds_of(t.request_mib)
                others = sum(held[s.key][1] if s.key in asleep and s.phase is Phase.WARM
                             else (s.bounds or self.params.bounds_of(s.request_mib)).clamp(s.request_mib)
                             for s in out if s.key != t.key)
                if others + reserved_mib + b.clamp(t.request_mib) <= capacity:
                    continue
                log.info("wake beyond the wake reserve waits: its request is awake pods' requests",
                         tenant=str(t.key), gpu=gpu, others_mib=others + reserved_mib, capacity_mib=capacity)
                out[i] = dataclasses.replace(t, phase=Phase.WARM, demand_mib=None,
                                             bounds=Bounds(0, b.ceiling_mib, b.margin_mib))
        return out

    def _wake_on(self, gpu: str) -> bool:
        """A real wake waits on ``gpu`` (lock held)."""
        return any(e.state is Sleep.WAKING and (k, gpu) in self._reserve for k, e in self._engines.items())

    def _gpus_of(self) -> dict[TenantKey, set[str]]:
        out: dict[TenantKey, set[str]] = {}
        for k, g in self._reserve:
            out.setdefault(k, set()).add(g)
        return out

    def _wake_ahead(self, now: float) -> list[tuple[TenantKey, str]]:
        """Engines to book awake ahead of their forecast request (lock held): due by now, with what each
        of their GPUs has measured free covering their wake beyond the other sleepers' largest wakes, as
        many as the most any of their classes keeps room for (``wakeReserve``; the replay's
        ``room_ahead`` with its reserve of one), and no wake waiting there. A spell whose hold has passed
        is dropped."""
        gpus_of = self._gpus_of()
        taken: dict[str, int] = {}  # needs of engines already booked or sent, not in the reading yet
        for k, e in self._engines.items():
            if e.state is Sleep.SLEEPING and e.ahead:
                for g in gpus_of.get(k, ()):
                    r, u = self._room.get(g, (0, {}))[1].get(k, (0, 0))
                    taken[g] = taken.get(g, 0) + max(0, r - u)
        out = []
        for key, e in sorted(self._engines.items()):
            terms = self._terms.get(key, _NO_TERMS)
            on, idle_s = terms.wake_ahead, terms.idle_s
            if not on or e.state is not Sleep.SLEEPING or e.ahead or e.sleep_pending or e.due is None:
                continue
            hold = idle_s if self.ahead_rule.hold_s is None else self.ahead_rule.hold_s
            if now >= e.due + hold:
                e.due = None  # this spell's forecast has passed
                continue
            if now < e.due - self.ahead_rule.lead_s - (e.last_wake_s or 0.0):
                continue
            gpus = gpus_of.get(key, set())
            ok = bool(gpus)
            for g in gpus:
                free, held = self._room.get(g, (0, {}))
                need = max(0, held.get(key, (0, 0))[0] - held.get(key, (0, 0))[1])
                others = sorted(((r - u, k) for k, (r, u) in held.items() if k != key and k in self._engines
                                 and self._engines[k].state is Sleep.SLEEPING and not self._engines[k].ahead),
                                reverse=True)
                keep = max((self._terms.get(k, _NO_TERMS).wake_reserve for _, k in others), default=1)
                kept = sum(gap for gap, _ in others[:keep])  # room for that many of their wakes at once
                ok = ok and (key in held and not self._wake_on(g) and free - taken.get(g, 0) - kept >= need)
            if not ok:
                continue
            for g in gpus:
                r, u = self._room[g][1][key]
                taken[g] = taken.get(g, 0) + max(0, r - u)
            e.ahead = "booked"
            out.append((key, ",".join(sorted(gpus))))
            log.info("waking ahead of a forecast request: memory free beyond the wake reserve",
                     tenant=str(key), gpus=",".join(sorted(gpus)), due_in_s=round(e.due - now, 3))
        return out

    def _wake_order(self, key: TenantKey) -> tuple:
        e = self._engines[key]
        return (-self._rank.get(key, 0), e.wake_since if e.wake_since is not None else 0.0, key)

    def _first_waking(self, key: TenantKey, gpu: str) -> bool:
        """Is ``key`` the first wake on ``gpu`` (higher class first, then the earlier request)? Every GPU
        orders wakes alike, so the first of all is first on each of its GPUs: some wake always proceeds."""
        with self._lock:
            return self._first_on(key, gpu)

    def note(self, decided: Mapping[tuple[TenantKey, str], Decision]) -> None:
        """Record what each sleeping engine lends under this tick's decisions (its reserve minus its new
        limit): called before the files and the mirror are written, so both show it."""
        with self._lock:
            lent: dict[TenantKey, int] = {}
            for (key, gpu), d in decided.items():
                e = self._engines.get(key)
                if e is not None and e.state is Sleep.SLEEPING:
                    lent[key] = lent.get(key, 0) + max(0, self._reserve.get((key, gpu), 0) - d.limit_mib)
            for key, e in self._engines.items():
                e.lent_mib = lent.get(key, 0) if e.state is Sleep.SLEEPING else 0

    def after_tick(self, phases: Mapping[TenantKey, Phase],
                   decided: Mapping[tuple[TenantKey, str], Decision],
                   now: float | None = None) -> list[tuple[TenantKey, contract.WarmMessage]]:
        """Send ``sleep`` to idle engines that can sleep and ``grant`` to waking engines whose decision
        reached their reserve (the request within their bounds) on every GPU they hold; returns what
        was sent. A sleep unanswered for ``sleep_answer_s`` (by ``now``) may be sent again."""
        reserve = (lambda key, gpu: self._reserve.get((key, gpu), 0))
        per_key: dict[TenantKey, list[Decision]] = {}
        for (key, _), d in decided.items():
            per_key.setdefault(key, []).append(d)
        out: list[tuple[TenantKey, contract.WarmMessage]] = []
        with self._lock:
            out.extend(self._yield_ahead(per_key, reserve, now))
            for key, e in self._engines.items():
                if (e.sleep_pending and now is not None and e.sleep_sent_at is not None
                        and now - e.sleep_sent_at > self.sleep_answer_s):
                    log.warning("engine did not answer a sleep; asking again when idle", tenant=str(key))
                    e.sleep_pending = False
                ds = per_key.get(key, [])
                restored = bool(ds) and all(d.limit_mib >= reserve(key, d.gpu_uuid) for d in ds)
                if e.state is Sleep.WAKING and restored:
                    out.append((key, contract.WarmMessage.of(
                        contract.WARM_GRANT, seq=e.wake_seq, bytes=sum(d.limit_mib for d in ds) * MIB)))
                elif e.state is Sleep.SLEEPING and e.ahead == "booked":
                    if restored:  # the quota carries it: wake ahead
                        e.sleep_seq += 1
                        e.ahead, e.ahead_seq, e.ahead_at = "sent", e.sleep_seq, now
                        out.append((key, contract.WarmMessage.of(contract.WARM_PREWAKE, seq=e.sleep_seq,
                                                                 bytes=sum(d.limit_mib for d in ds) * MIB)))
                    else:
                        e.ahead = ""
                        log.info("wake ahead cancelled: its quota was not restored", tenant=str(key))
                elif e.state is Sleep.SLEEPING and e.ahead == "sent" and now is not None and (
                        e.ahead_at is None or now - e.ahead_at >= self.prewake_answer_s):
                    e.ahead, e.due = "", None
                    e.prewakes_declined += 1
                    log.info("prewake declined: no answer", tenant=str(key), seq=e.ahead_seq)
                elif e.state is Sleep.AWAKE and e.prewoken_until is not None and e.request_seen:
                    e.prewoken_until, e.request_seen = None, False
                    e.prewakes_used += 1
                    if e.quiet_from is not None and now is not None:
                        e.gaps.append(now - e.quiet_from)  # its request came while up early
                    e.quiet_from, e.due = None, None
                elif (e.state is Sleep.AWAKE and e.can_sleep and not e.sleep_pending
                      and e.prewoken_until is not None):
                    if now is not None and now >= e.prewoken_until:  # the hold passed with no request
                        out.append((key, self._sleep_wasted(key, e, now)))
                elif (e.state is Sleep.AWAKE and e.can_sleep and not e.sleep_pending
                      and phases.get(key) is Phase.WARM):
                    e.sleep_seq += 1
                    e.sleep_pending, e.sleep_sent_at = True, now
                    out.append((key, contract.WarmMessage.of(contract.WARM_SLEEP, seq=e.sleep_seq, level=1)))
            if now is not None:
                self._wake_ahead(now)  # booked now: restored next tick, then prewake
            out.extend(self._displace(per_key, reserve, now))
        sent = []
        for key, msg in out:
            if self.send(key, msg):
                sent.append((key, msg))
                log.info("warm channel: sent", tenant=str(key), op=msg.op, seq=msg.get("seq"))
            elif msg.op == contract.WARM_SLEEP:
                with self._lock:
                    if key in self._engines:
                        self._engines[key].sleep_pending = False
        self._publish_credits()
        return sent

    def _sleep_wasted(self, key: TenantKey, e: EngineView, now: float | None) -> contract.WarmMessage:
        """``sleep`` to an engine woken ahead with no request (lock held): its early wake is wasted once
        the engine confirms (``slept``); a ``busy`` refusal means a request came after all."""
        e.sleep_seq += 1
        e.sleep_pending, e.sleep_sent_at, e.wasted_seq = True, now, e.sleep_seq
        log.info("early-woken engine with no request sent back to sleep", tenant=str(key))
        return contract.WarmMessage.of(contract.WARM_SLEEP, seq=e.sleep_seq, level=1)

    def _yield_ahead(self, per_key: Mapping[TenantKey, list[Decision]],
                     reserve: Callable[[TenantKey, str], int],
                     now: float | None) -> list[tuple[TenantKey, contract.WarmMessage]]:
        """A real wake short of memory on a GPU takes it from wake ahead first, whatever the classes
        (lock held): bookings there are cancelled, an unanswered prewake counts declined, and an engine
        woken ahead with no request is sent ``sleep``."""
        short: set[str] = set()
        for key, e in self._engines.items():
            if e.state is Sleep.WAKING:
                short |= {d.gpu_uuid for d in per_key.get(key, []) if d.limit_mib < reserve(key, d.gpu_uuid)}
        if not short:
            return []
        out = []
        gpus_of = self._gpus_of()
        for key, e in self._engines.items():
            if not gpus_of.get(key, set()) & short:
                continue
            if e.state is Sleep.SLEEPING and e.ahead:
                e.prewakes_declined += e.ahead == "sent"
                e.ahead, e.due = "", None
                log.info("wake ahead yields to a wake", tenant=str(key))
            elif (e.state is Sleep.AWAKE and e.prewoken_until is not None and not e.request_seen
                  and not e.sleep_pending and e.can_sleep):
                out.append((key, self._sleep_wasted(key, e, now)))
        return out

    def _displace(self, per_key: Mapping[TenantKey, list[Decision]],
                  reserve: Callable[[TenantKey, str], int], now: float | None) -> list[tuple[TenantKey, contract.WarmMessage]]:
        """Sleep asked of one awake engine of a strictly lower class per waiting wake (lock held)."""
        out: list[tuple[TenantKey, contract.WarmMessage]] = []
        asked: set[TenantKey] = set()
        gpus_of: dict[TenantKey, set[str]] = {}
        for k, g in self._reserve:
            gpus_of.setdefault(k, set()).add(g)
        for key, e in sorted(self._engines.items(), key=lambda kv: -self._rank.get(kv[0], 0)):
            ds = per_key.get(key, [])
            if e.state is not Sleep.WAKING:
                continue
            if not ds or all(d.limit_mib >= reserve(key, d.gpu_uuid) for d in ds):
                e.ungranted_ticks = 0
                continue
            e.ungranted_ticks += 1
            e.waited += e.ungranted_ticks == 1
            if not all(self._first_on(key, g) for g in gpus_of.get(key, ())):
                continue  # queued behind an earlier wake: that one displaces first
            if e.ungranted_ticks <= self.displace_after_ticks:
                continue
            short = {d.gpu_uuid for d in ds if d.limit_mib < reserve(key, d.gpu_uuid)}
            rank = self._rank.get(key, 0)
            victims = sorted((self._rank.get(k, 0), k) for k, v in self._engines.items()
                             if k not in asked and k != key and v.state is Sleep.AWAKE and v.can_sleep
                             and not v.sleep_pending and self._rank.get(k, 0) < rank
                             and gpus_of.get(k, set()) & short)
            if not victims:
                continue  # nothing lower to displace: the wake waits (it is never refused)
            _, victim = victims[0]
            v = self._engines[victim]
            v.sleep_seq += 1
            v.sleep_pending, v.sleep_sent_at, v.displaced = True, now, v.displaced + 1
            asked.add(victim)
            log.info("asking a lower class to sleep for a wake", tenant=str(victim), waking=str(key),
                     rank=self._rank.get(victim, 0), waking_rank=rank)
            out.append((victim, contract.WarmMessage.of(contract.WARM_SLEEP, seq=v.sleep_seq, level=1)))
        return out

    def _first_on(self, key: TenantKey, gpu: str) -> bool:
        mine = self._wake_order(key)
        return not any(e.state is Sleep.WAKING and k != key and (k, gpu) in self._reserve
                       and self._wake_order(k) < mine for k, e in self._engines.items())

    def _sleepers(self) -> list[tuple[TenantKey, overcommit.Sleeper]]:
        """The sleeping tenants of overcommit classes, per GPU; a waking engine, or one booked awake
        ahead of a forecast request, is none."""
        with self._lock:
            return [(key, overcommit.Sleeper(gpu, req, used if used is not None else req, frac, k))
                    for (key, gpu), (req, used, frac, k) in self._overcommit.items()
                    if (e := self._engines.get(key)) is not None and e.state is Sleep.SLEEPING and not e.ahead]

    def sleep_credits(self) -> dict[str, int]:
        """Per GPU, MiB the sleeping tenants of overcommit classes lend to the books beyond the reserve
        (:func:`vramshare.overcommit.credits`); a waking engine lends nothing."""
        return overcommit.credits(s for _, s in self._sleepers())

    def booked_sleepers(self) -> dict[tuple[TenantKey, str], int]:
        """Per (tenant, GPU), MiB the books count a sleeping tenant of an overcommit class at (its
        class's fraction of its request, never below what it holds): what a claim prepared beside it
        may count it at (the DRA preparer's room check)."""
        return {(key, s.gpu): math.ceil(s.booked) for key, s in self._sleepers()}

    def _publish_credits(self) -> None:
        if self.on_credits is None:
            return
        credits = self.sleep_credits()
        if credits != self._credits:
            self._credits = credits
            self.on_credits(dict(credits))

    def wake_pending(self) -> bool:
        """A wake waits for memory: the loop should tick again within ``fast_tick_s``."""
        with self._lock:
            return any(e.state is Sleep.WAKING or e.ahead == "booked" for e in self._engines.values())

    def engines(self, gpus_of: Mapping[TenantKey, Iterable[str]],
                annotated: Mapping[TenantKey, str] | None = None) -> list[tuple[contract.ModelRef, str, str]]:
        """``(model, gpu uuid, "awake" | "sleeping")`` of every engine with a valid model: what the node
        reports as resident (a waking engine counts as awake). The model is the one the engine named, else
        its pod's ``<domain>/model`` annotation (``annotated``): vLLM started from a local path names a
        path, not a model."""
        out = []
        for key, e in self.views().items():
            ref = None
            for name in (e.model, (annotated or {}).get(key, "")):
                try:
                    ref = contract.parse_model_ref(name)
                    break
                except contract.ModelRefError:
                    continue
            if ref is None:
                continue
            state = "sleeping" if e.state is Sleep.SLEEPING else "awake"
            out.extend((ref, gpu, state) for gpu in gpus_of.get(key, ()))
        return out

    def views(self) -> dict[TenantKey, EngineView]:
        with self._lock:
            return {k: dataclasses.replace(v) for k, v in self._engines.items()}
