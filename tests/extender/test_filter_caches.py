"""The caches filter and prioritize read (issue 21, the CPU per cycle) answer what a fresh computation would.

Each cache here is kept across requests and brought up to date row by row: the failed-node reasons
(per row version), the remembered node lists (compared as one joined string), the lazily sliced best
fit, the GPU scale kept per row. A random sequence of changes to the books, each followed by requests,
must get the same answers as the same request against uncached, from-scratch computations.
"""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings, strategies as st

from extender import placement
from extender.cluster import EXCLUSIVE, SHARED, ClusterState, Demand, HostDemand, OverCommit, Slot
from extender.fit import Ask, greedy
from extender.slottable import UNLIMITED
from extender.reasons import why_not, with_best

GIB = 1024
NAMES = [f"n{i}" for i in range(6)]
MODELS = ["NVIDIA-A100", "NVIDIA-L4"]


def _uncached(state: ClusterState, demands: list[Demand], names: list[str],
              host: HostDemand) -> tuple[list[str], dict[str, str]]:
    """filter_nodes as it would answer with no memo at all: every name looked up, every row placed
    greedily afresh, every failed row explained by :func:`extender.reasons.why_not` (filter's wording,
    without the row's own amounts) and the most free on a room-short node added by ``with_best``."""
    fitting: list[str] = []
    failed: dict[str, str] = {}
    short: list[int] = []  # rows that failed for room alone: with_best adds the most free of them
    for name in names:
        row = state.row(name)
        if row is None:
            failed[name] = placement.UNKNOWN_NODE
            continue
        ask = Ask(state, tuple(demands), np.array([row]), host)
        _fresh_views(state, ask)
        if greedy(ask).ok[0]:
            fitting.append(name)
        else:
            failed[name] = why_not(ask, 0, detail=False)
            short.append(row)
    rows = np.array(sorted(set(short)), np.int64)
    if len(rows):
        ask = Ask(state, tuple(demands), rows, host)
        _fresh_views(state, ask)
        order = {int(r): j for j, r in enumerate(rows)}
        named = [(n, order[state.row(n)]) for n in failed if state.row(n) is not None]
        best = with_best(ask, np.array([j for _, j in named], np.int64), [failed[n] for n, _ in named])
        failed.update({n: why for (n, _), why in zip(named, best)})
    return fitting, failed


def _fresh_views(state: ClusterState, ask: Ask) -> None:
    """The views an Ask reads, from the raw table (not the state's per-row cached views)."""
    r = ask.rows
    tracked = state.host_tracked[r]
    ask.__dict__.update(
        free=np.where(state.healthy[r], np.maximum(state.capacity[r] - state.used[r], 0), 0),
        shared=(state.kind[r] == state.kind_code(SHARED)) & state.healthy[r],
        cpu_free=np.where(tracked, state.cpu_cap[r] - state.cpu_used[r], UNLIMITED),
        mem_free=np.where(tracked, state.mem_cap[r] - state.mem_used[r], UNLIMITED))


slot = st.tuples(st.sampled_from([SHARED, SHARED, SHARED, EXCLUSIVE]), st.sampled_from(MODELS),
                 st.sampled_from([16, 24, 40, 80]), st.booleans())
change = st.one_of(
    st.tuples(st.just("node"), st.sampled_from(NAMES), st.lists(slot, min_size=0, max_size=4)),
    st.tuples(st.just("drop"), st.sampled_from(NAMES)),
    st.tuples(st.just("pod"), st.integers(0, 30), st.sampled_from(NAMES), st.integers(0, 3), st.integers(1, 40)),
    st.tuples(st.just("unpod"), st.integers(0, 30)),
    st.tuples(st.just("host"), st.sampled_from(NAMES), st.integers(0, 16_000), st.integers(0, 64 * GIB)),
)
demand = st.builds(Demand, st.sampled_from([4, 10, 16, 20, 24, 40, 80]).map(lambda g: g * GIB),
                   st.integers(1, 2), st.sampled_from([SHARED, SHARED, EXCLUSIVE]),
                   st.sampled_from([(), ("A100",), ("L4",)]))
request = st.tuples(st.lists(demand, min_size=1, max_size=2),
                    st.builds(HostDemand, st.sampled_from([0, 2000, 8000]), st.sampled_from([0, 16 * GIB])),
                    st.permutations(NAMES + ["ghost"]))


def _apply(state: ClusterState, step: tuple) -> None:
    kind = step[0]
    if kind == "node":
        _, name, slots = step
        state.set_node(name, [Slot(f"{name}-{i}", model, k, gib * GIB, healthy, i)
                              for i, (k, model, gib, healthy) in enumerate(slots)])
    elif kind == "drop":
        state.remove_node(step[1])
    elif kind == "pod":
        _, pod, name, col, gib = step
        state.remove_pod(f"p{pod}")
        try:
            state.add_pod(f"p{pod}", name, [(f"{name}-{col}", gib * GIB)], HostDemand(1000, GIB))
        except OverCommit:
            pass
    elif kind == "unpod":
        state.remove_pod(f"p{step[1]}")
    elif state.row(step[1]) is not None:
        state.set_host(step[1], step[2], step[3])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(change, st.lists(request, min_size=1, max_size=3)), min_size=1, max_size=12))
def test_filter_with_its_caches_answers_as_a_fresh_computation(steps: list) -> None:
    state = ClusterState()
    for name in NAMES[:3]:
        _apply(state, ("node", name, [(SHARED, MODELS[0], 40, True), (SHARED, MODELS[1], 24, True)]))
    for step, requests in steps:
        _apply(state, step)
        for demands, host, names in requests:
            names = list(names)
            want = _uncached(state, demands, names, host)
            for _ in range(2):  # the second time from the memo, and from the remembered list
                got = placement.filter_rows(state, demands, names, host)
                assert (got.fitting, list(got.failed.items())) == (want[0], list(want[1].items()))
                # the rows it hands on are each name's row, in the order of its answers
                assert got.fitting_rows.tolist() == [state.row(n) for n in got.fitting]
                assert got.failed_rows.tolist() == [-1 if state.row(n) is None else state.row(n) for n in got.failed]
            # the list filter answered with, freshly decoded (new string objects), finds the same rows
            again = [str(n.encode().decode()) for n in got.fitting]
            assert state.rows_of(again).tolist() == [state.row(n) for n in got.fitting]
            assert state.gpu_scale() == _scale(state)


def _scale(state: ClusterState) -> float:
    caps = state.capacity[(state.kind == state.kind_code(SHARED)) & state.healthy]
    return float(caps.max()) if caps.size and caps.max() > 0 else 1.0


def test_a_name_holding_the_separator_never_matches_another_list_by_its_joined_text() -> None:
    state = ClusterState()
    for name in ("a", "b\nc", "a\nb", "c"):
        state.set_node(name, [Slot(f"{name}-0", "G", capacity=1000)])
    assert state.rows_of(["a", "b\nc"]).tolist() == [state.row("a"), state.row("b\nc")]
    # joined, both lists read "a\nb\nc": the second must still be looked up name by name
    assert state.rows_of(["a\nb", "c"]).tolist() == [state.row("a\nb"), state.row("c")]
    assert state.rows_of(["a", "b\nc"]).tolist() == [state.row("a"), state.row("b\nc")]


def test_a_remembered_list_changed_in_place_by_its_caller_is_not_answered_from_memory() -> None:
    state = ClusterState()
    for name in ("a", "b", "c"):
        state.set_node(name, [Slot(f"{name}-0", "G", capacity=1000)])
    names = ["a", "b"]
    assert state.rows_of(names).tolist() == [0, 1]
    names[1] = "c"
    assert state.rows_of(names).tolist() == [0, 2]


@given(st.integers(0, 40).flatmap(lambda n: st.tuples(st.just([f"n{i}" for i in range(n)]),
                                                       st.sets(st.integers(0, max(0, n - 1)), max_size=n))))
def test_without_drops_exactly_the_given_indices_in_order(case: tuple[list[str], set[int]]) -> None:
    items, drop = case
    drop = {i for i in drop if i < len(items)}
    assert placement.without(items, sorted(drop)) == [x for i, x in enumerate(items) if i not in drop]


element = st.sampled_from([("vramshare.io/gpu-memory", 4), ("vramshare.io/gpu-memory", 16), ("vramshare.io/gpu", 1)])
signature = st.frozensets(element, min_size=1, max_size=2)
hold_step = st.one_of(
    st.tuples(st.just("hold"), st.integers(0, 3), st.sampled_from(NAMES[:2]), signature, st.booleans()),
    st.tuples(st.just("expect"), st.integers(0, 3), st.sampled_from(NAMES[:2]), signature),
    st.tuples(st.just("release"), st.integers(0, 3)),
    st.tuples(st.just("reported"), st.sampled_from(NAMES[:2])),
    st.tuples(st.just("expire"), st.integers(0, 40)),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(hold_step, max_size=30), signature)
def test_the_held_nodes_filter_walks_for_a_size_are_the_only_ones_that_ask_anything(steps: list, sig: frozenset) -> None:
    """``Holds.held_nodes(signature)`` (kept by element as holds come and go) names exactly the held
    nodes where a hold shares an element with the signature; on every other node :meth:`required`
    asks nothing of such a pod, so filter may skip it."""
    from extender.holds import Holds, Required

    sec = 1_000_000_000
    h = Holds(30 * sec)
    now = 10 * sec
    for step in steps:
        now += sec // 2
        if step[0] == "hold":
            _, pod, node, s, planned = step
            h.hold(f"p{pod}", node, s, now, {e: (("gpu", 1),) for e in s} if planned else None)
        elif step[0] == "expect":
            h.expect(f"p{step[1]}", step[2], step[3], now)
        elif step[0] == "release":
            h.release(f"p{step[1]}")
        elif step[0] == "reported":
            h.reported(step[1], now)
        else:
            h.expire(now + step[1] * sec)
    sharing = set(h.held_nodes(sig))
    assert sharing == {n for n in h.held_nodes() if any(x.signature & sig for x in h._by_node[n].values())}
    for node in set(h.held_nodes()) - sharing:
        assert h.required(node, "newcomer", sig, now, record=False) == Required()


def test_a_hold_whose_plans_become_known_is_indexed_once() -> None:
    """The bind's hold is taken again when the watch brings its plans (same pod, node and size): once
    released, no size may still name its node."""
    from extender.holds import Holds

    h = Holds(30_000_000_000)
    size = frozenset({("vramshare.io/gpu-memory", 4)})
    h.hold("p", "n0", size, 10)
    h.hold("p", "n0", size, 11, {("vramshare.io/gpu-memory", 4): (("GPU-0", 4096),)})
    assert h.held_nodes(size) == ["n0"]
    h.release("p")
    assert h.held_nodes(size) == [] and h.held_nodes() == []
