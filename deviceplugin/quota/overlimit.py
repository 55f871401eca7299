"""Over-limit detection for nodes where nothing fences (``cooperative``, and ``mps`` after a shrink).

Pure: :class:`OverLimitWatch` is fed each tick's (tenant, GPU, use, limit) and says which tenants
have stayed above their hard limit for ``grace`` seconds without a break. It acts once per episode
(the tenant must come back within its limit before it can be reported again) and never names a
tenant within its quota, nor one without telemetry.
"""
from __future__ import annotations

from dataclasses import dataclass

from deviceplugin.quota.model import TenantKey


@dataclass(frozen=True)
class Breach:
    key: TenantKey
    gpu_uuid: str
    used_mib: int
    limit_mib: int
    since: float  # when it first went over, on the loop's clock
    seconds: float

    def message(self) -> str:
        return (f"container {self.key.container} uses {self.used_mib} MiB on {self.gpu_uuid}, above its limit "
                f"{self.limit_mib} MiB for {self.seconds:.0f} s")


class OverLimitWatch:
    def __init__(self, grace_seconds: float) -> None:
        self.grace = grace_seconds
        self._since: dict[tuple[TenantKey, str], float] = {}
        self._acted: set[tuple[TenantKey, str]] = set()

    def observe(self, key: TenantKey, gpu: str, used: int | None, limit: int, now: float) -> Breach | None:
        """One tick's reading; a :class:`Breach` the first time it has lasted ``grace`` seconds."""
        k = (key, gpu)
        if used is None or used <= limit:
            self._since.pop(k, None)
            self._acted.discard(k)
            return None
        since = self._since.setdefault(k, now)
        if now - since < self.grace or k in self._acted:
            return None
        self._acted.add(k)
        return Breach(key, gpu, used, limit, since, now - since)

    def keys(self) -> set[TenantKey]:
        """The tenants it keeps state for."""
        return {k[0] for k in self._since} | {k[0] for k in self._acted}

    def forget(self, alive: set[TenantKey]) -> None:
        self._since = {k: v for k, v in self._since.items() if k[0] in alive}
        self._acted = {k for k in self._acted if k[0] in alive}
