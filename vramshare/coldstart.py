"""Cold starts on shared GPUs: the pure core of the multi-model replay (issue 23). No I/O.

Each model deployment is one replica that serves bursts of requests and sits idle in between. Three ways
to run it are compared on the same arrivals:

* ``zero``: Knative scale to zero; the first request after ``idle_s`` of quiet pays a full load.
* ``keep``: a warm pod (``minScale: 1``) that keeps its whole GPU slice while idle.
* ``warm``: vramshare's warm tier: after ``idle_s`` of quiet the engine sleeps (vLLM sleep level 1: weights
  to host RAM, KV cache freed), the pod keeps only ``residual`` bytes of GPU memory and the rest is lent
  to co-tenants; the first request takes the memory back from the co-tenants, wakes the engine (weights
  over host-to-GPU bandwidth) and is served. Sleeping weights use the node's host RAM; past the node's
  budget the least recently used sleeper is dropped (level 2 / exit) and its next start loads its files
  from the node's disk cache (residency: it restarts where its files are).

Placement (:func:`place`) books each pod at its slice divided by the GPU's ``overcommit`` ratio (issue 23
item 5: an admin's choice per quota class; 1.0 is today's books). A wake that finds no memory on its GPU
waits (FIFO) until a co-tenant sleeps; it never fails. Every constant is a field of :class:`Costs` with
its source. With elastic KV (``Deployment.kv``, :mod:`vramshare.elastic_kv`) an awake engine holds its
weights plus the KV its load uses instead of its whole slice, and a growth that finds no memory waits in
the same queue as the wakes.
"""
from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

from vramshare import elastic_kv as ekv

GIB = 1 << 30
WINDOW_S = 600.0  # ServeGen: one row per 10-minute window
#: arrivals closer than this are one stretch of activity (far below any idle timer)
SEGMENT_GAP_S = 30.0
#: windows expecting more arrivals than this are one stretch from first to last arrival (gaps > 30 s at
#: > 3 requests/s have probability far below the sampling noise); below it every arrival is drawn
FULL_SAMPLING_MAX = 2000


@dataclass(frozen=True)
class Costs:
    """The replay's constants. Sources: ``shared/reference/coldstart-mig-anchors.md`` unless noted."""

    #: full load = a draw from the GenAI base-model load latencies (p50 22.7 s, p99 51.9 s; Stable
    #: Diffusion models, a few GB) scaled by ``weight_bytes / load_ref_bytes``. 8 GiB makes a 15 GiB 8B
    #: model's median 42.6 s, DeepServe's measured Llama3-8B scale-up (42.1 s).
    load_ref_bytes: float = 8 * GIB
    #: wake = weights / host-to-GPU bandwidth + fixed part. llm-d fast model actuation: level-1 wake about
    #: 3 s for 64 GiB, i.e. ~21 GiB/s effective over PCIe Gen5; 20 GiB/s taken.
    h2d_bytes_per_s: float = 20 * GIB
    #: fixed part of a wake (re-creating the KV cache pool, remapping cumem): assumption, to be measured
    wake_fixed_s: float = 0.3
    #: GPU memory a sleeping engine still holds (CUDA context, graphs, allocator pool): assumption; vLLM
    #: logs it at sleep ("... GiB memory is still in use"), the gpu test measures it
    residual_bytes: float = 1.5 * GIB
    #: taking lent memory back from awake co-tenants before a wake (fast channel + KV shrink): assumption
    reclaim_s: float = 0.5
    #: prefill of the first request once weights are on the GPU (same under every policy): assumption
    base_ttft_s: float = 0.15
    #: a wake that finds no memory sends to sleep early the co-tenants (overcommitted ones only) that had
    #: no request for this long, instead of waiting out their idle timer: design choice
    displace_idle_s: float = 30.0
    #: a wake that found no memory waits this long for a co-tenant to sleep, then its replica restarts on
    #: any GPU with room (a cold start from the node's files): design choice
    max_wait_s: float = 10.0
    #: restart from the node's disk cache after a sleeper was dropped: engine start (process, compile
    #: cache hit, CUDA graphs; assumption) + weights from local NVMe (4 GiB/s; assumption)
    engine_start_s: float = 20.0
    disk_bytes_per_s: float = 4 * GIB

    def full_load_s(self, weight_bytes: float, genai_draw_s: float) -> float:
        return genai_draw_s * weight_bytes / self.load_ref_bytes

    def wake_s(self, weight_bytes: float) -> float:
        return self.wake_fixed_s + weight_bytes / self.h2d_bytes_per_s

    def restart_s(self, weight_bytes: float) -> float:
        return self.engine_start_s + weight_bytes / self.disk_bytes_per_s


@dataclass(frozen=True)
class Deployment:
    """One model deployment: its weights, its GPU slice (weights + KV cache) and when it is busy."""

    name: str
    weight_bytes: float
    slice_bytes: float
    segments: np.ndarray  # [k, 2] (first, last) arrival of each stretch of activity, seconds, sorted
    #: may the books count it below its slice (item 5)? Its quota class's choice; the bench sets it for
    #: deployments that slept most of a training period (a pod that never sleeps gains nothing from it)
    overcommit: bool = True
    #: its quota class's lendingPriority: a wake that finds no memory may displace (sleep early) only
    #: co-tenants of a strictly lower class, as the live broker does (``live=True``)
    rank: int = 0
    #: its class's idleSeconds under the warm tier (None: the replay's ``idle_s``)
    idle_s: float | None = None
    #: elastic KV (:mod:`vramshare.elastic_kv`): ``[k, 3]`` rows (window start, rate, booked KV bytes); an
    #: awake engine holds its weights plus the booked KV, growing on demand up to its slice. None: it holds
    #: its whole slice while awake (today's engines)
    kv: np.ndarray | None = None

    def awake_bytes(self, t: float) -> float:
        """What its engine holds awake at ``t`` (:func:`vramshare.elastic_kv.awake_bytes`)."""
        return ekv.awake_bytes(self.weight_bytes, self.slice_bytes, self.kv, t)

    def request_bytes(self, kv_booked: float = 1.0) -> float:
        """What the books count it at when placed: its slice, or with elastic KV its weights plus
        ``kv_booked`` of its slice's KV part (the class's choice, like ``sleepBookedFraction``)."""
        if self.kv is None or kv_booked >= 1.0:
            return self.slice_bytes
        return self.weight_bytes + max(0.0, kv_booked) * (self.slice_bytes - self.weight_bytes)


@dataclass(frozen=True)
class Cluster:
    gpus: int
    gpu_bytes: float
    gpus_per_node: int = 8
    host_bytes_per_node: float = 1536 * GIB  # host RAM for sleeping weights (of 2 TiB on a DGX H100)

    @property
    def nodes(self) -> int:
        return -(-self.gpus // self.gpus_per_node)


# -- arrivals ---------------------------------------------------------------------------------------------
def _scale_for_mean(dist: str, shape: float, mean: float) -> float:
    if dist == "Weibull":
        return mean / math.gamma(1.0 + 1.0 / shape)
    return mean / shape  # Gamma (and the default): mean = shape * scale


def _draw(dist: str, shape: float, scale: float, n: int, rng: np.random.Generator) -> np.ndarray:
    if dist == "Weibull":
        return scale * rng.weibull(shape, n)
    return rng.gamma(shape, scale, n)


def window_arrivals(rate: float, dist: str, shape: float, rng: np.random.Generator,
                    window_s: float = WINDOW_S) -> np.ndarray:
    """Arrival offsets in one window: a renewal process at mean ``rate`` with the window's fitted
    inter-arrival law (ServeGen's ``param1`` is the shape; the scale is set so the mean is ``1/rate``: the
    published scales are fitted on normalised gaps). Busy windows return only their first and last."""
    if rate <= 0:
        return np.zeros(0)
    if not (shape > 0 and math.isfinite(shape)):
        dist, shape = "Gamma", 1.0  # no fit published: Poisson
    shape = max(shape, 0.05)  # shapes below this put all mass at 0 and blow up the variance
    scale = _scale_for_mean(dist, shape, 1.0 / rate)
    expected = rate * window_s
    if expected > FULL_SAMPLING_MAX:
        first = min(float(_draw(dist, shape, scale, 1, rng)[0]), window_s)
        last = max(window_s - float(_draw(dist, shape, scale, 1, rng)[0]), first)
        return np.array([first, last])
    out: list[np.ndarray] = []
    t = 0.0
    while t < window_s:
        gaps = _draw(dist, shape, scale, int(expected * 1.5) + 16, rng)
        times = t + np.cumsum(gaps)
        out.append(times[times < window_s])
        t = float(times[-1])
    return np.concatenate(out)


def segments_of(arrivals: np.ndarray, gap_s: float = SEGMENT_GAP_S) -> np.ndarray:
    """``[k, 2]`` (first, last) of the stretches of sorted ``arrivals`` whose gaps are below ``gap_s``."""
    if len(arrivals) == 0:
        return np.zeros((0, 2))
    cut = np.flatnonzero(np.diff(arrivals) >= gap_s)
    starts = np.concatenate(([0], cut + 1))
    ends = np.concatenate((cut, [len(arrivals) - 1]))
    return np.stack([arrivals[starts], arrivals[ends]], axis=1)


def client_segments(rows: Iterable[tuple[float, float, str, float]], rng: np.random.Generator,
                    window_s: float = WINDOW_S) -> np.ndarray:
    """Stretches of activity of one ServeGen client from its rows ``(window_start, rate, dist, shape)``."""
    parts = [start + window_arrivals(rate, dist, shape, rng, window_s) for start, rate, dist, shape in rows if rate > 0]
    return segments_of(np.concatenate(parts)) if parts else np.zeros((0, 2))


def busy_intervals(segments: np.ndarray, idle_s: float) -> np.ndarray:
    """``[m, 2]`` (first request, last request + ``idle_s``): when a replica with an idle timer of
    ``idle_s`` is up. Stretches closer than ``idle_s`` merge. Each row's start is a first request after
    idleness."""
    if len(segments) == 0:
        return np.zeros((0, 2))
    cut = np.flatnonzero(segments[1:, 0] - segments[:-1, 1] >= idle_s)
    starts = np.concatenate(([0], cut + 1))
    ends = np.concatenate((cut, [len(segments) - 1]))
    return np.stack([segments[starts, 0], segments[ends, 1] + idle_s], axis=1)


def awake_profile(deps: Sequence[Deployment], idle_s: float, horizon: float) -> dict:
    """GPU memory held by awake replicas over time (every replica sleeps ``idle_s`` after its last request):
    its peak, time-weighted p99 and mean, against the sum of all slices. ``bound_x`` = total / peak is the
    most deployments per GPU any placement reaches against keeping every slice, without a wake ever
    waiting, even one that knew the future and moved replicas freely."""
    ev: list[tuple[float, float]] = []
    for d in deps:
        for s, e in busy_intervals(d.segments, idle_s):
            if s >= horizon:
                continue
            e = float(min(e, horizon))
            if d.kv is None:
                ev += [(float(s), d.slice_bytes), (e, -d.slice_bytes)]
                continue
            # elastic: its weights plus its booked KV, stepping at the window starts inside the interval
            cuts = [float(s)] + [float(x) for x in ekv.change_times(d.kv) if s < x < e]
            level = [d.awake_bytes(x) for x in cuts]
            ev.append((cuts[0], level[0]))
            ev += [(x, b - a) for x, a, b in zip(cuts[1:], level, level[1:])]
            ev.append((e, -level[-1]))
    total = float(sum(d.slice_bytes for d in deps))
    if not ev:
        return {"total_gib": total / GIB, "peak_gib": 0.0, "p99_gib": 0.0, "mean_gib": 0.0, "bound_x": None}
    ev.sort()
    t = np.array([x for x, _ in ev])
    level = np.cumsum([y for _, y in ev])
    dur = np.diff(np.append(t, horizon))
    order = np.argsort(level)
    cum = np.cumsum(dur[order]) / max(dur.sum(), 1e-9)
    p99 = float(level[order][min(len(order) - 1, int(np.searchsorted(cum, 0.99)))])
    peak = float(level.max())
    half = float(dur[level > total / 2].sum() / max(dur.sum(), 1e-9))
    return {"total_gib": round(total / GIB, 1), "peak_gib": round(peak / GIB, 1), "p99_gib": round(p99 / GIB, 1),
            "mean_gib": round(float((level * dur).sum() / max(dur.sum(), 1e-9)) / GIB, 1),
            "bound_x": round(total / peak, 3) if peak > 0 else None,
            "time_above_half_pct": round(100.0 * half, 2)}


# -- placement --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Placement:
    gpu_of: dict[str, int]  # deployment -> GPU index (node = index // gpus_per_node)
    gpus_used: int


def booked_bytes(d: Deployment, overcommit: float) -> float:
    """What the books count a pod at: its slice, or its slice / ``overcommit`` where its class allows."""
    return d.slice_bytes / overcommit if d.overcommit and overcommit > 1.0 else d.slice_bytes


def place(deployments: Sequence[Deployment], gpu_bytes: float, overcommit: float = 1.0,
          residual_bytes: float = 0.0, max_gpus: int = 1 << 16, awake: frozenset[str] = frozenset(),
          wake_reserve: int = 1, kv_booked: float = 1.0) -> Placement:
    """First fit decreasing by slice, with the live books' rule (:func:`vramshare.overcommit.books`, the
    one the node and the extender use): a pod of the overcommitted class that sleeps at placement is
    booked at ``slice / overcommit`` (its class's ``sleepBookedFraction`` = 1 / ``overcommit``, never below
    ``residual_bytes``), while each GPU keeps room for the ``wake_reserve`` largest wakes; every other pod,
    and one that is ``awake`` when placed, is booked whole. So ``wake_reserve`` wakes at a time always find
    memory; more at once wait. ``overcommit`` 1.0 is today's books (every slice). ``kv_booked``: a pod with
    elastic KV counts as its weights plus that share of its slice's KV part (:meth:`Deployment.request_bytes`)
    in place of its slice; a growth past it that finds no memory waits (:func:`warm_tier`)."""
    from vramshare import overcommit as oc
    req = {d.name: d.request_bytes(kv_booked) for d in deployments}
    order = sorted(deployments, key=lambda d: (-req[d.name], d.name))
    firm: list[list[float]] = []
    sleepers: list[list[oc.Sleeper]] = []
    gpu_of: dict[str, int] = {}
    fraction = 1.0 / overcommit if overcommit > 1.0 else 1.0
    for d in order:
        asleep = d.overcommit and overcommit > 1.0 and d.name not in awake
        me = oc.Sleeper("g", req[d.name], residual_bytes, fraction, wake_reserve) if asleep else None
        for g in range(len(firm)):
            f = firm[g] if me else firm[g] + [req[d.name]]
            ss = sleepers[g] + [me] if me else sleepers[g]
            if oc.books(f, ss) <= gpu_bytes + 1e-6:
                break
        else:
            if len(firm) >= max_gpus:
                raise ValueError(f"{d.name}: no GPU of {max_gpus} has room")
            firm.append([]), sleepers.append([])
            g = len(firm) - 1
        if me:
            sleepers[g].append(me)
        else:
            firm[g].append(req[d.name])
        gpu_of[d.name] = g
    return Placement(gpu_of, len(firm))


def awake_at(deps: Sequence[Deployment], t: float, idle_s: float) -> frozenset[str]:
    """The deployments whose replica is up at ``t`` (a request within the last ``idle_s``)."""
    out = set()
    for d in deps:
        iv = busy_intervals(d.segments, d.idle_s or idle_s)
        k = int(np.searchsorted(iv[:, 0], t, side="right")) - 1 if len(iv) else -1
        if k >= 0 and iv[k, 1] > t:
            out.add(d.name)
    return frozenset(out)


def asleep_fraction(segments: np.ndarray, idle_s: float, until_s: float) -> float:
    """Share of ``[0, until_s)`` a replica with idle timer ``idle_s`` would have slept."""
    iv = busy_intervals(segments[segments[:, 0] < until_s] if len(segments) else segments, idle_s)
    return 1.0 - _busy_s(iv, until_s) / until_s if until_s > 0 else 0.0


# -- the three policies -----------------------------------------------------------------------------------
@dataclass
class PolicyResult:
    """Per policy: first requests after idleness and what they cost; memory held while idle."""

    policy: str
    ttft_s: list[float] = field(default_factory=list)  # first request after idleness, modeled
    full_loads: int = 0  # first requests that paid a full load (or a restart from disk)
    wakes: int = 0
    waited_for_memory: int = 0
    wait_s: list[float] = field(default_factory=list)
    reclaims: int = 0  # wakes that took lent memory back from awake co-tenants first
    evictions: int = 0  # sleepers dropped for host RAM
    relocations: int = 0  # wakes that found no memory and restarted on another GPU
    displaced: int = 0  # idle co-tenants sent to sleep early to make room for a wake
    idle_bytes_s: float = 0.0  # GPU memory x time held by pods with no request for idle_s
    busy_bytes_s: float = 0.0
    gpus: int = 0
    #: per entry of ``ttft_s``: how long its deployment had been quiet before it (inf: no request before),
    #: so every policy and idle timer can be compared on the same requests (:meth:`summary`'s ``quiet_ref_s``)
    quiet_s: list[float] = field(default_factory=list)
    prewakes: int = 0  # wake-ahead: engines woken before a forecast request (memory was free)
    prewake_hits: int = 0  # ... whose request came while they were up (served without a wake in its path)
    prewake_wasted: int = 0  # ... that slept again with no request, or were sent to sleep for a real wake
    host_peak_bytes: float = 0.0  # most host RAM any node's sleeping weights held at once
    #: elastic KV (:mod:`vramshare.elastic_kv`): reported only when some deployment has it
    elastic: bool = False
    growths: int = 0  # an awake engine's booked KV rose (a window's use grew)
    growth_waits: int = 0  # ... and its GPU had not the memory: it waited like a wake
    growth_wait_s: list[float] = field(default_factory=list)  # how long each waited (censored at the horizon)
    #: per growth wait: (its seconds, the requests that arrived while it waited and were delayed by it)
    growth_delays: list[tuple[float, float]] = field(default_factory=list)
    requests_total: float = 0.0  # requests of the elastic deployments over the evaluated period (rates x time)
    #: steps after which a GPU's engines held more than the GPU (the invariant: never)
    over_capacity: int = 0
    peak_gpu_frac: float = 0.0  # the most any GPU's engines held at once, as a share of the GPU

    def record(self, ttft: float, quiet: float) -> None:
        self.ttft_s.append(ttft)
        self.quiet_s.append(quiet)

    def summary(self, hours: float, deployments: int, quiet_ref_s: float | None = None) -> dict:
        """``quiet_ref_s``: also the first-token percentiles over only the requests that came after at
        least that long without one (``ttft_ref_*``): the same requests under any idle timer."""
        t = np.asarray(self.ttft_s) if self.ttft_s else np.zeros(1)
        n = len(self.ttft_s)
        pct = (lambda q: round(float(np.percentile(t, q)), 3))
        ref: dict = {}
        if quiet_ref_s is not None:
            q = np.asarray(self.quiet_s) if len(self.quiet_s) == n else np.full(n, np.inf)
            tr = t[q >= quiet_ref_s] if n else np.zeros(0)
            tr = tr if len(tr) else np.zeros(1)
            ref = {"ttft_ref_quiet_s": quiet_ref_s, "ttft_ref_n": int((q >= quiet_ref_s).sum()) if n else 0,
                   **{f"ttft_ref_{k}_s": round(float(np.percentile(tr, v)), 3)
                      for k, v in (("p50", 50), ("p99", 99), ("p999", 99.9))}}
        return {
            "policy": self.policy, "deployments": deployments, "gpus": self.gpus,
            "deployments_per_gpu": round(deployments / self.gpus, 3) if self.gpus else None,
            "first_requests_after_idle": n,
            "avoided_full_load_pct": round(100.0 * (n - self.full_loads) / n, 2) if n else None,
            "cold_starts_per_hour": round(self.full_loads / hours, 3),
            "ttft_first_p50_s": pct(50), "ttft_first_p90_s": pct(90), "ttft_first_p99_s": pct(99),
            "ttft_first_p999_s": pct(99.9), "ttft_first_max_s": round(float(t.max()), 3),
            "wakes": self.wakes, "reclaims_from_cotenants": self.reclaims,
            "waited_for_memory": self.waited_for_memory,
            "waited_pct": round(100.0 * self.waited_for_memory / n, 3) if n else None,
            "wait_p99_s": round(float(np.percentile(self.wait_s, 99)), 3) if self.wait_s else 0.0,
            "evicted_to_zero": self.evictions, "relocated": self.relocations,
            "displaced_early_sleeps": self.displaced,
            "idle_gpu_gib_hours": round(self.idle_bytes_s / GIB / 3600, 1),
            "busy_gpu_gib_hours": round(self.busy_bytes_s / GIB / 3600, 1),
            "wakes_per_hour": round(self.wakes / hours, 2),
            "prewakes": self.prewakes, "prewake_hits": self.prewake_hits, "prewake_wasted": self.prewake_wasted,
            "host_peak_gib_per_node": round(self.host_peak_bytes / GIB, 1),
            **ref, **(self._elastic_summary(hours) if self.elastic else {}),
        }

    def _elastic_summary(self, hours: float) -> dict:
        """Growths of awake engines' KV, how often and how long they waited for memory, and the delay
        that added to requests (:func:`vramshare.elastic_kv.delay_quantile`)."""
        w = np.asarray(self.growth_wait_s) if self.growth_wait_s else np.zeros(1)
        delayed = sum(n for _, n in self.growth_delays)
        return {
            "elastic_kv": True, "growths": self.growths, "growth_waits": self.growth_waits,
            "growth_waits_per_hour": round(self.growth_waits / hours, 3),
            "growth_wait_p50_s": round(float(np.percentile(w, 50)), 3),
            "growth_wait_p99_s": round(float(np.percentile(w, 99)), 3),
            "growth_wait_max_s": round(float(w.max()), 3),
            "requests_total": round(self.requests_total),
            "requests_delayed_by_growth": round(delayed),
            "requests_delayed_pct": round(100.0 * delayed / self.requests_total, 4) if self.requests_total else None,
            "request_growth_delay_p99_s": round(ekv.delay_quantile(self.growth_delays, self.requests_total, 0.99), 3),
            "request_growth_delay_p999_s": round(ekv.delay_quantile(self.growth_delays, self.requests_total, 0.999), 3),
            "over_capacity_steps": self.over_capacity,
            "peak_gpu_used_pct": round(100.0 * self.peak_gpu_frac, 2),
        }


def _counted(start: float, count_from: float) -> bool:
    """First requests before ``count_from`` are not counted: the trace's first stretch has no known past,
    and a training period (what decided who is overcommitted) is not evaluated on."""
    return start >= count_from


def quiet_before(segments: np.ndarray, t: float) -> float:
    """How long the deployment had sent nothing before its stretch starting at ``t`` (inf: nothing before)."""
    k = int(np.searchsorted(segments[:, 0], t, side="left")) - 1 if len(segments) else -1
    return float(t - segments[k, 1]) if k >= 0 else math.inf


def _busy_s(iv: np.ndarray, horizon: float) -> float:
    return float(np.minimum(iv[:, 1], horizon).sum() - iv[:, 0].sum()) if len(iv) else 0.0


def scale_to_zero(deps: Sequence[Deployment], idle_s: float, horizon: float, costs: Costs,
                  genai_s: np.ndarray, rng: np.random.Generator, count_from: float | None = None) -> PolicyResult:
    """(a) every first request after ``idle_s`` pays a full load (a GenAI draw scaled by weight bytes)."""
    res = PolicyResult("zero")
    for d in deps:
        iv = busy_intervals(d.segments, idle_s)
        res.busy_bytes_s += d.slice_bytes * _busy_s(iv, horizon)
        for s, _ in iv:
            if _counted(s, idle_s if count_from is None else count_from):
                res.record(costs.full_load_s(d.weight_bytes, float(rng.choice(genai_s))) + costs.base_ttft_s,
                           quiet_before(d.segments, s))
                res.full_loads += 1
    return res


def keep_warm(deps: Sequence[Deployment], idle_s: float, horizon: float, costs: Costs, gpus: int,
              count_from: float | None = None) -> PolicyResult:
    """(b) ``minScale: 1``: every pod keeps its slice; the first request after idleness is served at once."""
    res = PolicyResult("keep", gpus=gpus)
    for d in deps:
        iv = busy_intervals(d.segments, idle_s)
        busy = _busy_s(iv, horizon)
        res.busy_bytes_s += d.slice_bytes * busy
        res.idle_bytes_s += d.slice_bytes * (horizon - busy)
        for s, _ in iv:
            if _counted(s, idle_s if count_from is None else count_from):
                res.record(costs.base_ttft_s, quiet_before(d.segments, s))
    return res


@dataclass(frozen=True)
class WakeAhead:
    """Wake a sleeping engine before its forecast next request (issue 23, wake ahead), only when its GPU
    has the memory free beyond the wake reserve and no wake waits there; a real wake that needs the
    memory sends a woken-ahead engine with no request back to sleep first. The forecast uses only the
    past: the ``quantile`` of the deployment's last ``history`` quiet gaps (last request to the next
    first request). The engine is woken ``lead_s`` plus its wake time before the forecast and stays up
    until ``hold_s`` (its idle timer if None) past it; with no request by then the wake was wasted."""

    history: int = 8
    min_history: int = 3
    quantile: float = 0.5
    lead_s: float = 0.0
    hold_s: float | None = None

    def due(self, gaps: Sequence[float], last_request_at: float) -> float | None:
        """The forecast next request: ``last_request_at`` plus the ``quantile`` of the last ``history``
        finite quiet gaps; None with fewer than ``min_history``. The one rule: the replay and the node's
        broker (:mod:`deviceplugin.quota.warm`) both call it."""
        recent = [g for g in list(gaps)[-self.history:] if math.isfinite(g)]
        if len(recent) < self.min_history:
            return None
        return last_request_at + float(np.quantile(recent, self.quantile))


@dataclass
class _Pod:
    dep: Deployment
    gpu: int
    idx: int = 0
    state: str = "asleep"  # asleep | awake | zero | queued
    held: float = 0.0
    since: float = 0.0  # when the current state began (for idle memory-time)
    pending: list[float] = field(default_factory=list)  # first-request times waiting for memory
    sleep_at: float = 0.0
    resume: str = ""  # the state a queued pod leaves the queue from (asleep or zero)
    ready_at: float = 0.0  # when its current wake ends (weights back on the GPU)
    prewoken: bool = False  # woken ahead of a forecast request that has not come yet
    forecast: float = -1.0  # the pending wake-ahead's hold end (identifies it)
    gaps: list[float] = field(default_factory=list)  # its quiet gaps so far (the forecast's history)
    grow_since: float | None = None  # awake and waiting in its GPU's queue for its KV to grow, since then


def warm_tier(deps: Sequence[Deployment], cluster: Cluster, placement: Placement, idle_s: float,
              horizon: float, costs: Costs, count_from: float | None = None, relocate: bool = True,
              live: bool = False, ahead: WakeAhead | None = None) -> PolicyResult:
    """(c) sleep after ``idle_s``, lend, take back, wake in place. A wake that finds no memory on its GPU
    is never refused: with ``relocate`` it restarts at once on a GPU with room (its files are in the
    node's cache: :meth:`Costs.restart_s`, counted as a cold start), else it waits for a co-tenant to
    sleep. ``live``: as the node's broker does it (:mod:`deviceplugin.quota.warm`): no restart elsewhere,
    the wake waits on its GPU, wakes are served higher class first, and a waiting wake displaces (sleeps
    early) only co-tenants of a strictly lower class (``Deployment.rank``) with no request for
    ``displace_idle_s``, asked again every ``max_wait_s`` while it waits. ``ahead``: wake ahead of a
    forecast request (:class:`WakeAhead`). A deployment with elastic KV (``Deployment.kv``) holds, awake,
    its weights plus its booked KV; when that rises and its GPU has not the memory, the growth joins the
    GPU's queue like a wake (served in the same order, displacing the same co-tenants), the engine serving
    meanwhile at what it holds, and the requests that arrive while it waits are counted delayed."""
    res = PolicyResult("warm", gpus=placement.gpus_used, elastic=any(d.kv is not None for d in deps))
    pods = [_Pod(d, placement.gpu_of[d.name], i) for i, d in enumerate(deps)]
    _run(pods, cluster, placement.gpus_used, idle_s, horizon, costs, res,
         idle_s if count_from is None else count_from, relocate and not live, live, ahead)
    return res


def _run(pods: list[_Pod], cluster: Cluster, gpus: int, idle_s: float, horizon: float, costs: Costs,
         res: PolicyResult, count_from: float, relocate: bool, live: bool = False,
         ahead: WakeAhead | None = None) -> None:
    per_node = cluster.gpus_per_node
    held = [0.0] * gpus
    on_gpu: list[set[int]] = [set() for _ in range(gpus)]
    queue: dict[int, list[_Pod]] = {}
    lru: dict[int, OrderedDict[int, _Pod]] = {}  # per node: sleepers, least recently slept first
    host: dict[int, float] = {}
    # (time, 0 sleep | 1 wake | 2 patience | 3 wake ahead | 4 KV booking changes, pod, end)
    events: list[tuple[float, int, int, float]] = []
    for p in pods:
        on_gpu[p.gpu].add(p.idx)
        for s, e in busy_intervals(p.dep.segments, p.dep.idle_s or idle_s):
            if s < horizon:
                heapq.heappush(events, (float(s), 1, p.idx, float(e)))
        if p.dep.kv is not None:
            for t in ekv.change_times(p.dep.kv):
                if t < horizon:
                    events.append((float(t), 4, p.idx, 0.0))
            res.requests_total += ekv.requests_between(p.dep.kv, count_from, horizon)
    heapq.heapify(events)

    def account(p: _Pod, now: float) -> None:
        """Charge the memory ``p`` held since its state began (idle unless awake for a request: an engine
        woken ahead holds idle memory until its request comes)."""
        span = max(0.0, min(now, horizon) - min(p.since, horizon))
        if p.state == "awake" and not p.prewoken:
            res.busy_bytes_s += p.held * span
        else:
            res.idle_bytes_s += p.held * span
        p.since = now

    def set_held(p: _Pod, amount: float) -> None:
        held[p.gpu] += amount - p.held
        p.held = amount
        if held[p.gpu] > cluster.gpu_bytes + 1e-6:
            res.over_capacity += 1
        res.peak_gpu_frac = max(res.peak_gpu_frac, held[p.gpu] / cluster.gpu_bytes)

    def need(p: _Pod, now: float) -> float:
        """What ``p`` holds awake at ``now``: its slice, or with elastic KV its weights and booked KV."""
        return p.dep.awake_bytes(now)

    def since(q: _Pod) -> float:
        """When a queued wake's first request came, or a queued growth began."""
        return q.pending[0] if q.pending else (q.grow_since if q.grow_since is not None else 0.0)

    def end_growth(p: _Pod, now: float) -> None:
        """``p``'s growth stops waiting (granted, or the engine sleeps): count the wait and its requests."""
        if p.grow_since is None:
            return
        if _counted(p.grow_since, count_from):
            end = min(now, horizon)
            res.growth_wait_s.append(end - p.grow_since)
            res.growth_delays.append((end - p.grow_since, ekv.requests_between(p.dep.kv, p.grow_since, end)))
        p.grow_since = None

    def grow(p: _Pod, now: float) -> None:
        """``p`` (awake) needs more KV: at once where its GPU has the memory and nothing waits there,
        else after displacing lower classes, else it waits in the GPU's queue (never fails)."""
        res.growths += int(_counted(now, count_from))
        for attempt in range(2):
            if fits(p.gpu, p, now) and not queue.get(p.gpu):
                account(p, now)
                set_held(p, need(p, now))
                return
            if attempt == 0:
                displace(p, now)
        res.growth_waits += int(_counted(now, count_from))
        p.grow_since = now
        line = queue.setdefault(p.gpu, [])
        line.append(p)
        if live:
            line.sort(key=lambda q: (-q.dep.rank, since(q)))
        heapq.heappush(events, (now + costs.max_wait_s, 2, p.idx, 0.0))

    def to_sleep(p: _Pod, now: float) -> None:
        node = p.gpu // per_node
        if p.grow_since is not None:  # a waiting growth ends with the engine's sleep
            queue[p.gpu].remove(p)
            end_growth(p, now)
        account(p, now)
        set_held(p, costs.residual_bytes)
        p.state = "asleep"
        lru.setdefault(node, OrderedDict())[p.idx] = p
        host[node] = host.get(node, 0.0) + p.dep.weight_bytes
        p.prewoken = False
        while host[node] > cluster.host_bytes_per_node and lru[node]:
            _, q = lru[node].popitem(last=False)
            account(q, now)
            host[node] -= q.dep.weight_bytes
            set_held(q, 0.0)
            q.state = "zero"
            res.evictions += 1
            serve_queue(q.gpu, now)
        res.host_peak_bytes = max(res.host_peak_bytes, host[node])

    def leave_host(p: _Pod) -> None:
        node = p.gpu // per_node
        if lru.get(node, {}).pop(p.idx, None) is not None:
            host[node] -= p.dep.weight_bytes

    def start(p: _Pod, now: float, firsts: list[float], cold: bool) -> None:
        """Wake (or restart) ``p`` at ``now`` for the first requests ``firsts`` that arrived since."""
        awake_peers = any(pods[j].state == "awake" for j in on_gpu[p.gpu] if j != p.idx)
        cost = costs.restart_s(p.dep.weight_bytes) if cold else costs.wake_s(p.dep.weight_bytes)
        reclaim = costs.reclaim_s if awake_peers else 0.0
        res.reclaims += int(awake_peers)
        account(p, now)
        set_held(p, need(p, now))
        p.state, p.prewoken, p.ready_at = "awake", False, now + reclaim + cost
        for s in firsts:
            quiet = quiet_before(p.dep.segments, s)
            p.gaps.append(quiet)
            if _counted(s, count_from):
                res.record(now - s + reclaim + cost + costs.base_ttft_s, quiet)
                if cold:
                    res.full_loads += 1
                else:
                    res.wakes += 1
        heapq.heappush(events, (max(p.sleep_at, now + reclaim + cost), 0, p.idx, 0.0))

    def fits(g: int, p: _Pod, now: float) -> bool:
        return held[g] - (p.held if p.gpu == g else 0.0) + need(p, now) <= cluster.gpu_bytes + 1e-6

    def reserve_ok(g: int, p: _Pod, now: float) -> bool:
        """After ``p`` moves onto ``g``, one of ``g``'s sleepers can still wake."""
        asleep = [need(pods[j], now) - pods[j].held for j in on_gpu[g] if pods[j].state == "asleep"]
        return held[g] + need(p, now) + max(asleep, default=0.0) <= cluster.gpu_bytes + 1e-6

    def move(p: _Pod, g: int) -> None:
        leave_host(p)
        set_held(p, 0.0)
        on_gpu[p.gpu].discard(p.idx)
        p.gpu = g
        on_gpu[g].add(p.idx)

    def displace(p: _Pod, now: float) -> None:
        """Send to sleep now the awake co-tenants with no request for ``displace_idle_s`` that may be
        displaced (live: a strictly lower class than ``p``'s; else: the overcommitted ones); the rest of
        their busy interval is re-armed as wakes at their next request. Engines woken ahead with no
        request yet go back to sleep first, whatever their class."""
        for j in list(on_gpu[p.gpu]):
            q = pods[j]
            if j != p.idx and q.state == "awake" and q.prewoken:
                res.prewake_wasted += 1
                q.sleep_at = now
                to_sleep(q, now)
        for j in list(on_gpu[p.gpu]):
            q = pods[j]
            if j == p.idx or q.state != "awake" or not (q.dep.rank < p.dep.rank if live else q.dep.overcommit):
                continue
            seg = q.dep.segments
            k = int(np.searchsorted(seg[:, 0], now, side="right")) - 1
            if k < 0 or seg[k, 1] > now - costs.displace_idle_s:
                continue
            if k + 1 < len(seg) and seg[k + 1, 0] < q.sleep_at:
                heapq.heappush(events, (float(seg[k + 1, 0]), 1, j, q.sleep_at))
            q.sleep_at = now
            res.displaced += 1
            to_sleep(q, now)

    def serve_queue(gpu: int, now: float) -> None:
        line = queue.get(gpu, [])
        while line and fits(gpu, line[0], now):
            p = line.pop(0)
            if p.grow_since is not None:  # a growth: granted
                end_growth(p, now)
                account(p, now)
                set_held(p, need(p, now))
                continue
            for s in p.pending:
                if _counted(s, count_from):
                    res.wait_s.append(now - s)
            firsts, p.pending = p.pending, []
            start(p, now, firsts, p.resume == "zero")

    def give_up_waiting(p: _Pod, now: float) -> None:
        """``p`` waited ``max_wait_s``: restart it on any GPU with room now, else look again later."""
        if p.grow_since is not None:  # a growth waits on its GPU (it cannot restart elsewhere)
            if live:
                displace(p, now)
                serve_queue(p.gpu, now)
            if p.grow_since is not None:
                heapq.heappush(events, (now + costs.max_wait_s, 2, p.idx, 0.0))
            return
        if p.state != "queued":
            return
        if live:  # the broker asks lower classes again while the wake waits
            displace(p, now)
            serve_queue(p.gpu, now)
            if p.state == "queued":
                heapq.heappush(events, (now + costs.max_wait_s, 2, p.idx, 0.0))
            return
        target = next((g for g in sorted(range(gpus), key=lambda g: held[g])
                       if g != p.gpu and fits(g, p, now) and not queue.get(g)), None) if relocate else None
        if target is None:
            heapq.heappush(events, (now + costs.max_wait_s, 2, p.idx, 0.0))
            return
        queue[p.gpu].remove(p)
        for s in p.pending:
            if _counted(s, count_from):
                res.wait_s.append(now - s)
        firsts, p.pending = p.pending, []
        move(p, target)
        res.relocations += 1
        start(p, now, firsts, True)

    def forecast(p: _Pod, now: float) -> None:
        """After ``p`` slept on its idle timer: arm a wake ahead of its forecast next request."""
        if ahead is None or len(p.gaps) < ahead.min_history:
            return
        due = ahead.due(p.gaps, p.sleep_at - (p.dep.idle_s or idle_s))
        if due is None or due <= now:
            return
        p.forecast = due + (p.dep.idle_s or idle_s if ahead.hold_s is None else ahead.hold_s)
        at = due - ahead.lead_s - costs.wake_s(p.dep.weight_bytes) - costs.reclaim_s
        heapq.heappush(events, (max(now, at), 3, p.idx, p.forecast))

    def room_ahead(p: _Pod, now: float) -> bool:
        """``p`` may wake ahead: what it holds awake fits with room left for the largest other sleeper's wake."""
        g = p.gpu
        gaps = [need(pods[j], now) - pods[j].held for j in on_gpu[g] if j != p.idx and pods[j].state == "asleep"]
        return (held[g] - p.held + need(p, now) + max(gaps, default=0.0) <= cluster.gpu_bytes + 1e-6
                and not queue.get(g))

    # every pod starts loaded and asleep (deployed, then idle); past a node's host budget, dropped
    for p in pods:
        set_held(p, costs.residual_bytes)
        p.state = "awake"
        to_sleep(p, 0.0)

    while events:
        now, kind, i, end = heapq.heappop(events)
        if now >= horizon:  # what is still open is censored there (below); a wake waiting for memory that
            break  # frees only later was asked again for ever (a hang: hypothesis seed 2 of the elastic property)
        p = pods[i]
        if kind == 2:  # waited long enough for memory on its own GPU
            give_up_waiting(p, now)
            continue
        if kind == 3:  # wake ahead of the forecast request, if the memory is free
            if p.state == "asleep" and p.forecast == end and room_ahead(p, now):
                leave_host(p)
                account(p, now)
                set_held(p, need(p, now))
                p.state, p.prewoken, p.ready_at = "awake", True, now + costs.wake_s(p.dep.weight_bytes)
                res.prewakes += 1
                p.sleep_at = max(p.ready_at, end)
                heapq.heappush(events, (p.sleep_at, 0, i, 0.0))
            continue
        if kind == 4:  # elastic KV: an awake engine's booking changes at a window start
            if p.state == "awake":
                target = need(p, now)
                if target <= p.held + 1e-6:  # a shrink (or a waiting growth no longer needed): give it back
                    if p.grow_since is not None:
                        queue[p.gpu].remove(p)
                        end_growth(p, now)
                    account(p, now)
                    set_held(p, target)
                    serve_queue(p.gpu, now)
                elif p.grow_since is None:
                    grow(p, now)
            continue
        if kind == 0:  # idle timer ran out: sleep, lend what it held
            if p.state == "awake" and now >= p.sleep_at:
                wasted = p.prewoken
                res.prewake_wasted += int(wasted)
                gpu = p.gpu
                to_sleep(p, now)
                serve_queue(gpu, now)
                if not wasted:  # one forecast per quiet spell
                    forecast(p, now)
            continue
        p.sleep_at = max(p.sleep_at, end)
        if p.state == "awake":  # up already (woken ahead, or a wake ran past the last interval's end)
            quiet = quiet_before(p.dep.segments, now)
            p.gaps.append(quiet)
            if _counted(now, count_from):
                res.record(max(0.0, p.ready_at - now) + costs.base_ttft_s, quiet)
                res.prewake_hits += int(p.prewoken)
            account(p, now)
            p.prewoken = False
            heapq.heappush(events, (p.sleep_at, 0, i, 0.0))
            continue
        if p.state == "queued":
            p.pending.append(now)
            continue
        cold = p.state == "zero"
        if fits(p.gpu, p, now) and not queue.get(p.gpu):
            leave_host(p)
            start(p, now, [now], cold)
            continue
        displace(p, now)
        if fits(p.gpu, p, now) and not queue.get(p.gpu):
            leave_host(p)
            start(p, now, [now], cold)
            continue
        res.waited_for_memory += int(_counted(now, count_from))
        target = next((g for g in sorted(range(gpus), key=lambda g: held[g])
                       if g != p.gpu and fits(g, p, now) and reserve_ok(g, p, now) and not queue.get(g)), None) if relocate else None
        if target is not None:  # restart where there is room, from the node's file cache
            move(p, target)
            res.relocations += 1
            start(p, now, [now], True)
            continue
        leave_host(p)
        p.resume, p.state, p.pending = ("zero" if cold else "asleep"), "queued", [now]
        queue.setdefault(p.gpu, []).append(p)
        if live:  # the broker's order: higher class first, then the earlier request
            queue[p.gpu].sort(key=lambda q: (-q.dep.rank, since(q)))
            serve_queue(p.gpu, now)
            if p.state != "queued":
                continue
        heapq.heappush(events, (now + costs.max_wait_s, 2, p.idx, 0.0))
    for p in pods:
        account(p, horizon)
        end_growth(p, horizon)  # still waiting at the end: censored at the horizon
        for s in p.pending if p.state == "queued" else ():  # still waiting at the end: censored at the horizon
            if _counted(s, count_from):
                res.record(max(horizon, s) - s, quiet_before(p.dep.segments, s))
                res.wait_s.append(max(horizon, s) - s)
