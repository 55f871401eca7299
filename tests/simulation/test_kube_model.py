"""The model of kube-scheduler's cycle shared by the simulator and the stand-in driver (upstream numbers)."""
from __future__ import annotations

import os

import numpy as np
import pytest

from extender.simulation.kube_model import (DEFAULT_WEIGHTS, KubeModel, PodRequest, Profile, ProfileError)

GI = 1 << 30
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def model(profile: Profile = Profile(), seed: int = 0) -> KubeModel:
    return KubeModel(profile, [4000, 8000], [8 * GI, 8 * GI], [110, 110], seed)


def test_least_allocated_and_balanced_as_upstream() -> None:
    m = model()
    pod = PodRequest.of(1000, 2 * GI)
    # node 0: cpu (4000-1000)*100/4000 = 75, memory (8-2)*100/8 = 75 -> 75; balanced: |0.25-0.25|/2 = 0 -> 100
    # node 1: cpu 87, memory 75 -> (87+75)//2 = 81; balanced: 1 - |0.125-0.25|/2 = 0.9375 -> 93
    assert m.plugin_scores(np.array([0, 1]), pod).tolist() == [175, 174]


def test_zero_requests_count_as_the_non_zero_defaults_for_scoring_only() -> None:
    pod = PodRequest.of(0, 0)
    assert (pod.cpu, pod.memory, pod.nonzero_cpu, pod.nonzero_memory) == (0, 0, 100, 200 * 1024 * 1024)


def test_fit_filter_counts_pods_cpu_and_memory() -> None:
    m = model()
    m.bind(0, PodRequest.of(3500, GI))
    assert m.fits(PodRequest.of(1000, GI)).tolist() == [False, True]
    assert m.fits(PodRequest.of(100, 8 * GI)).tolist() == [False, True]  # exactly all of node 1


def test_extender_score_counts_weight_times_ten() -> None:
    m = model(Profile(extender_weight=1))
    pod = PodRequest.of(1000, 2 * GI)
    # default scores 175 vs 174; the extender's 0 vs 1 is worth 10 points
    assert m.select(np.array([0, 1]), pod, np.array([0, 1])) == 1
    assert m.select(np.array([0, 1]), pod, np.array([1, 0])) == 0


def test_equal_totals_are_chosen_at_random() -> None:
    m = KubeModel(Profile(), [4000] * 4, [8 * GI] * 4, [110] * 4, 1)
    picks = {m.select(np.arange(4), PodRequest.of(100, GI)) for _ in range(60)}
    assert picks == {0, 1, 2, 3}


def test_weights_and_managed_resources_come_from_the_deployed_configuration() -> None:
    p = Profile.from_yaml(os.path.join(ROOT, "deploy", "daemonset", "scheduler-config.yaml"))
    assert p.extender_weight >= 1
    assert "vramshare.io/gpu-memory" in p.managed
    assert p.interested(["cpu", "vramshare.io/gpu-memory"]) and not p.interested(["cpu", "memory"])


def test_profile_plugins_and_strategy_are_read() -> None:
    cfg = {"extenders": [{"weight": 7}], "profiles": [{
        "schedulerName": "vramshare-scheduler",
        "plugins": {"score": {"disabled": [{"name": "NodeResourcesBalancedAllocation"}],
                              "enabled": [{"name": "NodeResourcesFit", "weight": 3}]}},
        "pluginConfig": [{"name": "NodeResourcesFit", "args": {"scoringStrategy": {
            "type": "MostAllocated", "resources": [{"name": "cpu", "weight": 2}]}}}]}]}
    p = Profile.from_config(cfg)
    assert (p.extender_weight, p.fit_weight, p.balanced_weight, p.fit_strategy, p.fit_resources, p.managed) == (
        7, 3, 0, "MostAllocated", (("cpu", 2),), ())
    assert p.interested(["anything"])  # no managedResources: every pod
    assert DEFAULT_WEIGHTS["NodeResourcesFit"] == 1


def test_unmodelled_strategies_are_refused_by_name() -> None:
    cfg = {"extenders": [{"weight": 1}], "profiles": [{"schedulerName": "vramshare-scheduler", "pluginConfig": [
        {"name": "NodeResourcesFit", "args": {"scoringStrategy": {"type": "RequestedToCapacityRatio"}}}]}]}
    with pytest.raises(ProfileError, match="RequestedToCapacityRatio"):
        Profile.from_config(cfg)
