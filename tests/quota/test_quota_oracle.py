"""bench/quota_oracle.py: the default policy run with an oracle for its forecast (issue 19's "how good
must the forecast be"). A measuring instrument only, so what it must get right is that it answers with
what it claims to know, and leaves the shipped forecast in place afterwards."""
from __future__ import annotations

import numpy as np
import pytest

from deviceplugin.quota import headroom
from tests.fixtures import bench

GIB = 1024


@pytest.fixture(scope="module")
def qo():
    return bench.load("quota_oracle")


def test_the_oracles_keep_only_what_agrees_with_the_next_demand(qo):
    recent = [10 * GIB, 20 * GIB, 10 * GIB, 30 * GIB]
    sample = headroom.forecast(recent, 20 * GIB)
    qo._NEXT.update(demand=np.array([30 * GIB]), i=0, oracle="point")
    assert qo.oracle_forecast(recent, 20 * GIB) == [(30 * GIB, 1.0)]
    qo._NEXT.update(i=0, oracle="direction")
    up = qo.oracle_forecast(recent, 20 * GIB)
    assert {v for v, _ in up} == {v for v, _ in sample if v > 20 * GIB + 256}
    assert sum(w for _, w in up) == pytest.approx(1.0)
    qo._NEXT.update(demand=np.array([20 * GIB + 512]), i=0, oracle="rises")  # no rise of more than 1 GiB
    assert {v for v, _ in qo.oracle_forecast(recent, 20 * GIB)} == {v for v, _ in sample if v - 20 * GIB <= 1024}


def test_the_point_oracle_covers_every_tenant_while_the_gpu_fits_and_the_shipped_forecast_is_put_back(qo):
    """Two tenants on 80 GiB that take turns rising far beyond their window, the second a minute after
    the first fell (what it held is free by then): with the exact demand the default's rules cover both
    in every minute, which its own forecast cannot (neither rise is anything its window has seen)."""
    a = [5 * GIB] * 10 + [40 * GIB] * 10 + [5 * GIB] * 10
    b = [5 * GIB] * 21 + [60 * GIB] * 9  # a minute after a falls: what it held is free by then
    demand = np.array([a, b], dtype=np.int64)
    limits, _ = qo.run_oracle(demand, "point", "demand")
    assert (limits[:, 1:] >= demand[:, 1:]).all()
    assert headroom.forecast is qo._FORECAST and qo.bq._world.__name__ == "_world"
    shipped, _ = qo.bq.run_new(demand)
    assert (shipped[:, 1:] < demand[:, 1:]).any()
