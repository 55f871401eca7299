"""Wake ahead, live (issue 23): the broker forecasts a sleeping engine's next request from its own
timestamps (the replay's one rule, :meth:`vramshare.coldstart.WakeAhead.due`) and sends ``prewake``
only into memory measured free beyond the wake reserve; a real wake takes the memory back first; an
early wake with no request is slept again after the hold and counted wasted; an engine that does not
answer declined. The broker goes through the real policy (``rebalance``) every tick; the engines are
fakes at the channel boundary (they answer as the plugin does, or drop ``prewake`` as an old one)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from deviceplugin.quota.warm_channel import WarmCollector
from deviceplugin.quota.classes import ClassTerms
from deviceplugin.quota.model import Bounds, GpuState, Phase, PolicyParams, Signals, TenantKey, TenantState
from deviceplugin.quota.policy import rebalance
from deviceplugin.quota.warm import Sleep, WarmBroker
from vramshare import contract
from vramshare.coldstart import WakeAhead
from vramshare.config import OverLimitAction

P = PolicyParams(floor_fraction=0.5, ceiling_fraction=1.0, step_mib=256, margin_mib=512)
GPU = "GPU-0"
IDLE_S = 30.0
RESIDUAL = 1000
REQ = 20000
AHEAD = TenantKey("ns", "ahead", "c")  # a class with wakeAhead
OTHER = TenantKey("ns", "other", "c")  # a sleeper without it
BUSY = TenantKey("ns", "busy", "c")  # an awake co-tenant
THIRD = TenantKey("ns", "third", "c")  # another sleeper, where a rig asks for one


def terms(ahead: bool, wake_reserve: int = 1) -> ClassTerms:
    return ClassTerms("warm" if ahead else "default", 0.5, None, 1.0, None, 512, IDLE_S, 0,
                      OverLimitAction.EVENT, wake_reserve=wake_reserve, wake_ahead=ahead)


class FakeEngine:
    """An engine at the channel boundary: obeys sleep when idle, answers prewake as the plugin does
    (``old``: drops it, as an engine that does not know the op), and its use follows its state."""

    def __init__(self, rig: "Rig", key: TenantKey, old: bool = False):
        self.rig, self.key, self.old = rig, key, old
        self.running = 0
        self.finished = 0  # requests finished since the last tick (vllm:request_success_total's increase)
        self.wake_seq = 0

    def on(self, msg: contract.WarmMessage, now: float) -> None:
        r, b = self.rig, self.rig.broker
        if msg.op == contract.WARM_SLEEP:
            if self.running:
                b.receive(self.key, contract.WarmMessage.of(contract.WARM_REFUSED, seq=msg.get("seq"), reason="busy"),
                          now)
                return
            r.used[self.key] = RESIDUAL
            b.receive(self.key, contract.WarmMessage.of(contract.WARM_SLEPT, seq=msg.get("seq")), now)
        elif msg.op == contract.WARM_PREWAKE and not self.old:
            if b.views()[self.key].state is Sleep.SLEEPING and not self.running:
                r.prewakes.append((self.key, now, r.free_beyond_reserve(self.key)))
                r.used[self.key] = REQ - 1000
                b.receive(self.key, contract.WarmMessage.of(contract.WARM_AWAKE, seq=msg.get("seq"), seconds=1.0), now)
        elif msg.op == contract.WARM_GRANT:
            r.used[self.key] = REQ - 1000
            b.receive(self.key, contract.WarmMessage.of(contract.WARM_AWAKE, seq=msg.get("seq"), seconds=1.0), now)

    def request(self, now: float) -> None:
        """A request arrives: a sleeping engine asks for a wake (the plugin's ``before_request``)."""
        self.running = 1
        if self.rig.broker.views()[self.key].state is Sleep.SLEEPING:
            self.wake_seq += 1
            self.rig.broker.receive(self.key, contract.WarmMessage.of(contract.WARM_WAKE, seq=self.wake_seq), now)


class Rig:
    def __init__(self, cap: int = 60000, old: bool = False, ahead: bool = True, busy_used: int = 10000,
                 third: bool = False, others_reserve: int = 1):
        self.cap = cap
        self.broker = WarmBroker(send=self.send, params=P)
        sleepers = (OTHER, THIRD) if third else (OTHER,)
        self.engines = {AHEAD: FakeEngine(self, AHEAD, old), **{k: FakeEngine(self, k) for k in sleepers}}
        self.terms = {AHEAD: terms(ahead), BUSY: terms(False), **{k: terms(False, others_reserve) for k in sleepers}}
        self.limits = {k: REQ for k in (*self.engines, BUSY)}
        self.used = {**{k: REQ - 1000 for k in self.engines}, BUSY: busy_used}
        self.idle_since = {k: 0.0 for k in self.engines}
        self.out: list[tuple[float, TenantKey, contract.WarmMessage]] = []
        self.prewakes: list[tuple[TenantKey, float, int]] = []
        self.now = 0.0
        self.reserved = 0  # pending claims on the GPU (a pod admitted, not started)
        for k in self.engines:
            self.broker.receive(k, contract.WarmMessage.of(contract.WARM_HELLO, canSleep=True), 0.0)

    def send(self, key: TenantKey, msg: contract.WarmMessage) -> bool:
        self.out.append((self.now, key, msg))
        return True

    def free_beyond_reserve(self, key: TenantKey) -> int:
        """Measured free on the GPU minus the largest other sleeper's wake, before ``key`` takes its own."""
        free = self.cap - self.reserved - sum(self.used.values())
        others = [REQ - self.used[k] for k, e in self.broker.views().items()
                  if k != key and e.state is Sleep.SLEEPING]
        return free - max(others, default=0) - (REQ - self.used[key])

    def tick(self, now: float) -> list[tuple[TenantKey, contract.WarmMessage]]:
        self.now = now
        b = self.broker
        states, phases = [], {}
        for k in (*self.engines, BUSY):
            running = self.engines[k].running if k in self.engines else 1
            if k in self.engines and self.engines[k].finished:  # traffic between ticks, as Warmth reads it
                self.idle_since[k] = now
            idle = k in self.engines and not running and now - self.idle_since[k] >= IDLE_S
            phases[k] = Phase.WARM if idle else Phase.HOT
            finished = self.engines[k].finished if k in self.engines else 0
            if k in self.engines:
                self.engines[k].finished = 0
            t = TenantState(k, REQ, self.limits[k], self.used[k],
                            Signals(running=running, waiting=0, kv_usage=0.0, finished=finished), phase=phases[k])
            states.append(b.prepare(t, GPU, self.terms[k]))
        states = b.hold_wakes(GPU, self.cap, states, self.reserved)
        gpu = GpuState(GPU, self.cap, tuple(states), reserved_mib=self.reserved)
        decided = {(d.key, GPU): d for d in rebalance(gpu, P)}
        b.note(decided)
        before = len(self.out)
        b.after_tick(phases, decided, now)
        for (k, _), d in decided.items():
            self.limits[k] = d.limit_mib
        assert sum(max(self.limits[k], self.used[k]) for k in self.limits) + self.reserved <= self.cap  # granted once
        sent = [(k, m) for _, k, m in self.out[before:]]
        for k, m in sent:
            self.engines[k].on(m, now)
        return sent

    def serve(self, key: TenantKey, at: float) -> None:
        """A request at ``at``: woken if asleep (ticks until granted), served, then idle from ``at``."""
        e = self.engines[key]
        self.tick(at - 0.5)
        e.request(at)
        t = at
        while self.broker.views()[key].state is not Sleep.AWAKE:
            t += 0.2
            assert t < at + 60, "the wake was never granted"
            self.tick(t)
        self.tick(t + 0.2)
        e.running = 0
        self.idle_since[key] = t + 0.2

    def run(self, start: float, end: float, step: float = 1.0) -> list[tuple[float, TenantKey, contract.WarmMessage]]:
        before = len(self.out)
        t = start
        while t <= end:
            self.tick(t)
            t += step
        return self.out[before:]


def history(rig: Rig, gaps: int = 3, every: float = 100.0) -> float:
    """AHEAD serves a request every ``every`` s and sleeps ``IDLE_S`` after each: ``gaps`` quiet gaps."""
    rig.run(1.0, IDLE_S + 1)
    assert rig.broker.views()[AHEAD].state is Sleep.SLEEPING
    t = 0.0
    for _ in range(gaps):
        t += every
        rig.serve(AHEAD, t)
        rig.run(t + 1, t + IDLE_S + 2)
        assert rig.broker.views()[AHEAD].state is Sleep.SLEEPING
    return t + every  # the next request, as forecast


def ops(out, key=None, op=None):
    return [(t, k, m) for t, k, m in out if (key is None or k == key) and (op is None or m.op == op)]


def test_the_forecast_is_the_replays_rule():
    rule = WakeAhead()
    assert rule.due([100.0, 90.0, 110.0], 300.0) == 400.0  # the median of the quiet gaps
    assert rule.due([100.0, 100.0], 300.0) is None  # fewer than min_history
    assert rule.due([1.0] * 5 + [100.0] * 8, 0.0) == 100.0  # the last 8 only


def test_a_regular_client_finds_its_engine_woken_ahead_and_the_early_wake_is_used():
    rig = Rig()
    due = history(rig)
    out = rig.run(due - 60, due - 0.5, step=0.5)
    pre = ops(out, AHEAD, contract.WARM_PREWAKE)
    assert len(pre) == 1 and due - 3 <= pre[0][0] < due  # woken its last wake's seconds (1 s) ahead
    assert rig.broker.views()[AHEAD].state is Sleep.AWAKE
    assert not ops(out, AHEAD, contract.WARM_SLEEP)  # held up, although idle for far longer than idleSeconds
    assert rig.broker.sleep_credits() == {}  # booked awake: no credit to the books
    wakes = rig.broker.views()[AHEAD].wakes
    rig.engines[AHEAD].request(due)
    rig.tick(due + 0.5)
    v = rig.broker.views()[AHEAD]
    assert v.wakes == wakes and v.state is Sleep.AWAKE  # no wake in the request's path
    assert (v.prewakes_used, v.prewakes_wasted, v.prewakes_declined) == (1, 0, 0)
    assert abs(v.gaps[-1] - 100.0) <= 1.5  # the request came while up early: its gap still counts (tick-dated)


def test_prewake_is_sent_only_into_free_memory_beyond_the_wake_reserve():
    # 60 GiB, 3 claimed by a pod starting: BUSY uses 20, the two sleepers 1 each: 35 free. AHEAD takes
    # 19 back and OTHER's wake (19) is kept: 38 is needed, so no early wake (a real wake, 19, fits)
    # until BUSY uses 5 less
    rig = Rig(cap=60000, busy_used=20000)
    due = history(rig)
    rig.reserved = 3000
    assert rig.broker.views()[OTHER].state is Sleep.SLEEPING
    out = rig.run(due - 30, due + 5, step=0.5)
    assert not ops(out, op=contract.WARM_PREWAKE)
    rig.serve(AHEAD, due + 6)  # its request wakes it the ordinary way
    rig.run(due + 7, due + 7 + IDLE_S)
    assert rig.broker.views()[AHEAD].state is Sleep.SLEEPING
    rig.used[BUSY] = 15000
    due2 = rig.broker.views()[AHEAD].due
    assert due2 is not None and due2 > rig.now
    out = rig.run(due2 - 30, due2 - 0.5, step=0.5)
    assert len(ops(out, AHEAD, contract.WARM_PREWAKE)) == 1
    assert rig.prewakes and all(room >= 0 for _, _, room in rig.prewakes)  # measured free beyond the reserve


def test_prewake_keeps_room_for_as_many_wakes_as_the_sleepers_classes_reserve():
    """Two other sleepers (19 GiB wakes each) beside AHEAD: 80 GiB, BUSY uses 20, the sleepers 1 each and
    3 are claimed by a pod starting, so 54 are free. With their class's wakeReserve 1 one wake is kept
    (19 + AHEAD's 19 = 38 fit): AHEAD is woken ahead. With wakeReserve 2 both are kept (57 do not fit):
    it is not, and a real wake still is."""
    for reserve, woken in ((1, 1), (2, 0)):
        rig = Rig(cap=80000, busy_used=20000, third=True, others_reserve=reserve)
        due = history(rig)
        rig.reserved = 3000
        assert {rig.broker.views()[k].state for k in (OTHER, THIRD)} == {Sleep.SLEEPING}
        out = rig.run(due - 30, due - 0.5, step=0.5)
        assert len(ops(out, AHEAD, contract.WARM_PREWAKE)) == woken, reserve
    rig.serve(AHEAD, due)  # its request wakes it the ordinary way (its wake is within the reserve)
    assert rig.broker.views()[AHEAD].state is Sleep.AWAKE


def test_no_prewake_while_a_wake_waits_on_the_gpu():
    rig = Rig(cap=42000, busy_used=1000)
    due = history(rig)
    rig.used[BUSY] = 20000
    rig.engines[OTHER].request(due - 10)  # OTHER's wake takes what there is
    out = rig.run(due - 9.5, due - 0.5, step=0.5)
    assert not ops(out, AHEAD, contract.WARM_PREWAKE)
    assert ops(out, OTHER, contract.WARM_GRANT)


def test_a_real_wake_sends_the_early_woken_engine_back_to_sleep_first():
    rig = Rig(cap=42000, busy_used=1000)
    due = history(rig)
    rig.run(due - 5, due - 0.5, step=0.5)
    assert rig.broker.views()[AHEAD].state is Sleep.AWAKE
    rig.used[BUSY] = 20000
    rig.limits[BUSY] = 20000
    rig.engines[OTHER].request(due - 0.2)  # OTHER needs 19 GiB: only AHEAD's early wake holds it
    out = rig.run(due - 0.1, due + 3, step=0.2)
    sleep_at = [t for t, _, _ in ops(out, AHEAD, contract.WARM_SLEEP)]
    grant_at = [t for t, _, _ in ops(out, OTHER, contract.WARM_GRANT)]
    assert sleep_at and grant_at and sleep_at[0] < grant_at[0]
    v = rig.broker.views()[AHEAD]
    assert v.state is Sleep.SLEEPING and v.prewakes_wasted == 1 and v.prewakes_used == 0


def test_a_real_wake_that_comes_while_an_early_wake_is_booked_cancels_the_booking():
    """An early wake is booked at one tick (its quota restored at the next, then prewake). When a real
    request wakes another sleeper on the GPU before that next tick, the real wake has the memory: the
    booking is dropped and no prewake goes out, although the room found for both is still there."""
    rig = Rig(cap=60000, busy_used=1000)
    due = history(rig)
    t = due - 60
    while rig.broker.views()[AHEAD].ahead != "booked":
        assert t < due, "never booked"
        rig.tick(t)
        t += 0.5
    rig.engines[OTHER].request(t)  # between the booking tick and the next
    sent = rig.tick(t + 0.1)
    assert [(k, m.op) for k, m in sent] == [(OTHER, contract.WARM_GRANT)]  # no prewake beside it
    assert rig.broker.views()[AHEAD].state is Sleep.SLEEPING


def test_a_sleeper_and_a_queued_wake_are_shown_to_the_policy_warm_with_no_floor():
    """Asleep, an engine holds only its residue: the policy may lend everything above it (floor 0, its
    class's ceiling and margin kept). A wake queued behind an earlier one on the GPU waits the same way."""
    rig = Rig(cap=60000, busy_used=1000)
    rig.run(1.0, IDLE_S + 1)
    for key in (AHEAD, OTHER):
        assert rig.broker.views()[key].state is Sleep.SLEEPING
    rig.engines[OTHER].request(IDLE_S + 1.5)
    rig.engines[AHEAD].request(IDLE_S + 1.6)  # behind OTHER's wake
    for key in (AHEAD, OTHER):
        t = TenantState(key, REQ, REQ, RESIDUAL, Signals(running=1, waiting=0, kv_usage=0.0), phase=Phase.HOT)
        shown = rig.broker.prepare(t, GPU, rig.terms[key])
        want = (Phase.WAKING, t.bounds) if key == OTHER else (Phase.WARM, Bounds(0, REQ, 512))
        assert (shown.phase, shown.bounds) == want, key


def test_a_request_that_comes_and_goes_between_two_ticks_uses_the_early_wake():
    """Woken ahead, the engine serves a short request entirely between two ticks: no gauge shows it,
    the finished counter does. Counted used (not wasted), and the engine is not sent to sleep at the
    hold's end as if no request had come."""
    rig = Rig()
    due = history(rig)
    rig.run(due - 60, due - 0.5, step=0.5)
    assert rig.broker.views()[AHEAD].state is Sleep.AWAKE
    rig.engines[AHEAD].finished += 1  # started and finished at `due`, between the ticks at due-0.5 and due
    out = rig.run(due, due + 3, step=0.5)
    v = rig.broker.views()[AHEAD]
    assert (v.prewakes_used, v.prewakes_wasted) == (1, 0)
    assert not ops(out, AHEAD, contract.WARM_SLEEP)


def test_a_wasted_early_wake_is_slept_after_the_hold_counted_and_not_forecast_again():
    rig = Rig()
    due = history(rig)
    out = rig.run(due - 5, due + IDLE_S + 3, step=0.5)
    pre = ops(out, AHEAD, contract.WARM_PREWAKE)
    sleeps = ops(out, AHEAD, contract.WARM_SLEEP)
    assert len(pre) == 1 and len(sleeps) == 1
    assert due + IDLE_S <= sleeps[0][0] < due + IDLE_S + 1  # the hold: the forecast plus idleSeconds
    v = rig.broker.views()[AHEAD]
    assert v.state is Sleep.SLEEPING and (v.prewakes_used, v.prewakes_wasted) == (0, 1)
    assert not ops(rig.run(due + IDLE_S + 4, due + 300, step=2.0), AHEAD, contract.WARM_PREWAKE)  # one per spell


def test_an_engine_that_drops_prewake_is_counted_declined_and_its_memory_lent_again():
    rig = Rig(old=True)
    due = history(rig)
    out = rig.run(due - 5, due + 15, step=0.5)
    assert len(ops(out, AHEAD, contract.WARM_PREWAKE)) == 1
    v = rig.broker.views()[AHEAD]
    assert v.state is Sleep.SLEEPING and v.prewakes_declined == 1 and not v.ahead
    assert rig.limits[AHEAD] < REQ // 2  # back to lending
    rig.serve(AHEAD, due + 16)  # its request wakes it the ordinary way
    assert rig.broker.views()[AHEAD].wakes == 4


def test_wake_ahead_is_off_unless_the_class_sets_it():
    rig = Rig(ahead=False)
    due = history(rig)
    assert not ops(rig.run(due - 30, due + 5, step=0.5), op=contract.WARM_PREWAKE)


def test_prewake_outcomes_are_counted_on_metrics():
    rig = Rig()
    due = history(rig)
    rig.run(due - 5, due + IDLE_S + 3, step=0.5)
    reg = CollectorRegistry()
    reg.register(WarmCollector(rig.broker))
    text = generate_latest(reg).decode()
    tenant = 'tenant_container="c",tenant_namespace="ns",tenant_pod="ahead"'
    assert f'vramshare_warm_prewakes_total{{outcome="wasted",{tenant}}} 1.0' in text
    assert f'vramshare_warm_prewakes_total{{outcome="used",{tenant}}} 0.0' in text
    assert 'outcome="declined",tenant_container="c",tenant_namespace="ns",tenant_pod="ahead"} 0.0' in text


def test_an_engine_started_from_a_local_path_is_reported_by_its_pods_model_annotation():
    from deviceplugin.quota.kube import pod_meta

    names = contract.Names()
    pod = {"metadata": {"namespace": "ns", "annotations": {names.model: "meta-llama/Llama-3.1-8B@abc"}}, "spec": {}}
    meta = pod_meta(pod, names)
    assert meta.model == "meta-llama/Llama-3.1-8B@abc"
    broker = WarmBroker(send=lambda k, m: True, params=P)
    named = TenantKey("ns", "named", "c")
    broker.receive(AHEAD, contract.WarmMessage.of(contract.WARM_HELLO, canSleep=True, model="/models/llama"), 0.0)
    broker.receive(named, contract.WarmMessage.of(contract.WARM_HELLO, canSleep=True, model="org/own"), 0.0)
    gpus = {AHEAD: ["GPU-0"], named: ["GPU-1"]}
    assert [str(r) for r, _, _ in broker.engines(gpus)] == ["org/own"]  # a path is no model
    got = broker.engines(gpus, {AHEAD: meta.model, named: "org/annotated"})
    assert sorted((str(r), g, s) for r, g, s in got) == [
        ("meta-llama/Llama-3.1-8B@abc", "GPU-0", "awake"), ("org/own", "GPU-1", "awake")]  # the engine's own first
