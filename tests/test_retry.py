"""Retry loops back off with jitter (issue 22): one Backoff (client-go's wait.Backoff shape) everywhere,
so daemons that lost the API server together do not retry in lockstep."""
from __future__ import annotations

import pathlib
import random
import re

from vramshare.retry import Backoff

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_steps_double_to_the_cap_and_each_wait_adds_up_to_half_again():
    b = Backoff(0.5, 4.0, rng=random.Random(1))
    waits = [b.next() for _ in range(6)]
    for wait, step in zip(waits, [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]):
        assert step <= wait <= 1.5 * step
    b.reset()
    assert 0.5 <= b.next() <= 0.75


def test_two_daemons_that_failed_together_do_not_retry_together():
    a, b = Backoff(1.0, 30.0, rng=random.Random(1)), Backoff(1.0, 30.0, rng=random.Random(2))
    assert all(abs(x - y) > 1e-6 for x, y in zip([a.next() for _ in range(8)], [b.next() for _ in range(8)]))


def test_no_retry_loop_doubles_its_own_delay():
    doubling = re.compile(r"\b\w*(delay|backoff|wait|retry)\w*\s*\*\s*2\b", re.I)
    found = [f"{p.relative_to(ROOT)}:{n}" for pkg in ("deviceplugin", "extender", "vramshare", "vramshare_cli", "vllm_patches")
             for p in (ROOT / pkg).rglob("*.py") if p.name != "retry.py"
             and "standins" not in p.parts  # stand-ins copy their peer (kube-scheduler's pod backoff has no jitter)
             for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if doubling.search(line)]
    assert found == [], f"use vramshare.retry.Backoff: {found}"
