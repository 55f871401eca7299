"""Pods deleted while their containers may still run, and the GPUs they hold meanwhile. Pure, no I/O.

``kubectl delete --force --grace-period=0`` removes a pod from the API at once, whatever its kubelet is
doing: the kubelet still stops its containers over the termination grace, and its own accounting forgets
the pod's devices at once as well (``GetActivePods`` omits force-deleted pods that are still terminating,
kubernetes#104824, so the device manager's ``UpdateAllocatedDevices`` frees their IDs at the next
admission). Two parts keep such a pod's GPUs booked for its grace, by the one rule here:

* the extender, from the deletion its watch delivers (:mod:`extender.accounting`), in memory;
* the node agent, from the deletion its pod cache delivers (:class:`Departures`), published in the
  node inventory's ``departing`` section: an extender that restarts inside the grace books it from
  there (the soak with forced recreations and extender kills found GPUs planned twice without it).
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from vramshare import contract, logs, managed
from vramshare.contract import assignment

Obj = Mapping[str, Any]
log = logs.get(__name__)

TERMINAL_PHASES = ("Succeeded", "Failed")
DEPARTING_MARGIN_S = 5  # beyond the pod's grace: the kubelet's sync period to notice and kill
DEFAULT_GRACE_S = 30  # the API server's default terminationGracePeriodSeconds
MAX_GRACE_S = 3600  # a pod's grace as vramshare believes it (the API allows more; nothing waits longer)
#: bounds of the inventory's ``departing`` section: a node reports at most this many (the latest to end
#: first), so the annotation stays small (~128 x 200 bytes)
MAX_DEPARTING = 128
MAX_POD_KEY = 63 + 1 + 253  # "<namespace>/<name>": a namespace is a DNS label, a name a DNS subdomain


def may_still_run(pod: Obj) -> bool:
    """Whether a deleted pod's containers may still run on its node (and its devices be held there):
    yes unless it never reached a node or every container status says terminated. A pod the kubelet
    finished deleting shows them all terminated (``status_manager.go canBeDeleted``); one removed by
    ``--grace-period=0 --force`` shows whatever the kubelet last reported, and that may be nothing yet:
    the kubelet takes a pod's devices when it admits it (the device manager's Allocate), before any
    container status, so a bound pod without statuses, or with containers still waiting, may hold its
    GPUs for its grace. An unbound pod was never on a kubelet."""
    status = pod.get("status") or {}
    if status.get("phase") in TERMINAL_PHASES or not (pod.get("spec") or {}).get("nodeName"):
        return False
    statuses = [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]
    return not statuses or not all(isinstance(c, Mapping) and "terminated" in (c.get("state") or {}) for c in statuses)


def grace_seconds(pod: Obj) -> int:
    """The termination grace the kubelet gives the pod's containers (spec, default 30 s), bounded."""
    raw = (pod.get("spec") or {}).get("terminationGracePeriodSeconds", DEFAULT_GRACE_S)
    if isinstance(raw, bool) or not isinstance(raw, int):
        return DEFAULT_GRACE_S
    return min(max(raw, 0), MAX_GRACE_S)


def booked_seconds(pod: Obj) -> int:
    """How long a departing pod's GPUs stay booked after its deletion: its grace and the margin."""
    return grace_seconds(pod) + DEPARTING_MARGIN_S


@dataclass(frozen=True)
class DepartingPod:
    """One deleted pod a node reports as possibly still running: its GPUs (uuid, MiB) until ``until_s``
    (Unix seconds, the node's clock; the margin covers a few seconds of skew)."""

    pod: str  # namespace/name
    uid: str
    until_s: int
    gpus: tuple[tuple[str, int], ...] = field(default_factory=tuple)

    @property
    def ghost(self) -> str:
        return ghost_key(self.pod, self.uid)


def ghost_key(pod_key: str, uid: str) -> str:
    """The key a departing pod's booking has in the extender's books: never a live pod's (``ns/name``)."""
    return f"{pod_key}@{uid}"


_OURS = frozenset({contract.FIELD_MANAGER_EXTENDER, contract.FIELD_MANAGER_DEVICE_PLUGIN})


def pod_key(pod: Obj) -> str:
    """``namespace/name``: how the extender's books key a pod (a recreated pod has the same key)."""
    meta = pod.get("metadata") or {}
    return f"{meta.get('namespace') or 'default'}/{meta.get('name', '')}"


class Departures:
    """One node's deleted pods that may still run, fed by its pod cache's deletions (the object as the
    API last had it); the inventory publishes :meth:`current`. Only the pod's assignment is read (the
    plan or the device plugin's report: the kubelet may have taken the planned devices before any
    report), and only where vramshare wrote it (``managedFields``: the extender's or the device plugin's
    field manager, as the extender trusts it); the extender books only the GPUs (or MIG slots) the
    node's inventory has."""

    def __init__(self, names: contract.Names, max_entries: int = MAX_DEPARTING) -> None:
        self._names = names
        self._max = max_entries
        self._lock = threading.Lock()  # the pod watch notes, the publisher reads
        self._by_uid: dict[str, DepartingPod] = {}

    def note(self, pod: Obj, now_s: float) -> DepartingPod | None:
        """A deletion: the record it adds (``None`` when the pod holds nothing here or has stopped)."""
        uid = str((pod.get("metadata") or {}).get("uid") or "")
        if not uid or not may_still_run(pod):
            return None
        key = self._names.assignment
        text = ((pod.get("metadata") or {}).get("annotations") or {}).get(key)
        if not text or not managed.annotation_owners(pod, (key,))[key] & _OURS:
            return None  # nobody of ours planned it: nothing vramshare handed out
        try:
            containers = assignment.parse(text)
        except contract.AssignmentError as exc:  # nothing we can book: the extender's own rule has its plan
            log.warning("deleted pod not reported as departing: its assignment is unreadable",
                        pod=pod_key(pod), uid=uid, error=str(exc))
            return None
        held: dict[str, int] = {}
        for assigned in containers.values():
            for g in assigned:
                held[g.uuid] = min(held.get(g.uuid, 0) + g.mib, assignment.MAX_MIB)
        if not held:
            return None
        entry = DepartingPod(pod_key(pod), uid, math.ceil(now_s) + booked_seconds(pod), tuple(sorted(held.items())))
        with self._lock:
            self._by_uid[uid] = entry
        return entry

    def restore(self, entries: Iterable[DepartingPod], now_s: float) -> int:
        """An earlier run's report (the inventory it left on the node): the records not ended yet are kept,
        so a restarted node agent does not drop pods still in their grace; returns how many."""
        kept = [e for e in entries if e.until_s > now_s]
        with self._lock:
            for e in kept:
                if e.uid not in self._by_uid or self._by_uid[e.uid].until_s < e.until_s:
                    self._by_uid[e.uid] = e
        return len(kept)

    def current(self, now_s: float) -> tuple[DepartingPod, ...]:
        """The records not ended yet, the latest to end first, at most ``max_entries`` (ended ones are
        forgotten here)."""
        with self._lock:
            for uid in [u for u, e in self._by_uid.items() if e.until_s <= now_s]:
                del self._by_uid[uid]
            return tuple(sorted(self._by_uid.values(), key=lambda e: (-e.until_s, e.uid))[:self._max])

    def next_end_s(self) -> float | None:
        """When the earliest record ends (the node republishes then); ``None`` when there is none."""
        with self._lock:
            return min((e.until_s for e in self._by_uid.values()), default=None)
