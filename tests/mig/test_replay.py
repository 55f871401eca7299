"""The MIG-mapped replay (extender/simulation/mig_replay.py): every layout it builds is one NVML would
accept, host resources are never overdrawn, and partitions made on demand beat a wrong static cut."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extender.simulation import mig_replay as mr
from extender.simulation.trace import TraceNode, TracePod
from vramshare import mig


def _nodes(n: int, gpus: int = 2, model: str = "G2") -> list[TraceNode]:
    return [TraceNode(f"n{i}", 64000, 262144, gpus, model) for i in range(n)]


def _pod(i: int, milli: int, num_gpu: int = 1, cpu: int = 1000) -> TracePod:
    return TracePod(f"p{i}", cpu, 1024, num_gpu, milli)


def test_task_mapping_on_an_h100() -> None:
    h100 = mig.MODELS["H100-SXM5-80GB"]
    assert mr.ask(_pod(0, 100), h100) == ("1g.10gb", 1)     # 8 GiB
    assert mr.ask(_pod(0, 200), h100) == ("1g.20gb", 1)     # 16 GiB
    assert mr.ask(_pod(0, 460), h100) == ("3g.40gb", 1)     # 36.8 GiB
    assert mr.ask(_pod(0, 600), h100) == ("7g.80gb", 1)
    assert mr.ask(_pod(0, 1000, num_gpu=4), h100) == ("7g.80gb", 4)
    assert mr.ask(TracePod("cpu", 1000, 1024, 0, 0), h100) is None


def test_dynamic_cuts_what_the_static_layout_lacks() -> None:
    """Four 3g tasks and four whole-GPU tasks on four GPUs cut all-3g: static places the 3g half only."""
    nodes = _nodes(2)
    seq = [_pod(i, 460) for i in range(4)] + [_pod(10 + i, 1000) for i in range(2)]
    ref = mig.MODELS["A100-SXM4-40GB"]
    all_3g = (mig.Placed(0, "3g.20gb"), mig.Placed(4, "3g.20gb"))
    static = mr.replay(nodes, seq, "static", 0, mr.uniform_layouts(nodes, all_3g, ref))
    assert (static.accepted, static.refused) == (4, 2)
    for policy in ("firstfit", "bestfit", "frag"):
        run = mr.replay(nodes, seq, policy, 0)
        assert (run.accepted, run.refused) == (6, 0), policy  # two GPUs cut 3g+3g, two left whole


def test_best_fit_and_frag_keep_whole_gpus_for_whole_gpu_tasks() -> None:
    """Small tasks pack onto one GPU instead of spreading; the whole-GPU task then still fits."""
    nodes = _nodes(1, gpus=2)
    seq = [_pod(i, 100) for i in range(7)] + [_pod(9, 1000)]
    for policy in ("bestfit", "frag"):
        run = mr.replay(nodes, seq, policy, 0)
        assert run.accepted == 8, policy


def test_static_needs_a_legal_layout_per_gpu() -> None:
    nodes = _nodes(1, gpus=1)
    bad = [(mig.Placed(0, "4g.40gb"), mig.Placed(4, "4g.40gb"))]
    with pytest.raises(ValueError, match="more than 1 4g.40gb"):
        mr.replay(nodes, [_pod(0, 100)], "static", 0, bad)
    with pytest.raises(ValueError, match="policy must be one of"):
        mr.replay(nodes, [], "worstfit", 0)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([50, 100, 200, 300, 460, 700, 1000]), st.sampled_from([1, 1, 1, 2]),
                          st.integers(500, 30000)), max_size=40),
       st.sampled_from(mr.POLICIES[1:]), st.sampled_from(["G2", "G3", "T4", "V100M32"]), st.integers(0, 5))
def test_every_layout_built_is_legal_and_hosts_are_never_overdrawn(
        tasks: list[tuple[int, int, int]], policy: str, model: str, seed: int) -> None:
    nodes = _nodes(3, gpus=2, model=model)
    seq = [_pod(i, milli if n == 1 else 1000, n, cpu) for i, (milli, n, cpu) in enumerate(tasks)]
    cluster_seen: list[mr.Cluster] = []
    run = mr.replay(nodes, seq, policy, seed, observe=cluster_seen.append)
    cluster = cluster_seen[-1] if cluster_seen else None
    assert run.accepted + run.refused == run.arrived
    if cluster is not None:
        for g, layout in enumerate(cluster.layouts):
            assert mig.check_layout(cluster.model(g), layout) == []
            assert cluster.held[g] == frozenset(range(len(layout)))  # dynamic: made only for tasks
        assert (cluster.cpu >= 0).all() and (cluster.mem >= 0).all()


def test_dra_path_first_fit_and_the_mig_term() -> None:
    """The DRA path: the allocator takes each profile's highest free start on the first GPU that has one;
    the extender's MIG term sends the second small task to the GPU already cut, so the whole-GPU task
    still fits, where a random feasible node (DRA unscored) often spreads them."""
    nodes = _nodes(2, gpus=1)
    seq = [_pod(0, 100), _pod(1, 100), _pod(2, 1000)]
    seen: list[mr.Cluster] = []
    run = mr.replay(nodes, seq, "dra-frag", 0, observe=seen.append)
    assert run.accepted == 3
    cut = next(layout for layout in seen[-1].layouts if len(layout) == 2)
    assert [(p.profile, p.start) for p in cut] == [("1g.10gb", 5), ("1g.10gb", 6)]
    assert min(mr.replay(nodes, seq, "dra-random", seed).accepted for seed in range(10)) == 2


# -- the replay's DRA path against the live scorer (extender.dra_scoring) ---------------------------------
_CARDS = {"A100-SXM4-40GB": ("NVIDIA A100-SXM4-40GB", 40960), "A100-SXM4-80GB": ("NVIDIA A100-SXM4-80GB", 81920),
          "H100-SXM5-80GB": ("NVIDIA H100 80GB HBM3", 81559), "H200-SXM5-141GB": ("NVIDIA H200", 143771)}


def _live_gpu(card: str):
    """The one dynamic-MIG GPU the DRA plugin publishes for ``card``, as the extender reads it back."""
    from deviceplugin import devices
    from deviceplugin.dra import slices
    from deviceplugin.backend import DiscoveredGpu
    from extender import dra_scoring
    from vramshare import contract
    from vramshare.config import Config, DraConfig, DynamicMigConfig
    names = contract.Names()
    cfg = Config(dra=DraConfig(gpus=("all",)), dynamic_mig=DynamicMigConfig(gpus=("all",)))
    model, memory = _CARDS[card]
    inv = devices.build_inventory([DiscoveredGpu(index=0, uuid="GPU-0", model=model, memory_mib=memory,
                                                 mig_enabled=True)], cfg, dra=True)
    dyn = slices.dynamic_models(inv, cfg.dra_partitions)
    objs = slices.resource_slices("n", None, slices.desired_devices(inv, names, "n", taints=False, dynamic=dyn), 1,
                                  names, slices.counter_sets(inv, dyn))
    [gpu] = dra_scoring.partitions_of_slices(objs)
    assert gpu.model.name == card
    return gpu


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(sorted(_CARDS)), st.lists(st.integers(0, 20), min_size=1, max_size=9))
def test_the_replay_s_dra_term_is_the_live_scorer_s(card: str, asks: list[int]) -> None:
    """The replay (bench_mig's dra-frag, bench_residency's dra-mig) must score a node as the extender's
    ``mig_scores`` does: the allocator's partition (``first_fit_partition``) and its loss as a share of
    the card's empty potential (``partition_loss``). The replay scored absolute potential, so across cards
    of different sizes (the openb mapping mixes four) it ranked nodes differently from the live path."""
    from extender import dra_scoring
    gpu = _live_gpu(card)
    plain = [p.name for p in gpu.model.profiles if not p.media]
    held: list[str] = []
    layout: tuple[mig.Placed, ...] = ()
    for a in asks:
        profile = plain[a % len(plain)]
        live = dra_scoring.partition_loss([gpu], held, [profile])
        replayed = mr._dra_first_fit_of(card, (layout,), profile, 1)
        assert (live is None) == (replayed is None), (profile, layout)
        if live is None:
            continue
        _g, uuid, start = dra_scoring.first_fit_partition(
            [gpu], {gpu.counter_set: [mig.Placed(st_, p) for u, p, st_ in gpu.devices if u in held]}, profile)
        assert replayed[1] == ((0, start),), "the replay's partition is the allocator's"
        assert replayed[0] == pytest.approx(live, abs=1e-9), (profile, layout)
        held.append(uuid)
        layout = tuple(sorted((*layout, mig.Placed(start, profile))))
