"""Issue 24, the extender's books for dynamic MIG: placements as slots, geometry as capacity, refine.

Any order of binds (policy pick + the fragmentation refine) and departures, on a node whose inventory
carries dynamicMig, never books two overlapping partitions: the plans booked on each GPU, together with
the instances NVML showed, always form a layout NVIDIA's rules accept (``mig.check_layout``). On main a
dynamic-MIG GPU offered no slot at all: a ``mig-<profile>`` pod fit nowhere.
"""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from extender import cluster, mig_books, placement, translate
from vramshare import mig, mig_plan
from vramshare.inventory import DynamicMig, Gpu, GpuMode, MigInstance, NodeInventory

A, B = "GPU-aaaaaaaa-0000-4000-8000-000000000001", "GPU-bbbbbbbb-0000-4000-8000-000000000002"
TABLE = mig.MODELS["A100-SXM4-80GB"]
PROFILES = [p for p in TABLE.names if "+me" not in p]


def inventory(existing: tuple[tuple[str, int], ...] = ()) -> NodeInventory:
    def gpu(i: int, uuid: str, inst: tuple[tuple[str, int], ...]) -> Gpu:
        placed = [mig.Placed(s, p) for p, s in inst]
        free = tuple((p.name, tuple(mig.free_starts(TABLE, placed, p.name))) for p in TABLE.profiles)
        migs = tuple(MigInstance(f"MIG-{uuid[4:12]}-{n}", p, TABLE.profile(p).memory_mib, start=s)
                     for n, (p, s) in enumerate(inst))
        return Gpu(index=i, uuid=uuid, model="NVIDIA A100-SXM4-80GB", memory_mib=81920, mode=GpuMode.MIG,
                   mig=migs, dynamic_mig=DynamicMig(TABLE.name, inst, free))
    return NodeInventory(unit_mib=1024, gpus=(gpu(0, A, existing), gpu(1, B, ())))


def state_with(existing: tuple[tuple[str, int], ...] = ()) -> cluster.ClusterState:
    state = cluster.ClusterState()
    state.set_node("n", translate.slots_from_inventory(NodeInventory.from_json(inventory(existing).to_json())))
    return state


def bind(state: cluster.ClusterState, key: str, profiles: list[str]) -> bool:
    demands = [cluster.Demand(per_gpu=0, count=1, kind=translate.mig_kind(p)) for p in profiles]
    try:
        picks = placement.pick(state, demands, "n", "binpack")
        picks = mig_books.refine(state, "n", [d.kind for d in demands], picks)
    except (cluster.NoFit, ValueError):
        return False
    state.add_pod(key, "n", [pair for ps in picks for pair in ps])
    return True


def booked(state: cluster.ClusterState) -> dict[str, list[mig.Placed]]:
    out: dict[str, list[mig.Placed]] = {A: [], B: []}
    for u in state.node_usage("n"):
        if u.used:
            p = mig_plan.parse(u.slot.uuid)
            out[p.gpu_uuid].append(p.placed)
    return out


def test_a_dynamic_gpu_offers_every_placement_and_blocks_what_an_instance_covers():
    state = state_with((("3g.40gb", 0),))
    cap = {u.slot.uuid: int(state.capacity[0, c]) for c, u in enumerate(state.node_usage("n"))}
    pid = lambda g, p, s: mig_plan.encode(mig_plan.MigPlacement(g, p, s))  # noqa: E731
    assert len(cap) == 2 * len(mig.all_placements(TABLE))
    assert cap[pid(A, "3g.40gb", 0)] == 40960  # the unheld instance itself may be adopted
    assert cap[pid(A, "1g.10gb", 0)] == 0 and cap[pid(A, "7g.80gb", 0)] == 0 and cap[pid(A, "4g.40gb", 0)] == 0
    assert cap[pid(A, "3g.40gb", 4)] == 40960 and cap[pid(B, "7g.80gb", 0)] == 81920


def test_a_booked_plan_blocks_its_overlaps_before_any_instance_exists_and_frees_them_on_release():
    state = state_with()
    assert bind(state, "p1", ["7g.80gb"]) and bind(state, "p2", ["7g.80gb"])
    assert not bind(state, "p3", ["1g.10gb"])  # both GPUs planned whole, nothing made yet
    state.remove_pod("p1")
    assert bind(state, "p3", ["1g.10gb"])


def test_refine_adopts_an_unheld_instance_and_otherwise_keeps_big_profiles_creatable():
    state = state_with((("2g.20gb", 0),))
    assert bind(state, "p1", ["2g.20gb"])
    assert booked(state)[A] == [mig.Placed(0, "2g.20gb")]  # adopted: no new instance on an empty GPU
    assert bind(state, "p2", ["1g.10gb"])
    assert sorted(booked(state)[A]) == [mig.Placed(0, "2g.20gb"), mig.Placed(2, "1g.10gb")]  # packed, B whole


def test_two_asks_of_one_pod_never_overlap():
    state = state_with()
    assert bind(state, "p1", ["4g.40gb", "3g.40gb", "3g.40gb"])
    for layout in booked(state).values():
        assert mig.check_layout(TABLE, layout) == []


@settings(max_examples=60, deadline=None)
@given(st.lists(st.one_of(st.lists(st.sampled_from(PROFILES), min_size=1, max_size=2),
                          st.integers(0, 30)), max_size=30),
       st.sampled_from([(), (("3g.40gb", 4),), (("1g.10gb", 3), ("2g.20gb", 0))]))
def test_any_order_of_binds_and_departures_never_books_overlapping_partitions(ops, existing):
    state = state_with(existing)
    live: list[str] = []
    for n, op in enumerate(ops):
        if isinstance(op, int):
            if live:
                state.remove_pod(live.pop(op % len(live)))
        elif bind(state, f"p{n}", op):
            live.append(f"p{n}")
        for gpu, layout in booked(state).items():
            shown = [mig.Placed(s, p) for p, s in existing] if gpu == A else []
            assert mig.check_layout(TABLE, list(dict.fromkeys([*shown, *layout]))) == [], (gpu, layout)
