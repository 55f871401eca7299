"""The incremental hot path answers exactly as a full recompute (issue 21, 300 cycles/s).

Filter and prioritize keep per-row results between requests: the greedy fit of each pod shape
(:meth:`ClusterState.memo_fit`, patched for the rows a bind or a watch event touched), FGD's row memo,
and each node's encoded HostPriority entries (:class:`extender.wire.HostFragments`, valid for one
:attr:`ClusterState.names_epoch`). A property over random sequences of binds, releases, node updates,
host updates, node removals and re-additions (a row changing hands): after every step, the books that
answered every step before (warm memos) and books built afresh from the same events (cold) give the
same filter answer, the same scores, the same greedy fit and the same bytes on the wire.
"""
from __future__ import annotations

import random

import numpy as np
import pytest

from extender import placement, wire
from extender.cluster import ClusterState, Demand, HostDemand, Slot

MODELS = ("A100", "H100", "L40S")
SIZES = (100, 250, 400, 500, 700, 1000)


def _event(rng: random.Random, st: ClusterState, serial: int) -> tuple:
    nodes = st.nodes()
    roll = rng.random()
    if roll < 0.12 or not nodes:
        name = f"n{rng.randrange(40)}"
        slots = tuple(Slot(f"{name}-g{g}-{serial}" if rng.random() < 0.2 else f"{name}-g{g}", rng.choice(MODELS),
                           kind="exclusive" if rng.random() < 0.1 else "shared",
                           capacity=rng.choice((500, 1000)), healthy=rng.random() > 0.1, index=g)
                      for g in range(rng.randint(1, 4)))
        return ("node", name, slots)
    node = rng.choice(nodes)
    if roll < 0.18:
        return ("gone", node)
    if roll < 0.25:
        return ("host", node, rng.choice((4000, 16000)), rng.choice((8000, 64000)))
    if roll < 0.4 and st._pods:  # noqa: SLF001 - which keys exist, to release one
        return ("unpod", rng.choice(sorted(st._pods)))  # noqa: SLF001
    slots = st.slots(st.row(node))
    if not slots:
        return ("observe", rng.choice(SIZES))
    slot = rng.choice(slots)
    return ("pod", f"p{serial}", node, ((slot.uuid, rng.choice((50, 100, 250, 500))),),
            HostDemand(rng.choice((0, 1000)), rng.choice((0, 2000))))


def _apply(st: ClusterState, ev: tuple) -> None:
    kind = ev[0]
    try:
        if kind == "node":
            st.set_node(ev[1], ev[2])
        elif kind == "gone":
            st.remove_node(ev[1])
        elif kind == "host":
            st.set_host(ev[1], ev[2], ev[3])
        elif kind == "unpod":
            st.remove_pod(ev[1])
        elif kind == "pod":
            st.add_pod(ev[1], ev[2], ev[3], ev[4])
        else:
            st.observe([Demand(ev[1])])
    except Exception:  # noqa: BLE001 - a refused event is refused alike on both books
        pass


def _asks(rng: random.Random) -> list[tuple[tuple[Demand, ...], HostDemand]]:
    one = (Demand(rng.choice(SIZES)),)
    two = (Demand(rng.choice(SIZES), 2, models=(rng.choice(MODELS),) if rng.random() < 0.5 else ()),)
    side = (Demand(rng.choice(SIZES)), Demand(rng.choice((100, 250))))
    whole = (Demand(rng.choice((500, 1000)), kind="exclusive"),)
    return [(d, HostDemand(rng.choice((0, 1000)), rng.choice((0, 2000)))) for d in (one, two, side, whole)]


def _answers(st: ClusterState, names: list[str], demands: tuple[Demand, ...], host: HostDemand,
             frags: wire.HostFragments) -> tuple:
    fitting, failed = placement.filter_nodes(st, demands, names, host)
    rows, scores = placement.score_rows(st, demands, names, "fgd", host)
    encoded = frags.encode(names, rows, scores, st.names_epoch)
    assert encoded == wire.encode_host_priorities(list(zip(names, scores.tolist())))
    fit = placement.ask_for(st, demands, rows[rows >= 0], host).best_fit
    cols = tuple(np.where(fit.ok[:, None], c, -1).tolist() for c in fit.columns)
    return fitting, failed, scores.tolist(), encoded, fit.ok.tolist(), cols, fit.free_after.tolist()


@pytest.mark.parametrize("seed", range(12))
def test_incremental_answers_equal_a_full_recompute(seed: int) -> None:
    rng = random.Random(seed)
    warm, events, frags = ClusterState(gpus_per_node=4), [], wire.HostFragments()
    for size in SIZES:
        warm.observe([Demand(size)], HostDemand(1000, 2000))
    for step in range(60):
        for _ in range(rng.choice((1, 1, 2, 4))):  # several rows may change between two requests
            ev = _event(rng, warm, len(events))
            events.append(ev)
            _apply(warm, ev)
        names = sorted(warm.nodes())
        rng.shuffle(names)
        if rng.random() < 0.3:
            names.append("ghost")  # a name the books do not know
        for demands, host in _asks(rng):
            cold = ClusterState(gpus_per_node=4)
            for size in SIZES:
                cold.observe([Demand(size)], HostDemand(1000, 2000))
            for past in events:
                _apply(cold, past)
            got = _answers(warm, names, demands, host, frags)
            want = _answers(cold, names, demands, host, wire.HostFragments())
            assert got == want, (seed, step, ev, demands, host)
