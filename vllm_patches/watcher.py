"""Follow ``quota.json`` at runtime: a daemon thread that polls the file and reports new limits.

Polling the file's ``(mtime_ns, size, inode)`` once a second is enough: the quota loop rebalances on
a scale of seconds, the file is tiny, and polling works on every filesystem a Kubernetes volume can
be (inotify misses updates through the ``..data`` symlink swap of projected volumes and does not
work on some network filesystems). The quota loop writes atomically (write + rename), so a changed
inode is the normal signal; a half-written or malformed file is logged and the last good quota kept.
"""
from __future__ import annotations

import os
import threading
from typing import Callable

from vramshare import logs

from .quota import GpuQuota, QuotaError, parse_quota, select_gpu

log = logs.get(__name__)

ENV_POLL_S = "VRAMSHARE_QUOTA_POLL_S"
DEFAULT_POLL_S = 1.0


class QuotaTracker:
    """The last good limit for this GPU. Pure: feed it file contents, it says what changed."""

    def __init__(self, start_limit_mib: int | None, uuid: str | None, index: int = 0) -> None:
        self.limit_mib = start_limit_mib
        self.uuid = uuid
        self.index = index
        self.generation: int | None = None
        self.errors = 0

    def update(self, text: str | bytes) -> int | None:
        """Parse a new file body; return the new limit when it changed, else None.

        Malformed documents, and documents without an entry for this GPU, keep the last good limit:
        an engine that shrinks to nothing because a writer crashed mid-file is worse than one that
        follows the quota a few seconds late.
        """
        try:
            doc = parse_quota(text)
        except QuotaError as exc:
            self.errors += 1
            log.warning("quota file rejected, keeping last good quota", reason=str(exc),
                        limit_mib=self.limit_mib)
            return None
        gpu: GpuQuota | None = select_gpu(doc, self.uuid, self.index)
        if gpu is None:
            self.errors += 1
            log.warning("quota file has no entry for this GPU, keeping last good quota",
                        uuid=self.uuid, index=self.index, limit_mib=self.limit_mib)
            return None
        self.generation = doc.generation
        if gpu.limit_mib == self.limit_mib:
            return None
        self.limit_mib = gpu.limit_mib
        return gpu.limit_mib


class EngineTracker:
    """The quota of an engine that drives several GPUs: the tightest per-GPU limit.

    A tensor-parallel engine keeps the same KV blocks on every GPU of its group (each worker holds
    its shard of every block), so one scheduler cap serves them all and the GPU with the smallest
    budget decides it; a data-parallel engine follows only its own slice of GPUs
    (:func:`vllm_patches.quota.engine_gpu_indices`). Same interface as :class:`QuotaTracker`.
    """

    def __init__(self, trackers: list[QuotaTracker]) -> None:
        if not trackers:
            raise ValueError("an engine drives at least one GPU")
        self.trackers = trackers
        self.limit_mib = self._tightest()
        gens = [t.generation for t in trackers if t.generation is not None]
        self.generation: int | None = max(gens) if gens else None
        self.errors = sum(t.errors for t in trackers)

    def _tightest(self) -> int | None:
        limits = [t.limit_mib for t in self.trackers if t.limit_mib is not None]
        return min(limits) if limits else None

    def update(self, text: str | bytes) -> int | None:
        """Feed the file to every GPU's tracker; return the new tightest limit when it moved."""
        for t in self.trackers:
            t.update(text)
        self.errors = sum(t.errors for t in self.trackers)
        gens = [t.generation for t in self.trackers if t.generation is not None]
        self.generation = max(gens) if gens else self.generation
        new = self._tightest()
        if new is None or new == self.limit_mib:
            return None
        self.limit_mib = new
        return new


def read_file(path: str) -> bytes | None:
    """The file's bytes, or None when it does not exist (no quota loop yet)."""
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except FileNotFoundError:
        return None


class QuotaWatcher:
    """Polls one quota file and calls ``on_change(limit_mib)`` from a daemon thread.

    :meth:`poll_once` is public so a caller (and a test) can check the file synchronously; the
    thread only calls it on a timer. ``on_tick`` runs after every poll, changed or not, which is
    where the owner refreshes metrics that move without a quota change (blocks in use).
    """

    def __init__(self, path: str, tracker: QuotaTracker, on_change: Callable[[int], None], *,
                 interval_s: float = DEFAULT_POLL_S,
                 on_tick: Callable[[], None] | None = None) -> None:
        self.path = path
        self.tracker = tracker
        self.on_change = on_change
        self.on_tick = on_tick
        self.interval_s = interval_s
        self._stamp: tuple[int, int, int] | None = None
        self._missing = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._poll_lock = threading.Lock()

    def poll_once(self) -> int | None:
        """Look at the file now; apply and return the new limit if it changed."""
        with self._poll_lock:
            try:
                st = os.stat(self.path)
            except OSError as exc:
                if not self._missing:  # once per disappearance, not once a second
                    self._missing = True
                    log.warning("quota file unreadable, keeping last good quota", path=self.path,
                                reason=exc.strerror or type(exc).__name__,
                                limit_mib=self.tracker.limit_mib)
                return None
            if self._missing:
                self._missing = False
                log.info("quota file back", path=self.path)
            stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
            if stamp == self._stamp:
                return None
            body = read_file(self.path)
            if body is None:
                return None
            self._stamp = stamp
            new = self.tracker.update(body)
        if new is not None:
            self.on_change(new)
        return new

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.poll_once()
                if self.on_tick is not None:
                    self.on_tick()
            except Exception:  # the watcher must outlive any single bad poll
                log.error("quota watcher poll failed", exc_info=True, path=self.path)

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="vramshare-quota-watcher",
                                            daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
