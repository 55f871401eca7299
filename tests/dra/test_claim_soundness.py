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
from tests.quota.node_sim import DraNode
from tests.quota.test_node_soundness import CAP, issue_node, issue_scenario, nodes, sound_run


def test_a_claim_prepared_beside_a_lender_is_not_promised_lent_memory(tmp_path):
    """The issue's scenario: alone, a 40 GiB claim is lent up to 61,440 MiB and uses 59,392; a 39 GiB
    claim is allocated and prepared there, its pod seen by the watch 3 ticks later."""
    issue_scenario(*issue_node(tmp_path, b_startup=6, kind=DraNode, b_list_lag=3))


@settings(max_examples=40, deadline=None)
@given(nodes(), st.one_of(st.none(), st.integers(1, 44)), st.sampled_from(["forecast", "learned", "peak"]))
def test_sum_of_uses_fits_on_the_dra_path(tmp_path_factory, engines, restart, headroom):
    """Over 45 ticks: the sum of uses and the node-level sum of max(limit, use) over every claim with a
    quota file never exceed the GPU, and no started claim is held below min(its request, its demand)
    while another borrows for longer than the loop needs to react; also when the loop restarts at
    ``restart``. Every headroom rule."""
    sound_run(DraNode(str(tmp_path_factory.mktemp("node")), CAP, engines, PolicyParams(headroom=headroom)), restart)
