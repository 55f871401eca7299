"""Elastic KV for awake engines in the cold-start replay (issue 23 item 5, "2x at the same p99"). Pure, no I/O.

An engine whose KV pool is elastic (kvcached: virtual address space reserved for the whole pool, physical
pages mapped on demand and returned when blocks are freed; ``shared/reference/enforcement-anchors.md``)
holds its weights plus the KV its running requests use, plus a margin, and grows on demand up to its slice.
The replay books such an awake engine at

    weights + min(KV part of its slice, max(KV in use over the last ``lookback_s``, a floor) + a margin)

where *KV in use* in a 10-minute ServeGen window comes from the window's request rate by Little's law:
concurrency L = rate x request time (first token + output tokens x time per output token), taken at a
high quantile (L + z * max(cv, 1) * sqrt(L): M/G/inf's Poisson count, its spread widened by the window's
inter-arrival cv), times the KV tokens a running request holds on average (prompt + half the output), times
the model's KV bytes per token. A growth that finds no memory on the GPU waits like a wake (it may displace
lower classes; it never fails); the requests that arrive while it waits are delayed until it is granted.
Every constant is a field of :class:`KvLoad` with its source.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

GIB = 1 << 30
MIB = 1 << 20


@dataclass(frozen=True)
class KvLoad:
    """How one model's engine uses KV under load. Sources: per field; the bench states the per-model values."""

    #: K and V of every layer for one token (``vllm_patches.budget.kv_bytes_per_token`` of the model config)
    bytes_per_token: float
    #: mean prompt / output tokens per request: ServeGen's per-client token distributions
    #: (``alibaba/ServeGen`` ``data/language/<pool>/chunk-*-dataset.json``); the bench takes the per-client
    #: p90 of the request-weighted mean, so 9 clients in 10 use less (conservative for the density)
    input_tokens: float
    output_tokens: float
    #: decode time per output token on a shared GPU: assumption (published vLLM serving runs of 8B-14B models
    #: on one H100 report 10-30 ms at moderate load; the upper end is taken: a longer request holds KV longer)
    tpot_s: float
    #: first token (prefill and queue), the same as ``Costs.base_ttft_s``
    ttft_s: float = 0.15
    #: the concurrency quantile booked: z of the normal approximation (2.33: the window's p99)
    z: float = 2.33
    #: KV an awake engine always holds: one ``max_model_len`` request (8,192 tokens); vLLM refuses to start
    #: with less (``check_enough_kv_cache_memory``, ``vllm_patches.budget.min_kv_bytes``): design choice
    floor_tokens: float = 8192.0
    #: booked on top of the use, as a share of the slice's KV part (kvcached maps pages ahead of use,
    #: its ``prealloc_size``): design choice
    margin_frac: float = 0.05
    #: the booking follows the highest use over this much of the past: a growth is immediate, a shrink
    #: lags one ServeGen window (600 s): design choice
    lookback_s: float = 600.0

    @property
    def request_s(self) -> float:
        """How long a request holds KV: first token + its output at ``tpot_s`` a token."""
        return self.ttft_s + self.output_tokens * self.tpot_s

    @property
    def tokens_per_request(self) -> float:
        """KV tokens a running request holds on average over its life: its prompt plus half its output."""
        return self.input_tokens + self.output_tokens / 2.0

    def in_use_bytes(self, rate: float, cv: float = 1.0) -> float:
        """KV in use at a window's booked concurrency quantile (0 with no requests)."""
        if not rate > 0:
            return 0.0
        mean = rate * self.request_s
        high = mean + self.z * max(cv if math.isfinite(cv) else 1.0, 1.0) * math.sqrt(mean)
        return high * self.tokens_per_request * self.bytes_per_token


def schedule(windows: Iterable[tuple[float, float, float]], load: KvLoad, kv_cap_bytes: float,
             window_s: float = 600.0) -> np.ndarray:
    """``[k, 3]`` rows ``(window start, rate, booked KV bytes)`` from ServeGen rows ``(start, rate, cv)``:
    the KV an awake engine is booked at from that window's start, ``max(use over the last lookback, floor)
    + margin`` in whole MiB, never above ``kv_cap_bytes`` (its slice's KV part) and never below zero."""
    rows = sorted(windows)
    if not rows:
        return np.zeros((0, 3))
    t = np.array([r[0] for r in rows], float)
    rate = np.array([max(0.0, r[1]) for r in rows], float)
    use = np.array([load.in_use_bytes(r[1], r[2]) for r in rows], float)
    booked = np.empty(len(rows))
    floor = load.floor_tokens * load.bytes_per_token
    margin = load.margin_frac * kv_cap_bytes
    lo = 0
    for k in range(len(rows)):
        while t[lo] + window_s + load.lookback_s <= t[k]:  # windows wholly older than the lookback
            lo += 1
        booked[k] = max(use[lo:k + 1].max(), floor) + margin
    # whole MiB, as the node books (and so the replay's sums of bytes stay exact)
    booked = np.ceil(booked / MIB) * MIB
    return np.stack([t, rate, np.clip(booked, 0.0, max(0.0, kv_cap_bytes))], axis=1)


def awake_bytes(weight_bytes: float, slice_bytes: float, kv: np.ndarray | None, t: float) -> float:
    """What an awake engine holds (and is booked at) at ``t``: its whole slice without elastic KV (``kv``
    None), else its weights plus its booked KV then; never below its weights, never above its slice."""
    if kv is None or len(kv) == 0:
        return slice_bytes
    k = max(0, int(np.searchsorted(kv[:, 0], t, side="right")) - 1)
    return min(slice_bytes, weight_bytes + max(0.0, float(kv[k, 2])))


def change_times(kv: np.ndarray) -> np.ndarray:
    """The window starts where the booking changes (where a growth or a shrink happens while awake)."""
    if len(kv) < 2:
        return np.zeros(0)
    return kv[1:, 0][np.diff(kv[:, 2]) != 0]


def requests_between(kv: np.ndarray, t0: float, t1: float, window_s: float = 600.0) -> float:
    """Expected requests in ``[t0, t1)`` from the windows' rates."""
    if kv is None or len(kv) == 0 or t1 <= t0:
        return 0.0
    starts, rates = kv[:, 0], kv[:, 1]
    overlap = np.clip(np.minimum(starts + window_s, t1) - np.maximum(starts, t0), 0.0, None)
    return float((overlap * rates).sum())


def delay_quantile(waits: Sequence[tuple[float, float]], total_requests: float, q: float) -> float:
    """The ``q`` quantile (0..1) of the delay growth waits add to a request, over ``total_requests``:
    each wait ``(d, n)`` delays its ``n`` requests uniformly between 0 and ``d`` (they arrived while it
    waited and are served when it is granted); every other request is not delayed."""
    pieces = [(d, n) for d, n in waits if d > 0 and n > 0]
    if total_requests <= 0 or not pieces:
        return 0.0
    budget = (1.0 - q) * total_requests

    def tail(x: float) -> float:  # requests delayed by more than x
        return sum(n * max(0.0, d - x) / d for d, n in pieces)

    if tail(0.0) <= budget:
        return 0.0
    lo, hi = 0.0, max(d for d, _ in pieces)
    for _ in range(60):
        mid = (lo + hi) / 2
        if tail(mid) > budget:
            lo = mid
        else:
            hi = mid
    return hi
