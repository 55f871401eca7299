"""Health bookkeeping shared by the backends: which Xids count, what is unhealthy, when it recovers.

Pure, no I/O, not thread-safe on its own (each backend's watch loop owns one ledger). NVIDIA's plugin
marks a GPU unhealthy on a critical Xid and never brings it back ("FIXME: there is no way to recover
from the Unhealthy state"); we re-probe unhealthy GPUs and call them healthy again once they answer
for ``probes_to_recover`` probes in a row, with no new critical Xid in between.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from deviceplugin.backend import HealthEvent
from vramshare import config

# Application errors (illegal address, MMU fault from user code, ...), not a sick GPU: NVIDIA's list.
DEFAULT_IGNORED_XIDS = frozenset(config.DEFAULT_IGNORED_XIDS)
RECOVERED_REASON = "gpu answers again"
DEFAULT_PROBES_TO_RECOVER = 3

Key = tuple[str, str | None]  # (gpu uuid, mig uuid or None)


def is_critical(xid: int, ignored: frozenset[int]) -> bool:
    """A critical-error Xid makes the device unhealthy unless it is on the ignore list."""
    return xid not in ignored


@dataclass
class HealthLedger:
    """Current health per device and the recovery streak of each unhealthy one.

    Every method returns the :class:`HealthEvent` to publish, or ``None`` when nothing changed, so
    the caller reports transitions only (the ``watch_health`` contract).
    """

    probes_to_recover: int = DEFAULT_PROBES_TO_RECOVER
    _unhealthy: dict[Key, int] = field(default_factory=dict)  # key -> consecutive good probes

    def unhealthy(self) -> list[Key]:
        return sorted(self._unhealthy, key=lambda k: (k[0], k[1] or ""))

    def is_healthy(self, uuid: str, mig_uuid: str | None = None) -> bool:
        return (uuid, mig_uuid) not in self._unhealthy

    def mark_unhealthy(self, uuid: str, reason: str, xid: int | None = None,
                       mig_uuid: str | None = None) -> HealthEvent | None:
        key = (uuid, mig_uuid)
        was_healthy = key not in self._unhealthy
        self._unhealthy[key] = 0  # a new fault restarts the recovery streak
        if not was_healthy:
            return None
        return HealthEvent(uuid=uuid, healthy=False, reason=reason, xid=xid, mig_uuid=mig_uuid)

    def probe_ok(self, uuid: str, mig_uuid: str | None = None) -> HealthEvent | None:
        """One good probe; the ``probes_to_recover``-th in a row brings the device back."""
        key = (uuid, mig_uuid)
        if key not in self._unhealthy:
            return None
        self._unhealthy[key] += 1
        if self._unhealthy[key] < self.probes_to_recover:
            return None
        del self._unhealthy[key]
        return HealthEvent(uuid=uuid, healthy=True, reason=RECOVERED_REASON, mig_uuid=mig_uuid)

    def probe_failed(self, uuid: str, mig_uuid: str | None = None) -> None:
        key = (uuid, mig_uuid)
        if key in self._unhealthy:
            self._unhealthy[key] = 0

    def mark_healthy(self, uuid: str, reason: str, mig_uuid: str | None = None) -> HealthEvent | None:
        """An explicit recovery (the simulated backend's ``recover``), no probing needed."""
        if self._unhealthy.pop((uuid, mig_uuid), None) is None:
            return None
        return HealthEvent(uuid=uuid, healthy=True, reason=reason, mig_uuid=mig_uuid)
