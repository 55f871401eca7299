"""Per-row results that only change when the row does, so repeated requests recompute little.

Live, kube-scheduler asks about the same few request sizes over and over while only the nodes that
just got a pod change; in the simulator one node changes per task. Fragmentation per node is the
expensive part of FGD (``[nodes, GPUs, shapes]``), so it is memoised per (what it depends on) and
recomputed only for rows whose ``row_version`` moved. Bounded: least recently used keys are dropped.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Hashable

import numpy as np


class _Entry:
    __slots__ = ("values", "seen", "pin")

    def __init__(self, values: np.ndarray, seen: np.ndarray, pin: object) -> None:
        self.values, self.seen, self.pin = values, seen, pin


class RowMemo:
    """``get(key, rows, versions, compute)``: values for ``rows``, computing only stale ones."""

    def __init__(self, max_keys: int = 256) -> None:
        self._entries: OrderedDict[Hashable, _Entry] = OrderedDict()
        self._max = max_keys

    def get(self, key: Hashable, pin: object, rows: np.ndarray, versions: np.ndarray,
            compute: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
        """``pin`` is an object the values depend on by identity (e.g. the target workload).

        ``versions`` is the state's per-row version array (covering every row); ``compute(mask)``
        returns values for ``rows[mask]``.
        """
        entry = self._entries.get(key)
        if entry is None or entry.pin is not pin or len(entry.seen) < len(versions):
            entry = None
        stale = np.ones(len(rows), bool) if entry is None else entry.seen[rows] != versions[rows]
        if entry is None or stale.any():
            fresh = compute(stale)
            if entry is None:
                values = np.zeros((len(versions),) + fresh.shape[1:], fresh.dtype)
                entry = _Entry(values, np.full(len(versions), -1, np.int64), pin)
                self._entries[key] = entry
            elif fresh.shape[1:] != entry.values.shape[1:]:  # the row width grew: start over
                del self._entries[key]
                return self.get(key, pin, rows, versions, compute)
            entry.values[rows[stale]] = fresh
            entry.seen[rows[stale]] = versions[rows[stale]]
        self._entries.move_to_end(key)
        while len(self._entries) > self._max:
            self._entries.popitem(last=False)
        return entry.values[rows]

    def stale(self, key: Hashable, pin: object, rows: np.ndarray, versions: np.ndarray) -> np.ndarray:
        """The subset of ``rows`` whose values :meth:`get` would compute now (without computing)."""
        entry = self._entries.get(key)
        if entry is None or entry.pin is not pin or len(entry.seen) < len(versions):
            return rows
        return rows[entry.seen[rows] != versions[rows]]

    def clear(self) -> None:
        self._entries.clear()
