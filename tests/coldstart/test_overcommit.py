"""Overcommit of sleeping pods (issue 23 item 5), each part on literal input: the class keys and their
bounds, the one rule (:mod:`vramshare.overcommit`), the inventory's ``sleepCreditMiB``, the node's
credit units, the extender's books, the broker's credit, its wake queue and its displacement rule."""
from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, strategies as st

from deviceplugin import devices
from deviceplugin.backend import DiscoveredGpu
from deviceplugin.node_state import NodeState
from deviceplugin.quota.classes import ClassTerms
from deviceplugin.quota.model import GpuState, Phase, PolicyParams, Signals, TenantKey, TenantState
from deviceplugin.quota.policy import rebalance
from deviceplugin.quota.warm import Sleep, WarmBroker
from extender import accounting, verbs, wire
from tests.extender import builders as b
from vramshare import contract, overcommit
from vramshare.config import Config, ConfigError, OverLimitAction, config_from_dict
from vramshare.inventory import InventoryError, NodeInventory

GIB = 1024


# -- config ------------------------------------------------------------------------------------------------
def classes(**keys) -> dict:
    return {"quota": {"classes": [{"name": "tail", **keys}]}}


def test_class_keys_parse_with_bounds():
    qc = config_from_dict(classes(sleepBookedFraction=0.25, wakeReserve=2)).quota.classes[0]
    assert (qc.sleep_booked_fraction, qc.wake_reserve) == (0.25, 2)
    plain = config_from_dict(classes()).quota.classes[0]
    assert (plain.sleep_booked_fraction, plain.wake_reserve) == (None, 1)  # off unless an admin sets it
    for bad, where in [({"sleepBookedFraction": 1.5}, "sleepBookedFraction: must be <= 1"),
                       ({"sleepBookedFraction": -0.1}, "sleepBookedFraction: must be >= 0"),
                       ({"sleepBookedFraction": "half"}, "sleepBookedFraction: expected float"),
                       ({"wakeReserve": 0}, "wakeReserve: must be >= 1"),
                       ({"wakeReserve": 65}, "wakeReserve: must be <= 64"),
                       ({"wakeReserve": 1.5}, "wakeReserve: expected int")]:
        with pytest.raises(ConfigError, match=where):
            config_from_dict(classes(**bad))


# -- the rule ----------------------------------------------------------------------------------------------
def test_credit_is_the_gaps_beyond_the_reserve():
    s = [overcommit.Sleeper("g", 20 * GIB, 1536, 0.25), overcommit.Sleeper("g", 40 * GIB, 1536, 0.25),
         overcommit.Sleeper("g", 10 * GIB, 4 * GIB, 0.25)]  # holds more asleep than a quarter: booked at that
    assert [x.booked for x in s] == [5 * GIB, 10 * GIB, 4 * GIB]
    assert overcommit.credit(s) == 15 * GIB + 6 * GIB  # 15 + 30 + 6 gaps, the largest (30) kept free
    assert overcommit.credit(s, unit=4 * GIB) == 20 * GIB  # whole units only
    two = [dataclasses.replace(x, wake_reserve=2) for x in s]
    assert overcommit.credit(two) == 6 * GIB
    assert overcommit.credits(s + [overcommit.Sleeper("h", 8 * GIB, 0, 0.5)]) == {"g": 21 * GIB}


@given(st.lists(st.tuples(st.integers(1, 80_000), st.integers(0, 80_000), st.floats(0, 1), st.integers(1, 4)),
                max_size=8), st.lists(st.integers(1, 80_000), max_size=4), st.sampled_from([1, 256, 1024]))
def test_books_plus_reserve_is_what_the_credit_allows(raw, firm, unit):
    """Σ requests - credit = Σ firm + Σ booked + the k largest gaps (never less): a GPU the books fill to
    its memory plus the credit holds the awake, the sleepers' booked sizes and the reserve."""
    ss = [overcommit.Sleeper("g", r, min(h, r), f, k) for r, h, f, k in raw]
    c = overcommit.credit(ss, unit)
    assert c >= 0 and c % unit == 0
    k = max((s.wake_reserve for s in ss if s.gap > 0), default=0)
    exact = sum(firm) + sum(s.booked for s in ss) + overcommit.reserve([s.gap for s in ss if s.gap > 0], k)
    assert sum(firm) + sum(s.request for s in ss) - c >= exact - 1e-6
    assert overcommit.books(firm, ss) == pytest.approx(exact)


# -- the inventory and the node's devices ----------------------------------------------------------------
def test_inventory_carries_the_credit_and_old_documents_read_as_none():
    inv = b.node_inventory("n1", b.a100())
    assert "sleepCreditMiB" not in inv.to_json()  # absent unless there is a credit: old readers unchanged
    lent = dataclasses.replace(inv, gpus=(dataclasses.replace(inv.gpus[0], sleep_credit_mib=20 * GIB),))
    back = NodeInventory.from_json(lent.to_json())
    assert back.gpus[0].sleep_credit_mib == 20 * GIB
    assert back.capacity_mib(back.gpus[0]) == 80 * GIB  # what the quota loop divides: the real memory
    assert back.bookable_mib(back.gpus[0]) == 100 * GIB  # what the extender books against
    for bad in (-1, 1 << 40, 2.5, True):
        doc = lent.to_json().replace('"sleepCreditMiB":20480', f'"sleepCreditMiB":{str(bad).lower()}')
        with pytest.raises(InventoryError, match="sleepCreditMiB"):
            NodeInventory.from_json(doc)


def test_node_state_offers_credit_units_and_withdraws_them_on_wake():
    cfg = Config()
    gpu = DiscoveredGpu(index=0, uuid="GPU-a", model="NVIDIA A100-SXM4-80GB", memory_mib=81920)
    state = NodeState([gpu], cfg)
    base = len(state.snapshot.devices[cfg.names.gpu_memory])
    seen = []
    state.add_listener(lambda old, new: seen.append(new.inventory.gpus[0].sleep_credit_mib))
    state.on_credits({"GPU-a": 20 * GIB + 300})  # rounded down to whole units
    assert state.snapshot.inventory.gpus[0].sleep_credit_mib == 20 * GIB
    assert len(state.snapshot.devices[cfg.names.gpu_memory]) == base + 20
    devices.check_ids(d.id for d in state.snapshot.devices[cfg.names.gpu_memory])
    state.on_credits({"GPU-a": 20 * GIB})  # no change: no new snapshot
    state.on_credits({"GPU-a": 500 * GIB})  # never past the GPU's own units (twice its memory at most)
    assert len(state.snapshot.devices[cfg.names.gpu_memory]) == 2 * base
    seen.pop()
    state.on_credits({})  # the sleeper woke
    assert len(state.snapshot.devices[cfg.names.gpu_memory]) == base
    assert seen == [20 * GIB, 0]


# -- the extender's books --------------------------------------------------------------------------------
def _node(credit_gib: int) -> dict:
    inv = b.node_inventory("n1", b.a100())
    inv = dataclasses.replace(inv, gpus=(dataclasses.replace(inv.gpus[0], sleep_credit_mib=credit_gib * GIB),))
    return b.gpu_node("n1", b.a100(), annotation=inv.to_json())


def _passed(acct, pod) -> list[str]:
    return verbs.filter_pod(acct.view(acct.config.extender.policy), wire.ExtenderArgs(pod=pod, node_names=["n1"])).passed


def test_the_extender_books_a_gpu_at_its_memory_plus_the_credit():
    acct = accounting.Accounting(Config())
    acct.apply_node("ADDED", _node(0))
    uuid = b.uuid_of("n1", 0)
    for i, gib in enumerate((40, 30)):  # 70 of 80 GiB booked (one of them asleep, say)
        acct.apply_pod("ADDED", b.assigned(b.pod(f"p{i}", gib), "n1", [(uuid, gib * GIB)], 1, "allocated"))
    assert _passed(acct, b.pod("new", 20)) == []  # today's books: 10 GiB free
    acct.apply_node("MODIFIED", _node(30))  # the node reports 30 GiB of sleep credit
    assert _passed(acct, b.pod("new", 20)) == ["n1"]
    acct.apply_pod("ADDED", b.assigned(b.pod("new", 20), "n1", [(uuid, 20 * GIB)], 1, "allocated"))
    acct.apply_node("MODIFIED", _node(0))  # the sleeper woke: the credit is withdrawn
    assert _passed(acct, b.pod("more", 1)) == []  # a GPU over its memory takes no more pods
    assert acct.state.node_usage("n1")[0].used == 90 * GIB  # and the books still say what it holds


# -- the broker ------------------------------------------------------------------------------------------
P = PolicyParams(floor_fraction=0.5, ceiling_fraction=1.0, step_mib=256, margin_mib=256)


def terms(rank: int, fraction: float | None) -> ClassTerms:
    return ClassTerms("c", 0.5, None, 1.0, None, 256, 300.0, rank, OverLimitAction.EVENT,
                      sleep_booked_fraction=fraction)


class Rig:
    def __init__(self, cap: int) -> None:
        self.cap, self.sent, self.credits = cap, [], []
        self.broker = WarmBroker(send=lambda k, m: self.sent.append((k, m)) or True, params=P,
                                 on_credits=self.credits.append)
        self.t: dict[TenantKey, dict] = {}

    def add(self, name: str, req: int, used: int, rank: int = 0, fraction: float | None = None) -> TenantKey:
        k = TenantKey("ns", name, "c")
        self.t[k] = {"req": req, "used": used, "limit": req, "terms": terms(rank, fraction), "busy": True}
        self.broker.receive(k, contract.WarmMessage.of(contract.WARM_HELLO, canSleep=True), 0)
        return k

    def prepared(self) -> list[TenantState]:
        """Every tenant as the broker shows it to the policy (:meth:`WarmBroker.prepare`)."""
        return [self.broker.prepare(TenantState(k, t["req"], t["limit"], t["used"],
                                                Signals(running=int(t["busy"]), waiting=0, kv_usage=0.5),
                                                phase=Phase.HOT if t["busy"] else Phase.WARM,
                                                rank=t["terms"].lending_priority), "G", t["terms"])
                for k, t in self.t.items()]

    def tick(self, now: float) -> list:
        states = self.prepared()
        decided = {(d.key, "G"): d for d in rebalance(GpuState("G", self.cap, tuple(states)), P)}
        self.broker.note(decided)
        before = len(self.sent)
        self.broker.after_tick({k: Phase.HOT if t["busy"] else Phase.WARM for k, t in self.t.items()}, decided, now)
        for (k, _), d in decided.items():
            self.t[k]["limit"] = d.limit_mib
        assert sum(max(t["limit"], t["used"]) for t in self.t.values()) <= self.cap
        return self.sent[before:]

    def sleep(self, k: TenantKey, held: int = 1000) -> None:
        self.t[k]["busy"] = False
        out = self.tick(0)
        seq = next(m.get("seq") for key, m in out if key == k and m.op == contract.WARM_SLEEP)
        self.broker.receive(k, contract.WarmMessage.of(contract.WARM_SLEPT, seq=seq), 0)
        self.t[k]["used"] = held

    def wake(self, k: TenantKey, now: float) -> None:
        self.t[k]["busy"] = True
        self.broker.receive(k, contract.WarmMessage.of(contract.WARM_WAKE, seq=int(now)), now)


def test_broker_credits_only_sleepers_of_overcommit_classes():
    r = Rig(80 * GIB)
    a = r.add("a", 20 * GIB, 18 * GIB, fraction=0.25)
    c = r.add("c", 30 * GIB, 28 * GIB, fraction=0.25)
    firm = r.add("firm", 20 * GIB, 18 * GIB)  # its class does not overcommit: no credit when asleep
    for k in (a, c, firm):
        r.sleep(k)
    r.tick(1)
    assert r.broker.sleep_credits() == {"G": 15 * GIB}  # gaps 15 and 22.5 GiB, the larger is the reserve
    assert r.credits[-1] == {"G": 15 * GIB}
    r.wake(a, 2)
    r.tick(2)
    assert r.credits[-1] == {}  # a waking pod lends nothing: withdrawn on the tick of the wake


def test_a_wake_beyond_the_reserve_waits_and_displaces_only_a_lower_class():
    r = Rig(60 * GIB)
    high = r.add("high", 25 * GIB, 24 * GIB, rank=10, fraction=0.1)
    r.sleep(high)
    low = r.add("low", 25 * GIB, 24 * GIB, rank=0)
    peer = r.add("peer", 25 * GIB, 24 * GIB, rank=10)  # 75 GiB of requests on 60, on the sleeper's credit
    r.tick(1)
    r.wake(high, 2)
    out = r.tick(2)  # needs 25, 60 - 24 - 24 = 12 free: no grant
    assert not [m for _, m in out if m.op == contract.WARM_GRANT]
    out = r.tick(3)  # still short after a tick: the lower class is asked to sleep, the equal one never
    sleeps = [k for k, m in out if m.op == contract.WARM_SLEEP]
    assert sleeps == [low] and r.broker.views()[low].displaced == 1
    r.broker.receive(low, contract.WarmMessage.of(contract.WARM_REFUSED, seq=r.broker.views()[low].sleep_seq), 3)
    out = r.tick(4)  # it refused (serving): asked again, the wake still waits, nothing fails
    assert [k for k, m in out if m.op == contract.WARM_SLEEP] == [low]
    r.broker.receive(low, contract.WarmMessage.of(contract.WARM_SLEPT, seq=r.broker.views()[low].sleep_seq), 4)
    r.t[low]["used"] = 1000
    grants = [k for _ in range(3) for k, m in r.tick(5) if m.op == contract.WARM_GRANT]
    assert grants[:1] == [high]
    assert r.broker.views()[peer].displaced == 0
    assert r.broker.views()[high].waited == 1  # the reserve ran out once: counted (vramshare_warm_wakes_waited)
    from prometheus_client import CollectorRegistry, generate_latest
    from deviceplugin.quota.warm_channel import WarmCollector
    reg = CollectorRegistry()
    reg.register(WarmCollector(r.broker))
    text = generate_latest(reg).decode()
    assert 'vramshare_warm_wakes_waited_total{tenant_container="c",tenant_namespace="ns",tenant_pod="high"} 1.0' in text
    assert 'vramshare_warm_displaced_total{tenant_container="c",tenant_namespace="ns",tenant_pod="low"} 2.0' in text


@pytest.mark.parametrize("awake,reserved,held", [(2, 0, True), (1, 0, False), (1, 15 * GIB, True),
                                                   (1, 10 * GIB, False)])
def test_a_wake_is_held_while_its_request_does_not_fit_beside_the_others_and_the_pending_claims(awake, reserved,
                                                                                              held):
    """``hold_wakes``: a sleeper of an overcommit class wakes (25 GiB) on 60 GiB beside awake pods counted
    at their requests (25 GiB each) and the pending claims' ``reserved``: two awake pods (75 GiB) or one
    with 15 GiB pending (65) hold it asleep, at floor 0; one alone (50), or with 10 GiB pending (exactly 60),
    lets it be restored."""
    r = Rig(60 * GIB)
    x = r.add("x", 25 * GIB, 24 * GIB, fraction=0.1)
    r.sleep(x)
    for n in range(awake):
        r.add(f"awake{n}", 25 * GIB, 24 * GIB)
    r.wake(x, 1)
    shown = {s.key: s for s in r.broker.hold_wakes("G", r.cap, r.prepared(), reserved)}
    assert shown[x].phase is (Phase.WARM if held else Phase.WAKING)
    assert (shown[x].bounds.floor_mib == 0) if held else shown[x].bounds is None


@pytest.mark.parametrize("cotenant,held", [("asleep-9", False), ("asleep-11", True), ("asleep-unread", True),
                                            ("awake-idle", True)])
def test_a_wake_counts_a_sleeping_co_tenant_at_what_it_holds_and_any_other_at_its_request(cotenant, held):
    """``hold_wakes``: a 25 GiB wake on 60 GiB beside an awake pod (25) and a co-tenant asking 20 GiB.
    Asleep, that co-tenant counts at what it holds: 9 GiB lets the wake be restored (59), 11 holds it
    (61). Asleep with no reading, or awake but idle (``WARM`` to the policy, its engine awake: its
    request is promised), it counts at its request (70): held."""
    r = Rig(60 * GIB)
    x = r.add("x", 25 * GIB, 24 * GIB, fraction=0.1)
    r.sleep(x)
    r.add("awake", 25 * GIB, 24 * GIB)
    z = r.add("z", 20 * GIB, 19 * GIB, fraction=0.1)
    if cotenant.startswith("asleep"):
        r.sleep(z)
        r.t[z]["used"] = None if cotenant == "asleep-unread" else int(cotenant.split("-")[1]) * GIB
    else:
        r.t[z].update(busy=False, used=2 * GIB)
    r.wake(x, 1)
    shown = {s.key: s for s in r.broker.hold_wakes("G", r.cap, r.prepared())}
    assert shown[x].phase is (Phase.WARM if held else Phase.WAKING)


def test_a_tenant_waking_without_the_warm_plugin_passes_through_untouched():
    """A pod whose traffic came back after idleness is ``WAKING`` to the policy (:mod:`quota.warmth`)
    whether or not its engine speaks to the broker; one that never said hello is not the broker's to
    hold, however full the GPU."""
    r = Rig(60 * GIB)
    r.add("awake", 25 * GIB, 24 * GIB)
    plain = TenantState(TenantKey("ns", "plain", "c"), 40 * GIB, 10 * GIB, 9 * GIB, Signals(running=1),
                        phase=Phase.WAKING)
    shown = r.broker.hold_wakes("G", r.cap, r.prepared() + [plain])
    assert shown[-1] is plain


def test_a_lower_class_wake_displaces_nobody_it_waits():
    r = Rig(60 * GIB)
    low = r.add("low", 25 * GIB, 24 * GIB, rank=0, fraction=0.1)
    r.sleep(low)
    r.add("a", 25 * GIB, 24 * GIB, rank=10)
    r.add("b", 25 * GIB, 24 * GIB, rank=10)
    r.wake(low, 1)
    for now in range(1, 8):
        out = r.tick(now)
        assert not [m for _, m in out if m.op in (contract.WARM_SLEEP, contract.WARM_GRANT)]
    assert r.broker.views()[low].state is Sleep.WAKING  # waiting, not refused


def test_wakes_that_compete_are_restored_one_whole_request_at_a_time():
    r = Rig(60 * GIB)
    x = r.add("x", 25 * GIB, 24 * GIB, fraction=0.1)
    r.sleep(x)
    y = r.add("y", 25 * GIB, 24 * GIB, fraction=0.1)
    r.sleep(y)
    r.add("busy", 20 * GIB, 19 * GIB)
    r.wake(y, 1)
    r.wake(x, 2)  # 40 GiB free, two wakes of 25: the first asked goes first
    grants = [k for now in range(3, 6) for k, m in r.tick(now) if m.op == contract.WARM_GRANT]
    assert grants[:1] == [y] and x not in grants
    assert r.t[x]["limit"] < 25 * GIB


def test_inspect_shows_the_sleep_credit_in_the_gpus_total():
    """An admin reading ``vramshare inspect`` saw a GPU booked 90 of 90 GiB on an 80 GiB A100 with
    nothing saying why: the sleep credit the node reports is now shown next to the total it is part of."""
    from extender import inspection

    acct = accounting.Accounting(Config())
    acct.apply_node("ADDED", _node(10))
    doc = inspection.render(acct, "n1")
    assert doc is not None
    [g] = doc["gpus"]
    assert g["sleepCreditMiB"] == 10 * GIB and g["totalMiB"] == 80 * GIB + 10 * GIB
    assert "sleep credit 10.0 in TOTAL" in inspection.format_table(doc)
    acct.apply_node("MODIFIED", _node(0))  # the sleeper woke
    [g] = inspection.render(acct, "n1")["gpus"]
    assert "sleepCreditMiB" not in g and g["totalMiB"] == 80 * GIB
