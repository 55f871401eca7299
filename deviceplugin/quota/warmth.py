"""Hot, warm and waking tenants (issue 9 item 4). Pure: readings in, a phase per tenant out.

A tenant is *idle* when its vLLM reports no running and no waiting requests, has finished none since
the last tick, and its use has stayed within one step of where it was; idle for ``idle_seconds`` makes it ``warm`` (the policy shrinks it
toward its floor and lends the memory). The first sign of traffic (a running or waiting request, or
use rising by a step) makes a warm tenant ``waking`` for one tick, in which the policy restores it
ahead of everybody; then it is ``hot`` again. A tenant without vLLM signals is never made warm: flat
use alone cannot tell an idle server from a busy one whose KV cache was allocated up front.
"""
from __future__ import annotations

from dataclasses import dataclass

from deviceplugin.quota.model import Phase, Signals, TenantKey


@dataclass
class _Seen:
    phase: Phase
    idle_since: float | None
    used: int | None


class Warmth:
    def __init__(self) -> None:
        self._seen: dict[TenantKey, _Seen] = {}

    def phase_of(self, key: TenantKey) -> Phase:
        s = self._seen.get(key)
        return s.phase if s else Phase.HOT

    def update(self, key: TenantKey, used: int | None, signals: Signals, now: float, idle_seconds: float,
               step_mib: int) -> Phase:
        s = self._seen.setdefault(key, _Seen(Phase.HOT, None, used))
        reported = signals.running is not None or signals.waiting is not None
        # a request that came and went between two ticks shows only in the finished counter's increase
        busy = bool(signals.running) or bool(signals.waiting) or bool(signals.finished)
        rising = used is not None and s.used is not None and used - s.used >= step_mib
        flat = used is not None and s.used is not None and abs(used - s.used) < step_mib
        if s.phase is Phase.WARM and (busy or rising):
            s.phase, s.idle_since = Phase.WAKING, None
        elif s.phase is Phase.WAKING:
            s.phase = Phase.HOT
        if s.phase is Phase.HOT:
            if reported and not busy and flat:
                s.idle_since = now if s.idle_since is None else s.idle_since
                if idle_seconds > 0 and now - s.idle_since >= idle_seconds:
                    s.phase = Phase.WARM
            else:
                s.idle_since = None
        s.used = used
        return s.phase

    def keys(self) -> set[TenantKey]:
        """The tenants it keeps state for."""
        return set(self._seen)

    def forget(self, alive: set[TenantKey]) -> None:
        self._seen = {k: v for k, v in self._seen.items() if k in alive}
