"""Issue 19's node-level rule on the DRA path: lent memory is never promised twice. The node of
tests/quota/node_sim.py with the DRA plugin's tenants (:class:`~tests.quota.node_sim.DraNode`: claims the
kubelet prepares, pods the watch delivers late, the preparer's first quota file at the full grant) and
the real loop, policy and writer, over the same random arrivals, lags, release modes and demand walks
as the device plugin's property (tests/quota/test_node_soundness.py). On the commit before this one it
fails: a claim prepared beside a lender was neither a tenant nor a claim until its pod was seen, and
its full-grant file was never fitted to what the lender had released."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from deviceplugin.quota.model import PolicyParams
from tests.quota.node_sim import DraNode, Engine
from tests.quota.test_node_soundness import CAP, GIB, nodes


def test_a_claim_prepared_beside_a_lender_is_not_promised_lent_memory(tmp_path):
    """The issue's scenario: alone, a 40 GiB claim is lent up to 61,440 MiB and uses 59,392; a 39 GiB
    claim is allocated and prepared there, its pod seen by the watch 3 ticks later."""
    a = Engine("a", 40 * GIB, "unmap", bind=0, demand=[59392], startup=1)
    b = Engine("b", 39 * GIB, "unmap", bind=12, demand=[39 * GIB], startup=6, list_lag=3)
    node = DraNode(str(tmp_path), CAP, [a, b])
    for _ in range(12):
        node.step()
    assert a.use == 59392 and a.limit() > 40 * GIB
    for _ in range(20):
        node.step()
        assert a.use + b.use <= CAP
        assert node.committed() <= CAP, (node.t, a.use, a.limit(), b.use, b.limit())
    assert b.use == 39 * GIB and b.limit() >= 39 * GIB and a.limit() <= CAP - b.request
    assert node.loop.counts["node_overcommit"] == 0


@settings(max_examples=40, deadline=None)
@given(nodes(), st.one_of(st.none(), st.integers(1, 44)), st.sampled_from(["forecast", "learned", "peak"]))
def test_sum_of_uses_fits_on_the_dra_path(tmp_path_factory, engines, restart, headroom):
    """Over 45 ticks: the sum of uses and the node-level sum of max(limit, use) over every claim with a
    quota file never exceed the GPU, and no started claim is held below min(its request, its demand)
    while another borrows for longer than the loop needs to react; also when the loop restarts at
    ``restart``. Every headroom rule."""
    node = DraNode(str(tmp_path_factory.mktemp("node")), CAP, engines, PolicyParams(headroom=headroom))
    react = 2 * max(e.ack_lag for e in engines) + 4
    fenced = {e.name: 0 for e in engines}
    for _ in range(45):
        if node.t == restart:
            node.restart()
        node.step()
        t = node.t - 1
        assert sum(e.use for e in engines) <= CAP, (t, [(e.name, e.use, e.limit()) for e in engines])
        assert node.committed() <= CAP, (t, [(e.name, e.use, e.limit()) for e in engines])
        assert not node.loop.last.errors
        borrowing = [e for e in engines if e.use > e.request]
        for e in engines:  # as on the device plugin's path: nobody is held short while another borrows
            short = t >= e.bind + e.startup and e.limit() < min(e.request, e.demand_at(t)) and any(
                o is not e for o in borrowing)
            fenced[e.name] = fenced[e.name] + 1 if short else 0
            assert fenced[e.name] <= react, (e.name, t, e.limit(), e.demand_at(t), [(o.name, o.use) for o in borrowing])
    assert node.loop.counts["node_overcommit"] == 0
