"""Issue 19: lent memory is never promised twice. A node simulated at its edges (tests/quota/node_sim.py)
runs the real loop, policy, writer, kube parsers and quota-file layout; containers are bound, allocated,
linked and started as on a real node, and their engines follow their quota files with a lag. (This
file imports only what main had, so the regression runs, and fails, there too.)"""
from __future__ import annotations

import random

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from deviceplugin.quota.model import PolicyParams
from tests.quota.node_sim import Engine, Node

CAP = 80896  # the issue's GPU
GIB = 1024


def issue_node(tmp_path, lender_mode="unmap", b_startup=4, kind=Node, b_list_lag=0):
    a = Engine("a", 40 * GIB, lender_mode, bind=0, demand=[59392], startup=1)
    b = Engine("b", 39 * GIB, "unmap", bind=12, demand=[39 * GIB], startup=b_startup, list_lag=b_list_lag)
    return kind(str(tmp_path), CAP, [a, b]), a, b


def test_the_issues_newcomer_is_not_promised_lent_memory(tmp_path):
    """Regression (fails on main): alone on 80,896 MiB a tenant asking 40 GiB is lent up to 61,440 and
    uses 59,392; a 39 GiB pod is bound there. On main the loop never saw the bound pod and its first
    quota file, so the lender kept its loan: limits and use summed to 101,376 / 99,328 MiB."""
    issue_scenario(*issue_node(tmp_path))


def issue_scenario(node: Node, a: Engine, b: Engine) -> None:
    """The issue's newcomer beside a lender (:func:`issue_node`), checked tick by tick; the DRA path's
    node runs it too (tests/dra/test_claim_soundness.py)."""
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
    node, a, b = issue_node(tmp_path, lender_mode="throttle")
    for _ in range(32):
        node.step()
        assert a.limit() <= a.request and a.use + b.use <= CAP and node.committed() <= CAP
    assert b.use == b.request


def _throttler_cut_while_idle(tmp_path, returns_at: int):
    """A borrower (releasing, acknowledges at once) beside a throttling engine that stays idle past
    its start-up and wants its whole request back at ``returns_at``, acknowledging files 2 ticks late."""
    a = Engine("a", CAP - 4 * GIB, "unmap", bind=0, demand=[CAP], startup=6, ack_lag=0, alloc_after=0, link_after=0)
    b = Engine("b", 4 * GIB, "throttle", bind=0, demand=[0] * (returns_at - 6) + [4 * GIB], startup=6, ack_lag=2,
               alloc_after=0, link_after=0)
    return Node(str(tmp_path), CAP, [a, b]), a, b


def test_a_cut_the_engine_has_not_acknowledged_is_not_lent_when_it_still_follows_allocates_file(tmp_path_factory):
    """Regression (fails before the fix; found by the property test below): the loop cuts an idle
    throttling engine below its request, on the first file it writes for it. Until the engine
    acknowledges that file it still follows the one Allocate wrote (its request), but the loop
    remembered only the files it wrote itself, so the limit it "may still grow to" was the cut: the
    cut was lent to the borrower at once, and the engine growing back to its request before its
    acknowledgement put the sum of uses over the GPU (82,432 MiB on 80,896)."""
    for returns_at in range(26, 42):
        node, a, b = _throttler_cut_while_idle(tmp_path_factory.mktemp("node"), returns_at)
        for _ in range(returns_at + 8):
            node.step()
            assert a.use + b.use <= CAP, (returns_at, node.t - 1, a.use, a.limit(), b.use, b.limit())
            assert node.committed() <= CAP, (returns_at, node.t - 1, a.use, a.limit(), b.use, b.limit())
        assert node.loop.counts["node_overcommit"] == 0


def test_a_restarted_loop_does_not_lend_what_an_engine_on_an_older_file_may_still_use(tmp_path):
    """Regression (fails before the fix; found by the property test with restarts): the loop lent e1
    up to 12,288 MiB (its ceiling, request 8,192), then cut it to 10,240; it restarted before e1's
    engine (2 ticks behind) applied the cut. The new loop knew only the file on disk (10,240) and
    treated 10,240 as the most e1 could grow to, so it raised e0 into the 2,048 MiB e1 was still
    using under the older file: 81,920 MiB used on 80,896."""
    e0 = Engine("e0", 25600, "unmap", bind=0, link_after=1, alloc_after=0, startup=4, ack_lag=0, demand=[
        16619, 17643, 16619, 16619, 17643, 17643, 21739, 22763, 18667, 19691, 15595, 23787, 23787, 23787, 24811, 23787,
        22763, 26859, 26859, 27883, 36075, 37099, 37099, 37099, 41195, 49387, 48363, 47339, 51200, 50176, 51200])
    e1 = Engine("e1", 8192, "unmap", bind=0, list_lag=1, alloc_after=0, link_after=0, startup=8, ack_lag=2, demand=[
        5426, 13618, 16384, 16384, 12288, 12288, 8192, 8192, 16384, 16384, 16384, 16384, 16384, 16384, 15360, 11264,
        11264, 7168, 15360, 15360, 15360, 16384, 16384, 16384, 12288, 16384, 16384])
    e2 = Engine("e2", 28672, "unmap", bind=5, alloc_after=0, link_after=0, startup=4, ack_lag=1, demand=[
        55340, 57344, 57344, 53248, 53248, 54272, 54272, 54272, 57344, 57344, 57344, 57344, 57344, 57344, 56320, 57344,
        56320, 56320, 55296, 57344, 53248, 54272, 57344, 57344, 57344, 57344])
    node = Node(str(tmp_path), CAP, [e0, e1, e2])
    for _ in range(45):
        if node.t == 34:
            node.restart()
        node.step()
        assert e0.use + e1.use + e2.use <= CAP, (node.t - 1, [(e.name, e.use, e.limit()) for e in (e0, e1, e2)])
        assert node.committed() <= CAP, (node.t - 1, [(e.name, e.use, e.limit()) for e in (e0, e1, e2)])
    assert node.loop.counts["node_overcommit"] == 0


def _walk(seed: int, request: int, ticks: int) -> list[int]:
    """A demand walk between 0 and twice the request (the property test's; a seed pins one)."""
    rng = random.Random(seed)
    level, walk = rng.randint(0, 2 * request), []
    for _ in range(ticks):
        level = max(0, min(2 * request, level + rng.choice((-4096, -1024, 0, 0, 1024, 4096, 8192))))
        walk.append(level)
    return walk


def test_a_restarted_loop_holds_the_limit_of_an_engine_on_a_file_it_never_saw(tmp_path):
    """Regression (fails before the fix; found with restarts, 100 ticks, headroom ``peak``): after a
    restart e2's engine still follows a file the new loop never saw, so the loop counts it at up to
    its ceiling (41,472 MiB). Planned with its use, the policy then raised its limit into that bound
    (39,424 -> 40,448: free, as far as the books went), while e3's acknowledged 6,144 MiB grant was
    still in use: 81,408 MiB used and promised on 80,896. Until its engine acknowledges a file the
    loop knows, such a tenant's limit is held (like one without telemetry)."""
    params = PolicyParams(headroom="peak", protect_requests=False, share_spare=False)
    quick = dict(alloc_after=0, link_after=0)
    engines = [Engine("e0", 11264, "unmap", bind=0, demand=_walk(0, 11264, 100), startup=2, ack_lag=0, **quick),
               Engine("e1", 12288, "unmap", bind=0, demand=_walk(0, 12288, 100), startup=2, ack_lag=0, **quick),
               Engine("e2", 27648, "unmap", bind=0, demand=_walk(0, 27648, 100), startup=6, ack_lag=2, **quick),
               Engine("e3", 4096, "unmap", bind=1, demand=_walk(3, 4096, 100), startup=4, ack_lag=1, **quick)]
    node = Node(str(tmp_path), CAP, engines, params)
    for _ in range(90):
        if node.t == 83:
            node.restart()
        node.step()
        assert sum(e.use for e in engines) <= CAP, (node.t - 1, [(e.name, e.use, e.limit()) for e in engines])
        assert node.committed() <= CAP, (node.t - 1, [(e.name, e.use, e.limit()) for e in engines])
    assert node.loop.counts["node_overcommit"] == 0


def test_a_raise_into_a_limit_not_yet_let_go_of_must_fit_once_it_is(tmp_path):
    """Regression (fails before the fix; found with 100 ticks and later binds, default policy): e1
    was lent up to 30,720 MiB; e3 (30,720) is bound. e1 is cut to 25,339 but has not acknowledged,
    so it still counts at 30,720; the policy then raised it to 26,363 "for free" (within what it
    held), and e2 back to 19,968: once the acknowledgements were in, 81,920 MiB were promised on
    80,896. Every raise must also fit the GPU as it will be when the pending cuts are acknowledged."""
    quick = dict(alloc_after=0, link_after=0)
    engines = [Engine("e0", 4096, "unmap", bind=0, demand=_walk(0, 4096, 100), startup=2, ack_lag=0, **quick),
               Engine("e1", 20480, "unmap", bind=6, demand=_walk(46187, 20480, 100), startup=7, ack_lag=1, **quick),
               Engine("e2", 13312, "unmap", bind=0, demand=_walk(0, 13312, 100), startup=4, ack_lag=1, **quick),
               Engine("e3", 30720, "unmap", bind=22, demand=_walk(0, 30720, 100), list_lag=2, startup=6, ack_lag=1,
                      **quick)]
    node = Node(str(tmp_path), CAP, engines)
    for _ in range(60):
        node.step()
        assert sum(e.use for e in engines) <= CAP, (node.t - 1, [(e.name, e.use, e.limit()) for e in engines])
        assert node.committed() <= CAP, (node.t - 1, [(e.name, e.use, e.limit()) for e in engines])
    assert node.loop.counts["node_overcommit"] == 0


def test_a_tenant_on_a_file_the_loop_never_saw_is_not_raised(tmp_path):
    """Regression (fails before the fix; found with two restarts, headroom ``learned``): after the
    restart at 64, e2's engine follows a file the new loop never saw and is counted at up to its
    ceiling (39,936 MiB); planned without telemetry, rule 3 raised it back toward its request
    (24,576 -> 26,624) inside that guess: 81,920 MiB promised on 80,896 the next tick."""
    engines = [Engine("e0", 14336, "unmap", bind=34, demand=_walk(4351, 14336, 100), alloc_after=0, link_after=0,
                      startup=2, ack_lag=0),
               Engine("e1", 4096, "unmap", bind=29, demand=_walk(65535, 4096, 100), alloc_after=0, link_after=1,
                      startup=4, ack_lag=1),
               Engine("e2", 26624, "unmap", bind=56, demand=_walk(237, 26624, 100), list_lag=3, alloc_after=1,
                      link_after=2, startup=12, ack_lag=2),
               Engine("e3", 24576, "unmap", bind=7, demand=_walk(5429, 24576, 100), list_lag=2, alloc_after=0,
                      link_after=2, startup=13, ack_lag=3)]
    node = Node(str(tmp_path), CAP, engines, PolicyParams(headroom="learned"))
    for _ in range(80):
        if node.t in (35, 64):
            node.restart()
        node.step()
        assert sum(e.use for e in engines) <= CAP, (node.t - 1, [(e.name, e.use, e.limit()) for e in engines])
        assert node.committed() <= CAP, (node.t - 1, [(e.name, e.use, e.limit()) for e in engines])


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
        walk = _walk(draw(st.integers(0, 2 ** 16)), req, 60)
        engines.append(Engine(f"e{i}", req, draw(st.sampled_from(["unmap", "unmap", "throttle"])),
                              bind=draw(st.integers(0, 20)), demand=walk, list_lag=lag,
                              alloc_after=draw(st.integers(0, 2)), link_after=draw(st.integers(0, 2)),
                              startup=lag + 2 * 2 + 2 + draw(st.integers(0, 3)), ack_lag=ack))
    return engines


# the counterexample hypothesis found (demand walks cut after the tick that failed, 31): e1 is cut below
# its request at 30 on the loop's first file for it, and wants its request back at 31, before it acknowledges
_E1 = [3040, 4064, 8160, 8160, 8192, 7168, 8192, 8192, 8192, 8192, 8192, 8192, 4096, 4096, 3072, 2048, 2048, 0,
       4096, 0, 0, 1024, 5120]
_E2 = [58686, 58686, 54590, 54590, 55614, 55614, 55614, 63806, 69632, 69632, 69632, 69632, 69632, 68608, 69632,
       68608, 68608, 67584, 69632, 65536, 66560, 69632, 69632, 69632, 69632, 69632]
_E0 = [18068, 22164, 22164, 18068, 18068, 18068, 22164, 22164, 22164, 21140, 20116, 28308, 24212, 23188, 31380,
       31380, 34816, 34816, 33792, 33792]


@settings(max_examples=40, deadline=None)
@example(engines=[Engine("e0", 17408, "unmap", bind=5, demand=_E0, list_lag=1, alloc_after=0, link_after=0, startup=7,
                         ack_lag=1),
                  Engine("e1", 4096, "throttle", bind=0, demand=_E1, list_lag=0, alloc_after=0, link_after=0, startup=9,
                         ack_lag=2),
                  Engine("e2", 34816, "unmap", bind=0, demand=_E2, list_lag=0, alloc_after=0, link_after=0, startup=6,
                         ack_lag=0)], restart=None, headroom="forecast")
@given(nodes(), st.one_of(st.none(), st.integers(1, 44)), st.sampled_from(["forecast", "learned", "peak"]))
def test_sum_of_uses_fits_and_nobody_is_fenced_below_its_request_while_another_borrows(tmp_path_factory, engines,
                                                                                       restart, headroom):
    """Over 45 ticks: the sum of uses never exceeds the GPU, the node-level sum of max(limit, use)
    over every container with a quota file never does either, and no started container is fenced
    below min(its request, its demand) while another uses more than its request for longer than the
    loop needs to react (see it at its fence, the lender's acknowledgement, the raise's
    acknowledgement: 2 x the largest ack lag + 4 ticks); also when the quota loop restarts at
    ``restart`` (a new process on the same files, remembering nothing). Every headroom rule."""
    sound_run(Node(str(tmp_path_factory.mktemp("node")), CAP, engines, PolicyParams(headroom=headroom)), restart)


def sound_run(node: Node, restart: int | None, ticks: int = 45) -> None:
    """The property's checks over ``ticks`` ticks of ``node`` (restarted at ``restart``); the DRA path's
    node runs them too (tests/dra/test_claim_soundness.py)."""
    engines = node.engines
    react = 2 * max(e.ack_lag for e in engines) + 4
    fenced = {e.name: 0 for e in engines}
    for _ in range(ticks):
        if node.t == restart:
            node.restart()
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


# two fairness counterexamples (demand walks cut at tick 90): the one q19sound's hunt left open under
# headroom ``learned`` (on its tree, cff5451), and one the same hunt finds on main (seed 5, no restart)
_SOUND_E0 = [
    1138, 2162, 10240, 6144, 5120, 1024, 0, 4096, 8192, 10240, 6144, 6144, 5120, 9216, 10240, 10240,
    10240, 10240, 10240, 10240, 6144, 6144, 6144, 7168, 6144, 10240, 10240, 6144, 10240, 10240, 9216,
    10240, 6144, 10240, 10240, 10240, 6144, 6144, 10240, 10240, 10240, 10240, 10240, 10240, 6144, 6144,
    6144, 6144, 5120, 5120, 5120, 1024, 2048, 2048, 0, 8192, 7168, 7168, 10240, 10240, 10240, 10240,
    6144, 6144, 10240, 9216, 10240, 10240, 10240, 10240, 10240, 9216, 10240, 10240, 9216, 10240]
_SOUND_E1 = [
    16171, 17195, 18219, 17195, 16171, 24363, 23339, 26624, 26624, 26624, 26624, 26624, 26624, 26624,
    26624, 26624, 26624, 26624, 26624, 26624, 26624, 26624, 26624, 26624, 26624, 26624, 26624, 22528,
    26624, 22528, 18432, 19456, 19456, 15360, 15360, 19456, 26624, 25600, 25600, 26624, 26624, 26624,
    26624, 26624, 26624, 26624, 26624, 26624, 25600, 26624, 26624, 22528, 22528, 26624, 25600, 25600,
    21504, 17408, 13312, 21504, 26624, 26624, 26624, 26624, 26624, 26624, 22528, 21504, 22528, 22528,
    18432, 22528, 22528, 22528, 21504, 21504, 17408, 17408]
_SOUND_E2 = [
    20172, 21196, 20172, 20172, 19148, 27340, 27340, 27340, 27340, 23244, 31436, 39628, 35532, 39628,
    47820, 46796, 45772, 45772, 41676, 40652, 44748, 52940, 48844, 48844, 57036, 61132, 60108, 59084,
    59084]
_SOUND_E3 = [
    33439, 33439, 29343, 29343, 30367, 30367, 30367, 38559, 43008, 43008, 43008, 43008, 43008, 41984,
    43008, 41984, 41984, 40960, 43008, 38912, 39936, 43008, 43008, 43008, 43008, 43008, 43008, 41984,
    41984, 37888, 41984, 37888, 43008, 43008, 43008, 43008, 43008, 38912, 38912, 38912, 38912, 39936,
    43008, 41984, 43008, 43008, 43008, 43008, 43008, 43008, 38912]
_MAIN_E0 = [
    8192, 8192, 8192, 8192, 8192, 8192, 7168, 8192, 7168, 8192, 8192, 7168, 8192, 4096, 4096, 4096,
    5120, 8192, 4096, 3072, 3072, 4096, 8192, 7168, 3072, 3072, 0, 4096, 4096, 8192, 8192, 8192, 8192,
    4096, 4096, 3072, 8192, 4096, 3072, 3072, 7168, 7168, 3072, 4096, 4096, 5120, 8192, 8192, 8192,
    8192, 8192, 8192, 8192, 8192, 8192, 8192, 8192, 4096, 4096, 4096, 0, 4096, 3072, 3072, 0, 0, 8192,
    4096, 4096, 0, 4096, 0, 1024, 5120, 5120]
_MAIN_E1 = [
    26207, 26207, 26207, 30303, 26207, 34399, 42591, 42591, 38495, 37471, 36447, 35423, 36447, 37471,
    37471, 38495, 38495, 37471, 41567, 41567, 37471, 45663, 45663, 41567, 41567, 40543, 41567, 37471,
    37471, 37471, 38495, 38495, 37471, 41567, 40543, 36447, 44639, 44639, 48735, 48735, 44639, 43615,
    42591]
_MAIN_E2 = [
    8965, 7941, 12037, 11013, 15109, 14085, 13061, 12037, 11013, 19205, 18181, 18181, 18181, 18181,
    19205, 27397, 27397, 31493, 27397, 23301, 22277, 23301, 19205, 19205, 15109, 11013, 11013, 6917,
    6917, 2821, 1797, 9989, 11013, 6917, 7941, 16133, 12037, 7941, 16133, 16133, 16133, 16133, 12037,
    12037, 12037, 12037, 13061, 8965, 13061, 21253, 21253, 22277, 18181, 18181, 22277, 22277, 18181,
    18181, 17157, 21253, 20229]
_MAIN_E3 = [
    18552, 22648, 23672, 23672, 22648, 18552, 18552, 19576, 19576, 19576, 19576, 23672, 27768, 28792,
    29816, 29816, 30840, 34936, 39032, 43128, 47104, 46080, 47104, 47104, 47104, 43008, 43008, 43008,
    43008, 47104, 46080, 45056, 44032, 47104, 47104, 47104, 47104]
_TIMING = ("bind", "list_lag", "alloc_after", "link_after", "startup", "ack_lag")
_FAIRNESS_CASES = {  # name, request, release mode, demand walk, _TIMING
    "q19sound": [
        ("e0", 5120, "unmap", _SOUND_E0, (10, 0, 2, 0, 4, 0)),
        ("e1", 13312, "unmap", _SOUND_E1, (0, 1, 2, 0, 12, 3)),
        ("e2", 30720, "unmap", _SOUND_E2, (59, 0, 2, 1, 2, 0)),
        ("e3", 21504, "unmap", _SOUND_E3, (28, 3, 1, 2, 11, 3)),
    ],
    "main": [
        ("e0", 4096, "unmap", _MAIN_E0, (6, 0, 1, 2, 9, 3)),
        ("e1", 24576, "throttle", _MAIN_E1, (44, 1, 2, 0, 3, 0)),
        ("e2", 18432, "throttle", _MAIN_E2, (26, 1, 2, 1, 3, 0)),
        ("e3", 23552, "unmap", _MAIN_E3, (42, 3, 1, 1, 11, 2)),
    ],
}


@pytest.mark.parametrize("case", sorted(_FAIRNESS_CASES))
def test_a_borrowers_cut_is_not_revoked_before_it_lands_so_the_owner_gets_its_request_back(tmp_path, case):
    """Regression (``main`` fails on main: e2, a throttling owner, held below its request 21 ticks by
    tick 100 while e3 borrows 10 GiB; ``q19sound`` failed on cff5451: e0 held 11 ticks at tick 79,
    27 by tick 100). The borrowers acknowledge 2-3 ticks late; each tick the overload rule cut one for
    the owners, and the next the grant raised it back into the memory its engine had not released
    yet (free, since it still held it), so no cut ever landed and the owner waited as long as the
    borrower's demand lasted. Every headroom rule, driven by the real loop (pure-policy regression:
    test_policy.py, test_a_borrowers_pending_cut_stands_while_an_owner_waits_below_its_request)."""
    for headroom in ("learned", "forecast", "peak"):
        engines = [Engine(n, req, mode, demand=d, **dict(zip(_TIMING, timing)))
                   for n, req, mode, d, timing in _FAIRNESS_CASES[case]]
        node = Node(str(tmp_path / headroom), CAP, engines, PolicyParams(headroom=headroom))
        react = 2 * max(e.ack_lag for e in engines) + 4
        fenced = {e.name: 0 for e in engines}
        for _ in range(90):
            node.step()
            t = node.t - 1
            assert sum(e.use for e in engines) <= CAP and node.committed() <= CAP
            borrowing = [e for e in engines if e.use > e.request]
            for e in engines:
                short = t >= e.bind + e.startup and e.limit() < min(e.request, e.demand_at(t)) and \
                    any(o is not e for o in borrowing)
                fenced[e.name] = fenced[e.name] + 1 if short else 0
                assert fenced[e.name] <= react, (headroom, e.name, t, e.limit(), [(o.name, o.use) for o in borrowing])


def test_a_newcomer_prepared_at_its_bind_while_two_loans_are_not_yet_released(tmp_path):
    """Regression (fails before the fix; found by hypothesis on the DRA path's property at round 17's
    end, and on this path too; round 16's code fails it as well). e2 (request 44 GiB) borrows up to
    66,048 MiB, and e0, starting and not reporting yet, is raised to 6,144 (request 4,096) at 13. e1
    (11 GiB) is bound with its full grant written at 15, with no notice. The loop cuts e0 to 3,584 and
    counted that cut as free, so e1's file kept all 11,264; but e0's engine may already follow the
    6,144 file, and it reports so only at 16, when e2 also still uses 66,048 (both acknowledge 2 ticks
    late): 81,408 MiB committed on 80,896. A starting engine that has reported no generation counts,
    for co-tenants and newcomers, at the highest file it may have read, so e1's file is fitted to what
    is left (8,704) and grows to its grant at 18, once the loans are back."""
    engines = [Engine("e0", 4096, "unmap", bind=11, demand=[8192, 8192, 4096], list_lag=0, alloc_after=2,
                      link_after=0, startup=6, ack_lag=2),
               Engine("e1", 11264, "unmap", bind=15, demand=[20815, 20815, 16719], list_lag=1, alloc_after=0,
                      link_after=0, startup=7, ack_lag=0),
               Engine("e2", 44032, "unmap", bind=0, demand=[58686, 58686, 54590, 54590, 55614, 55614, 55614, 63806,
                                                             71998, 71998, 71998, 71998, 73022],
                      list_lag=0, alloc_after=0, link_after=0, startup=6, ack_lag=2)]
    sound_run(Node(str(tmp_path), CAP, engines, PolicyParams(headroom="forecast")), None)
    assert engines[1].seen[:2] == [(15, 2, 8704), (18, 3, 11264)]  # fitted to what is left, then its whole grant
