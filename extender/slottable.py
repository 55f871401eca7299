"""The numpy side of the cluster: one row per node, one column per slot, and views cached per change.

Split from :mod:`extender.cluster` so the bookkeeping (names, pods, uuids) and the arrays that placement
reads stay small enough to read at once. Every array has a row per node (rows are reused after a node
goes) and grows in both directions as nodes with more slots appear. Pure, no I/O.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from vramshare.inventory import model_matches

SHARED = "shared"
EXCLUSIVE = "exclusive"
MIG_PREFIX = "mig:"
#: A gpu-memory ask with ``isolation: mig`` (issue 24): it takes one dynamic-MIG placement slot of the
#: smallest profile of that GPU's table that holds ``per_gpu`` (:meth:`ClusterState.kind_mask`).
MIG_FIT = "mig-fit"
NO_SLOT = -1  # kind code of an empty column
UNLIMITED = np.iinfo(np.int64).max // 4


class SlotTable:
    """Capacity, usage, kind, model, health and index per slot; CPU and memory per node."""

    def __init__(self, gpus_per_node: int = 8) -> None:
        self._kinds: dict[str, int] = {}
        self.model_names: list[str] = []
        self._model_codes: dict[str, int] = {}
        self.version = 0  # bumped on every change
        g = max(1, gpus_per_node)
        self.capacity = np.zeros((0, g), np.int64)
        self.used = np.zeros((0, g), np.int64)
        self.kind = np.full((0, g), NO_SLOT, np.int16)
        self.model = np.zeros((0, g), np.int32)
        self.healthy = np.zeros((0, g), bool)
        self.index = np.zeros((0, g), np.int32)
        self.cpu_cap = np.zeros(0, np.int64)  # host resources; tracked only where host_tracked
        self.cpu_used = np.zeros(0, np.int64)
        self.mem_cap = np.zeros(0, np.int64)
        self.mem_used = np.zeros(0, np.int64)
        self.host_tracked = np.zeros(0, bool)
        self.row_version = np.zeros(0, np.int64)  # bumped whenever a row's slots, usage or host change
        self.tie_rank = np.zeros(0, np.uint32)  # a stable per-node order for equal scores (CRC-32 of the name)
        self._views: dict[str, tuple[int, np.ndarray]] = {}  # name -> (version computed at, values)
        #: (table version, since version, rows in the table, rows changed since): :meth:`_changed_since`
        self._changed: tuple[int, int, int, np.ndarray] = (-1, -1, 0, np.zeros(0, np.int64))
        self._scale: tuple[int, float] = (-1, 1.0)
        self._model_masks: dict[tuple[tuple[str, ...], int], np.ndarray] = {}

    def _touch(self, row: int) -> None:
        self.version += 1
        self.row_version[row] = self.version

    # -- codes ------------------------------------------------------------------------------
    def kind_code(self, kind: str) -> int:
        """Small integer for a slot kind; new kinds get the next code."""
        if kind not in self._kinds:
            self._kinds[kind] = len(self._kinds)
        return self._kinds[kind]

    def model_code(self, model: str) -> int:
        if model not in self._model_codes:
            self._model_codes[model] = len(self.model_names)
            self.model_names.append(model)
        return self._model_codes[model]

    # -- growth ----------------------------------------------------------------------------
    def _grow(self, rows: int, cols: int) -> None:
        old_r, old_c = self.capacity.shape
        if rows <= old_r and cols <= old_c:
            return
        r, c = max(rows, old_r * 2 if rows > old_r else old_r), max(cols, old_c)

        def widen(a: np.ndarray, fill: object) -> np.ndarray:
            out = np.full((r, c) if a.ndim == 2 else (r,), fill, a.dtype)
            out[tuple(slice(0, n) for n in a.shape)] = a
            return out

        self.capacity, self.used = widen(self.capacity, 0), widen(self.used, 0)
        self.kind, self.model = widen(self.kind, NO_SLOT), widen(self.model, 0)
        self.healthy, self.index = widen(self.healthy, False), widen(self.index, 0)
        self.cpu_cap, self.cpu_used = widen(self.cpu_cap, 0), widen(self.cpu_used, 0)
        self.mem_cap, self.mem_used = widen(self.mem_cap, 0), widen(self.mem_used, 0)
        self.host_tracked = widen(self.host_tracked, False)
        self.row_version = widen(self.row_version, 0)
        self.tie_rank = widen(self.tie_rank, 0)

    # -- views for placement (kept current row by row) ---------------------------------------
    def _view(self, name: str, compute: Callable[[slice | np.ndarray], np.ndarray]) -> np.ndarray:
        """``compute(rows)`` for every row once, then only for the rows whose version moved since: after
        a bind one row changed, and recomputing 40,000 slots per view per cycle was most of a filter's
        fixed cost at 5,000 nodes. Callers copy what they take (fancy indexing), so patching in place
        changes nothing they hold."""
        hit = self._views.get(name)
        if hit is not None and hit[0] == self.version:
            return hit[1]
        if hit is None or hit[1].shape[0] != self.capacity.shape[0] or (
                hit[1].ndim == 2 and hit[1].shape[1] != self.capacity.shape[1]):
            values = compute(slice(None))
        else:
            values = hit[1]
            rows = self._changed_since(hit[0])
            if len(rows):
                values[rows] = compute(rows)
        self._views[name] = (self.version, values)
        return values

    def _changed_since(self, version: int) -> np.ndarray:
        """Rows whose ``row_version`` moved past ``version``: the views are brought up to date together
        (a filter reads four or five of them after each bind), so the scan is shared while the table
        stands still."""
        hit = self._changed
        if hit[0] == self.version and hit[1] == version and hit[2] == len(self.row_version):
            return hit[3]
        rows = np.flatnonzero(self.row_version > version)
        self._changed = (self.version, version, len(self.row_version), rows)
        return rows

    def free(self) -> np.ndarray:
        """Free amount per slot, 0 for unhealthy or absent slots and never negative. Read-only."""
        return self._view("free", lambda r: np.where(self.healthy[r], np.maximum(self.capacity[r] - self.used[r], 0), 0))

    def shared_mask(self) -> np.ndarray:
        """Healthy slots in shared mode: the only ones that fragment."""
        code = self.kind_code(SHARED)
        return self._view("shared", lambda r: (self.kind[r] == code) & self.healthy[r])

    def cpu_free(self) -> np.ndarray:
        """Free CPU per row; untracked rows are unlimited."""
        return self._view("cpu", lambda r: np.where(self.host_tracked[r], self.cpu_cap[r] - self.cpu_used[r], UNLIMITED))

    def mem_free(self) -> np.ndarray:
        return self._view("mem", lambda r: np.where(self.host_tracked[r], self.mem_cap[r] - self.mem_used[r], UNLIMITED))

    def gpu_scale(self) -> float:
        """Capacity of the largest shared GPU (1000 in the share view): the unit scores compare in."""
        if self._scale[0] != self.version:
            # per row, kept current row by row (a bind changes one row): the whole-table boolean mask
            # cost every request ~0.1 ms at 5,000 nodes once the books moved
            code = self.kind_code(SHARED)
            per_row = self._view("scale", lambda r: np.where((self.kind[r] == code) & self.healthy[r],
                                                             self.capacity[r], 0).max(axis=1, initial=0))
            top = int(per_row.max()) if per_row.size else 0
            self._scale = (self.version, float(top) if top > 0 else 1.0)
        return self._scale[1]

    def model_mask(self, patterns: Sequence[str]) -> np.ndarray:
        """Which model codes a ``gpu-models`` constraint allows (substring match, empty = all)."""
        key = (tuple(patterns), len(self.model_names))
        mask = self._model_masks.get(key)
        if mask is None:
            mask = np.array([model_matches(m, patterns) for m in self.model_names] or [True], bool)
            self._model_masks[key] = mask
        return mask
