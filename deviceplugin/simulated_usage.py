"""Per-container GPU memory use without GPUs: replay series (the GenAI trace, or a built-in swing) so
the quota loop runs on simulated nodes and in ``vramshare demo``.

:class:`UsageReplay` is a ``quota.telemetry.UsageReader`` (and a ``SignalReader``): each tenant the
loop lists is given the next series on first sight, and every ``read_usage`` is one tick (one sample
a minute in the trace). Its vLLM signals say "running" while the tenant's use moves and "idle" while
it stays flat, which is what the warmth tracker needs to tell hot from warm tenants.
"""
from __future__ import annotations

import csv
import threading
from collections import defaultdict
from typing import Callable, Sequence

from deviceplugin.quota.model import Tenant, TenantKey
from deviceplugin.quota.telemetry import UsageSample, VllmSample
from vramshare import traces

MIB = 1 << 20
GENAI_TRACE = traces.GENAI_MEMORY

# A day compressed into 16 ticks, MiB: a chat server with a midday peak, a batch job that goes idle,
# a RAG server that bursts late. Used when the GenAI trace is not at hand.
BUILTIN = (
    (18000, 22000, 26000, 30000, 34000, 36000, 35000, 33000, 30000, 26000, 24000, 22000, 20000, 20000, 21000, 24000),
    (30000, 31000, 29000, 24000, 16000, 9000, 9000, 9000, 9000, 9000, 9000, 9000, 9000, 20000, 28000, 30000),
    (8000, 8000, 10000, 12000, 12000, 14000, 18000, 24000, 28000, 30000, 31000, 30000, 26000, 20000, 14000, 10000),
)


def genai_series(path: str, count: int, every: int = 1, start: int = 0, *, by_swing: bool = False,
                 max_mib: int | None = None) -> list[list[int]]:
    """``count`` containers of the GenAI trace with a full day, MiB, one sample each ``every`` minutes
    (``by_swing``: the containers whose sampled use swings most, so a short replay shows movement;
    ``max_mib``: only those that never use more)."""
    by_c: dict[str, dict[float, float]] = defaultdict(dict)
    with open(path, encoding="utf-8") as fh:
        for row in csv.DictReader(fh):
            by_c[row["container_ip"]][float(row["timestamp_anon"])] = float(row["value"])
    times = sorted({t for d in by_c.values() for t in d})
    full = sorted(c for c, d in by_c.items() if len(d) >= 1400)
    out = []
    for cid in full:
        last, series = 0.0, []
        for t in times:
            last = by_c[cid].get(t, last)
            series.append(int(last // MIB))
        out.append(series[::every])
    if max_mib is not None:
        out = [s for s in out if max(s) <= max_mib]
    if by_swing:
        out.sort(key=lambda s: -(max(s) - min(s)))
    return out[start:start + count]


def find_trace(name: str = GENAI_TRACE) -> str | None:
    """The trace where :func:`vramshare.traces.find` finds it (``$VRAMSHARE_TRACES``, a checkout's
    ``../shared/traces``, the download folder); ``None`` if absent."""
    return traces.find(name)


class UsageReplay:
    name = "replay"

    def __init__(self, series: Sequence[Sequence[int]], tenants: Callable[[], Sequence[Tenant]] | None = None) -> None:
        if not series or not all(series):
            raise ValueError("usage replay needs at least one non-empty series")
        self.series = [list(s) for s in series]
        self.tick = 0
        self._tenants = tenants
        self._slot: dict[TenantKey, int] = {}
        self._lock = threading.Lock()

    def bind(self, tenants: Callable[[], Sequence[Tenant]]) -> None:
        """The loop's tenants of the current tick (``QuotaLoop.tenants_now``)."""
        self._tenants = tenants

    def _value(self, key: TenantKey, tick: int) -> int:
        s = self.series[self._slot.setdefault(key, len(self._slot) % len(self.series))]
        return s[tick % len(s)]

    def read_usage(self) -> list[UsageSample]:
        with self._lock:
            tenants = sorted(self._tenants() if self._tenants else [], key=lambda t: t.key)
            out = [UsageSample(gpu, self._value(t.key, self.tick), pod_uid=t.key.pod_uid or None,
                               namespace=t.key.namespace, pod=t.key.pod, container=t.key.container)
                   for t in tenants for gpu, _req in t.gpus[:1]]
            self.tick += 1
            return out

    def read_signals(self, url: str) -> VllmSample:
        """``url`` is the tenant's key as text (the demo's tenants carry it as their metrics URL)."""
        with self._lock:
            key = next((k for k in self._slot if str(k) == url), None)
            # the replayed servers give memory back on a cut (vLLM with kvcached: release mode unmap),
            # so the quota loop may lend to them (issue 19: it lends to releasing engines only)
            if key is None or self.tick < 2:
                return VllmSample(running=1, waiting=0, release_mode="unmap")
            moving = self._value(key, self.tick - 1) != self._value(key, self.tick - 2)
            return VllmSample(running=1 if moving else 0, waiting=0, release_mode="unmap")
