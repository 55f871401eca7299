"""Issue 19: lent memory is never promised twice. A node simulated at its edges (tests/quota/node_sim.py)
runs the real loop, policy, writer, kube parsers and quota-file layout; containers are bound, allocated,
linked and started as on a real node, and their engines follow their quota files with a lag. (This
file imports only what main had, so the regression runs, and fails, there too.)"""
from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.quota.node_sim import Engine, Node

CAP = 80896  # the issue's GPU
GIB = 1024


def _issue_node(tmp_path, lender_mode="unmap", b_startup=4):
    a = Engine("a", 40 * GIB, lender_mode, bind=0, demand=[59392], startup=1)
    b = Engine("b", 39 * GIB, "unmap", bind=12, demand=[39 * GIB], startup=b_startup)
    return Node(str(tmp_path), CAP, [a, b]), a, b


def test_the_issues_newcomer_is_not_promised_lent_memory(tmp_path):
    """Regression (fails on main): alone on 80,896 MiB a tenant asking 40 GiB is lent up to 61,440 and
    uses 59,392; a 39 GiB pod is bound there. On main the loop never saw the bound pod and its first
    quota file, so the lender kept its loan: limits and use summed to 101,376 / 99,328 MiB."""
    node, a, b = _issue_node(tmp_path)
    for _ in range(12):
        node.step()
    assert a.use == 59392 and a.limit() > 40 * GIB  # lent beyond its request while alone (it releases)
    for _ in range(20):
        node.step()
        assert a.use + b.use <= CAP
        assert node.committed() <= CAP, (node.t, a.use, a.limit(), b.use, b.limit())
    assert b.use == 39 * GIB and b.limit() >= 39 * GIB and a.limit() <= CAP - b.request
    assert node.loop.counts["node_overcommit"] == 0


def test_a_throttling_engine_is_never_lent_memory(tmp_path):
    """A vLLM cap frees nothing: a throttling engine gets no loan, so the newcomer's request is whole."""
    node, a, b = _issue_node(tmp_path, lender_mode="throttle")
    for _ in range(32):
        node.step()
        assert a.limit() <= a.request and a.use + b.use <= CAP and node.committed() <= CAP
    assert b.use == b.request


@st.composite
def nodes(draw):
    """Up to three containers, requests that fit the GPU (the extender's books), random arrivals,
    listing lags, Allocate/link delays, acknowledgement lags, release modes and demand walks. A
    newcomer's engine starts no sooner than its listing lag + acknowledgement lags + 2 ticks after its
    bind (a container starts and loads weights before it allocates KV memory)."""
    n = draw(st.integers(2, 3))
    left, engines = CAP, []
    for i in range(n):
        req = draw(st.integers(4, max(4, left // GIB // (n - i)))) * GIB
        left -= req
        lag, ack = draw(st.integers(0, 2)), draw(st.integers(0, 2))
        rng = random.Random(draw(st.integers(0, 2 ** 16)))
        level, walk = rng.randint(0, 2 * req), []
        for _ in range(60):
            level = max(0, min(2 * req, level + rng.choice((-4096, -1024, 0, 0, 1024, 4096, 8192))))
            walk.append(level)
        engines.append(Engine(f"e{i}", req, draw(st.sampled_from(["unmap", "unmap", "throttle"])),
                              bind=draw(st.integers(0, 20)), demand=walk, list_lag=lag,
                              alloc_after=draw(st.integers(0, 2)), link_after=draw(st.integers(0, 2)),
                              startup=lag + 2 * 2 + 2 + draw(st.integers(0, 3)), ack_lag=ack))
    return engines


@settings(max_examples=40, deadline=None)
@given(nodes())
def test_sum_of_uses_fits_and_nobody_is_fenced_below_its_request_while_another_borrows(tmp_path_factory, engines):
    """Over 45 ticks: the sum of uses never exceeds the GPU, the node-level sum of max(limit, use)
    over every container with a quota file never does either, and no started container is fenced
    below min(its request, its demand) while another uses more than its request for longer than the
    loop needs to react (see it at its fence, the lender's acknowledgement, the raise's
    acknowledgement: 2 x the largest ack lag + 4 ticks)."""
    node = Node(str(tmp_path_factory.mktemp("node")), CAP, engines)
    react = 2 * max(e.ack_lag for e in engines) + 4
    fenced = {e.name: 0 for e in engines}
    for _ in range(45):
        node.step()
        t = node.t - 1
        assert sum(e.use for e in engines) <= CAP, [(e.name, e.use, e.limit()) for e in engines]
        assert node.committed() <= CAP, [(e.name, e.use, e.limit()) for e in engines]
        assert not node.loop.last.errors  # every file written (the writer refuses limits out of bounds)
        borrowing = [e for e in engines if e.use > e.request]
        for e in engines:
            started = t >= e.bind + e.startup
            short = started and e.limit() < min(e.request, e.demand_at(t)) and any(o is not e for o in borrowing)
            fenced[e.name] = fenced[e.name] + 1 if short else 0
            assert fenced[e.name] <= react, (e.name, t, e.limit(), e.demand_at(t), [(o.name, o.use) for o in borrowing])
    assert node.loop.counts["node_overcommit"] == 0
