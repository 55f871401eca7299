"""bench/quota_miss.py's classifier (issue 19: which lever is left): each cause on a hand-made GPU of
two tenants (request 40,960 MiB each), one decision at minute 1."""
from __future__ import annotations

import numpy as np
import pytest

from tests.fixtures import bench


@pytest.fixture(scope="module")
def qm():
    return bench.load("quota_miss")


def _classify(qm, held0, demand1, limits1, fair1, ceiling=10 ** 6):
    """Tenant 0 goes over at minute 1 (demand1[0] > limits1[0]); minute 0 only sets what was held."""
    demand = np.array([[held0[0], demand1[0]], [held0[1], demand1[1]]])
    limits = np.array([[held0[0], limits1[0]], [held0[1], limits1[1]]])
    held = np.minimum(demand, limits)
    fair = np.array([[held0[0], fair1[0]], [held0[1], fair1[1]]])
    out = qm.classify(demand, limits, held, fair, ceiling, "demand")
    return {k: v for k, v in out.items() if v and ":" not in k and k != "fair-only-left"}


def test_each_cause(qm):
    ok = (30000, 10000)  # clairvoyant-fair covers both
    assert _classify(qm, (10000, 10000), (30000, 10000), (20000, 10000), (20000, 10000)) == {"a-forced": 1}
    assert _classify(qm, (10000, 10000), (30000, 10000), (20000, 10000), (30000, 5000)) == {"s-swap": 1}
    assert _classify(qm, (10000, 10000), (30000, 10000), (20000, 10000), ok, ceiling=25000) == {"f-ceiling": 1}
    assert _classify(qm, (10000, 10000), (30000, 10000), (20000, 10000), ok) == {"b-low": 1}
    assert _classify(qm, (10000, 10000), (30000, 10000), (20000, 61920), ok) == {"b-elsewhere": 1}
    assert _classify(qm, (10000, 70000), (30000, 10000), (20000, 61920), ok) == {"c-release-lag": 1}
    # clairvoyant-fair, in its own world (it held differently before), covered both
    assert _classify(qm, (10000, 70000), (30000, 70000), (20000, 70000), (30000, 70000)) == {"e-other": 1}


def test_protected_rises_of_the_others_come_first(qm):
    """Tenant 1 rose within its request last minute (seen 40,000 > held 2,000) and its limit covers
    it: that rise is protected, so the 39,920 MiB left do not cover tenant 0's rise of 40,000."""
    demand = np.array([[10000, 50000], [2000, 40000]])
    demand[1, 0] = 40000  # its demand last minute (what @demand exports), held only 2,000 under its limit
    limits = np.array([[10000, 30000], [2000, 40000]])
    held = np.array([[10000, 30000], [2000, 40000]])
    fair = np.array([[10000, 50000], [2000, 40000]])
    out = qm.classify(demand, limits, held, fair, 10 ** 6, "demand")
    assert out["d-protected"] == 1
