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
from deviceplugin.quota.writer import read_quota
from tests.quota.node_sim import DraNode, Engine
from tests.quota.test_node_soundness import CAP, GIB, issue_node, issue_scenario, nodes, sound_run


def test_a_claim_prepared_beside_a_lender_is_not_promised_lent_memory(tmp_path):
    """The issue's scenario: alone, a 40 GiB claim is lent up to 61,440 MiB and uses 59,392; a 39 GiB
    claim is allocated and prepared there, its pod seen by the watch 3 ticks later."""
    issue_scenario(*issue_node(tmp_path, b_startup=6, kind=DraNode, b_list_lag=3))


def _prepared_late(tmp_path, allocated: bool = True) -> tuple[DraNode, Engine, Engine]:
    """The issue's lender (40 GiB, lent up to 61,440, uses 59,392) and a 39 GiB claim the scheduler
    allocated here at tick 12, whose pod the watch shows at once and the kubelet prepares 4 ticks later
    (image pull, init containers: the real gap between bind and NodePrepareResources)."""
    a = Engine("a", 40 * GIB, "unmap", bind=0, demand=[59392], startup=1)
    b = Engine("b", 39 * GIB, "unmap", bind=12, demand=[39 * GIB], startup=6, alloc_after=4, list_lag=0)
    return DraNode(str(tmp_path), CAP, [a, b], allocated=allocated), a, b


def test_a_claim_allocated_here_before_prepare_is_counted_and_the_lender_shrinks_first(tmp_path):
    """Issue 19 ("every pod bound there but not yet reported counts at its request from the moment it
    exists; lenders shrink first"), on the DRA path: between the scheduler's allocation (and bind) and
    the kubelet's Prepare the claim was in no checkpoint, so the loop kept lending its memory, and at
    Prepare the newcomer's file had to be cut to what the lender had not released yet (on the commit
    before this one its first two files read 19,456 MiB of its 39,936). Counted from the bind, the lender is
    back at its request by Prepare and the newcomer's file is its whole grant from the first tick; its
    claim is read once from the API server, not once per tick."""
    node, a, b = _prepared_late(tmp_path)
    for _ in range(12):
        node.step()
    assert a.use == 59392 and a.limit() > 40 * GIB  # a lender, while alone
    for _ in range(4):  # bound and allocated, not prepared yet
        node.step()
        assert node.loop.last.reserved.get("GPU-node") == b.request
    assert a.limit() <= CAP - b.request and a.use <= CAP - b.request  # shrunk before Prepare
    for _ in range(16):
        node.step()
        assert read_quota(node._alloc_dir(b)).gpus[0].limit_mib >= b.request  # never fitted below its grant
        assert a.use + b.use <= CAP and node.committed() <= CAP
    assert node.claims.reads == 2 and node.source.list_pending() == []  # one read per claim (a's too, at tick 0)


def test_without_counting_allocated_claims_the_newcomers_file_is_cut(tmp_path):
    """The same node without :class:`AllocatedClaims` (what the DRA plugin did before): still sound,
    through fitting, but the newcomer starts below its grant while the lender still borrows. This
    is what the test above guards against; it shows the scenario has a lender to shrink."""
    node, a, b = _prepared_late(tmp_path, allocated=False)
    cut = []
    for _ in range(32):
        node.step()
        if node.t > b.bind + b.alloc_after:
            cut.append(read_quota(node._alloc_dir(b)).gpus[0].limit_mib)
        assert a.use + b.use <= CAP and node.committed() <= CAP
    assert min(cut) < b.request


@settings(max_examples=40, deadline=None)
@given(nodes(), st.one_of(st.none(), st.integers(1, 44)), st.sampled_from(["forecast", "learned", "peak"]))
def test_sum_of_uses_fits_on_the_dra_path(tmp_path_factory, engines, restart, headroom):
    """Over 45 ticks: the sum of uses and the node-level sum of max(limit, use) over every claim with a
    quota file never exceed the GPU, and no started claim is held below min(its request, its demand)
    while another borrows for longer than the loop needs to react; also when the loop restarts at
    ``restart``. Every headroom rule."""
    sound_run(DraNode(str(tmp_path_factory.mktemp("node")), CAP, engines, PolicyParams(headroom=headroom)), restart)


def test_a_starting_engine_that_reports_late_is_not_counted_at_its_cut(tmp_path):
    """Regression (fails before the fix; hypothesis found it here at round 17's end). e2 borrows up to
    67,584 MiB and acknowledges 2 ticks late; e0's claim (4 GiB) is prepared at 14 with its full grant,
    e1's (10 GiB) at 15 with no notice. At 15 the loop cut e0, which had reported nothing yet, to 3,072
    and counted the 1,024 as free for e1's file; at 16 e0 reported that it still followed the prepared
    file (4,096) and was raised back within it, beside e1's whole grant and e2's raise landing late:
    81,920 MiB committed on 80,896. Counted at the file it may follow until it reports, e0's cut is not
    e1's, whose file is fitted to what is left and grows as e2 releases."""
    walk = [8192, 8192, 4096, 4096, 5120, 5120, 5120, 8192]
    engines = [Engine("e0", 4096, "unmap", bind=12, demand=walk, list_lag=0, alloc_after=2, link_after=0,
                      startup=6, ack_lag=1),
               Engine("e1", 10240, "unmap", bind=15, demand=[2 * x + 4096 for x in walk], list_lag=1,
                      alloc_after=0, link_after=0, startup=7, ack_lag=0),
               Engine("e2", 45056, "unmap", bind=0, demand=[58686, 58686, 54590, 54590, 55614, 55614, 55614, 63806,
                                                             71998, 71998, 71998, 71998, 73022, 71998, 73022],
                      list_lag=0, alloc_after=0, link_after=0, startup=6, ack_lag=2)]
    sound_run(DraNode(str(tmp_path), CAP, engines, PolicyParams(headroom="forecast")), None, ticks=30)
