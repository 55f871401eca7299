"""Replay drives the extender's placement code, with kube-scheduler's CPU/memory fit emulated."""
from __future__ import annotations

import numpy as np

from extender.simulation.replay import build_state, frag_rate, replay
from extender.simulation.trace import TraceNode, TracePod
from extender.workload import Shape, TargetWorkload

TWO_NODES = [TraceNode("a", 16000, 65536, 1, "T4"), TraceNode("b", 16000, 65536, 1, "T4")]
ONE_GPU = TargetWorkload.from_counts({Shape(1000): 1})


def pod(name: str, milli: int, cpu: int = 1000, gpus: int = 1) -> TracePod:
    return TracePod(name, cpu, 1024, gpus if milli else 0, milli)


def test_binpack_leaves_a_whole_gpu_that_spread_breaks_up() -> None:
    seq = [pod("p0", 400), pod("p1", 400), pod("p2", 1000)]
    packed = replay(TWO_NODES, seq, "binpack", "share", 1, ONE_GPU)
    spread = replay(TWO_NODES, seq, "spread", "share", 1, ONE_GPU)
    assert packed.failed == 0 and packed.allocated[-1] == 90.0
    assert spread.failed == 1 and spread.allocated[-1] == 40.0


def test_cpu_fit_is_checked_like_kube_scheduler() -> None:
    # two CPU-only tasks take (nearly) all CPU: the GPU task fails although both GPUs are idle
    seq = [pod("greedy", 0, cpu=15000), pod("big-cpu", 0, cpu=16000), pod("gpu", 1000, cpu=2000)]
    result = replay(TWO_NODES, seq, "bestfit", "share", 1, ONE_GPU)
    assert result.failed == 1 and result.allocated[-1] == 0
    assert replay(TWO_NODES, seq[1:], "bestfit", "share", 1, ONE_GPU).failed == 0
    too_big = replay(TWO_NODES, [pod("huge", 500, cpu=17000)], "fgd", "share", 1, ONE_GPU)
    assert too_big.failed == 1 and too_big.allocated[-1] == 0


def test_curves_are_cumulative_and_never_exceed_capacity() -> None:
    rng = np.random.default_rng(3)
    seq = [pod(f"p{i}", int(rng.choice([0, 250, 500, 1000])), cpu=int(rng.integers(1, 8)) * 1000) for i in range(40)]
    for policy in ("fgd", "fgd-paper", "random", "gpupacking", "dotprod"):
        r = replay(TWO_NODES, seq, policy, "share", 7, ONE_GPU)
        assert np.all(np.diff(r.arrived) >= 0) and np.all(np.diff(r.allocated) >= 0)
        assert r.allocated[-1] <= min(100.0, r.arrived[-1])
        assert r.frag and all(0 <= f <= 100 for _, f in r.frag)


def test_fragmentation_rate_counts_slivers_nobody_can_use() -> None:
    state = build_state(TWO_NODES, "share")
    state.add_pod("x", "a", [("a/gpu0", 700)])
    # idle: 300 on a (too small for a whole-GPU task) + 1000 on b
    assert frag_rate(state, ONE_GPU) == 100.0 * 300 / 1300


class _Prefer:
    """A bonus hook (the residency term's shape): steps on one node's row, and what was placed where."""

    def __init__(self, state, node: str, steps: float) -> None:
        self.row, self.steps_, self.seen = state.row(node), steps, []

    def steps(self, pod, rows):
        return np.where(rows == self.row, self.steps_, 0.0)

    def placed(self, pod, row):
        self.seen.append((pod.name, row))


def test_a_bonus_hook_breaks_ties_and_learns_placements_without_changing_fit() -> None:
    seq = [pod("p0", 400), pod("p1", 400)]
    state = build_state(TWO_NODES, "share")
    plain = replay(TWO_NODES, seq, "spread", "share", 1, ONE_GPU)
    none = _Prefer(state, "a", 0.0)
    same = replay(TWO_NODES, seq, "spread", "share", 1, ONE_GPU, bonus=none)
    assert (same.allocated == plain.allocated).all() and len(none.seen) == 2
    rows = {r for _, r in none.seen}
    assert len(rows) == 2  # spread: one pod per GPU
    pull = _Prefer(state, "a", 50.0)
    replay(TWO_NODES, seq, "spread", "share", 1, ONE_GPU, bonus=pull)
    assert {r for _, r in pull.seen} == {state.row("a")}  # a large bonus outweighs spread, never the fit
    big = _Prefer(state, "a", 50.0)
    out = replay(TWO_NODES, [pod("p0", 700), pod("p1", 700)], "spread", "share", 1, ONE_GPU, bonus=big)
    assert out.failed == 0 and {r for _, r in big.seen} == {state.row("a"), state.row("b")}
