"""The residency term (issue 23 item 3): prefer nodes that already hold the pod's model. Pure.

A pod that names a model (annotation ``model``) gets, on each node that fits it, a bonus proportional
to the load time the node saves it: the model's bytes over the bandwidth of the fastest tier the node
holds it in (an engine on one of its GPUs, its files in the host cache) against a full pull. The bonus is
added to the policy's raw score in units of the policy's own step and is at most ``max_steps`` of them,
so it reorders nodes only among those the policy rates within that many steps of each other; it is
applied after the filter, so it never makes a node that does not fit win (it never outweighs fit).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence

import numpy as np

from vramshare import contract
from vramshare.inventory import ResidentModel

GIB = 1 << 30


@dataclass(frozen=True)
class ResidencyConfig:
    """Defaults and their sources (``shared/reference/coldstart-mig-anchors.md``)."""

    #: a full pull (registry / object store): the GenAI trace's loads, ~22.7 s median for a few GB,
    #: i.e. ~0.35 GiB/s for the 8 GiB reference of bench/bench_coldstart.py
    remote_bytes_per_s: float = 0.35 * GIB
    #: files in the node's cache: local NVMe (assumption, ServerlessLLM's local-SSD setting)
    disk_bytes_per_s: float = 4 * GIB
    #: the node already runs an engine of the model (awake or asleep on one of its GPUs): host-to-GPU,
    #: llm-d's ~3 s for 64 GiB
    engine_bytes_per_s: float = 20 * GIB
    #: load time saved at which the bonus is full
    saturate_s: float = 60.0
    #: the most the bonus may be worth, in steps of the policy's raw score (fgd: 0.16 GPU of
    #: fragmentation removed per step). Below 1, residency only breaks near-ties of the policy.
    max_steps: float = 0.9
    #: an unknown size (engine only, no files) is priced at this
    default_bytes: int = 16 * GIB


def saved_seconds(ask: contract.ModelRef, held: Iterable[ResidentModel], cfg: ResidencyConfig) -> float:
    """Load time a node holding ``held`` saves a new replica of ``ask`` against a full pull."""
    best = 0.0
    for m in held:
        if not ask.matches(m.ref):
            continue
        size = m.bytes or cfg.default_bytes
        bw = cfg.engine_bytes_per_s if m.engines else cfg.disk_bytes_per_s
        best = max(best, size / cfg.remote_bytes_per_s - size / bw)
    return best


def bonus(ask: contract.ModelRef | None, per_node: Sequence[Iterable[ResidentModel]],
          cfg: ResidencyConfig = ResidencyConfig()) -> np.ndarray:
    """``[n]`` bonus in policy steps, in ``[0, cfg.max_steps]``; zeros when the pod names no model."""
    out = np.zeros(len(per_node))
    if ask is None or cfg.max_steps <= 0:
        return out
    for i, held in enumerate(per_node):
        out[i] = min(1.0, saved_seconds(ask, held, cfg) / cfg.saturate_s) * cfg.max_steps
    return out


def bonus_for(ask: contract.ModelRef | None, names: Sequence[str],
              held: Mapping[str, Sequence[ResidentModel]], cfg: ResidencyConfig = ResidencyConfig(),
              rows: tuple[np.ndarray, Callable[[str], int | None]] | None = None) -> np.ndarray | None:
    """:func:`bonus` per node name, for both prioritize paths (device plugin and DRA): computed only for
    the names in ``held`` (the nodes that report a model: one that reports none saves no load time);
    ``None`` when no name gets one. ``rows`` = (each name's row, the row of a node name): the device
    plugin's path, whose rows for the names are known, finds the reporting nodes among 5,000 names
    without a Python step per name (walking them cost a prioritize ~10 ms); else each name is looked up."""
    if ask is None or not held:
        return None
    if rows is not None:
        found, row_of = rows
        by_row = {r: m for r, m in ((row_of(n), m) for n, m in held.items() if m) if r is not None}
        if not by_row:
            return None
        at = np.flatnonzero(np.isin(found, np.fromiter(by_row, np.int64, len(by_row)))).tolist()
        per_node = [by_row[int(r)] for r in found[at].tolist()]
    else:
        at, per_node = [], []
        for i, n in enumerate(names):
            m = held.get(n)  # one read per name: the node watch may change ``held`` meanwhile (DRA path)
            if m:
                at.append(i)
                per_node.append(m)
    if not at:
        return None
    out = np.zeros(len(names))
    out[at] = bonus(ask, per_node, cfg)
    return out


def step_of(raw: np.ndarray, score_step: float | None = None) -> float:
    """One step of a score, the bonus's unit, over the raw scores of the nodes that fit: the policy's
    own ``score_step`` (fgd: 1, its raw scores are whole steps), else a tenth of the raw range (one point
    of the 0..10 scale; 1 when they all tie). The one bound of both prioritize paths and of the DRA
    path's MIG term (:meth:`extender.dra_scoring.DraCluster.mig_scores`)."""
    return score_step or (float(raw.max() - raw.min()) / 10 if len(raw) else 0.0) or 1.0


def with_bonus(raw: np.ndarray, steps: np.ndarray, step: float = 1.0) -> np.ndarray:
    """The policy's raw scores plus the bonus (``step`` is the policy's raw unit per step: 1 for fgd,
    whose raw scores are whole steps; :func:`step_of` for any score)."""
    return raw + np.clip(steps, 0.0, None) * step
