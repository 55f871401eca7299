"""The residency term on the MIG replay's DRA path (``dra-frag`` + ``bonus``, bench/bench_residency.py
``--policy dra-mig``): as :meth:`extender.dra_scoring.DraCluster.mig_scores` adds it, the bonus breaks
ties of the MIG term (and differences under one step, a tenth of the fitting nodes' loss range), never
a whole step."""
from __future__ import annotations

import dataclasses

import numpy as np

from extender.simulation import mig_replay as mr
from extender.simulation.trace import TraceNode, TracePod

NODES = [TraceNode(f"n{i}", 64000, 262144, 1, "G2") for i in range(3)]


def _pod(i: int, milli: int = 100) -> TracePod:
    return TracePod(f"p{i}", 1000, 1024, 1, milli)


@dataclasses.dataclass
class OnNode:
    """A bonus of ``steps`` on node ``node`` for every pod (the replay's rows are node indices)."""

    node: int
    size: float = 0.9  # steps
    placed_on: list[int] = dataclasses.field(default_factory=list)

    def steps_for(self, n: int) -> np.ndarray:
        out = np.zeros(n)
        out[self.node] = self.size
        return out

    def steps(self, pod: TracePod, rows: np.ndarray) -> np.ndarray | None:
        return self.steps_for(len(NODES))[rows]

    def placed(self, pod: TracePod, row: int) -> None:
        self.placed_on.append(row)


def test_a_tie_goes_to_the_node_with_the_bonus():
    plain = mr.replay(NODES, [_pod(0)], "dra-frag", 0)
    for node in range(len(NODES)):
        bonus = OnNode(node)
        run = mr.replay(NODES, [_pod(0)], "dra-frag", 0, bonus=bonus)
        assert run.accepted == plain.accepted == 1 and bonus.placed_on == [node], node


def test_a_whole_step_worse_node_never_wins_by_the_bonus():
    """p1 on the GPU p0 cut loses least; an empty node is the whole loss range (ten steps) worse: a
    bonus below one step keeps p1 beside p0, only an outsized one (11 steps) moves it."""
    seen: list[mr.Cluster] = []
    mr.replay(NODES, [_pod(0)], "dra-frag", 0, observe=seen.append)
    first = next(seen[-1].gpu_node[g] for g, lay in enumerate(seen[-1].layouts) if lay)
    other = next(i for i in range(len(NODES)) if i != first)

    class Late(OnNode):
        def steps(self, pod: TracePod, rows: np.ndarray) -> np.ndarray | None:  # type: ignore[override]
            return None if pod.name == "p0" else self.steps_for(len(NODES))[rows]
    kept, moved = Late(other), Late(other, size=11.0)
    mr.replay(NODES, [_pod(0), _pod(1)], "dra-frag", 0, bonus=kept)
    mr.replay(NODES, [_pod(0), _pod(1)], "dra-frag", 0, bonus=moved)
    assert kept.placed_on == [first, first]
    assert moved.placed_on == [first, other]
