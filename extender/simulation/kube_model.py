"""kube-scheduler's part of a scheduling cycle, as a model: in-tree Fit, the default scores, the extender's
weight, and the choice among the best. Pure numpy, no I/O.

Shared by the simulator (``vramshare simulate --as-scheduler``) and the stand-in scheduler driver
(:mod:`standins.scheduler`), so a trace replayed through the HTTP extender and one replayed in
process make the same decisions from the same inputs. Reproduced from kube-scheduler (pkg/scheduler):

* ``schedule_one.go findNodesThatFitPod``: the in-tree filters run first and the extender only sees the
  nodes that pass; ``NodeResourcesFit`` (``fitsRequest``): the pod count, then every requested resource
  (CPU millicores, memory bytes) against ``allocatable - requested``;
* ``prioritizeNodes``: each score plugin's 0..100 score times its weight, summed; every extender's
  ``prioritize`` answer (0..10) adds ``score * weight * (MaxNodeScore / MaxExtenderPriority)``, i.e.
  ``score * weight * 10`` (``extender.go``); ``prioritize`` is skipped when one node is feasible;
* ``selectHost``: the highest total; among equal totals one at random (upstream by reservoir sampling
  over the list, here with one uniform draw: the same distribution).

Of the default profile's score plugins only ``NodeResourcesFit`` (LeastAllocated by default, CPU and
memory weight 1; non-zero requests: a container without a CPU or memory request counts 100m / 200 MB)
and ``NodeResourcesBalancedAllocation`` (actual requests; ``1 - |cpu fraction - memory fraction| / 2``)
tell the trace's pods apart. TaintToleration, NodeAffinity, PodTopologySpread, InterPodAffinity and
ImageLocality give every node the same score for a pod with no taints, affinities, spread constraints,
owner or image, so they cannot change which node wins and are left out.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

__all__ = ["Profile", "KubeModel", "DEFAULT_WEIGHTS", "NONZERO_CPU_MILLI", "NONZERO_MEMORY"]

MAX_NODE_SCORE = 100
MAX_EXTENDER_PRIORITY = 10
NONZERO_CPU_MILLI = 100  # schedutil.DefaultMilliCPURequest
NONZERO_MEMORY = 200 * 1024 * 1024  # schedutil.DefaultMemoryRequest, bytes
#: The default profile's score plugin weights (pkg/scheduler/apis/config/v1 default_plugins.go).
DEFAULT_WEIGHTS = {"TaintToleration": 3, "NodeAffinity": 2, "NodeResourcesFit": 1, "PodTopologySpread": 2,
                   "InterPodAffinity": 2, "NodeResourcesBalancedAllocation": 1, "ImageLocality": 1}
STRATEGIES = ("LeastAllocated", "MostAllocated")


class ProfileError(ValueError):
    """A scheduler configuration this model cannot reproduce; the message names the field."""


@dataclass(frozen=True)
class Profile:
    """The weights that decide a cycle: the extender's and the varying default plugins'."""

    extender_weight: int = 1
    fit_weight: int = 1
    fit_strategy: str = "LeastAllocated"
    fit_resources: tuple[tuple[str, int], ...] = (("cpu", 1), ("memory", 1))
    balanced_weight: int = 1
    managed: tuple[str, ...] = ()  # the extender's managedResources; empty = every pod

    def interested(self, resources: Sequence[str]) -> bool:
        """``extender.go IsInterested``: no managedResources, or the pod asks one of them."""
        return not self.managed or any(r in self.managed for r in resources)

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any], scheduler_name: str = "vramshare-scheduler") -> "Profile":
        """From a ``KubeSchedulerConfiguration`` (parsed YAML): the named profile and the first extender."""
        extenders = cfg.get("extenders") or []
        if not extenders:
            raise ProfileError("extenders: none configured")
        weight = int(extenders[0].get("weight", 1))
        managed = tuple(m["name"] for m in extenders[0].get("managedResources") or [])
        profiles = [p for p in cfg.get("profiles") or [] if p.get("schedulerName", "default-scheduler") == scheduler_name]
        prof = profiles[0] if profiles else {}
        weights = dict(DEFAULT_WEIGHTS)
        score = ((prof.get("plugins") or {}).get("score") or {})
        for off in score.get("disabled") or []:
            if off.get("name") == "*":
                weights.clear()
            weights.pop(off.get("name"), None)
        for on in score.get("enabled") or []:
            weights[on["name"]] = int(on.get("weight") or DEFAULT_WEIGHTS.get(on["name"], 1))
        strategy, resources = "LeastAllocated", (("cpu", 1), ("memory", 1))
        for pc in prof.get("pluginConfig") or []:
            if pc.get("name") == "NodeResourcesFit":
                ss = (pc.get("args") or {}).get("scoringStrategy") or {}
                strategy = ss.get("type", strategy)
                if strategy not in STRATEGIES:
                    raise ProfileError(f"pluginConfig NodeResourcesFit scoringStrategy.type {strategy!r}: "
                                       f"only {', '.join(STRATEGIES)} are modelled")
                if ss.get("resources"):
                    resources = tuple((r["name"], int(r.get("weight", 1))) for r in ss["resources"])
        for name, _ in resources:
            if name not in ("cpu", "memory"):
                raise ProfileError(f"NodeResourcesFit scoringStrategy.resources: {name!r} is not modelled")
        return cls(weight, weights.get("NodeResourcesFit", 0), strategy, resources,
                   weights.get("NodeResourcesBalancedAllocation", 0), managed)

    @classmethod
    def from_yaml(cls, path: str) -> "Profile":
        """From a file holding a ``KubeSchedulerConfiguration`` or a ConfigMap that embeds one."""
        import yaml

        with open(path, encoding="utf-8") as fh:
            doc = yaml.safe_load(fh)
        if doc.get("kind") == "ConfigMap":
            doc = yaml.safe_load(next(iter((doc.get("data") or {}).values())))
        return cls.from_config(doc)


@dataclass(frozen=True)
class PodRequest:
    """A pod's CPU (millicores) and memory (bytes), as requested and as scored (non-zero)."""

    cpu: int
    memory: int
    nonzero_cpu: int
    nonzero_memory: int

    @classmethod
    def of(cls, cpu_milli: int, memory_bytes: int) -> "PodRequest":
        """One container's requests (the trace's tasks have one)."""
        return cls(cpu_milli, memory_bytes, cpu_milli or NONZERO_CPU_MILLI, memory_bytes or NONZERO_MEMORY)


class KubeModel:
    """kube-scheduler's cache of node allocatable and requested, and its filter/score/select."""

    def __init__(self, profile: Profile, cpu_milli: Sequence[int], memory_bytes: Sequence[int],
                 pods: Sequence[int], seed: int) -> None:
        self.profile = profile
        self.cpu_alloc = np.asarray(cpu_milli, np.int64)
        self.mem_alloc = np.asarray(memory_bytes, np.int64)
        self.pods_alloc = np.asarray(pods, np.int64)
        n = len(self.cpu_alloc)
        self.cpu_req, self.mem_req, self.pods = np.zeros(n, np.int64), np.zeros(n, np.int64), np.zeros(n, np.int64)
        self.cpu_nz, self.mem_nz = np.zeros(n, np.int64), np.zeros(n, np.int64)
        self.rng = np.random.default_rng(seed)

    def fits(self, pod: PodRequest) -> np.ndarray:
        """``[n]`` bool: NodeResourcesFit's filter (pod count, CPU, memory) on every node."""
        return ((self.pods + 1 <= self.pods_alloc) & (self.cpu_req + pod.cpu <= self.cpu_alloc)
                & (self.mem_req + pod.memory <= self.mem_alloc))

    def plugin_scores(self, rows: np.ndarray, pod: PodRequest) -> np.ndarray:
        """``[len(rows)]`` sum of the varying default plugins' score x weight."""
        p = self.profile
        total = np.zeros(len(rows), np.int64)
        if p.fit_weight:
            acc = np.zeros(len(rows), np.int64)
            for name, w in p.fit_resources:
                cap = (self.cpu_alloc if name == "cpu" else self.mem_alloc)[rows]
                req = (self.cpu_nz if name == "cpu" else self.mem_nz)[rows] + (
                    pod.nonzero_cpu if name == "cpu" else pod.nonzero_memory)
                ok = (cap > 0) & (req <= cap)
                safe = np.where(cap > 0, cap, 1)
                if p.fit_strategy == "LeastAllocated":  # leastRequestedScore
                    s = np.where(ok, (cap - req) * MAX_NODE_SCORE // safe, 0)
                else:  # mostRequestedScore: a request beyond capacity counts as full
                    s = np.where(cap > 0, np.minimum(req, cap) * MAX_NODE_SCORE // safe, 0)
                acc += s * w
            total += acc // max(1, sum(w for _, w in p.fit_resources)) * p.fit_weight
        if p.balanced_weight:
            fr = []
            for cap, req in ((self.cpu_alloc[rows], self.cpu_req[rows] + pod.cpu),
                             (self.mem_alloc[rows], self.mem_req[rows] + pod.memory)):
                fr.append(np.minimum(np.where(cap > 0, req / np.where(cap > 0, cap, 1), 0.0), 1.0))
            std = np.abs(fr[0] - fr[1]) / 2
            total += ((1 - std) * MAX_NODE_SCORE).astype(np.int64) * p.balanced_weight
        return total

    def select(self, rows: np.ndarray, pod: PodRequest, extender: np.ndarray | None = None) -> int:
        """Index into ``rows`` of the chosen node. ``extender``: its 0..10 scores per row, or ``None``
        when it was not asked (a pod it does not manage, or one feasible node)."""
        total = self.plugin_scores(rows, pod)
        if extender is not None:
            total = total + np.asarray(extender, np.int64) * self.profile.extender_weight * (
                MAX_NODE_SCORE // MAX_EXTENDER_PRIORITY)
        best = np.flatnonzero(total == total.max())
        return int(best[0]) if len(best) == 1 else int(best[self.rng.integers(len(best))])

    def bind(self, row: int, pod: PodRequest) -> None:
        """The assumed pod joins the node's requested (kube-scheduler's cache ``AssumePod``)."""
        self.pods[row] += 1
        self.cpu_req[row] += pod.cpu
        self.mem_req[row] += pod.memory
        self.cpu_nz[row] += pod.nonzero_cpu
        self.mem_nz[row] += pod.nonzero_memory
