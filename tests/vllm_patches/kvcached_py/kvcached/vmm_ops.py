# SPDX-License-Identifier: Apache-2.0
"""kvcached's CUDA boundary, replaced: a Python port of ``kvcached._C.PageAllocator`` and
``InternalPage`` (kvcached 0.1.6, ``csrc/page_allocator.cpp``), with the GPU as :data:`DEVICE`.

Ported: page lists (free / reserved / reclaimed), ``alloc_page`` (reserved first, then free),
``free_pages`` (refill the reserve up to ``max_reserved`` and unmap the rest), ``resize`` (grow from
reclaimed then new ids; shrink from the back of the free list, unmapping the reserve when the free
list is short, refusing below the pages in use), ``trim``, the page counters and ``get_page_state``,
``get_avail_physical_pages`` (free device memory less ``1 - KVCACHED_GPU_UTILIZATION`` of the total,
per layer and buffer), and the ``MemInfoTracker`` (``csrc/inc/mem_info_tracker.hpp``): the segment
``/dev/shm/<ipc name>`` of three int64 ``total, used, prealloc`` under flock, written at start and
on every page change, and its resize watcher (``check_and_get_resize_target``: a segment total
that differs from the last observed size becomes the resize target), polled here at each
``get_resize_target`` instead of every 100 ms by a thread. Not ported: the background preallocation
thread (pages are mapped on demand; ``KVCACHED_PAGE_PREALLOC_ENABLED=false`` in kvcached's terms),
quarantine (mapping never fails here). "Mapping" a page charges
``page_size x layers x buffers`` bytes to :data:`DEVICE`, unmapping gives them back.
"""
from __future__ import annotations

import fcntl
import os
import struct
import threading
from collections import deque
from dataclasses import dataclass, field


@dataclass
class FakeDevice:
    """cudaMemGetInfo's view: what kvcached's pages take out of the device's free memory."""

    total_bytes: int = 80 << 30
    other_bytes: int = 0  # held by co-tenants
    mapped_bytes: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def free_bytes(self) -> int:
        return max(0, self.total_bytes - self.other_bytes - self.mapped_bytes)

    def charge(self, nbytes: int) -> None:
        with self._lock:
            self.mapped_bytes += nbytes


DEVICE = FakeDevice()
SHM_DIR = "/dev/shm"  # kvcached.utils.SHM_DIR


def kv_tensors_created(group_id: int = 0) -> bool:
    return True  # the engine's KV tensors exist (the CPU engine allocates them itself)


class InternalPage:
    def __init__(self, page_id: int, page_size: int) -> None:
        self.page_id = page_id
        self.page_size = page_size
        self.start_block = self.end_block = self.num_kv_blocks = 0
        self.free_list: list[int] = []

    def init(self, block_mem_size: int) -> None:
        self.start_block, self.end_block = self.get_block_range(self.page_id, self.page_size,
                                                                block_mem_size)
        self.num_kv_blocks = self.end_block - self.start_block
        self.free_list = list(range(self.start_block, self.end_block))

    def alloc(self, num_blocks: int = 1) -> list[int]:
        if len(self.free_list) < num_blocks:
            raise RuntimeError("Not enough free blocks in page")
        out, self.free_list = self.free_list[:num_blocks], self.free_list[num_blocks:]
        return out

    def free(self, block_id: int) -> None:
        self.free_list.append(block_id)

    def free_batch(self, block_ids: list[int]) -> None:
        self.free_list.extend(block_ids)

    def empty(self) -> bool:
        return len(self.free_list) == self.num_kv_blocks

    def full(self) -> bool:
        return not self.free_list

    def num_free_blocks(self) -> int:
        return len(self.free_list)

    def get_free_blocks(self) -> list[int]:
        return list(self.free_list)

    @staticmethod
    def get_block_range(page_id: int, page_size: int, block_mem_size: int) -> tuple[int, int]:
        start = (page_id * page_size + block_mem_size - 1) // block_mem_size
        end = ((page_id + 1) * page_size) // block_mem_size
        return start, end

    @staticmethod
    def get_num_blocks(page_size: int, block_mem_size: int) -> int:
        return page_size // block_mem_size


class PageAllocator:
    def __init__(self, num_layers: int, mem_size_per_layer: int, page_size: int,
                 world_size: int = 1, pp_rank: int = 0, async_sched: bool = False,
                 contiguous_layout: bool = True, enable_page_prealloc: bool = True,
                 num_kv_buffers: int = 2, group_id: int = 0, ipc_name: str = "") -> None:
        self.num_layers = num_layers
        self.page_size = page_size
        self.num_kv_buffers = num_kv_buffers
        self.gpu_utilization = float(os.getenv("KVCACHED_GPU_UTILIZATION", "0.95"))
        pages = mem_size_per_layer // page_size
        self.num_free_pages = pages
        self.num_total_pages = pages
        self.min_reserved = min(pages, int(os.getenv("KVCACHED_MIN_RESERVED_PAGES", "5")))
        self.max_reserved = min(pages, int(os.getenv("KVCACHED_MAX_RESERVED_PAGES", "10")))
        self.free_page_list: deque[int] = deque(range(pages))
        self.reserved_page_list: deque[int] = deque()
        self.reclaimed_page_list: deque[int] = deque()
        self.ipc_name = ipc_name
        self._lock = threading.RLock()
        self.last_observed_mem_size = mem_size_per_layer
        self.resize_target = -1
        self._segment_write(total=mem_size_per_layer * num_layers * num_kv_buffers)

    # -- MemInfoTracker -----------------------------------------------------------------------
    def _segment_path(self) -> str | None:
        if not self.ipc_name:
            return None
        return self.ipc_name if self.ipc_name.startswith("/") else os.path.join(SHM_DIR, self.ipc_name)

    def _segment_write(self, total: int | None = None) -> None:
        path = self._segment_path()
        if path is None:
            return
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        with os.fdopen(fd, "r+b") as fh:
            if os.fstat(fh.fileno()).st_size < 24:
                fh.truncate(24)
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                old_total, _, _ = struct.unpack("=3q", fh.read(24))
                used = self.get_num_inuse_pages() * self._bundle()
                prealloc = len(self.reserved_page_list) * self._bundle()
                fh.seek(0)
                fh.write(struct.pack("=3q", old_total if total is None else total, used, prealloc))
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    def _segment_total(self) -> int | None:
        path = self._segment_path()
        try:
            with open(path or "", "rb") as fh:
                fcntl.flock(fh, fcntl.LOCK_SH)
                try:
                    raw = fh.read(24)
                finally:
                    fcntl.flock(fh, fcntl.LOCK_UN)
        except OSError:
            return None
        return struct.unpack("=3q", raw)[0] if len(raw) == 24 else None

    def _watch(self) -> None:
        total = self._segment_total()
        if total is None:
            return
        new = total // self.num_layers // self.num_kv_buffers
        if new != self.last_observed_mem_size:
            self.last_observed_mem_size = new
            self.resize_target = new

    # -- the device boundary ----------------------------------------------------------------
    def _bundle(self) -> int:
        return self.page_size * self.num_layers * self.num_kv_buffers

    def _map(self, page_ids: list[int]) -> None:
        DEVICE.charge(len(page_ids) * self._bundle())
        self._segment_write()

    def _unmap(self, page_ids: list[int]) -> None:
        DEVICE.charge(-len(page_ids) * self._bundle())
        self._segment_write()

    # -- PageAllocator's API ------------------------------------------------------------------
    def alloc_page(self) -> InternalPage:
        with self._lock:
            if self.reserved_page_list:
                page_id = self.reserved_page_list.popleft()
                self.num_free_pages -= 1
                self._segment_write()
                return InternalPage(page_id, self.page_size)
            if not self.free_page_list:
                raise RuntimeError("No free pages left")
            page_id = self.free_page_list.popleft()
            self.num_free_pages -= 1
        self._map([page_id])
        return InternalPage(page_id, self.page_size)

    def free_page(self, page_id: int) -> None:
        self.free_pages([page_id])

    def free_pages(self, page_ids: list[int]) -> None:
        with self._lock:
            self.num_free_pages += len(page_ids)
            room = self.max_reserved - len(self.reserved_page_list)
            keep = list(page_ids[:max(0, room)])
            self.reserved_page_list.extend(keep)
            unmap = list(page_ids[len(keep):])
        self._segment_write()
        if unmap:
            self._unmap(unmap)
            with self._lock:
                self.free_page_list.extend(unmap)

    def resize(self, new_mem_size: int) -> bool:
        new_pages = new_mem_size // self.page_size
        with self._lock:
            if new_pages < self.get_num_inuse_pages():
                return False
            current = self.num_total_pages
            if new_pages == current:
                return True
            if new_pages > current:
                grow = new_pages - current
                reuse = min(len(self.reclaimed_page_list), grow)
                for _ in range(reuse):
                    self.free_page_list.append(self.reclaimed_page_list.popleft())
                grow -= reuse
                self.free_page_list.extend(range(current, current + grow))
                self.num_free_pages += reuse + grow
                self.num_total_pages = new_pages
                return True
            reclaim = current - new_pages
            if len(self.free_page_list) >= reclaim:
                for _ in range(reclaim):
                    self.reclaimed_page_list.append(self.free_page_list.pop())
                self.num_free_pages -= reclaim
                self.num_total_pages = new_pages
                return True
            if not self.reserved_page_list:
                return False
            unmap = list(self.reserved_page_list)
            self.reserved_page_list.clear()
        self._unmap(unmap)
        with self._lock:
            reclaim = self.num_total_pages - new_pages
            self.free_page_list.extend(unmap)
            if len(self.free_page_list) < reclaim:
                return False
            for _ in range(reclaim):
                self.reclaimed_page_list.append(self.free_page_list.pop())
            self.num_free_pages -= reclaim
            self.num_total_pages = new_pages
        return True

    def trim(self) -> None:
        with self._lock:
            unmap = list(self.reserved_page_list)
            self.reserved_page_list.clear()
        if unmap:
            self._unmap(unmap)
            with self._lock:
                self.free_page_list.extend(unmap)

    def get_num_free_pages(self) -> int:
        return self.num_free_pages

    def get_num_inuse_pages(self) -> int:
        return self.num_total_pages - self.num_free_pages

    def get_num_total_pages(self) -> int:
        return self.num_total_pages

    def get_num_reserved_pages(self) -> int:
        return len(self.reserved_page_list)

    def get_page_state(self) -> dict[str, int]:
        with self._lock:
            return {"total_pages": self.num_total_pages, "free_pages": self.num_free_pages,
                    "inuse_pages": self.get_num_inuse_pages(),
                    "reserved_pages": len(self.reserved_page_list)}

    def get_avail_physical_pages(self) -> int:
        headroom = int(DEVICE.total_bytes * (1.0 - self.gpu_utilization))
        usable = max(0, DEVICE.free_bytes() - headroom)
        return usable // self.page_size // self.num_layers // self.num_kv_buffers

    def get_resize_target(self) -> int:
        self._watch()
        return self.resize_target

    def get_page_id(self, block_id: int, block_mem_size: int) -> int:
        return block_id * block_mem_size // self.page_size

    def group_indices_by_page(self, indices: list[int], block_mem_size: int) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for idx in indices:
            out.setdefault(self.get_page_id(idx, block_mem_size), []).append(idx)
        return out

    def reset_free_page_order(self) -> None:
        with self._lock:
            self.free_page_list = deque(sorted(self.free_page_list))

    def start_prealloc_thread(self) -> None:
        pass

    def stop_prealloc_thread(self) -> None:
        pass

    def release_shared_segment(self) -> bool:
        return True

    def set_broadcast_map_callback(self, callback) -> None:  # noqa: ANN001
        pass

    def set_broadcast_unmap_callback(self, callback) -> None:  # noqa: ANN001
        pass

    def set_use_worker_ipc(self, use_worker_ipc: bool) -> None:
        pass
