"""Overcommit of sleeping pods (issue 23 item 5): the one rule the node, the extender and the replay share.

A quota class may set ``sleepBookedFraction`` (an admin's choice, off by default): a pod of that class
whose engine sleeps is booked at that fraction of its request, never below what it still holds on the
GPU (CUDA context, graphs, pool), never above its request. The difference (its *gap*) is memory the
scheduler may place other pods on. What keeps that safe is the *wake reserve*: each GPU keeps room for
the ``wakeReserve`` largest gaps of its sleepers (the class's count of wakes that may come at once), so

    Σ requests of the awake + Σ booked of the sleepers + Σ the k largest gaps  <=  the GPU

holds at placement. The node turns that into one number per GPU, its *sleep credit*

    credit = Σ gaps - Σ the k largest gaps      (rounded down to whole memory units)

which it adds to the GPU's schedulable memory (the inventory's ``sleepCreditMiB``, extra kubelet units):
the extender's books then count the sleepers at their requests against a GPU that is larger by the
credit, which is the inequality above. Up to k wakes at once always find memory (the policy takes back
what co-tenants borrowed); a wake beyond them waits, or displaces lower classes
(:mod:`deviceplugin.quota.warm`), and never fails. Pure: numbers in, numbers out.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable


@dataclass(frozen=True)
class Sleeper:
    """One sleeping pod's part on one GPU, as its class and its measured use say."""

    gpu: str
    request: float  # its request on this GPU (MiB live, bytes in the replay)
    held: float  # what it still holds asleep (measured)
    fraction: float  # its class's sleepBookedFraction
    wake_reserve: int = 1  # its class's wakeReserve

    @property
    def booked(self) -> float:
        return booked(self.request, self.held, self.fraction)

    @property
    def gap(self) -> float:
        return self.request - self.booked


def booked(request: float, held: float, fraction: float) -> float:
    """What the books count a sleeping pod of an overcommit class at: ``fraction`` of its request, at
    least what it still holds, at most its request."""
    return min(request, max(held, fraction * request))


def reserve(gaps: Iterable[float], wakes: int) -> float:
    """Room kept for ``wakes`` sleepers waking at once: the sum of the largest ``wakes`` gaps."""
    return sum(sorted(gaps, reverse=True)[:max(0, wakes)])


def credit(sleepers: Iterable[Sleeper], unit: float = 1) -> float:
    """One GPU's sleep credit: Σ gaps - the reserve, rounded down to whole ``unit`` (never negative).
    The reserve's count is the largest ``wake_reserve`` among the classes sleeping there."""
    ss = [s for s in sleepers if s.gap > 0]
    if not ss:
        return 0
    gaps = [s.gap for s in ss]
    c = sum(gaps) - reserve(gaps, max(s.wake_reserve for s in ss))
    return max(0, math.floor(c / unit) * unit) if unit else max(0, c)


def credits(sleepers: Iterable[Sleeper], unit: int = 1) -> dict[str, int]:
    """Per GPU, its sleep credit in whole units (GPUs without one are left out)."""
    per: dict[str, list[Sleeper]] = {}
    for s in sleepers:
        per.setdefault(s.gpu, []).append(s)
    out = {g: int(credit(ss, unit)) for g, ss in per.items()}
    return {g: c for g, c in out.items() if c > 0}


def books(firm: Iterable[float], sleepers: Iterable[Sleeper]) -> float:
    """What one GPU must hold under the rule: the awake (or never-overcommitted) at their requests, the
    sleepers at their booked size, plus the reserve. A placement fits while this is within the GPU."""
    ss = list(sleepers)
    return sum(firm) + sum(s.request for s in ss) - credit(ss, 0)
