"""GPU memory no pod of ours holds, as the scheduler must see it. Pure, no I/O.

Each tick the quota loop measures what a shared GPU holds beyond its tenants: a container that outlived
its pod's grace (a process stuck in the driver cannot be killed), a host process, another device
plugin's pod. It takes that memory off what it divides among the tenants. The extender books by
requests and cannot see it: without a report it plans a pod into memory that is not there, and the
quota loop then fences that GPU's tenants below their requests to make room.

So the node agent publishes it per GPU, the inventory's optional ``gpus[].foreignMiB``, and the extender
books it as used beside the pods (:meth:`vramshare.inventory.NodeInventory.booked_foreign_mib`).
Three rules keep the figure honest:

* **Settled, not seen once.** A GPU reports the least foreign memory of the readings over the last
  :data:`SETTLE_S` seconds (with the one in force at its start), and nothing until they span that long
  (:class:`SettledForeign`). A process that starts a moment before its pod becomes a tenant, or a
  reading taken between two processes, books nothing; memory that stays is booked within two ticks.
* **Never unbooked, sometimes twice.** A force-deleted pod whose containers still run is booked by its
  departing entry (:mod:`vramshare.departing`) and, once its memory has settled here, by this figure too.
  Subtracting the entries would be exact only if their memory were in the figure: a pod deleted a moment
  ago is not (yet), one whose containers stopped is not (ever), and subtracting either unbooks another
  process's memory (the soak with stuck containers planned pods into it). So nothing is subtracted: a
  short double booking per forced deletion, never a gap. The GPU's slack (memory beyond its whole units,
  which no pod is given) absorbs foreign memory first.
* **Whole units.** What is left is rounded up to the node's memory unit, so the annotation moves only
  when a unit changes, and never past the GPU's units.

A GPU whose readings stop (unreadable) keeps its last settled figure: the last good state, not zero.
A restarted node agent keeps the figures it last published until its own readings settle
(:meth:`SettledForeign.keep`): a restart must not unbook, for the two ticks it takes to settle again,
memory a stuck process still holds. The device plugin reads them back from its inventory
(:func:`settled_from_booked`); the DRA plugin, whose slices leave out a device the memory fills, from
the file it keeps beside its checkpoint (:func:`encode_kept`, :func:`decode_kept`).
"""
from __future__ import annotations

import json
import math
import threading
from collections import deque
from dataclasses import replace
from typing import Iterable, Mapping

from vramshare.inventory import GpuMode, NodeInventory

#: one quota tick (the default 10 s): the reading in force at the window's start and the one after it,
#: two readings in a row, so one reading alone never books memory. Short, so that the containers of a
#: force-deleted pod that outlive their grace are booked as its departing entry ends (deletion + grace +
#: 5 s): their memory is foreign from the deletion on and settles within two ticks of it (20 s at worst),
#: so from a grace of 15 s on there is no gap between the two bookings
SETTLE_S = 10.0


class SettledForeign:
    """Per GPU, the foreign memory every reading of the last ``settle_s`` seconds saw (thread-safe: the
    quota loop observes, the inventory publisher reads)."""

    def __init__(self, settle_s: float = SETTLE_S) -> None:
        if settle_s <= 0:
            raise ValueError(f"settle_s must be positive, got {settle_s}")
        self.settle_s = settle_s
        self._readings: dict[str, deque[tuple[float, int]]] = {}
        self._kept: dict[str, int] = {}  # a restarted agent's figures of its last run (:meth:`keep`)
        self._kept_until = float("-inf")
        self._lock = threading.Lock()

    def keep(self, figures: Mapping[str, int], until: float) -> None:
        """Report ``figures`` (per GPU, what the node agent had settled before it restarted) for each GPU
        until its own readings span the window, and never after ``until``: a reader that never sees the GPU
        whole (dcgm-exporter, a replay) reports nothing, and the figure must not outlive what measured it."""
        with self._lock:
            self._kept = {g: int(m) for g, m in figures.items() if m > 0}
            self._kept_until = until

    def observe(self, now: float, readings: Mapping[str, int]) -> None:
        """One tick's foreign MiB per GPU it could read (a GPU it could not read is left out, not 0)."""
        with self._lock:
            for gpu, mib in readings.items():
                q = self._readings.setdefault(gpu, deque())
                if q and now < q[-1][0]:
                    q.clear()  # the clock went back (a test's, or a bug): start the window afresh
                q.append((now, max(0, int(mib))))
                # keep the reading in force at the window's start and every one after it
                while len(q) > 1 and q[1][0] <= now - self.settle_s:
                    q.popleft()

    def settled(self, now: float) -> dict[str, int]:
        """Per GPU whose readings span ``settle_s``: the least of the reading in force at the window's
        start and every one since (GPUs without a settled figure, or with 0, are left out)."""
        start = now - self.settle_s
        out = {}
        with self._lock:
            for gpu, q in self._readings.items():
                if not q or q[0][0] > start:
                    continue  # readings do not span the window yet
                first = max(i for i, (t, _) in enumerate(q) if t <= start)
                least = min(m for _, m in list(q)[first:])
                if least > 0:
                    out[gpu] = least
            if now < self._kept_until:
                for gpu, mib in self._kept.items():
                    q = self._readings.get(gpu)
                    if not q or q[0][0] > start:  # its own readings do not span the window yet
                        out[gpu] = mib
        return dict(sorted(out.items()))

    def forget(self, keep: Iterable[str]) -> None:
        """Drop the GPUs not in ``keep`` (gone from the node, or no longer shared)."""
        keep = set(keep)
        with self._lock:
            for gpu in [g for g in self._readings if g not in keep]:
                del self._readings[gpu]
            self._kept = {g: m for g, m in self._kept.items() if g in keep}


def schedulable_foreign(inv: NodeInventory, settled: Mapping[str, int]) -> dict[str, int]:
    """Per shared GPU, the foreign MiB the extender must book: the settled figure beyond the GPU's slack,
    rounded up to whole units, at most the GPU's units."""
    unit = inv.unit_mib
    out = {}
    for g in inv.gpus:
        if g.mode is not GpuMode.SHARED or settled.get(g.uuid, 0) <= 0:
            continue
        beyond = settled[g.uuid] - max(0, g.memory_mib - g.units * unit)
        if beyond > 0:
            out[g.uuid] = min(math.ceil(beyond / unit), g.units) * unit
    return out


def settled_from_booked(inv: NodeInventory, booked: Mapping[str, int]) -> dict[str, int]:
    """The settled figures :func:`schedulable_foreign` turns back into ``booked`` (per shared GPU, the whole
    units a node published): each plus the GPU's slack. What a restarted node agent read back from its
    last publication keeps until its own readings settle (:meth:`SettledForeign.keep`)."""
    unit = inv.unit_mib
    return {g.uuid: booked[g.uuid] + max(0, g.memory_mib - g.units * unit) for g in inv.gpus
            if g.mode is GpuMode.SHARED and booked.get(g.uuid, 0) > 0}


KEPT_VERSION = 1
MAX_KEPT_MIB = 1 << 40  # far beyond any GPU: a larger figure is not one this code wrote
MAX_KEPT_GPUS = 1024


def encode_kept(settled: Mapping[str, int]) -> bytes:
    """The settled figures a node agent keeps on disk for its next start (per GPU UUID, MiB)."""
    doc = {"version": KEPT_VERSION, "foreignMiB": {g: int(m) for g, m in sorted(settled.items()) if m > 0}}
    return json.dumps(doc, sort_keys=True).encode()


def decode_kept(data: bytes) -> dict[str, int]:
    """:func:`encode_kept`'s figures back; ``ValueError`` naming what is wrong with anything else (the
    caller keeps nothing then: the loop settles the figures again within two ticks)."""
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"not JSON: {exc}") from exc
    if not isinstance(doc, dict) or doc.get("version") != KEPT_VERSION:
        raise ValueError(f"not version {KEPT_VERSION} of the kept foreign memory")
    figures = doc.get("foreignMiB")
    if not isinstance(figures, dict) or len(figures) > MAX_KEPT_GPUS:
        raise ValueError(f"foreignMiB must be a map of at most {MAX_KEPT_GPUS} GPUs")
    out = {}
    for gpu, mib in figures.items():
        if not gpu or isinstance(mib, bool) or not isinstance(mib, int) or not 0 < mib <= MAX_KEPT_MIB:
            raise ValueError(f"foreignMiB of {gpu!r} must be a whole number of MiB in [1, {MAX_KEPT_MIB}], got {mib!r}")
        out[gpu] = mib
    return out


def with_foreign(inv: NodeInventory, foreign: Mapping[str, int]) -> NodeInventory:
    """``inv`` with each GPU's ``foreign_mib`` set from ``foreign`` (0 where it names none)."""
    if not foreign and not any(g.foreign_mib for g in inv.gpus):
        return inv
    return replace(inv, gpus=tuple(replace(g, foreign_mib=foreign.get(g.uuid, 0)) for g in inv.gpus))
