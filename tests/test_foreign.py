"""Memory no pod of ours holds, settled and made schedulable (vramshare/foreign.py; pure, virtual clock).

The quota loop already took such memory off what it divides; the extender could not see it, planned pods
into memory that was not there, and the loop then fenced that GPU's tenants below their requests.
"""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings, strategies as st

from vramshare import inventory
from vramshare.contract import inventory as contract_inventory
from vramshare.foreign import (MAX_KEPT_GPUS, MAX_KEPT_MIB, SETTLE_S, SettledForeign, decode_kept, encode_kept,
                               schedulable_foreign, settled_from_booked, with_foreign)

UNIT = 1024
# an H100: 81,559 MiB, 79 units of 1 GiB, 663 MiB of slack beyond them
H100 = inventory.Gpu(index=0, uuid="GPU-0", model="NVIDIA H100 80GB HBM3", memory_mib=81559, units=79)
WHOLE = inventory.Gpu(index=1, uuid="GPU-1", model="NVIDIA H100 80GB HBM3", memory_mib=81559,
                      mode=inventory.GpuMode.EXCLUSIVE)
INV = inventory.NodeInventory(unit_mib=UNIT, gpus=(H100, WHOLE))


def test_one_reading_books_nothing_memory_that_stays_is_booked_after_the_settle_period() -> None:
    f = SettledForeign(settle_s=20)
    f.observe(0, {"GPU-0": 4000})
    assert f.settled(0) == {} and f.settled(19.9) == {}
    f.observe(10, {"GPU-0": 4000})
    assert f.settled(20) == {"GPU-0": 4000}


def test_a_spike_between_two_quiet_readings_is_never_booked() -> None:
    """A process that starts just before its pod becomes a tenant is foreign for one tick only."""
    f = SettledForeign(settle_s=20)
    for t, mib in [(0, 0), (10, 30000), (20, 0), (30, 0)]:
        f.observe(t, {"GPU-0": mib})
        assert f.settled(t) == {}


def test_memory_that_goes_is_dropped_at_the_next_reading() -> None:
    f = SettledForeign(settle_s=20)
    for t in (0, 10, 20):
        f.observe(t, {"GPU-0": 5000})
    assert f.settled(20) == {"GPU-0": 5000}
    f.observe(30, {"GPU-0": 0})
    assert f.settled(30) == {}


def test_a_gpu_left_unread_keeps_its_last_settled_figure() -> None:
    """An unreadable GPU is left out of the tick's readings, not read as 0: the last good state stays."""
    f = SettledForeign(settle_s=20)
    for t in (0, 10, 20):
        f.observe(t, {"GPU-0": 5000, "GPU-1": 100})
    for t in (30, 40, 50):
        f.observe(t, {"GPU-1": 100})
    assert f.settled(50) == {"GPU-0": 5000, "GPU-1": 100}
    f.forget(["GPU-1"])  # GPU-0 left the node
    assert f.settled(50) == {"GPU-1": 100}


def test_a_clock_that_goes_back_starts_the_window_afresh() -> None:
    f = SettledForeign(settle_s=20)
    for t in (100, 110, 120):
        f.observe(t, {"GPU-0": 5000})
    f.observe(50, {"GPU-0": 5000})
    assert f.settled(50) == {}
    f.observe(70, {"GPU-0": 5000})  # the new window spans: the readings from before the jump are gone
    assert f.settled(70) == {"GPU-0": 5000}


def test_a_settle_period_must_be_positive() -> None:
    with pytest.raises(ValueError):
        SettledForeign(settle_s=0)
    f = SettledForeign(settle_s=0.5)  # any positive period (a test's short tick)
    f.observe(0, {"GPU-0": 700})
    f.observe(0.5, {"GPU-0": 700})
    assert f.settled(0.5) == {"GPU-0": 700}


def test_a_kept_figure_of_nothing_is_not_reported() -> None:
    f = SettledForeign(settle_s=10)
    f.keep({"GPU-0": 0, "GPU-1": 300}, until=100)
    assert f.settled(0) == {"GPU-1": 300}


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.floats(0.5, 15), st.integers(0, 50000)), min_size=1, max_size=30),
       st.floats(1, 40))
def test_the_settled_figure_is_what_every_reading_in_the_window_saw(readings: list[tuple[float, int]],
                                                                   later: float) -> None:
    """Over random reading gaps and values: once readings span the window, the figure is the least of the
    reading in force at its start and every one since; never more than any of them, never before."""
    f = SettledForeign(settle_s=SETTLE_S)
    t, seen = 0.0, []
    for gap, mib in readings:
        t += gap
        f.observe(t, {"GPU-0": mib})
        seen.append((t, mib))
    now = t + later
    start = now - SETTLE_S
    got = f.settled(now).get("GPU-0", 0)
    if seen[0][0] > start:
        assert got == 0
        return
    first = max(i for i, (ts, _) in enumerate(seen) if ts <= start)
    assert got == min(m for _, m in seen[first:])


def test_slack_absorbs_foreign_memory_first_then_whole_units_are_booked() -> None:
    assert schedulable_foreign(INV, {"GPU-0": 600}) == {}  # within the 663 MiB no unit covers
    assert schedulable_foreign(INV, {"GPU-0": 663 + 1}) == {"GPU-0": UNIT}
    assert schedulable_foreign(INV, {"GPU-0": 663 + 5000}) == {"GPU-0": 5 * UNIT}
    assert schedulable_foreign(INV, {"GPU-0": 10 ** 6}) == {"GPU-0": 79 * UNIT}  # never past its units
    assert schedulable_foreign(INV, {"GPU-1": 5000}) == {}  # a whole GPU is its one pod's: not booked here


def test_on_a_gpu_without_slack_one_mib_beyond_a_unit_books_a_second_unit() -> None:
    gpu = inventory.Gpu(index=0, uuid="GPU-0", model="m", memory_mib=80 * 1024, units=80)
    inv = inventory.NodeInventory(unit_mib=1024, gpus=(gpu,))
    assert schedulable_foreign(inv, {"GPU-0": 1}) == {"GPU-0": 1024}
    assert schedulable_foreign(inv, {"GPU-0": 1025}) == {"GPU-0": 2048}
    assert settled_from_booked(inv, {}) == {}  # a GPU it booked nothing on keeps nothing


def test_the_inventory_carries_it_and_the_extender_books_it_in_whole_units() -> None:
    inv = with_foreign(INV, {"GPU-0": 5 * UNIT})
    text = contract_inventory.encode(inv)
    assert '"foreignMiB":5120' in text
    back = contract_inventory.parse(text)
    assert back == inv
    assert back.booked_foreign_mib(back.gpus[0]) == 5 * UNIT and back.booked_foreign_mib(back.gpus[1]) == 0
    assert with_foreign(back, {}) == INV and '"foreignMiB"' not in contract_inventory.encode(INV)


@pytest.mark.parametrize("value", [-1, 81560, "5120", True])
def test_a_foreign_figure_no_gpu_can_have_refuses_the_inventory(value: object) -> None:
    doc = json.loads(contract_inventory.encode(INV))
    doc["gpus"][0]["foreignMiB"] = value
    with pytest.raises(inventory.InventoryError, match="foreignMiB"):
        contract_inventory.parse(json.dumps(doc))


# -- a restarted node agent keeps what it last published until it settles again ------------------------------
def test_a_kept_figure_stands_until_the_gpus_own_readings_span_the_window_then_theirs_decides() -> None:
    """A restart must not unbook, for the two ticks it takes to settle again, memory a stuck process holds;
    once the new readings span the window they decide, 0 included (the process went meanwhile)."""
    f = SettledForeign(settle_s=10)
    f.keep({"GPU-0": 5000, "GPU-1": 3000}, until=100)
    assert f.settled(0) == {"GPU-0": 5000, "GPU-1": 3000}  # before any reading
    f.observe(0, {"GPU-0": 5000, "GPU-1": 0})
    assert f.settled(5) == {"GPU-0": 5000, "GPU-1": 3000}  # one reading proves nothing either way
    f.observe(10, {"GPU-0": 5000, "GPU-1": 0})
    assert f.settled(10) == {"GPU-0": 5000}  # GPU-1's memory went while the agent was down


def test_a_kept_figure_ends_at_its_deadline_where_nothing_reads_the_gpu_whole() -> None:
    """dcgm-exporter or a replay never observe a GPU whole: the kept figure must not outlive what measured it."""
    f = SettledForeign(settle_s=10)
    f.keep({"GPU-0": 5000}, until=30)
    assert f.settled(29.9) == {"GPU-0": 5000}
    assert f.settled(30) == {}
    f.keep({"GPU-0": 5000}, until=60)
    f.forget(["GPU-1"])  # no longer shared, or gone from the node
    assert f.settled(0) == {}


@settings(max_examples=200, deadline=None)
@given(booked_units=st.integers(0, 79), slack=st.integers(0, 4000), unit=st.sampled_from([256, 512, 1024]))
def test_the_figures_kept_book_again_exactly_what_was_published(booked_units: int, slack: int, unit: int) -> None:
    """:func:`settled_from_booked` inverts :func:`schedulable_foreign` on what a node publishes: whole units
    beyond the slack, at most the GPU's units (a GPU it fills included)."""
    gpu = inventory.Gpu(index=0, uuid="GPU-0", model="m", memory_mib=79 * unit + slack, units=79)
    inv = inventory.NodeInventory(unit_mib=unit, gpus=(gpu, WHOLE))
    booked = {"GPU-0": booked_units * unit, "GPU-1": 5 * unit}  # an exclusive GPU books nothing
    assert schedulable_foreign(inv, settled_from_booked(inv, booked)) == {k: v for k, v in booked.items()
                                                                           if k == "GPU-0" and v}


@given(st.dictionaries(st.text(min_size=1, max_size=40), st.integers(0, 1 << 40), max_size=16))
def test_the_kept_figures_round_trip(figures: dict[str, int]) -> None:
    assert decode_kept(encode_kept(figures)) == {g: m for g, m in figures.items() if m > 0}


@pytest.mark.parametrize("data,why", [
    (b"\xff", "not JSON"), (b"[]", "not version 1"), (b'{"version": 2, "foreignMiB": {}}', "not version 1"),
    (b'{"version": 1}', "must be a map"), (b'{"version": 1, "foreignMiB": {"GPU-0": -5}}', "whole number"),
    (b'{"version": 1, "foreignMiB": {"GPU-0": true}}', "whole number"),
    (b'{"version": 1, "foreignMiB": {"GPU-0": 1.5}}', "whole number"),
    (b'{"version": 1, "foreignMiB": {"": 5}}', "whole number"),
    (b'{"version": 1, "foreignMiB": {"GPU-0": 0}}', "whole number"),
    (json.dumps({"version": 1, "foreignMiB": {"GPU-0": MAX_KEPT_MIB + 1}}).encode(), "whole number"),
    (json.dumps({"version": 1, "foreignMiB": {f"GPU-{i}": 1 for i in range(MAX_KEPT_GPUS + 1)}}).encode(),
     "must be a map of at most")])
def test_a_kept_file_this_code_did_not_write_is_refused_with_the_reason(data: bytes, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        decode_kept(data)


def test_a_kept_file_at_its_bounds_is_read() -> None:
    most = {f"GPU-{i}": 1 for i in range(MAX_KEPT_GPUS - 1)} | {"GPU-big": MAX_KEPT_MIB}
    assert decode_kept(json.dumps({"version": 1, "foreignMiB": most}).encode()) == most
