"""The MIG tables and placement rules (vramshare/mig.py) against NVIDIA's documented shapes."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vramshare import mig
from vramshare.mig import Placed

# `nvidia-smi mig -lgipp` on an A100 40GB (NVIDIA MIG user guide, "GPU Instance Profiles" example output).
A100_40_LGIPP = {
    "1g.5gb": ((0, 1, 2, 3, 4, 5, 6), 1),
    "1g.5gb+me": ((0, 1, 2, 3, 4, 5, 6), 1),
    "1g.10gb": ((0, 2, 4, 6), 2),
    "2g.10gb": ((0, 2, 4), 2),
    "3g.20gb": ((0, 4), 4),
    "4g.20gb": ((0,), 4),
    "7g.40gb": ((0,), 8),
}
# `nvidia-smi mig -lgip` IDs and instance counts on an empty A100 40GB.
A100_40_LGIP = {"1g.5gb": (19, 7), "1g.5gb+me": (20, 1), "1g.10gb": (15, 4), "2g.10gb": (14, 3),
                "3g.20gb": (9, 2), "4g.20gb": (5, 1), "7g.40gb": (0, 1)}
# Combinations NVIDIA's guide lists as valid on A100/H100 (by compute slices), and some it cannot make.
DOCUMENTED = [
    ("7g.40gb@0",),
    ("4g.20gb@0", "3g.20gb@4"),
    ("3g.20gb@0", "3g.20gb@4"),
    ("4g.20gb@0", "2g.10gb@4", "1g.5gb@6"),
    ("2g.10gb@0", "2g.10gb@2", "2g.10gb@4", "1g.5gb@6"),
    ("2g.10gb@0", "1g.5gb@2", "1g.5gb@3", "3g.20gb@4"),
    tuple(f"1g.5gb@{s}" for s in range(7)),
]
IMPOSSIBLE = [
    ("4g.20gb@0", "4g.20gb@4"),          # one 4g only (and 8 compute slices)
    ("3g.20gb@0", "3g.20gb@4", "1g.5gb@6"),  # overlaps the second 3g
    ("1g.5gb@7",),                       # no 1g at slot 7
    ("2g.10gb@1",),                      # 2g starts on even slots
    ("1g.5gb+me@0", "1g.5gb+me@1"),      # one set of media engines
]


def _layout(names: tuple[str, ...]) -> list[Placed]:
    out = []
    for n in names:
        profile, start = n.split("@")
        out.append(Placed(int(start), profile))
    return out


def test_a100_table_is_nvidia_smi_s() -> None:
    model = mig.MODELS["A100-SXM4-40GB"]
    assert set(model.names) == set(A100_40_LGIPP)
    for p in model.profiles:
        assert (p.starts, p.memory_slots) == A100_40_LGIPP[p.name]
        assert (p.profile_id, p.max_count) == A100_40_LGIP[p.name]
        assert p.compute_slices == int(p.name.split("g.")[0])


@pytest.mark.parametrize("name,labels", [
    ("A100-SXM4-80GB", ["1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"]),
    ("H100-SXM5-80GB", ["1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"]),
    ("H200-SXM5-141GB", ["1g.18gb", "1g.18gb+me", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb"]),
])
def test_other_cards_share_the_geometry(name: str, labels: list[str]) -> None:
    model, ref = mig.MODELS[name], mig.MODELS["A100-SXM4-40GB"]
    assert list(model.names) == labels
    for p, q in zip(model.profiles, ref.profiles):
        assert (p.starts, p.memory_slots, p.compute_slices, p.max_count, p.profile_id) == \
            (q.starts, q.memory_slots, q.compute_slices, q.max_count, q.profile_id)


@pytest.mark.parametrize("names", DOCUMENTED)
def test_documented_combinations_are_legal(names: tuple[str, ...]) -> None:
    assert mig.check_layout(mig.MODELS["A100-SXM4-40GB"], _layout(names)) == []


@pytest.mark.parametrize("names", IMPOSSIBLE)
def test_impossible_combinations_are_refused_with_a_reason(names: tuple[str, ...]) -> None:
    assert mig.check_layout(mig.MODELS["A100-SXM4-40GB"], _layout(names))


def test_model_for_nvml_names() -> None:
    assert mig.model_for("NVIDIA A100-SXM4-40GB", 40960).name == "A100-SXM4-40GB"
    assert mig.model_for("NVIDIA A100 80GB PCIe", 81920).name == "A100-SXM4-80GB"
    assert mig.model_for("NVIDIA H100 80GB HBM3", 81559).name == "H100-SXM5-80GB"
    assert mig.model_for("NVIDIA H200", 143771).name == "H200-SXM5-141GB"
    assert mig.model_for("Tesla T4", 15360) is None


def test_smallest_fitting_profile() -> None:
    model = mig.MODELS["H100-SXM5-80GB"]
    assert mig.smallest_fitting(model, 1).name == "1g.10gb"
    assert mig.smallest_fitting(model, 15000).name == "1g.20gb"   # 2 slots, 1 compute slice beats 2g.20gb
    assert mig.smallest_fitting(model, 30000).name == "3g.40gb"   # 3 compute slices beat 4g.40gb
    assert mig.smallest_fitting(model, 50000).name == "7g.80gb"
    assert mig.smallest_fitting(model, 90000) is None


layouts = st.lists(st.tuples(st.integers(0, 6), st.integers(0, 7)), max_size=10)


@settings(max_examples=300, deadline=None)
@given(layouts, st.sampled_from(sorted(mig.MODELS)))
def test_free_starts_are_exactly_the_legal_additions(picks: list[tuple[int, int]], card: str) -> None:
    """Grow a layout at random through free_starts; at every step each start free_starts offers is legal
    and each legal start it leaves out is not (completeness against check_layout)."""
    model = mig.MODELS[card]
    layout: list[Placed] = []
    for k, s in picks:
        for p in model.profiles:
            offered = set(mig.free_starts(model, layout, p.name))
            for start in p.starts:
                legal = not mig.check_layout(model, [*layout, Placed(start, p.name)])
                assert (start in offered) == legal, (p.name, start, layout)
        p = model.profiles[k]
        starts = mig.free_starts(model, layout, p.name)
        if starts:
            layout.append(Placed(starts[s % len(starts)], p.name))
        assert mig.check_layout(model, layout) == []
        assert 0 <= mig.potential(model, layout, {q.name: 1.0 for q in model.profiles})


def test_maximal_layouts_are_legal_and_maximal() -> None:
    model = mig.MODELS["A100-SXM4-40GB"]
    found = mig.maximal_layouts(model)
    names = {mig.layout_name(l) for l in found}
    assert "7g.40gb@0" in names and "3g.20gb@0+3g.20gb@4" in names and "4g.20gb@0+3g.20gb@4" in names
    for layout in found:
        assert mig.check_layout(model, layout) == []
        assert all(not mig.free_starts(model, layout, p.name) for p in model.profiles if not p.media)


def test_placement_loss_prefers_keeping_the_big_profiles() -> None:
    """With 3g requests expected, a 1g goes beside a 2g rather than into the last free 3g half."""
    model = mig.MODELS["A100-SXM4-40GB"]
    weights = {"1g.5gb": 0.5, "3g.20gb": 0.5}
    half_free = [Placed(0, "3g.20gb")]                          # slots 4-7 free: one 3g still fits
    nearly_full = [Placed(0, "3g.20gb"), Placed(4, "2g.10gb")]  # slots 6-7 free: no 3g anyway
    breaks_3g = mig.placement_loss(model, half_free, "1g.5gb", 4, weights)
    beside_2g = mig.placement_loss(model, nearly_full, "1g.5gb", 6, weights)
    assert beside_2g < breaks_3g
    assert mig.potential(model, [], weights) > mig.potential(model, half_free, weights) > 0
