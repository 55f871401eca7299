"""Quota policies replayed on real per-container GPU memory demand (issue 9's protocol, issue 19's honesty).

Trace: ``$VRAMSHARE_TRACES/genai/pod_gpu_memory_used_bytes.csv`` (``vramshare traces download``; the 57 containers with a (nearly) full
day, one sample a minute). The *containers* are split in two with a fixed seed (``SPLIT_SEED``): a
tuning half (the learned forecaster is fitted on it, rules are chosen on it) and a held-back half
nothing was tuned on; every figure is given per half. Per seed, a half's containers are shuffled and
packed ``k`` to an 80 GiB GPU (``k`` = 2, 3, 4); every tenant's request is an equal share. Each
minute every tenant has a demand; its limit for minute t is set from what the node knew at t-1.

Causal rows are fed exactly what the node loop has (:func:`run_new`): held memory under the limit,
the loop's window of those uses, preemptions when fenced, a releasing engine; in two worlds:
``@demand``, the engine exports ``vramshare_vllm_kv_demand_bytes`` (last minute's unfenced demand),
``@held``, it does not. Rows: ``default`` (``PolicyParams()`` as shipped), ``peak`` (the rule that was
the default), ``learned`` (``headroom: learned``, wide bounds), ``*-fewest-over`` (``protectRequests:
false``, which breaks the no-one-below-its-request guarantee). References: ``clairvoyant`` (knows
minute t's demands, fits the most whole tenants), ``clairvoyant-release`` (the same, keeping the rule
that memory held at t-1 is not free at t), ``clairvoyant-protected`` (keeping protected requests:
nobody below min(request, demand) while another borrows, the guarantee issue 19's property test
asks for, minute by minute), ``clairvoyant-fair`` (keeping both, but protecting only out of free
memory: it never takes a loan back, so owners wait; round 17's reference), ``clairvoyant-reclaim``
(keeping both and the property: a loan an owner needs is cut at once, the fair reference for the
default; ``-4``: after 4 short minutes, the node property test's reaction time), ``naive`` (last
minute x 1.1, scaled to fit, the rest split evenly: the issue's naive rule), ``static-equal``.

The world: a tenant holds ``min(demand, limit)``; a cut is honoured by the next sample. Scored: %
of container-minutes with demand over limit (the headline; spread = min / median / max over
groupings), over-limit GiB-min, GPU-minutes where limits plus memory held beyond them exceed the GPU
(``sum max(limit, held) <= capacity``, never broken by a causal row), tenant-minutes where a tenant
is below min(demand, request) while another holds more than its request (issue 19's property), limit
changes per container-hour. ``--fit`` refits ``deviceplugin/quota/learned_model.json`` on the tuning half.
Writes ``bench/results/quota.json``; the machine is shared, CPU seconds are only indicative.

    nice -n 10 python bench/bench_quota.py [--seeds N] [--ks 2,3,4] [--rows ...] [--fit]
    python bench/bench_quota.py --merge a.json,b.json --out bench/results/quota.json
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import multiprocessing
import os
import sys
import time
from collections import defaultdict
from typing import Callable

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from deviceplugin.quota.model import GpuState, PolicyParams, Signals, TenantKey, TenantState  # noqa: E402
from deviceplugin.quota.policy import rebalance  # noqa: E402
from vramshare import traces  # noqa: E402

TRACE = traces.find(traces.GENAI_MEMORY) or traces.GENAI_MEMORY  # $VRAMSHARE_TRACES/genai/...
GPU_MIB = 80 * 1024
MIB = 1 << 20
WINDOW = 10  # minutes of use the loop remembers for the peak (quota.peakWindowTicks x one-minute ticks)
FORECAST_WINDOW = 60  # minutes of use behind the forecast rows (the loop's default quota.peakWindowTicks)
PARAMS = PolicyParams(floor_fraction=0.5, ceiling_fraction=1.5, step_mib=512, margin_mib=1024)


def load_demand(path: str) -> np.ndarray:
    """MiB demand, one row per container with >= 1,400 samples (sorted by id), one column a minute."""
    by_c: dict[str, dict[float, float]] = defaultdict(dict)
    with open(path, encoding="utf-8") as fh:
        for row in csv.DictReader(fh):
            by_c[row["container_ip"]][float(row["timestamp_anon"])] = float(row["value"])
    times = sorted({t for d in by_c.values() for t in d})
    rows = []
    for cid in sorted(c for c, d in by_c.items() if len(d) >= 1400):
        series, last = [], 0.0
        for t in times:  # a missing sample repeats the last one
            last = by_c[cid].get(t, last)
            series.append(last)
        rows.append(series)
    return np.floor(np.array(rows) / MIB).astype(np.int64)


def groupings(demand: np.ndarray, k: int, seed: int) -> list[np.ndarray]:
    order = np.random.default_rng(seed).permutation(len(demand))
    return [demand[order[i:i + k]] for i in range(0, len(order) - k + 1, k)]


# -- policies: each returns the limit matrix and the held matrix of one GPU ---------------------
def _world(demand: np.ndarray, decide: Callable[[int, np.ndarray, np.ndarray], np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    k, n = demand.shape
    limits = np.zeros_like(demand)
    held = np.zeros_like(demand)
    limits[:, 0] = GPU_MIB // k
    held[:, 0] = np.minimum(demand[:, 0], limits[:, 0])
    for t in range(1, n):
        limits[:, t] = decide(t, limits, held)
        # a cut is honoured by the next sample (hard limit + preemption, or kvcached freeing pages),
        # not before: at the decision the cut memory is still held, which the policy must respect
        keep = np.minimum(demand[:, t], limits[:, t])
        free = GPU_MIB - keep.sum()
        if free < 0:  # limits over capacity: the last grower finds no memory (only a broken policy)
            for i in reversed(range(k)):
                g = min(int(keep[i] - min(keep[i], held[i, t - 1])), -int(free))
                keep[i] -= g
                free += g
        held[:, t] = keep
    return limits, held


def run_new(demand: np.ndarray, params: PolicyParams = PARAMS, world: str = "demand") -> tuple[np.ndarray, np.ndarray]:
    """The policy fed exactly what the node loop has (issue 19): each tenant's use = what it *held*
    under its limit last minute, the loop's window of those uses (``FORECAST_WINDOW`` minutes; its
    peak is the window's peak), the vLLM signals a fenced engine shows (preemptions when its demand
    was above its limit), a releasing engine (``vramshare_vllm_release_mode`` unmap: a cut is honoured
    by the next sample, as the world below has it). ``world``: ``demand``, the engine exports
    ``vramshare_vllm_kv_demand_bytes`` (what it would hold unfenced: last minute's demand);
    ``held``, it does not (the loop sees only held memory and the preemptions)."""
    k = len(demand)
    keys = [TenantKey("bench", f"t{i}", "c", pod_uid=f"u{i}") for i in range(k)]
    req = GPU_MIB // k
    dem = demand.tolist()
    sig_fenced = Signals(preemptions=1, release_mode="unmap")
    sig_calm = Signals(preemptions=0, release_mode="unmap")

    def decide(t: int, limits: np.ndarray, held: np.ndarray) -> np.ndarray:
        lo = max(0, t - FORECAST_WINDOW)
        states = []
        for i in range(k):
            win = held[i, lo:t].tolist()
            fenced = dem[i][t - 1] > limits[i, t - 1]
            states.append(TenantState(keys[i], req, int(limits[i, t - 1]), int(held[i, t - 1]),
                                      sig_fenced if fenced else sig_calm, peak_mib=max(win),
                                      demand_mib=dem[i][t - 1] if world == "demand" else None,
                                      recent_mib=tuple(win)))
        return np.array([d.limit_mib for d in rebalance(GpuState("GPU-bench", GPU_MIB, tuple(states)), params)])
    return _world(demand, decide)


def run_clairvoyant(demand: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    def decide(t: int, limits: np.ndarray, held: np.ndarray) -> np.ndarray:
        d = demand[:, t]
        out = np.zeros(len(d), dtype=np.int64)
        free = GPU_MIB
        for i in np.argsort(d, kind="stable"):  # smallest first: the most whole tenants
            out[i] = min(d[i], free)
            free -= out[i]
        out[np.argmax(d)] += free  # what is left goes to the largest (harmless)
        return out
    return _world(demand, decide)


def run_clairvoyant_release(demand: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Knows minute t's demands but keeps the invariant: memory a co-tenant held at t-1 is not free
    at t. Covers the tenants whose rise above what they hold is cheapest, whole. What foresight alone
    is worth, separated from the release rule that binds every causal policy here."""
    def decide(t: int, limits: np.ndarray, held: np.ndarray) -> np.ndarray:
        h = held[:, t - 1]
        out = h.astype(np.int64).copy()
        _whole_rises(demand[:, t], out, GPU_MIB - int(h.sum()))
        return out
    return _world(demand, decide)


def _protect(d: np.ndarray, out: np.ndarray, free: int, request: int) -> int:
    """Raise each limit in ``out`` toward min(demand, request) out of ``free`` (smallest rise first, the
    last one partly); returns what is left. The protected-requests pass of the clairvoyant rows."""
    goal = np.maximum(out, np.minimum(d, request))
    for i in np.argsort(goal - out, kind="stable"):
        give = min(int(goal[i] - out[i]), max(0, free))
        out[i] += give
        free -= give
    return free


def _whole_rises(d: np.ndarray, out: np.ndarray, free: int) -> int:
    """Cover whole rises to demand ``d`` out of ``free``, smallest first (the most whole tenants);
    returns what is left."""
    for i in np.argsort(np.maximum(0, d - out), kind="stable"):
        rise = max(0, int(d[i] - out[i]))
        if rise <= free:
            out[i] += rise
            free -= rise
    return free


def _cover(d: np.ndarray, base: np.ndarray, free: int, protect: int | None) -> np.ndarray:
    """Limits covering demands ``d`` from ``base`` (what each already has for nothing) with ``free``
    MiB: with ``protect`` (the request), everyone's demand up to it first, then whole rises."""
    out = np.maximum(base, 0).astype(np.int64)
    if protect is not None:
        free = _protect(d, out, free, protect)
    _whole_rises(d, out, free)
    return out


def run_clairvoyant_protected(demand: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Knows minute t's demands and keeps the guarantee the default keeps (``protectRequests``:
    nobody below min(request, demand) while another borrows), but not the release rule: what the
    protection alone costs a perfect forecaster."""
    k = len(demand)

    def decide(t: int, limits: np.ndarray, held: np.ndarray) -> np.ndarray:
        return _cover(demand[:, t], np.zeros(k, dtype=np.int64), GPU_MIB, GPU_MIB // k)
    return _world(demand, decide)


def run_clairvoyant_fair(demand: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Knows minute t's demands, keeps the release rule (it may keep what it holds for nothing) and
    protects requests out of free memory only. Never cutting below what a tenant holds, it never takes
    memory back from a borrower: an owner whose request a borrower still holds waits as long as the
    borrower's demand lasts, which issue 19's property forbids (``pct_owner_short_while_another_borrows``).
    Kept as the round-17 reference; :func:`run_clairvoyant_reclaim` is the fair one."""
    k = len(demand)

    def decide(t: int, limits: np.ndarray, held: np.ndarray) -> np.ndarray:
        h = held[:, t - 1]
        return _cover(demand[:, t], h, GPU_MIB - int(h.sum()), GPU_MIB // k)
    return _world(demand, decide)


def run_clairvoyant_reclaim(demand: np.ndarray, allowance: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Perfect foresight under every rule the default must keep: knows minute t's demands, keeps the
    release rule (memory held at t-1 is not free at t), and issue 19's property: an owner short of
    min(demand, request) gets free memory first, and what free memory cannot give it is cut from the
    tenants holding above their request, at once (largest loan first, never below the request). A cut
    lands at t (the borrower holds no more than its new limit) and the owner gets the memory at t+1:
    knowing only minute t, one short minute is the least it can give the owner. With ``allowance``, an
    owner may stay short that many minutes before borrowers are cut (the node property test's reaction
    time is 4 ticks at an acknowledgement lag of 0). Then whole rises, smallest first, out of free memory."""
    k, request = len(demand), GPU_MIB // len(demand)
    streak = np.zeros(k, dtype=np.int64)

    def decide(t: int, limits: np.ndarray, held: np.ndarray) -> np.ndarray:
        d, h = demand[:, t], held[:, t - 1]
        out = h.astype(np.int64).copy()
        free = _protect(d, out, GPU_MIB - int(h.sum()), request)
        short = np.maximum(0, np.minimum(d, request) - out)
        streak[:] = np.where(short > 0, streak + 1, 0)
        owed = int(short[streak > allowance].sum())
        for i in np.argsort(request - h, kind="stable"):  # the largest loan first
            if owed <= 0 or h[i] <= request:
                break
            take = min(int(h[i]) - request, owed)
            out[i] -= take
            owed -= take
        _whole_rises(d, out, free)  # nothing is free when someone is owed: a cut borrower stays cut
        return out
    return _world(demand, decide)


def run_naive(demand: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    def decide(t: int, limits: np.ndarray, held: np.ndarray) -> np.ndarray:
        want = demand[:, t - 1] * 1.1
        if want.sum() > GPU_MIB:
            want = want * GPU_MIB / want.sum()
        return np.floor(want).astype(np.int64)
    return _world(demand, decide)


def run_naive_spare(demand: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The issue's "last minute x 1.1" (reproduces its 16.5% at k=3): scaled down in proportion when
    the GPU cannot hold it, otherwise what is left is split evenly. Like the clairvoyant it ignores
    what co-tenants still hold, so it breaks the capacity invariant."""
    k = len(demand)

    def decide(t: int, limits: np.ndarray, held: np.ndarray) -> np.ndarray:
        want = np.floor(demand[:, t - 1] * 1.1).astype(np.int64)
        if want.sum() > GPU_MIB:
            return np.floor(want * GPU_MIB / want.sum()).astype(np.int64)
        return want + (GPU_MIB - want.sum()) // k
    return _world(demand, decide)


def run_static(demand: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return _world(demand, lambda t, limits, held: np.full(len(demand), GPU_MIB // len(demand)))


def score(demand: np.ndarray, limits: np.ndarray, held: np.ndarray) -> dict[str, float]:
    """Minute sums for one GPU. ``owner_short_minutes``: issue 19's property, tenant-minutes where a
    limit is below min(demand, request) while another tenant holds more than its request."""
    over = np.maximum(0, demand - limits)
    request = GPU_MIB // len(demand)
    owner_short = (limits < np.minimum(demand, request)) & ((held > request).sum(axis=0) > 0)
    short = demand > held  # over its limit, or within it but the memory was not free (a co-tenant kept it)
    committed = np.maximum(limits[:, 1:], held[:, :-1]).sum(axis=0)  # at each decision, vs held before it
    return {"minutes": int(demand.size), "over_minutes": int((over > 0).sum()), "over_mib_min": int(over.sum()),
            "invariant_broken_gpu_minutes": int((committed > GPU_MIB).sum()),
            "short_minutes": int(short.sum()), "owner_short_minutes": int(owner_short.sum()),
            "limit_changes": int((np.diff(limits, axis=1) != 0).sum())}


def _wide(k: int) -> PolicyParams:
    """Floor 0.1 and ceiling k x the request: one tenant may take most of the GPU when the others are quiet."""
    return PolicyParams(floor_fraction=0.1, ceiling_fraction=float(k), step_mib=512, margin_mib=1024)


# causal rows (fed as the node loop feeds the policy, in one of the two worlds); "default" is
# PolicyParams() exactly as shipped (the quota: section's defaults)
CAUSAL: dict[str, Callable[[int], PolicyParams]] = {
    "default": lambda k: PolicyParams(),
    "peak": lambda k: dataclasses.replace(PolicyParams(), headroom="peak"),
    "forecast": lambda k: dataclasses.replace(_wide(k), headroom="forecast"),
    "learned": lambda k: dataclasses.replace(_wide(k), headroom="learned"),
    "learned-default-bounds": lambda k: dataclasses.replace(PolicyParams(), headroom="learned"),
    "forecast-default-bounds": lambda k: dataclasses.replace(PolicyParams(), headroom="forecast"),
    "learned-fewest-over": lambda k: dataclasses.replace(_wide(k), headroom="learned", protect_requests=False),
    "forecast-fewest-over": lambda k: dataclasses.replace(_wide(k), headroom="forecast", protect_requests=False),
}
# references: no policy inputs to be honest about
REFERENCE: dict[str, Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]] = {
    "clairvoyant": run_clairvoyant,
    "clairvoyant-release": run_clairvoyant_release,
    "clairvoyant-protected": run_clairvoyant_protected,
    "clairvoyant-fair": run_clairvoyant_fair,
    "clairvoyant-reclaim": run_clairvoyant_reclaim,
    "clairvoyant-reclaim-4": lambda demand: run_clairvoyant_reclaim(demand, allowance=4),
    "naive": run_naive_spare,  # the "last minute x 1.1, spare split evenly"
    "static-equal": run_static,
}
WORLDS = ("demand", "held")
SPLIT_SEED = 19  # which containers tune and which are held back (issue 19: split containers, not minutes)

_DEMAND: np.ndarray | None = None


def _init(demand: np.ndarray, model_path: str | None) -> None:
    global _DEMAND
    _DEMAND = demand
    if model_path:
        from deviceplugin.quota import learned
        learned.default_model.cache_clear()
        learned.MODEL_PATH = model_path


def split(n: int, seed: int = SPLIT_SEED) -> tuple[np.ndarray, np.ndarray]:
    """(tuning, held-back) container indices: a seeded half each."""
    order = np.random.default_rng(seed).permutation(n)
    return np.sort(order[: n // 2]), np.sort(order[n // 2:])


def _score_seed(part: str, k: int, row: str, world: str, seed: int) -> dict[str, float]:
    """One row on one seed's groupings of one part (a worker's unit of work), summed over its GPUs."""
    tune, held = split(len(_DEMAND))
    data = _DEMAND[tune if part == "tune" else held]
    tot: dict[str, float] = defaultdict(float)
    for g in groupings(data, k, seed):
        lim_held = REFERENCE[row](g) if row in REFERENCE else run_new(g, CAUSAL[row](k), world)
        for key_, v in score(g, *lim_held).items():
            tot[key_] += v
    return dict(tot)


def fit_model(demand: np.ndarray, out: str, snap_mib: int = 512) -> dict[str, object]:
    """Fit :mod:`deviceplugin.quota.learned` on the tuning containers only (every minute, the
    loop's window before it), write it to ``out``."""
    from deviceplugin.quota import learned
    tune, _ = split(len(demand))
    wins, nows, nexts = [], [], []
    for row in demand[tune].tolist():
        for t in range(1, len(row)):
            wins.append(row[max(0, t - FORECAST_WINDOW):t])
            nows.append(row[t - 1])
            nexts.append(row[t])
    model = learned.fit(wins, nows, nexts, snap_mib=snap_mib)
    with open(out, "w", encoding="utf-8") as fh:
        json.dump(model.to_json(), fh, indent=1)
    return {"rows": len(nows), "containers": int(len(tune)), "out": out}


def _summarise(scored: dict, tasks: list, seeds: list[int]) -> dict[str, object]:
    out: dict[str, object] = {}
    groups = sorted({(p, k, r, w) for p, k, r, w, _ in tasks})
    for p, k, r, w in groups:
        tot: dict[str, float] = defaultdict(float)
        per_seed = []
        for seed in seeds:
            sc = scored[(p, k, r, w, seed)]
            for key_, v in sc.items():
                tot[key_] += v
            per_seed.append(100 * sc["over_minutes"] / sc["minutes"])
        name = r if r in REFERENCE else f"{r}@{w}"
        out.setdefault(p, {}).setdefault(f"k{k}", {})[name] = {  # type: ignore[union-attr]
            "pct_container_minutes_over_limit": round(100 * tot["over_minutes"] / tot["minutes"], 2),
            "pct_spread_over_groupings": [round(min(per_seed), 2), round(float(np.median(per_seed)), 2),
                                          round(max(per_seed), 2)],
            "pct_container_minutes_short": round(100 * tot["short_minutes"] / tot["minutes"], 2),
            "pct_owner_short_while_another_borrows": round(100 * tot["owner_short_minutes"] / tot["minutes"], 2),
            "over_limit_gib_min": round(tot["over_mib_min"] / 1024, 1),
            "invariant_broken_gpu_minutes": int(tot["invariant_broken_gpu_minutes"]),
            "limit_changes_per_container_hour": round(tot["limit_changes"] / (tot["minutes"] / 60), 2)}
    _ratios(out)
    return out


# the references every row is given a ratio to: the unconstrained minimum (issue 19's target is 1.5x
# of it), the round-17 reference that keeps loans, and perfect foresight under the default's own rules
RATIO_TO = ("clairvoyant", "clairvoyant-fair", "clairvoyant-reclaim")


def _set_ratios(v: dict[str, object], refs: dict[str, float]) -> None:
    pct = v["pct_container_minutes_over_limit"]
    for r in RATIO_TO:
        ref = refs.get(r)
        v["ratio_to_" + r.replace("-", "_")] = round(pct / ref, 2) if ref else None  # type: ignore[operator]


def _ratios(out: dict[str, object]) -> None:
    """Each row's ratio to each reference in ``RATIO_TO`` of its part and k."""
    for parts in out.values():
        for rows in parts.values():  # type: ignore[union-attr]
            refs = {r: rows[r]["pct_container_minutes_over_limit"] for r in RATIO_TO if r in rows}
            for v in rows.values():
                _set_ratios(v, refs)


def merge(paths: list[str], out: str) -> dict[str, object]:
    """Several runs' JSON as one (each run under ~8 minutes on the shared machine). Seeds are the same
    in every run (groupings 0..n-1), so a row over n groupings is compared with the references over
    the same n; where two runs have the same row, the later one over at least as many groupings is
    kept. A file merged before may be one of them (its rows carry their groupings). ``setup.runs``
    keeps each run's command, groupings and wall time."""
    doc: dict[str, object] = {"results": {}, "setup": {}}
    refs: dict[tuple[str, str, int], dict[str, float]] = {}  # (part, k, groupings) -> reference % by row
    runs = []
    for path in paths:
        with open(path, encoding="utf-8") as fh:
            part = json.load(fh)
        for p, ks in part["results"].items():
            for k, rows in ks.items():
                have = doc["results"].setdefault(p, {}).setdefault(k, {})  # type: ignore[union-attr]
                for r, v in rows.items():
                    n = v.setdefault("groupings", part["setup"]["groupings_per_part_and_k"])
                    if r.startswith("clairvoyant"):
                        refs.setdefault((p, k, n), {})[r] = v["pct_container_minutes_over_limit"]
                    if r not in have or have[r]["groupings"] <= n:
                        have[r] = v
        setup = dict(part["setup"])
        runs.extend(setup.pop("runs", None) or
                    [{x: setup.pop(x, None) for x in ("command", "groupings_per_part_and_k", "wall_seconds")}])
        doc["setup"].update({x: v for x, v in setup.items()  # type: ignore[union-attr]
                             if x not in ("command", "wall_seconds")})
    for p, ks in doc["results"].items():  # type: ignore[union-attr]
        for k, rows in ks.items():
            for v in rows.values():
                _set_ratios(v, refs.get((p, k, v["groupings"]), {}))
    doc["setup"]["runs"] = runs  # type: ignore[index]
    doc["setup"]["groupings_per_part_and_k"] = "per row: see each row's groupings"  # type: ignore[index]
    with open(out, "w", encoding="utf-8") as fh:
        json.dump(doc, fh, indent=2)
    return doc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=20, help="random groupings per part and k")
    ap.add_argument("--jobs", type=int, default=2, help="worker processes (the machine is shared: 2)")
    ap.add_argument("--trace", default=TRACE)
    ap.add_argument("--ks", default="2,3,4")
    ap.add_argument("--rows", default=",".join(list(CAUSAL) + list(REFERENCE)))
    ap.add_argument("--tune-rows", default="peak,forecast,learned,learned-default-bounds",
                    help="rows also scored on the tuning containers (what tuning saw), at k=3")
    ap.add_argument("--worlds", default=",".join(WORLDS))
    ap.add_argument("--fit", action="store_true", help="refit the learned model on the tuning containers first")
    ap.add_argument("--model", default=None, help="learned model JSON (default: the shipped one)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "quota.json"))
    ap.add_argument("--merge", default="", help="comma-separated result files to merge into --out (no run)")
    args = ap.parse_args(argv)
    if args.merge:
        merge(args.merge.split(","), args.out)
        return 0
    t_start, wall = time.process_time(), time.perf_counter()
    demand = load_demand(args.trace)
    fitted = None
    if args.fit:
        from deviceplugin.quota import learned
        fitted = fit_model(demand, args.model or learned.MODEL_PATH)
    seeds = list(range(args.seeds))
    ks = [int(x) for x in args.ks.split(",")]
    rows = [r for r in args.rows.split(",") if r]
    worlds = [w for w in args.worlds.split(",") if w]
    tasks = []
    for part, part_ks, part_rows in (("held_back", ks, rows),
                                     ("tune", [3] if 3 in ks else [], [r for r in args.tune_rows.split(",") if r]
                                      + ["clairvoyant", "clairvoyant-protected", "clairvoyant-fair",
                                         "clairvoyant-reclaim"])):
        for k in part_ks:
            for r in dict.fromkeys(part_rows):  # once each, in order
                for w in ([None] if r in REFERENCE else worlds):
                    tasks.extend((part, k, r, w, seed) for seed in seeds)
    with multiprocessing.Pool(args.jobs, initializer=_init, initargs=(demand, args.model)) as pool:
        scored = dict(zip(tasks, pool.starmap(_score_seed, tasks, chunksize=1)))
    results = _summarise(scored, tasks, seeds)
    tune, held = split(len(demand))
    doc = {"results": results,
           "setup": {"gpu_mib": GPU_MIB, "containers": int(len(demand)), "minutes": int(demand.shape[1]),
                     "split": {"seed": SPLIT_SEED, "tune": int(len(tune)), "held_back": int(len(held)),
                               "what": "containers, not minutes"},
                     "groupings_per_part_and_k": len(seeds), "lag_minutes": 1, "window_minutes": FORECAST_WINDOW,
                     "worlds": {"demand": "engine exports vramshare_vllm_kv_demand_bytes (last minute's demand)",
                                "held": "no demand export: held memory, window, preemptions only"},
                     "requests": "equal share (capacity / k)", "fitted": fitted,
                     "trace": "genai/pod_gpu_memory_used_bytes.csv",
                     "command": "nice -n 10 python bench/bench_quota.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                     "cpu_seconds_main": round(time.process_time() - t_start, 2), "jobs": args.jobs,
                     "wall_seconds": round(time.perf_counter() - wall, 1), "machine": "shared, 2 cores"}}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump(doc, fh, indent=2)
    print(json.dumps({p: {k: {r: (v["pct_container_minutes_over_limit"], v["ratio_to_clairvoyant"],
                                  v["limit_changes_per_container_hour"]) for r, v in rows_.items()}
                          for k, rows_ in parts.items()} for p, parts in results.items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
