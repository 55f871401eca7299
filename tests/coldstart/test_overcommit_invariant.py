"""Overcommit of sleeping pods (issue 23 item 5), live: the broker, the real policy and a scheduler that
books each GPU at its memory plus the sleepers' credit, over many random sequences of arrivals, sleeps,
refusals and wakes on one GPU with two classes (``low``, overcommitted, lendingPriority 0; ``high``,
booked whole, lendingPriority 10).

* every tick, Σ max(limit, measured use) ≤ the GPU: what the awake hold never exceeds it, however many
  pods the books let in;
* a wake is never refused: it is granted only when its request is measured free, it waits otherwise,
  and once the others fall idle every wake is granted;
* a sleep asked of a tenant that is not idle (a displacement) goes only to a strictly lower class than
  a wake waiting on the same GPU;
* the scheduler's books never let the sleepers' booked sizes plus the reserve exceed the GPU.
"""
from __future__ import annotations

from hypothesis import event, given, settings, strategies as st

from deviceplugin.quota.classes import ClassTerms
from deviceplugin.quota.model import GpuState, Phase, PolicyParams, Signals, TenantKey, TenantState
from deviceplugin.quota.policy import rebalance
from deviceplugin.quota.warm import Sleep, WarmBroker
from vramshare import contract, overcommit
from vramshare.config import OverLimitAction

P = PolicyParams(floor_fraction=0.5, ceiling_fraction=1.0, step_mib=256, margin_mib=256)
GPU = "GPU-0"
RESIDUAL = 1000


def terms(name: str, rank: int, fraction: float | None) -> ClassTerms:
    return ClassTerms(name, 0.5, None, 1.0, None, 256, 300.0, rank, OverLimitAction.EVENT,
                      sleep_booked_fraction=fraction, wake_reserve=1)


@settings(max_examples=150, deadline=None)
@given(cap=st.integers(40_000, 80_000), fraction=st.sampled_from([0.1, 0.25, 0.5]), data=st.data())
def test_overcommit_never_overfills_a_gpu_and_wakes_only_wait(cap, fraction, data):
    low, high = terms("low", 0, fraction), terms("high", 10, None)
    sent: list[tuple[TenantKey, contract.WarmMessage]] = []
    broker = WarmBroker(send=lambda k, m: sent.append((k, m)) or True, params=P)
    credit = {"mib": 0}
    broker.on_credits = lambda c: credit.__setitem__("mib", c.get(GPU, 0))
    tenants: dict[TenantKey, dict] = {}

    def arrive(i: int, tick: int) -> None:
        cls = data.draw(st.sampled_from([low, low, high]), label=f"class{i}")
        req = data.draw(st.integers(4_000, cap // 3), label=f"req{i}")
        if sum(t["req"] for t in tenants.values()) + req > cap + credit["mib"]:
            return  # the extender's books: the GPU's memory plus the sleepers' credit
        k = TenantKey("ns", f"p{i}", "c")
        views = broker.views()
        asleep = {k2 for k2, t in tenants.items() if views[k2].state is Sleep.SLEEPING and t["cls"] is low}
        sleepers = [overcommit.Sleeper(GPU, tenants[k2]["req"], tenants[k2]["used"], fraction) for k2 in asleep]
        firm = [t["req"] for k2, t in tenants.items() if k2 not in asleep] + [req]
        assert overcommit.books(firm, sleepers) <= cap  # awake whole + sleepers booked + the reserve
        tenants[k] = {"req": req, "cls": cls, "limit": req, "used": 0, "lag": 0, "idle": False}
        broker.receive(k, contract.WarmMessage.of(contract.WARM_HELLO, canSleep=True), tick)
        event("a pod arrived")

    for i in range(2):
        arrive(i, 0)
    waiting: dict[TenantKey, int] = {}
    for tick in range(100):
        drain = tick >= 45  # the end: no arrivals, every awake tenant falls idle
        if not drain and data.draw(st.booleans(), label=f"arrive{tick}"):
            arrive(100 + tick, tick)
        views = broker.views()
        for k, t in tenants.items():
            t["idle"] = drain or data.draw(st.integers(0, 3), label=f"idle{k.pod}{tick}") == 0
            if views[k].state is Sleep.SLEEPING and not drain and data.draw(
                    st.booleans(), label=f"wake{k.pod}{tick}"):
                broker.receive(k, contract.WarmMessage.of(contract.WARM_WAKE, seq=tick), tick)
                waiting[k] = tick
                t["idle"] = False
                event("a wake was requested")
        states = []
        for k, t in tenants.items():
            busy = not t["idle"]
            ts = TenantState(k, t["req"], t["limit"], t["used"],
                             Signals(running=int(busy), waiting=0, kv_usage=0.95 if busy else 0.0),
                             phase=Phase.HOT if busy else Phase.WARM, rank=t["cls"].lending_priority)
            states.append(broker.prepare(ts, GPU, t["cls"]))
        decided = {(d.key, GPU): d for d in rebalance(GpuState(GPU, cap, tuple(states)), P)}
        broker.note(decided)
        before = len(sent)
        waking = {k for k, v in broker.views().items() if v.state is Sleep.WAKING}
        for w in waking:
            if broker.views()[w].ungranted_ticks > 1:
                event(f"a {tenants[w]['cls'].name} wake waited")
        broker.after_tick({k: Phase.WARM if t["idle"] else Phase.HOT for k, t in tenants.items()}, decided, tick)
        for (k, _), d in decided.items():
            tenants[k]["limit"] = d.limit_mib
        held = sum(max(t["limit"], t["used"]) for t in tenants.values())
        assert held <= cap, (tick, {k.pod: (t["limit"], t["used"]) for k, t in tenants.items()})
        for key, msg in sent[before:]:
            t = tenants[key]
            if msg.op == contract.WARM_GRANT:
                others = sum(max(o["limit"], o["used"]) for k2, o in tenants.items() if k2 != key)
                assert t["limit"] >= t["req"] and cap - others >= t["req"]  # measured free, not promised
                broker.receive(key, contract.WarmMessage.of(contract.WARM_AWAKE, seq=msg.get("seq"), seconds=1.0), tick)
                t["used"] = t["req"] - 500
                waiting.pop(key, None)
                event("a wake was granted")
            elif msg.op == contract.WARM_SLEEP:
                if not t["idle"]:  # a displacement: only for a higher class's wake
                    assert any(tenants[w]["cls"].lending_priority > t["cls"].lending_priority for w in waking), \
                        (key.pod, [w.pod for w in waking])
                    event("a lower class was displaced")
                # the engine answers: a serving engine refuses, an idle one sleeps
                if t["idle"] or data.draw(st.booleans(), label=f"refuse{key.pod}{tick}"):
                    broker.receive(key, contract.WarmMessage.of(contract.WARM_SLEPT, seq=msg.get("seq")), tick)
                    t["used"] = RESIDUAL
                else:
                    broker.receive(key, contract.WarmMessage.of(contract.WARM_REFUSED, seq=msg.get("seq")), tick)
        # awake tenants use what they are given; a cut is released once idle
        views = broker.views()
        for k, t in tenants.items():
            if views[k].state is not Sleep.AWAKE:
                continue
            want = data.draw(st.integers(t["req"] * 9 // 10, t["req"]), label=f"want{k.pod}{tick}")
            if t["used"] > t["limit"]:  # a serving engine keeps its KV cache until its requests end
                t["lag"] += 1
                if t["lag"] >= 2 and t["idle"]:
                    t["used"], t["lag"] = min(want, t["limit"]), 0
            else:
                t["used"] = min(want, t["limit"])
    views = broker.views()
    assert not waiting, (f"wakes still waiting after every other tenant fell idle: {waiting}; cap {cap}: " + "; ".join(
        f"{k.pod} {t['cls'].name} {views[k].state.value} req {t['req']} limit {t['limit']} used {t['used']}"
        for k, t in tenants.items()))
    if credit["mib"]:
        event("credit lent to the books")
    if sum(t["req"] for t in tenants.values()) > cap:
        event("more requests than the GPU")
