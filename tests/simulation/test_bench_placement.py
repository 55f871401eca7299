"""bench_placement's paired table: fgd against fgd-paper seed by seed (same arrival sequence)."""
from __future__ import annotations

from tests.fixtures import bench


def _bench():
    return bench.load("bench_placement")


def _policy(alloc: list[float], unalloc: list[float]) -> dict:
    return {"per_seed": {"seeds": [42, 43], "allocated_pct_at_100": alloc, "unallocated_pct_at_130": unalloc}}


def test_paired_reports_per_seed_differences_and_wins() -> None:
    summary = {"policies": {"fgd": _policy([95.5, 95.0], [4.4, 4.9]), "fgd-paper": _policy([95.2, 95.1], [4.6, 4.8])}}
    table = _bench().paired(summary)
    assert "| allocated @100 | +0.30 | -0.10 | +0.10 | 1/2 |" in table
    assert "| unallocated @130 | -0.20 | +0.10 | -0.05 | 1/2 |" in table


def test_paired_is_empty_without_both_policies_on_the_same_seeds() -> None:
    bench = _bench()
    assert bench.paired({"policies": {"fgd": _policy([95.0, 95.0], [5.0, 5.0])}}) == ""
    other = {"per_seed": {"seeds": [1, 2], "allocated_pct_at_100": [1, 2], "unallocated_pct_at_130": [1, 2]}}
    assert bench.paired({"policies": {"fgd": _policy([95.0, 95.0], [5.0, 5.0]), "fgd-paper": other}}) == ""
