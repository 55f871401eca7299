"""Policies: FGD's fragmentation arithmetic, its choices, and the paper's baselines to the letter."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from extender import policy_catalog
from extender.cluster import ClusterState, Demand, HostDemand, Slot
from extender.fit import Ask
from extender.fragmentation import frag_after_each_slot, host_per_unit, host_stranded, node_frag, unlimited_cpu
from extender.placement import pick, score_nodes
from extender.workload import Shape, TargetWorkload, WorkloadWindow, typical_workload


def share_cluster(frees: dict[str, list[int]], cpu: dict[str, int] | None = None) -> ClusterState:
    """Nodes of 1000-unit GPUs (the share view) with the given free amounts."""
    st = ClusterState()
    for name, free in frees.items():
        st.set_node(name, [Slot(f"{name}/{i}", "G2", capacity=1000, index=i) for i in range(len(free))])
        if cpu is not None:
            st.set_host(name, cpu[name], 10**6)
        used = [(f"{name}/{i}", 1000 - f) for i, f in enumerate(free) if f < 1000]
        if used:
            st.add_pod(f"fill/{name}", name, used)
    return st


def brute_frag(free: list[int], cpu: int, shapes: list[tuple[int, int, int, float]]) -> float:
    """The paper's NodeGpuShareFragAmount, written out loop by loop."""
    total, frag = sum(free), 0.0
    for per_gpu, count, need_cpu, weight in shapes:
        if per_gpu == 0:
            frag += weight * total
        elif sum(f >= per_gpu for f in free) >= count and cpu >= need_cpu:
            frag += weight * sum(f for f in free if f < per_gpu)
        else:
            frag += weight * total
    return frag


WL = TargetWorkload.from_counts({Shape(500, 1, cpu_milli=4000): 5, Shape(1000, 2, cpu_milli=8000): 3,
                                 Shape(250, 1, cpu_milli=2000): 4, Shape(0, 0, cpu_milli=1000): 2})
SHAPES = [(s.per_gpu, s.count, s.cpu_milli, w) for s, w in zip(WL.shapes, WL.weight)] + [(0, 0, 0, WL.cpu_only_weight)]


def test_node_frag_matches_the_papers_definition() -> None:
    frees = [0, 100, 250, 500, 1000]
    rows = [list(c) for c in itertools.product(frees, repeat=3)]
    free = np.array(rows)
    cpu = np.array([(i * 3700) % 12000 for i in range(len(rows))])
    got = node_frag(free, np.ones((len(rows), 3, 1), bool), cpu, WL)
    want = [brute_frag(r, int(c), SHAPES) for r, c in zip(rows, cpu)]
    assert np.allclose(got, want)


def test_frag_after_each_slot_equals_recomputing_the_node() -> None:
    rng = np.random.default_rng(7)
    free = rng.choice([0, 100, 250, 500, 750, 1000], size=(6, 4))
    cpu = rng.integers(0, 20000, 6)
    elig = np.ones((6, 4, 1), bool)
    after = frag_after_each_slot(free, elig, cpu, WL, 250, 3000)
    for n, g in zip(*np.nonzero(free >= 250)):
        changed = free.copy()
        changed[n, g] -= 250
        assert after[n, g] == pytest.approx(node_frag(changed, elig, cpu - np.eye(6, dtype=int)[n] * 3000, WL)[n])


def test_fgd_fills_the_gpu_whose_leftover_nobody_could_use() -> None:
    # a 500 request: GPU 1 (500 free) is filled exactly; GPU 0 (1000 free) would leave a 500 sliver
    st = share_cluster({"n": [1000, 500]})
    st.pinned = TargetWorkload.from_counts({Shape(1000): 1, Shape(500): 1})
    assert pick(st, [Demand(500)], "n", "fgd") == [[("n/1", 500)]]


def test_fgd_prefers_the_node_where_the_request_removes_fragmentation() -> None:
    # whole-GPU tasks dominate: a 300 request belongs on the node already broken up, not on a whole GPU
    st = share_cluster({"whole": [1000, 1000], "broken": [1000, 400]})
    st.pinned = TargetWorkload.from_counts({Shape(1000): 9, Shape(300): 1})
    scores = dict(score_nodes(st, [Demand(300)], ["whole", "broken"], "fgd"))
    assert scores == {"whole": 0, "broken": 10}


def test_fgd_counts_cpu_a_pod_would_strand_gpus_behind() -> None:
    # the GPU task needs 8 cores: a CPU-only pod on "tight" would strand its idle GPU
    st = share_cluster({"tight": [1000], "roomy": [1000]}, cpu={"tight": 10000, "roomy": 64000})
    st.pinned = TargetWorkload.from_counts({Shape(1000, cpu_milli=8000): 1})
    assert dict(score_nodes(st, [], ["tight", "roomy"], "fgd", HostDemand(4000))) == {"tight": 0, "roomy": 10}


def test_host_stranded_is_idle_gpu_beyond_what_the_cpu_left_can_feed() -> None:
    wl = TargetWorkload.from_counts({Shape(1000, cpu_milli=8000): 1, Shape(500, cpu_milli=4000): 1})
    assert host_per_unit(wl) == (8.0, 0.0)  # 12 cores per 1.5 GPU: 8 milli-CPU per GPU unit
    idle = np.array([2000.0, 2000.0, 0.0, 2000.0])
    cpu = np.array([8000.0, 32000.0, 0.0, 0.0])
    got = host_stranded(idle, cpu, np.full(4, 1e18), wl)
    assert got.tolist() == [1000.0, 0.0, 0.0, 2000.0]
    assert host_stranded(idle, unlimited_cpu(4).astype(np.float64), np.full(4, 1e18), wl).tolist() == [0.0] * 4


def test_fgd_keeps_cpu_next_to_idle_gpus_before_any_shape_stops_fitting() -> None:
    # both nodes still fit the 8-core GPU task after the CPU-only pod (per-shape FGD sees no change),
    # but on "gpus-idle" the 12 cores left can feed only 1.5 of its 2 idle GPUs: put the pod on "gpus-full"
    st = share_cluster({"gpus-idle": [1000, 1000], "gpus-full": [0, 0]},
                       cpu={"gpus-idle": 28000, "gpus-full": 28000})
    st.pinned = TargetWorkload.from_counts({Shape(1000, cpu_milli=8000): 1})
    ask = Ask(st, (), np.array([st.row("gpus-idle"), st.row("gpus-full")]), HostDemand(16000))
    fgd = policy_catalog.get("fgd")
    assert fgd.deltas(ask)[0].tolist() == [0.0, 0.0]
    assert fgd.stranding_removed(ask).tolist() == [-500.0, 0.0]
    assert dict(score_nodes(st, [], ["gpus-idle", "gpus-full"], "fgd", HostDemand(16000))) == {
        "gpus-idle": 0, "gpus-full": 10}


def test_fgd_without_any_observed_workload_still_scores() -> None:
    st = share_cluster({"a": [1000], "b": [400]})
    assert {s for _, s in score_nodes(st, [Demand(300)], ["a", "b"], "fgd")} <= set(range(11))


def test_window_republishes_only_after_real_drift() -> None:
    w = WorkloadWindow(size=100, drift=0.2)
    for _ in range(50):
        w.add(Shape(500))
    first = w.workload()
    w.add(Shape(250))
    assert w.workload() is first  # 2% drift: keep the memoised workload
    for _ in range(30):
        w.add(Shape(250))
    assert w.workload() is not first and len(w.workload().shapes) == 2


def test_typical_workload_keeps_the_popular_shapes_and_folds_cpu_only() -> None:
    shapes = [Shape(500)] * 60 + [Shape(1000)] * 30 + [Shape(0, 0, cpu_milli=4000)] * 8 + [Shape(123)] * 2
    wl = typical_workload(shapes, popularity=0.95)
    assert [s.per_gpu for s in wl.shapes] == [500, 1000]
    assert wl.cpu_only_weight == pytest.approx(8 / 98)
    assert wl.weight.sum() + wl.cpu_only_weight == pytest.approx(1.0)


def ask(st: ClusterState, demand: Demand, host: HostDemand = HostDemand(), seed: int | None = None) -> Ask:
    rows = np.array([st.row(n) for n in st.nodes()])
    rng = np.random.default_rng(seed) if seed is not None else None
    return Ask(st, (demand,), rows, host, rng)


def test_paper_bestfit_is_min_max_normalised_to_0_100() -> None:
    st = share_cluster({"empty": [1000] * 8, "half": [1000] * 4 + [0] * 4, "full": [500] + [0] * 7},
                       cpu={"empty": 96000, "half": 96000, "full": 96000})
    got = policy_catalog.get("bestfit").scores(ask(st, Demand(500), HostDemand(8000)))
    # raw int((1 - left) * 100): 18, 43, 65 -> (raw - 18) * 100 // 47
    assert list(got) == [0.0, 53.0, 100.0]


def test_paper_gpupacking_ranks_shared_then_used_node_then_idle_node() -> None:
    st = share_cluster({"idle8": [1000] * 8, "used": [1000, 0], "shared": [600, 1000]})
    got = policy_catalog.get("gpupacking").scores(ask(st, Demand(500)))
    assert list(got) == [25.0, 49.0, 94.0]  # 100/3-8 ; 100/2-1 ; 100 - (60/10)


def test_paper_dotprod_prefers_the_node_with_less_free() -> None:
    st = share_cluster({"a": [1000] * 8, "b": [1000, 0]}, cpu={"a": 128000, "b": 8000})
    got = policy_catalog.get("dotprod").scores(ask(st, Demand(1000), HostDemand(8000)))
    assert got[1] > got[0] and got[0] == 100 * (1 - (1 * 8000 / 128000 + 1 * 1000 / 8000) / 2) // 1


def test_paper_fgd_scores_are_int_sigmoid_and_take_the_first_best_gpu() -> None:
    st = share_cluster({"n": [1000, 1000, 1000]})
    st.pinned = TargetWorkload.from_counts({Shape(1000): 1})
    a = ask(st, Demand(200))
    delta, _ = policy_catalog.get("fgd").deltas(a)
    assert policy_catalog.get("fgd-paper").scores(a)[0] == int(100 / (1 + np.exp(-delta[0] / 1000)))
    assert pick(st, [Demand(200)], "n", "fgd-paper") == [[("n/0", 200)]]


def test_random_policy_needs_and_uses_the_rng() -> None:
    st = share_cluster({"a": [1000], "b": [1000], "c": [1000]})
    s1 = policy_catalog.get("random").scores(ask(st, Demand(100), seed=1))
    s2 = policy_catalog.get("random").scores(ask(st, Demand(100), seed=2))
    assert s1.shape == (3,) and not np.array_equal(s1, s2)


def test_unknown_policy_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="fgd-paper"):
        policy_catalog.get("nope")


def test_fgd_counts_host_memory_a_pod_would_strand_gpus_behind() -> None:
    st = share_cluster({"low-ram": [1000], "big-ram": [1000]}, cpu={"low-ram": 64000, "big-ram": 64000})
    st.set_host("low-ram", 64000, 40000)
    st.observe([Demand(1000)], HostDemand(4000, 32768))  # GPU tasks here ask 32 GiB of RAM
    scores = dict(score_nodes(st, [], ["low-ram", "big-ram"], "fgd", HostDemand(1000, 16384)))
    assert scores == {"low-ram": 0, "big-ram": 10}


def test_paper_fgd_ignores_host_memory_as_the_paper_does() -> None:
    shapes = [Shape(1000, 1, cpu_milli=4000)] * 3
    assert typical_workload(shapes).mem is None
