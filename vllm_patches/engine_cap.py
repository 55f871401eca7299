"""The cap, attached to a live vLLM scheduler: block-pool wrapper, quota watcher, metric publishing.

Called from the ``Scheduler.__init__`` hook in :mod:`vllm_patches.vllm_glue`, in the engine-core
process. The block pool gets two instance-level overrides:

* ``get_num_free_blocks`` answers ``KvCap.free(raw)``. Every admission and growth decision in the
  v1 scheduler (``KVCacheManager.allocate_slots``) compares against it, so at the cap the scheduler
  sees a full cache and preempts exactly as it would on a genuinely full one.
* ``get_usage`` (the ``vllm:kv_cache_usage_perc`` metric) reports ``used / cap`` and
  ``reset_prefix_cache`` checks the raw pool (see :func:`_install_on_pool`).
* ``get_new_blocks`` refuses requests beyond the capped free count with the pool's own error, as a
  guard for code paths that allocate without asking first.

When kvcached manages the pool it enforces the cap itself (its instance limit, set through the
releaser): then ``get_num_free_blocks`` is kvcached's own count, passed through (the cap counts
once), and the cap is what kvcached offers under the limit. The engine's GPUs are the ones its
workers drive (tightest quota wins); it also publishes its KV demand (from the scheduler's queues)
and the quota generation it has applied.
"""
from __future__ import annotations

import contextlib
import os
import threading
from typing import Any, Callable

from vramshare import logs

from . import metrics
from .budget import min_blocks_for
from .cap import KvCap
from .release import KeepMapped, KvcachedRelease, Releaser, choose
from .settings import QuotaSettings
from .watcher import QuotaWatcher

log = logs.get(__name__)


def demand_blocks(queues: "list[Any]", block_size: int) -> int:
    """KV blocks the engine's requests would hold unfenced: every token of every running, waiting
    and preempted request (preempted ones wait again), each request counted once. An upper bound
    where prefix caching shares blocks between requests."""
    seen: set[str] = set()
    total = 0
    for queue in queues:
        for _ in range(3):  # the scheduler thread may change a queue while we copy it
            try:
                requests = list(queue)
                break
            except RuntimeError:
                continue
        else:
            requests = []
        for req in requests:
            rid = getattr(req, "request_id", id(req))
            if rid in seen:
                continue
            seen.add(rid)
            tokens = int(getattr(req, "num_tokens_with_spec", None) or getattr(req, "num_tokens", 0))
            total += -(-tokens // max(1, block_size))
    return total


def scheduler_queues(scheduler: Any) -> "list[Any]":
    """The scheduler's request collections (vLLM 0.32: running, waiting, kv_holding_waiting,
    deferred_waiting); missing ones are skipped so another minor version still reads the rest."""
    names = ("running", "waiting", "kv_holding_waiting", "deferred_waiting")
    return [q for q in (getattr(scheduler, n, None) for n in names) if q is not None]


class EngineCap:
    """Everything the plugin keeps per scheduler; reachable as ``scheduler._vramshare``."""

    def __init__(self, pool: Any, cap: KvCap, watcher: QuotaWatcher, state_dir: str, engine: str,
                 releaser: Releaser, compression_bits: int, connector: Any = None,
                 scheduler: Any = None, block_size: int = 16) -> None:
        self.pool = pool
        self.cap = cap
        self.watcher = watcher
        self.state_dir = state_dir
        self.engine = engine
        self.releaser = releaser
        self.compression_bits = compression_bits
        self.connector = connector  # the SnapshotConnector, for its counters
        self.scheduler = scheduler
        self.block_size = block_size
        self.raw_free: Callable[[], int] = pool.get_num_free_blocks
        self.generation_applied: int | None = None
        # kvcached's manager is not thread-safe under sync scheduling: limit changes from the
        # watcher thread and the scheduler's pool calls take this lock (see _install_on_pool)
        self.pool_lock: threading.RLock | None = threading.RLock() if cap.pool_limits else None

    def apply_cap(self) -> None:
        """Give the cap to the releaser; with a pool that limits itself, its answer is the cap."""
        with self.pool_lock or contextlib.nullcontext():
            offered = self.releaser.apply(self.cap.cap, self.cap.block_bytes, self.cap.min_blocks)
        if self.cap.pool_limits:
            self.cap.set_offered(offered)
        self._note_applied()

    def _note_applied(self) -> None:
        """The quota generation in force: its cap holds and, when releasing, its memory is back."""
        if not self.releaser.pending():
            self.generation_applied = self.watcher.tracker.generation

    def on_change(self, limit_mib: int) -> None:
        old, new = self.cap.set_limit(limit_mib)
        self.apply_cap()
        state = self.cap.state(self.raw_free())
        log.info("kv block cap changed", limit_mib=limit_mib, old_cap=old, new_cap=state.cap_blocks,
                 used_blocks=state.used_blocks, usable_blocks=state.usable_blocks,
                 release_mode=self.releaser.mode, generation=self.watcher.tracker.generation,
                 generation_applied=self.generation_applied)
        if state.below_minimum:
            log.warning("quota below one full-length request; cap held at the minimum",
                        limit_mib=limit_mib, min_blocks=self.cap.min_blocks)
        if isinstance(self.releaser, KeepMapped):
            self.releaser.on_cap(old, new, self.cap.usable_blocks, self.cap.block_bytes)
        self.publish()

    def tick(self) -> None:
        """Every watcher poll: follow kvcached's lazy shrink, note the generation, refresh metrics."""
        with self.pool_lock or contextlib.nullcontext():
            self.releaser.tick()
            if self.cap.pool_limits and isinstance(self.releaser, KvcachedRelease):
                self.cap.set_offered(self.releaser.offered(self.cap.block_bytes))
        self._note_applied()
        self.publish()

    def demand_bytes(self) -> int | None:
        if self.scheduler is None:
            return None
        return demand_blocks(scheduler_queues(self.scheduler), self.block_size) * self.cap.block_bytes

    def publish(self) -> None:
        state = self.cap.state(self.raw_free())
        doc: dict[str, Any] = {
            "quota_mib": state.quota_mib, "cap_blocks": state.cap_blocks,
            "used_blocks": state.used_blocks, "usable_blocks": state.usable_blocks,
            "block_bytes": state.block_bytes, "compression_bits": self.compression_bits,
            "release_mode": self.releaser.mode, "release_reason": self.releaser.reason,
            "kv_held_bytes": self.releaser.held_bytes(state.usable_blocks, state.block_bytes)}
        demand = self.demand_bytes()
        if demand is not None:
            doc["kv_demand_bytes"] = demand
        if self.generation_applied is not None:
            doc["generation_applied"] = self.generation_applied
        if self.connector is not None:
            doc["snapshots_taken"] = self.connector.snapshots_taken
            doc["snapshot_tokens_restored"] = self.connector.tokens_restored
        metrics.publish(self.state_dir, self.engine, doc)
        metrics.set_multiprocess(self.engine, doc)


def _guarded(fn: Callable[..., Any], lock: "threading.RLock | None") -> Callable[..., Any]:
    if lock is None:
        return fn

    def call(*args: Any, **kwargs: Any) -> Any:
        with lock:
            return fn(*args, **kwargs)
    return call


def _install_on_pool(pool: Any, cap: KvCap, lock: "threading.RLock | None" = None) -> None:
    """Give the scheduler the capped view, and keep vLLM's own accounting on the raw one.

    Only admission (``KVCacheManager.allocate_slots`` and friends) should see the cap. Two other
    readers of ``get_num_free_blocks`` must not: ``get_usage`` (the ``vllm:kv_cache_usage_perc``
    metric, which the quota loop reads as pressure) reports ``used / cap`` instead, so an idle
    shrunk engine reads 0; ``reset_prefix_cache`` (also the sleep and
    ``pause_scheduler(clear_cache=True)`` path) checks "only the null block is used" against the
    raw pool, else it fails on an idle engine after any shrink. Both run on the scheduler thread,
    the only thread that touches the pool, so swapping the method for the reset is safe.

    ``lock`` (kvcached pools): kvcached's manager takes no lock of its own under synchronous
    scheduling (``NoOpLock``), but its limit is changed from the watcher thread; the pool's
    allocation, free and count calls and the limit changes then share this lock.
    """
    raw_free = _guarded(pool.get_num_free_blocks, lock)
    raw_new = _guarded(pool.get_new_blocks, lock)
    raw_reset = _guarded(pool.reset_prefix_cache, lock)
    if lock is not None:
        pool.free_blocks = _guarded(pool.free_blocks, lock)

    def get_num_free_blocks() -> int:
        return cap.free(raw_free())

    def get_new_blocks(num_blocks: int) -> list[Any]:
        if num_blocks > get_num_free_blocks():
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool "
                             f"(vramshare cap {cap.cap} of {cap.usable_blocks})")
        return raw_new(num_blocks)

    def get_usage() -> float:
        return cap.usage(raw_free())

    def reset_prefix_cache() -> bool:
        pool.get_num_free_blocks = raw_free
        try:
            return raw_reset()
        finally:
            pool.get_num_free_blocks = get_num_free_blocks

    pool.get_num_free_blocks = get_num_free_blocks
    pool.vramshare_raw_free = raw_free  # the uncapped count (the snapshot connector's policy)
    pool.get_new_blocks = get_new_blocks
    pool.get_usage = get_usage
    pool.reset_prefix_cache = reset_prefix_cache


def block_bytes_of(kv_cache_config: Any) -> int:
    """Bytes of one block over all layers: the device KV allocation divided by the block count."""
    device = [t.size for t in kv_cache_config.kv_cache_tensors if not getattr(t, "host_resident", False)]
    return max(1, sum(device) // max(1, kv_cache_config.num_blocks))


def attach(scheduler: Any, vllm_config: Any, kv_cache_config: Any,
           settings: QuotaSettings) -> EngineCap | None:
    """Cap the scheduler's block pool to the quota and start following the quota file."""
    if getattr(scheduler, "_vramshare", None) is not None:
        return scheduler._vramshare
    manager = getattr(scheduler, "kv_cache_manager", None)
    pool = getattr(manager, "block_pool", None)
    if pool is None:
        log.warning("no block pool on scheduler; kv cap not installed")
        return None
    from .vllm_glue import engine_gpus

    gpus = engine_gpus(vllm_config)
    tracker = settings.engine_tracker(gpus)
    start = tracker.limit_mib
    if start is None:
        log.warning("no usable quota at scheduler start; kv cap not installed", gpus=list(gpus))
        return None
    releaser = choose(os.environ, pool)
    usable = pool.num_gpu_blocks - 1  # block 0 is vLLM's null block
    cap = KvCap(start_limit_mib=start, usable_blocks=usable,
                block_bytes=block_bytes_of(kv_cache_config),
                min_blocks=min_blocks_for(scheduler.max_model_len, scheduler.block_size),
                pool_limits=releaser.pool_limits,
                start_kv_bytes=getattr(vllm_config.cache_config, "kv_cache_memory_bytes", None))
    state_dir = metrics.ensure_state_dir(os.environ)
    engine = str(vllm_config.parallel_config.data_parallel_rank or 0)
    transfer = vllm_config.kv_transfer_config
    snapshots = transfer is not None and transfer.kv_connector == "SnapshotConnector"
    holder: dict[str, EngineCap] = {}
    watcher = QuotaWatcher(settings.path, tracker, lambda mib: holder["ec"].on_change(mib),
                           interval_s=settings.poll_s, on_tick=lambda: holder["ec"].tick())
    connector = getattr(scheduler, "connector", None) if snapshots else None
    bits = int(getattr(connector, "snapshot_bits", 16))
    ec = EngineCap(pool, cap, watcher, state_dir, engine, releaser, bits, connector,
                   scheduler=scheduler, block_size=scheduler.block_size)
    holder["ec"] = ec
    _install_on_pool(pool, cap, ec.pool_lock)
    ec.raw_free = pool.vramshare_raw_free
    ec.apply_cap()  # kvcached sized its pool before the scheduler existed: the quota's cap now
    scheduler._vramshare = ec
    ec.publish()
    log.info("kv block cap installed", limit_mib=start, usable_blocks=usable, cap_blocks=cap.cap,
             block_bytes=cap.block_bytes, non_kv_mib=round(cap.non_kv_bytes / (1 << 20), 1),
             min_blocks=cap.min_blocks, quota_file=settings.path, gpus=list(gpus),
             release_mode=releaser.mode, release_reason=releaser.reason)
    watcher.start()
    return ec
