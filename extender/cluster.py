"""Per-GPU accounting of the whole cluster, kept in numpy arrays so placement is vectorised.

The extender answers filter and prioritize for thousands of nodes inside kube-scheduler's serialized
cycle, so every request must be a handful of array operations, never a Python loop over GPUs. Each node
owns one row of ``[rows, G]`` arrays (capacity, used, kind and model codes, health: see
:mod:`extender.slottable`); here a name->row map and a uuid->(row, column) map translate at the edges
and each pod's holdings are kept so it can be released. Pure: no I/O, no clock. The simulator drives this same
state (``vramshare simulate``), adding the node CPU/memory that kube-scheduler checks in-tree live.
"""
from __future__ import annotations

import itertools
import zlib

from dataclasses import dataclass, field
from typing import Callable, Sequence, TypeVar

import numpy as np

from extender import mig_books
from extender.memo import RowMemo
from extender.slottable import EXCLUSIVE, MIG_FIT, MIG_PREFIX, NO_SLOT, SHARED, SlotTable
from extender.workload import Shape, TargetWorkload, WorkloadWindow

T = TypeVar("T")
#: The largest slot capacity accepted (16 TiB, far beyond any GPU; well inside int64 arithmetic).
MAX_SLOT_MIB = 1 << 24

__all__ = ["SHARED", "EXCLUSIVE", "MIG_PREFIX", "Slot", "Demand", "HostDemand", "SlotUsage", "OverCommit",
           "NoFit", "ClusterState"]


@dataclass(frozen=True)
class Slot:
    """One schedulable GPU-like thing on a node: a shared or exclusive GPU, or a MIG instance."""

    uuid: str
    model: str
    kind: str = SHARED  # "shared" | "exclusive" | "mig:<profile>"
    capacity: int = 0  # MiB live; 1000 in the simulator's share view; MIG = its memory
    healthy: bool = True
    index: int = 0  # GPU index on the node, for messages ("GPU 3")
    mig_table: str = ""  # dynamic MIG (issue 24): the placement's profile table (vramshare.mig.MODELS)
    mig_exists: bool = False  # dynamic MIG: an instance sits at this very placement now
    mig_isolation: bool = False  # dynamic MIG: the node's plugin serves isolation: mig memory asks on this GPU
    credit: int = 0  # MiB of ``capacity`` that is sleep credit (issue 23 item 5), shown by inspect
    foreign: int = 0  # MiB no pod of ours holds (vramshare.foreign): counted as used, beside the pods' bookings


@dataclass(frozen=True)
class Demand:
    """What one container asks: ``per_gpu`` on each of ``count`` distinct slots of one node."""

    per_gpu: int
    count: int = 1
    kind: str = SHARED
    models: tuple[str, ...] = ()  # allowed model substrings, empty = any


@dataclass(frozen=True)
class HostDemand:
    """Pod-level CPU and memory requests (kube-scheduler's Fit checks them too; FGD counts GPUs stranded
    behind a node's remaining CPU and memory). Live from the pod's requests, in the simulator from the trace."""

    cpu_milli: int = 0
    memory_mib: int = 0


@dataclass(frozen=True)
class SlotUsage:
    slot: Slot
    used: int
    pods: dict[str, int] = field(default_factory=dict)


class OverCommit(Exception):
    """An allocation that does not fit what is free; nothing was changed."""


class NoFit(Exception):
    """The demands do not fit the node; the message says why."""


@dataclass
class _Pod:
    node: str
    allocations: tuple[tuple[str, int], ...]
    host: HostDemand


class _RecentList:
    """A name list :meth:`ClusterState.rows_of` has answered, and its rows. Two lists are compared as
    one joined string each (one ``memcmp``: comparing 5,000 freshly decoded names one by one cost a
    request ~0.1 ms); the join is unambiguous only when no name holds the separator, so a list where
    one does is never compared this way (:meth:`key_of` answers ``None``)."""

    __slots__ = ("names", "rows", "_key")
    _SEP = "\n"

    def __init__(self, names: Sequence[str], rows: np.ndarray, key: str | None = None) -> None:
        self.names, self.rows, self._key = names, rows, key

    @classmethod
    def key_of(cls, names: Sequence[str]) -> str | None:
        try:
            joined = cls._SEP.join(names)
        except TypeError:  # not all strings: compare no key
            return None
        return joined if joined.count(cls._SEP) == len(names) - 1 or not names else None

    def key(self) -> str | None:
        """The joined names, computed on first need (filter's answer is compared only if a list of its
        length comes)."""
        if self._key is None:
            self._key = self.key_of(self.names)
        return self._key


class ClusterState(SlotTable):
    """Nodes, their slots and what each pod holds. Not thread-safe: the adapter serialises writes."""

    def __init__(self, workload_window: int = 1000, gpus_per_node: int = 8) -> None:
        super().__init__(gpus_per_node)
        self._rows: dict[str, int] = {}
        self._lookup: tuple[int, dict[str, int]] = (-1, {})  # (names_epoch, a compact copy of _rows): rows_of
        self._names: list[str | None] = []
        self._spare: list[int] = []
        self._slots: list[list[Slot]] = []
        self._uuids: dict[str, tuple[int, int]] = {}
        self._pods: dict[str, _Pod] = {}
        self._holders: dict[tuple[int, int], dict[str, int]] = {}
        self.window = WorkloadWindow(workload_window)
        self.pinned: TargetWorkload | None = None
        self.memo = RowMemo()
        #: (demands, host) -> (state version, row versions, value): :meth:`memo_fit`
        self._fits: dict[tuple[tuple[Demand, ...], HostDemand], tuple[int, np.ndarray, object]] = {}
        self._recent_rows: list[_RecentList] = []  # cleared when rows change hands
        #: Bumped whenever a row changes hands (a node added to a row or removed from one): whatever
        #: is cached per row about its *name* (the wire's encoded entries) is valid for one epoch.
        self.names_epoch = 0
        self._mig: dict[int, dict[str, mig_books.GpuGeometry]] = {}  # row -> dynamic-MIG GPUs (issue 24)

    # -- nodes ------------------------------------------------------------------------------
    def set_node(self, name: str, slots: Sequence[Slot]) -> None:
        """Add or replace a node's slots; usage on slots that remain (same uuid) is kept.

        All or nothing: every check runs before the first write, so a refused inventory leaves the
        node's last good slots *and* their usage as they were."""
        uuids = [s.uuid for s in slots]
        if len(set(uuids)) != len(uuids):
            raise ValueError(f"node {name}: duplicate slot uuid")
        for s in slots:
            if not isinstance(s.capacity, int) or isinstance(s.capacity, bool) or not 0 <= s.capacity <= MAX_SLOT_MIB:
                raise ValueError(f"node {name}: GPU {s.uuid} capacity {s.capacity!r} MiB is outside 0..{MAX_SLOT_MIB}")
        row = self._rows.get(name)
        for u in uuids:  # a UUID names one physical GPU: two nodes announcing it is a broken inventory
            where = self._uuids.get(u)
            if where is not None and where[0] != row:
                raise ValueError(f"node {name}: GPU {u} is already announced by node {self._names[where[0]]}")
        if row is None:
            row = self._spare.pop() if self._spare else len(self._names)
            if row == len(self._names):
                self._names.append(name)
                self._slots.append([])
            self._names[row] = name
            self._rows[name] = row
            self._recent_rows.clear()
            self.names_epoch += 1
        self._grow(row + 1, len(slots))
        self.tie_rank[row] = zlib.crc32(name.encode())
        # what pods use of each slot that stays; the node's foreign memory is replaced by the new report's
        old = {s.uuid: (col, int(self.used[row, col]) - s.foreign) for col, s in enumerate(self._slots[row])}
        old_holders = {s.uuid: self._holders.pop((row, col), {}) for col, s in enumerate(self._slots[row])}
        for s in self._slots[row]:
            self._uuids.pop(s.uuid, None)
        self.kind[row], self.capacity[row], self.used[row] = NO_SLOT, 0, 0
        self.healthy[row], self.model[row], self.index[row] = False, 0, 0
        for col, s in enumerate(slots):
            self.kind[row, col] = self.kind_code(s.kind)
            self.model[row, col] = self.model_code(s.model)
            self.capacity[row, col], self.healthy[row, col], self.index[row, col] = s.capacity, s.healthy, s.index
            self.used[row, col] = max(0, old[s.uuid][1] if s.uuid in old else 0) + s.foreign
            if s.uuid in old:
                if old_holders[s.uuid]:
                    self._holders[(row, col)] = old_holders[s.uuid]
            self._uuids[s.uuid] = (row, col)
        self._slots[row] = list(slots)
        geo = mig_books.geometry(slots)
        if geo:
            self._mig[row] = geo
        else:
            self._mig.pop(row, None)
        self._reblock(row)
        self._touch(row)

    def _reblock(self, row: int | None) -> None:
        """Dynamic MIG: placements that overlap a booked or existing instance get no capacity."""
        if row is not None and row in self._mig:
            mig_books.reblock(self, row, self._mig[row])

    def mig_geometry(self, node: str) -> dict[str, "mig_books.GpuGeometry"]:
        """The node's dynamic-MIG GPUs (empty for most nodes)."""
        row = self._rows.get(node)
        return self._mig.get(row, {}) if row is not None else {}

    def kind_mask(self, d: Demand, rows: np.ndarray) -> np.ndarray:
        """``[n, G]`` slots of the kind demand ``d`` takes (health and models aside). A :data:`MIG_FIT` ask
        (``isolation: mig``) takes the placements of the smallest profile of each dynamic-MIG GPU's
        table that holds ``d.per_gpu`` (:func:`mig_books.fit_columns`): none where no profile does."""
        if d.kind != MIG_FIT:
            return self.kind[rows] == self.kind_code(d.kind)
        out = np.zeros((len(rows), self.kind.shape[1]), bool)
        if self._mig:
            for i, r in enumerate(rows.tolist()):
                for g in self._mig.get(r, {}).values():
                    out[i, mig_books.fit_columns(g, d.per_gpu)] = True
        return out

    def set_host(self, name: str, cpu_milli: int, memory_mib: int) -> None:
        """Track a node's allocatable CPU and memory (live: ``status.allocatable``; simulator: the trace)."""
        row = self._rows[name]
        if self.host_tracked[row] and (self.cpu_cap[row], self.mem_cap[row]) == (cpu_milli, memory_mib):
            return
        self.cpu_cap[row], self.mem_cap[row], self.host_tracked[row] = cpu_milli, memory_mib, True
        self._touch(row)

    def untrack_host(self, name: str) -> None:
        """Forget a node's CPU and memory limits (its allocatable is no longer published): unlimited."""
        row = self._rows[name]
        if self.host_tracked[row]:
            self.host_tracked[row] = False
            self._touch(row)

    def remove_node(self, name: str) -> None:
        row = self._rows.pop(name, None)
        if row is None:
            return
        self._recent_rows.clear()
        self.names_epoch += 1
        for col, s in enumerate(self._slots[row]):
            self._uuids.pop(s.uuid, None)
            self._holders.pop((row, col), None)
        self._slots[row], self._names[row] = [], None
        self._mig.pop(row, None)
        self.kind[row], self.capacity[row], self.used[row], self.healthy[row] = NO_SLOT, 0, 0, False
        self.cpu_cap[row] = self.cpu_used[row] = self.mem_cap[row] = self.mem_used[row] = 0
        self.host_tracked[row] = False
        self._spare.append(row)
        self._touch(row)

    def all_rows(self) -> np.ndarray:
        return np.arange(len(self._names))

    def live_rows(self) -> np.ndarray:
        """Rows that hold a node now (rows of removed nodes wait for reuse)."""
        if not self._spare:
            return self.all_rows()
        return np.array(sorted(self._rows.values()), np.int64)

    def memo_fit(self, demands: tuple[Demand, ...], host: HostDemand,
                 compute: Callable[[T | None, np.ndarray], T]) -> T:
        """The greedy fit of one pod shape over every row, kept per shape and brought up to date row by
        row: kube-scheduler asks filter, then prioritize, for one pod against one state, and the
        policies read the same fit; after a bind or a watch event only the rows it touched are stale.
        ``compute(previous, rows)`` returns the value for every row given the previous one (``None``:
        compute every row, then ``rows`` is :meth:`all_rows`) and the rows whose version moved."""
        key = (demands, host)
        entry = self._fits.get(key)
        if entry is not None and entry[0] == self.version:
            return entry[2]  # type: ignore[no-any-return]
        n = len(self._names)
        versions = self.row_version[:n]
        if entry is None or len(entry[1]) != n:
            value = compute(None, self.all_rows())
        else:
            stale = np.flatnonzero(entry[1] != versions)
            value = compute(entry[2], stale) if len(stale) else entry[2]
        if entry is None and len(self._fits) >= 64:
            self._fits.clear()
        self._fits[key] = (self.version, versions.copy(), value)
        return value

    def nodes(self) -> list[str]:
        return list(self._rows)

    def row(self, name: str) -> int | None:
        return self._rows.get(name)

    def rows_of(self, names: Sequence[str], remember: bool = True) -> np.ndarray:
        """Row per name, -1 where the name is unknown. kube-scheduler sends the same node list cycle
        after cycle, so the last few lists are remembered: comparing a list is cheaper than hashing
        every freshly decoded name again. ``remember=False``: a one-off list (filter's failed nodes),
        looked up without pushing the lists kube-scheduler repeats out of the few remembered."""
        if self._lookup[0] != self.names_epoch:  # _rows copied in one go, names and rows side by side in
            # memory: kube-scheduler's order is new every cycle (its filter is parallel), and 5,000 lookups
            # into the books' scattered keys and row ints cost ~2.7 ms of a filter, ~1 ms in this copy
            self._lookup = (self.names_epoch, dict(zip([n.encode().decode() for n in self._rows],
                                                       np.fromiter(self._rows.values(), np.int64).tolist())))
        lookup = self._lookup[1]
        if not remember:
            return np.fromiter(map(lookup.get, names, itertools.repeat(-1)), np.int64, len(names))
        recent = self._recent_rows
        for i, entry in enumerate(recent):  # the very list filter answered with (its holds step)
            if entry.names is names:
                return self._hit(i)
        key = _RecentList.key_of(names)
        if key is not None:
            for i, entry in enumerate(recent):
                if len(entry.names) == len(names) and entry.key() == key:
                    return self._hit(i)
        rows = np.fromiter(map(lookup.get, names, itertools.repeat(-1)), np.int64, len(names))
        rows.setflags(write=False)
        self._recent_rows = [_RecentList(list(names), rows, key)] + recent[:3]  # a copy: callers may reuse theirs
        return rows

    def _hit(self, i: int) -> np.ndarray:
        if i:
            self._recent_rows.insert(0, self._recent_rows.pop(i))
        return self._recent_rows[0].rows

    def remember_rows(self, names: list[str], rows: np.ndarray) -> None:
        """Register a name list whose rows are known (filter's answer): kube-scheduler sends exactly that
        list to prioritize next, and :meth:`rows_of` then finds it without hashing every name."""
        rows = np.asarray(rows, np.int64).copy()
        rows.setflags(write=False)
        self._recent_rows = [_RecentList(names, rows)] + self._recent_rows[:3]

    def name(self, row: int) -> str:
        name = self._names[row]
        assert name is not None
        return name

    def slots(self, row: int) -> list[Slot]:
        return self._slots[row]

    # -- pods -------------------------------------------------------------------------------
    def add_pod(self, key: str, node: str, allocations: Sequence[tuple[str, int]],
                host: HostDemand = HostDemand(), strict_host: bool = True, *, force: bool = False,
                beside_foreign: bool = True) -> None:
        """Record a pod's holdings; all or nothing. Same key and same holdings again is a no-op.

        ``force`` records what is already true (the device plugin's report of a running pod's GPUs)
        even beyond what is free: the books must say what the GPUs hold, and a GPU shown over capacity
        takes no more pods. ``beside_foreign=False`` checks the pods' bookings alone, not the memory the
        node reports no pod of ours holds (:mod:`vramshare.foreign`): a decision already made (a pod the
        watch shows assumed) is recorded even where foreign memory appeared since, only a new plan must fit
        beside it. ``strict_host=False`` records CPU and memory even past the node's
        allocatable: the accounting mirrors pods the kubelet already runs (kube-scheduler and the
        kubelet admit CPU and memory), so refusing them would only make the extender blind to what is used."""
        allocs = tuple((u, int(a)) for u, a in allocations)
        prev = self._pods.get(key)
        if prev is not None:
            if prev.node == node and sorted(prev.allocations) == sorted(allocs) and prev.host == host:
                return
            self.remove_pod(key)
            try:
                self.add_pod(key, node, allocs, host, strict_host, force=force, beside_foreign=beside_foreign)
            except OverCommit:
                self.add_pod(key, prev.node, prev.allocations, prev.host, strict_host=False)
                raise
            return
        row = self._rows.get(node)
        if row is None:
            raise OverCommit(f"node {node} is not known")
        per_slot: dict[tuple[int, int], int] = {}
        for uuid, amount in allocs:
            where = self._uuids.get(uuid)
            if where is None or where[0] != row:
                raise OverCommit(f"GPU {uuid} is not on node {node}")
            if not 0 < amount <= MAX_SLOT_MIB:
                raise OverCommit(f"allocation of {amount} MiB on GPU {uuid} is not in 1..{MAX_SLOT_MIB}")
            per_slot[where] = per_slot.get(where, 0) + amount
        for (r, c), amount in per_slot.items():
            s = self._slots[r][c]
            free = int(self.capacity[r, c] - self.used[r, c]) + (0 if beside_foreign else s.foreign)
            if amount > free and not force:
                raise OverCommit(f"GPU {s.index} ({s.uuid}) on {node} has {free} free, pod {key} needs {amount}")
        if self.host_tracked[row] and strict_host:
            if host.cpu_milli > self.cpu_cap[row] - self.cpu_used[row]:
                raise OverCommit(f"node {node} lacks CPU for pod {key}")
            if host.memory_mib > self.mem_cap[row] - self.mem_used[row]:
                raise OverCommit(f"node {node} lacks memory for pod {key}")
        self.cpu_used[row] += host.cpu_milli  # charged on every row: tracking may start later
        self.mem_used[row] += host.memory_mib
        for (r, c), amount in per_slot.items():
            self.used[r, c] += amount
            holders = self._holders.setdefault((r, c), {})
            holders[key] = holders.get(key, 0) + amount
        self._pods[key] = _Pod(node, allocs, host)
        self._reblock(row)
        self._touch(row)

    def remove_pod(self, key: str) -> None:
        pod = self._pods.pop(key, None)
        if pod is None:
            return
        row = self._rows.get(pod.node)
        for uuid, amount in pod.allocations:
            where = self._uuids.get(uuid)
            if where is None or where[0] != row:
                continue  # the slot went away with a node update
            holders = self._holders.get(where, {})
            if holders.pop(key, None) is not None:
                self.used[where] = max(0, int(self.used[where]) - amount)
            if not holders:
                self._holders.pop(where, None)
        if row is not None:
            self.cpu_used[row] -= pod.host.cpu_milli
            self.mem_used[row] -= pod.host.memory_mib
        if row is not None:
            self._reblock(row)
            self._touch(row)

    def has_pod(self, key: str) -> bool:
        return key in self._pods

    def pod_host(self, key: str) -> HostDemand | None:
        """The CPU and memory booked for a pod (what a what-if must put back with its GPUs)."""
        pod = self._pods.get(key)
        return pod.host if pod else None

    def pod_node(self, key: str) -> str | None:
        pod = self._pods.get(key)
        return pod.node if pod else None

    def pod_allocations(self, key: str) -> tuple[tuple[str, int], ...]:
        """The (GPU uuid, MiB) a pod is booked for; empty for an unknown pod."""
        pod = self._pods.get(key)
        return pod.allocations if pod else ()

    def node_usage(self, name: str) -> list[SlotUsage]:
        row = self._rows.get(name)
        if row is None:
            return []
        return [SlotUsage(s, int(self.used[row, c]), dict(self._holders.get((row, c), {})))
                for c, s in enumerate(self._slots[row])]

    # -- target workload (FGD) --------------------------------------------------------------
    def observe(self, demands: Sequence[Demand], host: HostDemand = HostDemand()) -> None:
        """Record request sizes: the recent distribution is FGD's target workload."""
        for d in demands:
            self.window.add(Shape(d.per_gpu, d.count, d.kind, tuple(d.models), host.cpu_milli, host.memory_mib))

    def target_workload(self) -> TargetWorkload:
        """The pinned workload (the paper's typical pods) when set, else the recent window."""
        return self.pinned if self.pinned is not None else self.window.workload()
