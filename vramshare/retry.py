"""The one backoff every retry loop uses: doubling, capped, with jitter.

As client-go's ``wait.Backoff{Duration, Factor: 2, Jitter, Cap}.Step()`` (k8s.io/apimachinery/pkg/util/
wait/backoff.go): the step doubles up to the cap, and each wait is the step plus a random part of up to
``jitter`` times it (``wait.Jitter``). Without the random part every device plugin that lost the API
server at the same moment would retry at the same moments, in lockstep, for ever.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

__all__ = ["Backoff"]


@dataclass
class Backoff:
    initial_s: float
    cap_s: float
    jitter: float = 0.5
    rng: random.Random = field(default_factory=random.Random, repr=False)
    _step: float = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._step = self.initial_s

    def next(self) -> float:
        """The wait before the next try (then the step doubles, up to the cap)."""
        step = self._step
        self._step = min(self._step * 2, self.cap_s)
        return step + self.jitter * step * self.rng.random()

    def reset(self) -> None:
        """After a success: the next failure waits ``initial_s`` again."""
        self._step = self.initial_s
