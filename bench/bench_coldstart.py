"""Cold-start replay (issue 23): every ServeGen client a model deployment on shared GPUs.

    python bench/bench_coldstart.py [--seeds 2] [--idle-s 300] [--days 14] [--target-p99-s 5]
                                    [--overcommit 1 1.5 2 2.5 3 4] [--warm-idle-s 30 60 120 300]
                                    [--wake-ahead] [--elastic-kv [--kv-booked 0.5 0.25]] [--name coldstart]

Compares, on the same sampled arrivals (per seed): (a) ``zero`` scale to zero, every cold start a full
load; (b) ``keep`` warm pods that keep their slice (Knative ``minScale: 1``); (c) ``warm`` vramshare's warm
tier (sleep level 1, lend, take back, wake in place; sleepers past the node's host RAM restart from its
disk cache), at today's books (overcommit 1.0) and with sleeping pods overcommitted (item 5) as the live
system does it: placed with the books' rule of :mod:`vramshare.overcommit` (a pod awake when placed is
booked whole; sleepers of the overcommitted class at slice / ratio, plus the largest wake per GPU), woken
with the node broker's rule (a wake without memory waits on its GPU and displaces only idle pods of a
strictly lower class; ``--relocate`` restores last round's restart elsewhere, which the live broker does
not do). Every p99 is over all first requests after idleness, those that waited included. The warm tier's
idle-before-sleep (its class's ``idleSeconds``) is swept apart from (a)'s ``--idle-s`` (``--warm-idle-s``);
``ttft_ref_*`` is each run's first-token time over the same requests under every timer (those after
``--idle-s`` of quiet), ``ttft_first_*`` over all of its own wakes. ``--wake-ahead`` wakes sleeping
engines ahead of a forecast request into free memory (:class:`vramshare.coldstart.WakeAhead`). The model
is :mod:`vramshare.coldstart` (pure); this file reads the traces and writes
``bench/results/<name>.json`` and ``<name>.png``.

``--elastic-kv`` adds, beside every run above (which it leaves as they are), runs where awake engines have
elastic KV (kvcached-style, :mod:`vramshare.elastic_kv`): an awake engine holds its weights plus the KV its
window's request rate uses (Little's law, see ``KV_LOAD``), plus a margin, growing on demand up to its
slice; the books count an elastic pod at its weights plus ``--kv-booked`` of its slice's KV part; a growth
that finds no memory waits like a wake and delays the requests that arrive meanwhile. (b) keeps its whole
slice by the issue's definition; ``keep_elastic`` is (b) with the same elasticity, for fairness (never
asleep, placed at the same ``--kv-booked``).

Deployments: ``m-small`` clients serve an 8B model (bf16 weights 15 GiB, slice 24 GiB with its KV cache),
``m-mid`` clients a 14B model (27.5 GiB, slice 40 GiB); GPUs of 80 GiB, 8 per node, 1.5 TiB of host RAM
per node for sleeping weights. One replica per deployment: the extra replicas a busy client needs for
throughput scale the same way under every policy and are left out. Seeds: arrivals and load draws use
``numpy.random.default_rng(seed)``, seeds 0, 1, ...
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import glob
import json
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from vllm_patches.budget import ModelShape, kv_bytes_per_token  # noqa: E402
from vramshare import coldstart as cs  # noqa: E402
from vramshare import elastic_kv as ekv  # noqa: E402

TRACES = os.environ.get("VRAMSHARE_TRACES_ROOT", os.path.join(ROOT, "..", "shared", "traces"))
GIB = cs.GIB
#: pool -> (model, weight bytes, slice bytes): assumptions stated in the module docstring
MODELS = {"m-small": ("8B", 15 * GIB, 24 * GIB), "m-mid": ("14B", 27.5 * GIB, 40 * GIB)}
#: the models' shapes for their KV bytes per token (bf16): Llama-3.1-8B and Qwen2.5-14B ``config.json``
SHAPES = {"8B": ModelShape(hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
                           head_size=128, vocab_size=128256, dtype_bytes=2),
          "14B": ModelShape(hidden_size=5120, intermediate_size=13824, num_layers=48, num_heads=40, num_kv_heads=8,
                            head_size=128, vocab_size=152064, dtype_bytes=2)}
#: pool -> (mean prompt tokens, mean output tokens) per request for elastic KV, from ServeGen's per-client
#: token distributions, ``data/language/<pool>/chunk-*-dataset.json`` (alibaba/ServeGen f891d11; 38 of 43
#: m-small and 74 of 109 m-mid clients: the others' files, the busiest clients', are over the mirror's 4 MiB
#: and absent). Each client's mean is request-weighted over its 6-hour periods. ``p90`` (the default,
#: conservative): the per-client p90 of those means, 9 clients in 10 use less; ``median``: the per-client
#: median; ``weighted``: the pool's request-weighted mean (its many short requests dominate)
KV_TOKENS = {"p90": {"m-small": (1510.0, 169.0), "m-mid": (2533.0, 491.0)},
             "median": {"m-small": (361.0, 40.0), "m-mid": (611.0, 69.0)},
             "weighted": {"m-small": (120.0, 15.0), "m-mid": (307.0, 51.0)}}
#: seconds per output token on a shared H100: assumption (:class:`vramshare.elastic_kv.KvLoad`)
TPOT_S = {"m-small": 0.030, "m-mid": 0.040}


def kv_load(pool: str, costs: cs.Costs, tokens: str = "p90") -> ekv.KvLoad:
    model = MODELS[pool][0]
    (tin, tout), tpot = KV_TOKENS[tokens][pool], TPOT_S[pool]
    return ekv.KvLoad(bytes_per_token=kv_bytes_per_token(SHAPES[model], 2), input_tokens=tin, output_tokens=tout,
                      tpot_s=tpot, ttft_s=costs.base_ttft_s)


def read_client(path: str, days: float) -> list[tuple[float, float, str, float]]:
    rows = []
    with open(path, encoding="utf-8") as fh:
        for rec in csv.reader(fh):
            if len(rec) < 5:
                continue
            start, rate = float(rec[0]), float(rec[1])
            if start >= days * 86400:
                break
            try:
                shape = float(rec[4])
            except ValueError:
                shape = float("nan")
            rows.append((start, rate, rec[3], shape))
    return rows


def genai_loads_s() -> np.ndarray:
    with open(os.path.join(TRACES, "genai", "basemodel_update_latency.csv"), encoding="utf-8") as fh:
        return np.array([float(r["value"]) / 1000.0 for r in csv.DictReader(fh)])


def read_load(path: str, days: float) -> list[tuple[float, float, float]]:
    """``(window_start, rate, cv)`` of one client (elastic KV's demand; no random draw)."""
    rows = []
    with open(path, encoding="utf-8") as fh:
        for rec in csv.reader(fh):
            if len(rec) < 3:
                continue
            start = float(rec[0])
            if start >= days * 86400:
                break
            try:
                cv = float(rec[2])
            except ValueError:
                cv = 1.0
            rows.append((start, float(rec[1]), cv))
    return rows


def elastic(deps: list[cs.Deployment], days: float, costs: cs.Costs, tokens: str = "p90") -> list[cs.Deployment]:
    """``deps`` with elastic KV: each one's booking schedule from its client's rates (same order, names)."""
    out = []
    for d in deps:
        pool, client = d.name.split(":")[0].split("/")
        path = os.path.join(TRACES, "servegen", pool, f"{client}-trace.csv")
        kv = ekv.schedule(read_load(path, days), kv_load(pool, costs, tokens), d.slice_bytes - d.weight_bytes)
        out.append(dataclasses.replace(d, kv=kv))
    return out


def deployments(seed: int, days: float) -> list[cs.Deployment]:
    rng = np.random.default_rng(seed)
    out = []
    for pool, (model, weights, slice_) in MODELS.items():
        for path in sorted(glob.glob(os.path.join(TRACES, "servegen", pool, "chunk-*-trace.csv"))):
            client = os.path.basename(path).split("-trace")[0]
            segs = cs.client_segments(read_client(path, days), rng)
            out.append(cs.Deployment(f"{pool}/{client}:{model}", weights, slice_, segs))
    return out


def run_seed(seed: int, args: argparse.Namespace, costs: cs.Costs, loads: np.ndarray) -> dict:
    t0 = time.monotonic()
    horizon = args.days * 86400.0
    train = min(args.train_days * 86400.0, horizon / 2)
    # the quota class that allows overcommit: deployments that slept most of the training days
    # it is the lower class (lendingPriority 0 vs 10): its wakes never displace the other class
    base_deps = deployments(seed, args.days)
    deps = base_deps
    hours = horizon / 3600.0
    gpu = args.gpu_gib * GIB
    rng = np.random.default_rng(10_000 + seed)
    today = cs.place(deps, gpu)
    cluster = cs.Cluster(today.gpus_used, gpu, host_bytes_per_node=args.host_gib * GIB)
    n = len(deps)
    out = {
        "zero": dict(cs.scale_to_zero(deps, args.idle_s, horizon, costs, loads, rng, train).summary(hours, n), gpus=today.gpus_used,
                     deployments_per_gpu=round(n / today.gpus_used, 3)),
        "keep": cs.keep_warm(deps, args.idle_s, horizon, costs, today.gpus_used, train).summary(hours, n),
    }
    ahead = cs.WakeAhead(hold_s=args.ahead_hold_s) if args.wake_ahead else None
    kv_of = {d.name: d.kv for d in elastic(base_deps, args.days, costs, args.kv_tokens)} if args.elastic_kv else {}
    by_idle = []
    for widle in sorted(set(args.warm_idle_s) | {args.idle_s}):
        # the warm class's idleSeconds: who may be overcommitted and who is up at placement follow it
        wdeps = [dataclasses.replace(d, overcommit=cs.asleep_fraction(d.segments, widle, train) >= args.sleepy)
                 for d in base_deps]
        wdeps = [dataclasses.replace(d, rank=(10, 0)[d.overcommit] if not args.oc_class_higher else (0, 10)[d.overcommit],
                                     idle_s=args.oc_idle_s if d.overcommit and args.oc_idle_s else None) for d in wdeps]
        sweep = []
        # placed when the evaluation starts, with the live books: a pod awake then is booked whole
        up = cs.awake_at(wdeps, train, widle)
        for ratio in args.overcommit:
            pl = cs.place(wdeps, gpu, ratio, costs.residual_bytes, awake=up, wake_reserve=args.wake_reserve)
            cl = dataclasses.replace(cluster, gpus=pl.gpus_used)
            r = cs.warm_tier(wdeps, cl, pl, widle, horizon, costs, train, live=not args.relocate,
                             relocate=args.relocate, ahead=ahead).summary(hours, n, quiet_ref_s=args.idle_s)
            r["warm_idle_s"] = widle
            r["overcommit"] = ratio
            r["sleep_booked_fraction"] = round(1.0 / ratio, 4)
            sweep.append(r)
            print(f"[coldstart] seed {seed} warm idle {widle:g} s x{ratio}: {pl.gpus_used} GPUs, p99 (after "
                  f"{args.idle_s:g} s quiet) {r['ttft_ref_p99_s']} s, own p99 {r['ttft_first_p99_s']} s, waited "
                  f"{r['waited_for_memory']}, evicted {r['evicted_to_zero']}, prewakes {r['prewakes']}/"
                  f"{r['prewake_hits']} hit", file=sys.stderr, flush=True)
        total = sum(d.slice_bytes for d in wdeps)
        # what lifts the ceiling instead: an awake engine holding only the KV cache it uses (kvcached-style
        # elastic KV; not modelled in the runs): its weights plus this share of its slice's KV part
        kv = {f"{k:g}": round(total / max(1.0, cs.awake_profile(
            [dataclasses.replace(d, slice_bytes=d.weight_bytes + k * (d.slice_bytes - d.weight_bytes)) for d in wdeps],
            widle, horizon)["peak_gib"] * GIB), 3) for k in (0.5, 0.25, 0.0)}
        by_idle.append({"warm_idle_s": widle, "overcommittable_deployments": sum(d.overcommit for d in wdeps),
                        "awake_memory": cs.awake_profile(wdeps, widle, horizon),
                        "bound_x_if_awake_kv_share": kv, "runs": sweep})
        if args.elastic_kv:
            edeps = [dataclasses.replace(d, kv=kv_of[d.name]) for d in wdeps]
            by_idle[-1]["awake_memory_elastic"] = cs.awake_profile(edeps, widle, horizon)
            by_idle[-1]["elastic_runs"] = elastic_sweep(edeps, up, widle, cluster, horizon, train, hours, n, costs,
                                                        ahead, args, seed)
        if widle == args.idle_s:
            deps = wdeps
            out["warm"] = sweep[0] if sweep and sweep[0]["overcommit"] == 1.0 else None
            out["warm_overcommit"] = sweep
    sweep = out["warm_overcommit"]
    ok = [r for r in sweep if r["ttft_first_p99_s"] <= args.target_p99_s]
    best = max(ok, key=lambda r: r["deployments_per_gpu"]) if ok else None
    keep = out["keep"]
    # "the same p99": the warm tier's own p99 at today's books (+5%), over every first request after
    # idleness (those that waited included); (b)'s 0.15 s no sleeping replica reaches (a wake moves weights)
    base_p99 = args.same_p99_s or (out["warm"]["ttft_first_p99_s"] if out["warm"] else None)
    same = [r for r in sweep if base_p99 is not None and r["ttft_first_p99_s"] <= base_p99 * 1.05]
    best_same = max(same, key=lambda r: r["deployments_per_gpu"]) if same else None
    out["targets"] = {
        "avoided_full_load_pct": out["warm"]["avoided_full_load_pct"] if out["warm"] else None,
        "idle_memory_vs_keep_pct": round(100.0 * out["warm"]["idle_gpu_gib_hours"] / keep["idle_gpu_gib_hours"], 2)
        if out["warm"] and keep["idle_gpu_gib_hours"] else None,
        "target_p99_s": args.target_p99_s,
        "best_overcommit_within_target": best["overcommit"] if best else None,
        "deployments_per_gpu_gain_vs_keep": round(best["deployments_per_gpu"] / keep["deployments_per_gpu"], 3) if best else None,
        "reserve_ran_out_at_best": best["waited_for_memory"] if best else None,
        "same_p99_s": base_p99,
        "best_overcommit_same_p99": best_same["overcommit"] if best_same else None,
        "deployments_per_gpu_gain_vs_keep_same_p99": round(best_same["deployments_per_gpu"] / keep["deployments_per_gpu"], 3)
        if best_same else None,
    }
    # every (warm idle, overcommit) at the reference's p99 over the same requests (after idle_s quiet)
    same_all = [r for b in by_idle for r in b["runs"] if base_p99 is not None and r["ttft_ref_p99_s"] <= base_p99 * 1.05]
    top = max(same_all, key=lambda r: (r["deployments_per_gpu"], r["warm_idle_s"])) if same_all else None
    for b in by_idle:
        ok = [r for r in b["runs"] if base_p99 is not None and r["ttft_ref_p99_s"] <= base_p99 * 1.05]
        bb = max(ok, key=lambda r: r["deployments_per_gpu"]) if ok else None
        b["best_same_p99"] = {k: bb[k] for k in SETTING_KEYS} if bb else None
        if bb:
            b["best_same_p99"]["gain_vs_keep"] = round(bb["deployments_per_gpu"] / keep["deployments_per_gpu"], 3)
    out["targets"]["best_setting_same_p99"] = dict({k: top[k] for k in SETTING_KEYS},
                                                  gain_vs_keep=round(top["deployments_per_gpu"] / keep["deployments_per_gpu"], 3)) if top else None
    out["warm_idle_sweep"] = by_idle
    if args.elastic_kv:
        edeps = [dataclasses.replace(d, kv=kv_of[d.name]) for d in base_deps]
        out["keep_elastic"] = keep_elastic(edeps, gpu, cluster, horizon, train, hours, n, costs, args)
        out["targets"].update(elastic_targets(out, by_idle, base_p99, costs))
    out["awake_memory"] = cs.awake_profile(deps, args.idle_s, horizon)
    out["overcommittable_deployments"] = sum(d.overcommit for d in deps)
    out["evaluated_from_s"] = train
    out["seconds"] = round(time.monotonic() - t0, 1)
    return out


def elastic_sweep(edeps: list[cs.Deployment], up: frozenset[str], widle: float, cluster: cs.Cluster, horizon: float,
                  train: float, hours: float, n: int, costs: cs.Costs, ahead, args: argparse.Namespace,
                  seed: int) -> list[dict]:
    """(c) with elastic KV: every ``--kv-booked`` x ``--overcommit``, placed and woken as the other runs."""
    out = []
    for f in args.kv_booked:
        for ratio in args.overcommit:
            pl = cs.place(edeps, cluster.gpu_bytes, ratio, costs.residual_bytes, awake=up,
                          wake_reserve=args.wake_reserve, kv_booked=f)
            cl = dataclasses.replace(cluster, gpus=pl.gpus_used)
            r = cs.warm_tier(edeps, cl, pl, widle, horizon, costs, train, live=not args.relocate,
                             relocate=args.relocate, ahead=ahead).summary(hours, n, quiet_ref_s=args.idle_s)
            r.update(warm_idle_s=widle, overcommit=ratio, sleep_booked_fraction=round(1.0 / ratio, 4), kv_booked=f)
            out.append(r)
            print(f"[coldstart] seed {seed} elastic KV, warm idle {widle:g} s, kv booked {f:g} x{ratio}: "
                  f"{pl.gpus_used} GPUs, p99 (after {args.idle_s:g} s quiet) {r['ttft_ref_p99_s']} s, growth waits "
                  f"{r['growth_waits']} (request delay p99 {r['request_growth_delay_p99_s']} s), wake waits "
                  f"{r['waited_for_memory']}", file=sys.stderr, flush=True)
    return out


def keep_elastic(edeps: list[cs.Deployment], gpu: float, cluster: cs.Cluster, horizon: float, train: float,
                 hours: float, n: int, costs: cs.Costs, args: argparse.Namespace) -> list[dict]:
    """(b) with the same elastic KV, for fairness: never asleep (its idle timer past the horizon), placed at
    each ``--kv-booked``; its risk is only growth waits (its first-token p99 stays (b)'s)."""
    never = [dataclasses.replace(d, overcommit=False, idle_s=10.0 * horizon) for d in edeps]
    out = []
    for f in args.kv_booked:
        pl = cs.place(never, gpu, 1.0, kv_booked=f)
        r = cs.warm_tier(never, dataclasses.replace(cluster, gpus=pl.gpus_used), pl, 10.0 * horizon, horizon, costs,
                         train, live=True, relocate=False).summary(hours, n)
        keys = ("gpus", "deployments_per_gpu", "growths", "growth_waits", "growth_waits_per_hour", "growth_wait_p99_s",
                "growth_wait_max_s", "requests_delayed_pct", "request_growth_delay_p99_s",
                "request_growth_delay_p999_s", "over_capacity_steps", "peak_gpu_used_pct")
        out.append(dict({k: r[k] for k in keys}, kv_booked=f))
    return out


def elastic_targets(out: dict, by_idle: list[dict], base_p99: float | None, costs: cs.Costs) -> dict:
    """The best elastic setting at the same p99, on both populations: the first requests after idleness
    (``ttft_ref_p99_s``) and every request (first token ``base_ttft_s`` plus its growth delay, p99)."""
    keep = out["keep"]["deployments_per_gpu"]
    bound = None if base_p99 is None else base_p99 * 1.05

    def same(r: dict) -> bool:
        return bound is not None and r["ttft_ref_p99_s"] <= bound and \
            costs.base_ttft_s + r["request_growth_delay_p99_s"] <= bound
    tops = []
    for b in by_idle:
        ok = [r for r in b["elastic_runs"] if same(r)]
        bb = max(ok, key=lambda r: (r["deployments_per_gpu"], r["kv_booked"])) if ok else None
        b["best_same_p99_elastic"] = dict({k: bb[k] for k in SETTING_KEYS + ELASTIC_KEYS},
                                          gain_vs_keep=round(bb["deployments_per_gpu"] / keep, 3)) if bb else None
        if bb:
            tops.append(bb)
    top = max(tops, key=lambda r: (r["deployments_per_gpu"], r["warm_idle_s"])) if tops else None
    ke = [k for k in out["keep_elastic"] if bound is not None and costs.base_ttft_s + k["request_growth_delay_p99_s"] <= bound]
    kbest = max(ke, key=lambda k: k["deployments_per_gpu"]) if ke else None
    return {
        "best_setting_same_p99_elastic": dict({k: top[k] for k in SETTING_KEYS + ELASTIC_KEYS},
                                              gain_vs_keep=round(top["deployments_per_gpu"] / keep, 3),
                                              gain_vs_keep_elastic=round(top["deployments_per_gpu"] / kbest["deployments_per_gpu"], 3)
                                              if kbest else None) if top else None,
        "keep_elastic_best_same_p99": kbest,
        "keep_elastic_gain_vs_keep": round(kbest["deployments_per_gpu"] / keep, 3) if kbest else None,
    }


#: what the JSON keeps of an elastic run where it names the best one
ELASTIC_KEYS = ("kv_booked", "growths", "growth_waits", "growth_waits_per_hour", "growth_wait_p50_s", "growth_wait_p99_s",
                "growth_wait_max_s", "requests_delayed_pct", "request_growth_delay_p99_s", "request_growth_delay_p999_s",
                "over_capacity_steps", "peak_gpu_used_pct")


#: what the JSON keeps of a setting's run where it names the best one
SETTING_KEYS = ("warm_idle_s", "overcommit", "gpus", "deployments_per_gpu", "ttft_ref_p50_s", "ttft_ref_p99_s",
                "ttft_ref_p999_s", "ttft_first_p99_s", "ttft_first_p999_s", "first_requests_after_idle", "wakes_per_hour",
                "waited_for_memory", "waited_pct", "evicted_to_zero", "host_peak_gib_per_node", "avoided_full_load_pct",
                "idle_gpu_gib_hours", "prewakes", "prewake_hits", "prewake_wasted")


def summary(per_seed: list[dict]) -> dict:
    """The headline figures, mean over seeds (what bench/run_all.py puts in SUMMARY.md)."""
    def mean(get) -> float | None:
        vals = [get(r) for r in per_seed if get(r) is not None]
        return round(float(np.mean(vals)), 3) if vals else None
    out: dict = {}
    for pol in ("zero", "keep", "warm"):
        for key in ("avoided_full_load_pct", "cold_starts_per_hour", "ttft_first_p50_s", "ttft_first_p99_s",
                    "idle_gpu_gib_hours", "waited_for_memory"):
            out[f"{pol}.{key}"] = mean(lambda r, p=pol, k=key: r[p][k] if r[p] else None)
    for key in ("idle_memory_vs_keep_pct", "best_overcommit_within_target", "deployments_per_gpu_gain_vs_keep",
                "reserve_ran_out_at_best", "best_overcommit_same_p99", "deployments_per_gpu_gain_vs_keep_same_p99"):
        out[f"targets.{key}"] = mean(lambda r, k=key: r["targets"][k])
    out["bound_x_any_placement"] = mean(lambda r: r["awake_memory"]["bound_x"])
    for b in per_seed[0].get("warm_idle_sweep", []):
        w = b["warm_idle_s"]
        pick = (lambda r, w=w: next(x for x in r["warm_idle_sweep"] if x["warm_idle_s"] == w))
        out[f"warm_idle_{w:g}.bound_x_any_placement"] = mean(lambda r: pick(r)["awake_memory"]["bound_x"])
        out[f"warm_idle_{w:g}.gain_vs_keep_same_p99"] = mean(
            lambda r: (pick(r)["best_same_p99"] or {}).get("gain_vs_keep"))
    out["targets.best_setting_gain_vs_keep_same_p99"] = mean(lambda r: (r["targets"]["best_setting_same_p99"] or {}).get("gain_vs_keep"))
    if "keep_elastic" in per_seed[0]:  # --elastic-kv only: the default output keeps its keys
        for b in per_seed[0]["warm_idle_sweep"]:
            w = b["warm_idle_s"]
            pick = (lambda r, w=w: next(x for x in r["warm_idle_sweep"] if x["warm_idle_s"] == w))
            out[f"warm_idle_{w:g}.elastic.bound_x_any_placement"] = mean(lambda r: pick(r)["awake_memory_elastic"]["bound_x"])
            out[f"warm_idle_{w:g}.elastic.gain_vs_keep_same_p99"] = mean(
                lambda r: (pick(r)["best_same_p99_elastic"] or {}).get("gain_vs_keep"))
        best = (lambda r: r["targets"]["best_setting_same_p99_elastic"] or {})
        out["targets.elastic.best_setting_gain_vs_keep_same_p99"] = mean(lambda r: best(r).get("gain_vs_keep"))
        out["targets.elastic.best_setting_gain_vs_keep_elastic"] = mean(lambda r: best(r).get("gain_vs_keep_elastic"))
        out["targets.elastic.keep_elastic_gain_vs_keep"] = mean(lambda r: r["targets"]["keep_elastic_gain_vs_keep"])
    return out


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    first = result["per_seed"][0]
    fig, ax = plt.subplots(1, 3, figsize=(15, 4.2))
    labels = {"zero": "(a) scale to zero", "keep": "(b) keep warm (minScale 1)", "warm": "(c) warm tier"}
    for key in ("zero", "keep", "warm"):
        r = first[key]
        ax[0].bar(labels[key], r["ttft_first_p99_s"], color={"zero": "C3", "keep": "C0", "warm": "C2"}[key])
        ax[0].text(labels[key], r["ttft_first_p99_s"], f"p50 {r['ttft_first_p50_s']:.1f} s\np99 {r['ttft_first_p99_s']:.1f} s",
                   ha="center", va="bottom", fontsize=8)
    ax[0].set_yscale("log")
    ax[0].set_ylabel("first token after idleness, p99 (s, log)")
    ax[0].tick_params(axis="x", labelsize=8)
    ax[0].set_title("First request after idleness", pad=22)
    for key in ("keep", "warm"):
        ax[1].bar(labels[key], first[key]["idle_gpu_gib_hours"], color={"keep": "C0", "warm": "C2"}[key])
    ax[1].set_ylabel("GPU GiB-hours held by idle pods (14 days)")
    ax[1].tick_params(axis="x", labelsize=8)
    ax[1].set_title(f"Idle memory: warm = {first['targets']['idle_memory_vs_keep_pct']}% of keep")
    sw = first["warm_overcommit"]
    ax[2].plot([r["deployments_per_gpu"] for r in sw], [r["ttft_first_p99_s"] for r in sw], "o-", color="C2",
               label="(c) warm tier, overcommit 1..")
    ax[2].plot([r["deployments_per_gpu"] for r in sw], [r.get("ttft_first_p999_s", np.nan) for r in sw], "^:",
               color="C2", alpha=0.5, label="(c) p99.9")
    for r in sw:
        ax[2].annotate(f"x{r['overcommit']:g}", (r["deployments_per_gpu"], r["ttft_first_p99_s"]), fontsize=7)
    for k, b in enumerate(x for x in first.get("warm_idle_sweep", []) if x["warm_idle_s"] != result["params"]["idle_s"]):
        ax[2].plot([r["deployments_per_gpu"] for r in b["runs"]], [r["ttft_ref_p99_s"] for r in b["runs"]], "x--",
                   color=f"C{4 + k}", alpha=0.7, label=f"(c) sleeps after {b['warm_idle_s']:g} s (p99 after "
                                                       f"{result['params']['idle_s']:g} s quiet)")
    for k, b in enumerate(x for x in first.get("warm_idle_sweep", []) if x.get("elastic_runs")):
        for f in sorted({r["kv_booked"] for r in b["elastic_runs"]}, reverse=True)[:1]:  # books at whole slices
            runs = [r for r in b["elastic_runs"] if r["kv_booked"] == f]
            ax[2].plot([r["deployments_per_gpu"] for r in runs], [r["ttft_ref_p99_s"] for r in runs], "+-",
                       color=f"C{8 + k % 2}", alpha=0.8, label=f"(c) elastic KV, sleeps after {b['warm_idle_s']:g} s, "
                                                           f"KV booked {f:g}")
    ax[2].plot([first["keep"]["deployments_per_gpu"]], [first["keep"]["ttft_first_p99_s"]], "s", color="C0", label="(b) keep")
    ax[2].axhline(result["params"]["target_p99_s"], ls="--", color="gray", label="p99 target")
    keep_dpg = first["keep"]["deployments_per_gpu"]
    ax[2].axvline(2 * keep_dpg, ls=":", color="C3", label="2x (b): the issue's target")
    if first["awake_memory"].get("bound_x"):
        ax[2].axvline(first["awake_memory"]["bound_x"] * keep_dpg, ls="-.", color="C1",
                      label="bound: all slices / peak awake")
    ax[2].set_yscale("log")
    ax[2].set_xlabel("deployments per GPU")
    ax[2].set_ylabel("first token p99 (s, log)")
    ax[2].legend(fontsize=6.5, loc="lower right")
    ax[2].set_title("Deployments that fit at the p99 target")
    fig.suptitle(f"ServeGen, {len(first and result['per_seed'])} seed(s), idle timer {result['params']['idle_s']:.0f} s, seed 0 shown")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--first-seed", type=int, default=0, help="run seeds first-seed .. first-seed + seeds - 1")
    ap.add_argument("--idle-s", type=float, default=300.0,
                    help="idle timer of scale to zero (a), and the quiet that makes a first request after idleness "
                         "in every policy's reference p99 (ttft_ref_*)")
    ap.add_argument("--warm-idle-s", type=float, nargs="*", default=[30.0, 60.0, 120.0, 300.0],
                    help="the warm tier's idle-before-sleep (its class's idleSeconds), swept; --idle-s is always run")
    ap.add_argument("--same-p99-s", type=float, default=None,
                    help="the first-token p99 densities are compared at (default: the warm tier's own at --idle-s "
                         "and overcommit 1)")
    ap.add_argument("--ahead-hold-s", type=float, default=None,
                    help="with --wake-ahead: how long past the forecast an engine woken ahead waits for its request "
                         "(default: its idle timer)")
    ap.add_argument("--wake-ahead", action="store_true",
                    help="wake a sleeping engine ahead of its forecast next request when memory is free "
                         "(vramshare.coldstart.WakeAhead)")
    ap.add_argument("--elastic-kv", action="store_true",
                    help="also run (c) and (b) with elastic KV for awake engines (vramshare.elastic_kv); the default "
                         "runs are unchanged")
    ap.add_argument("--kv-tokens", choices=sorted(KV_TOKENS), default="p90",
                    help="with --elastic-kv: which ServeGen token statistic sets a request's KV (see KV_TOKENS)")
    ap.add_argument("--kv-booked", type=float, nargs="*", default=[1.0, 0.75, 0.5],
                    help="with --elastic-kv: the share of its slice's KV part an elastic pod is booked at when placed")
    ap.add_argument("--days", type=float, default=14.0)
    ap.add_argument("--gpu-gib", type=float, default=80.0)
    ap.add_argument("--host-gib", type=float, default=1536.0, help="host RAM per 8-GPU node for sleeping weights")
    ap.add_argument("--train-days", type=float, default=2.0,
                    help="days that decide which deployments may be overcommitted; evaluation starts after them")
    ap.add_argument("--sleepy", type=float, default=0.5,
                    help="asleep share over the training days from which a deployment may be overcommitted")
    ap.add_argument("--target-p99-s", type=float, default=5.0)
    ap.add_argument("--overcommit", type=float, nargs="*", default=[1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0],
                    help="1 / sleepBookedFraction of the overcommitted class")
    ap.add_argument("--oc-idle-s", type=float, default=None,
                    help="the overcommitted class's idleSeconds under the warm tier (default: --idle-s)")
    ap.add_argument("--oc-class-higher", action="store_true",
                    help="give the overcommitted class the higher lendingPriority (its wakes may displace idle "
                         "pods of the other class; default: it is the lower class)")
    ap.add_argument("--wake-reserve", type=int, default=1, help="the class's wakeReserve (wakes per GPU at once)")
    ap.add_argument("--relocate", action="store_true",
                    help="last round's model: a wake without memory restarts on another GPU (the live broker "
                         "does not; default: the live rule, it waits and displaces only lower classes)")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--name", default="coldstart")
    ap.add_argument("--quick", action="store_true", help="1 seed, 2 days (smoke run; bench/run_all.py --quick)")
    args = ap.parse_args()
    if args.quick:
        args.seeds, args.days, args.name = 1, 2.0, f"{args.name}-quick"
    costs = cs.Costs()
    loads = genai_loads_s()
    per_seed = [run_seed(seed, args, costs, loads) for seed in range(args.first_seed, args.first_seed + args.seeds)]
    result = {
        "params": {**{k: v for k, v in vars(args).items()
                      if k not in ("out", "name") and (args.elastic_kv or k not in ("elastic_kv", "kv_booked", "kv_tokens"))
                      and (args.first_seed or k != "first_seed")},
                   "models": {p: {"model": m, "weight_gib": w / GIB, "slice_gib": s / GIB} for p, (m, w, s) in MODELS.items()},
                   "costs": {k: (v / GIB if k.endswith("bytes") or k.endswith("bytes_per_s") else v)
                             for k, v in dataclasses.asdict(costs).items()},
                   "costs_units": "*_bytes in GiB, *_bytes_per_s in GiB/s, *_s in seconds",
                   "genai_loads": {"n": len(loads), "p50_s": round(float(np.percentile(loads, 50)), 2),
                                   "p99_s": round(float(np.percentile(loads, 99)), 2)},
                   **({"kv_load": {p: dict(dataclasses.asdict(kv_load(p, costs, args.kv_tokens)),
                                           request_s=kv_load(p, costs, args.kv_tokens).request_s,
                                           tokens_per_request=kv_load(p, costs, args.kv_tokens).tokens_per_request)
                                   for p in MODELS},
                       "kv_load_units": "bytes_per_token in bytes, *_s in seconds, tokens in tokens"}
                      if args.elastic_kv else {})},
        "summary": summary(per_seed),
        "per_seed": per_seed,
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{args.name}.json"), "w", encoding="utf-8") as fh:
        json.dump(result, fh, indent=2)
    plot(result, os.path.join(args.out, f"{args.name}.png"))
    print(json.dumps([{k: s[k] for k in ("zero", "keep", "warm", "targets")} for s in per_seed], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
