"""kvcached's per-engine KV limit: the quota, as kvcached reads it, and kvcached's measured use.

kvcached (github.com/ovg-project/kvcached, Apache-2.0; ``pip install 'vramshare[kvcached]'``)
backs vLLM's KV cache with CUDA virtual memory and maps physical pages only for blocks in use, so
freed blocks give their memory back to the GPU. Each engine has a POSIX shared-memory segment,
``/dev/shm/<KVCACHED_IPC_NAME>``, of three native int64 ``total_size, used_size, prealloc_size``
read and written under ``fcntl.flock`` (shared to read, exclusive to write). kvcached's engine
reads ``total_size`` as its KV limit (bytes over all layers, K and V) and unmaps down to it; it
writes ``used_size`` / ``prealloc_size`` (bytes mapped for blocks in use / pages kept ready).

This module is that format, and nothing else: we write ``total_size`` from the quota and read
``used_size`` back as the engine's real KV memory. It does not import kvcached (which needs CUDA to
build); ``tests/vllm_patches/test_kvcached_limit.py`` checks it against a verbatim copy of
kvcached's own reader (``kvcached/cli/utils.py``: ``RwLockedShm``, ``MemInfoStruct``,
``get_kv_cache_limit``, ``update_kv_cache_limit``). Same open/create/lock sequence as their
``RwLockedShm.__enter__``: open ``r+b``, create (mode 0666) only when writing, grow to 24 bytes,
then flock.
"""
from __future__ import annotations

import fcntl
import os
import struct
from dataclasses import dataclass

SHM_DIR = "/dev/shm"
ENV_IPC_NAME = "KVCACHED_IPC_NAME"
ENV_ENABLE = "ENABLE_KVCACHED"
_FMT = "=3q"  # numpy int64, native byte order, as kvcached's MemInfoStruct
SEGMENT_BYTES = struct.calcsize(_FMT)


@dataclass(frozen=True)
class KvcachedMemInfo:
    """One reading of the segment, in bytes."""

    total_size: int
    used_size: int
    prealloc_size: int


def segment_path(ipc_name: str, shm_dir: str = SHM_DIR) -> str:
    """Where the segment lives; an absolute name is taken as is (as kvcached's ``get_ipc_path``)."""
    if ipc_name.startswith("/"):
        return ipc_name
    if not ipc_name or "/" in ipc_name:
        raise ValueError(f"bad kvcached IPC name {ipc_name!r}")
    return os.path.join(shm_dir, ipc_name)


def read(ipc_name: str, shm_dir: str = SHM_DIR) -> KvcachedMemInfo | None:
    """The segment under a shared lock; None when kvcached has not created it (yet)."""
    try:
        fh = open(segment_path(ipc_name, shm_dir), "rb")
    except FileNotFoundError:
        return None
    with fh:
        fcntl.flock(fh, fcntl.LOCK_SH)
        try:
            raw = fh.read(SEGMENT_BYTES)
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
    if len(raw) < SEGMENT_BYTES:
        return None
    return KvcachedMemInfo(*struct.unpack(_FMT, raw))


def write_limit(ipc_name: str, total_bytes: int, shm_dir: str = SHM_DIR) -> KvcachedMemInfo:
    """Set ``total_size`` under an exclusive lock, keeping kvcached's ``used`` / ``prealloc``.

    Creates the segment (zeros) when missing, as kvcached's ``update`` path does for a writer.
    Returns the segment as written.
    """
    if total_bytes < 0:
        raise ValueError(f"kvcached limit must be >= 0, got {total_bytes}")
    path = segment_path(ipc_name, shm_dir)
    try:
        fh = open(path, "r+b")
    except FileNotFoundError:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        fh = os.fdopen(fd, "r+b")
    with fh:
        if os.fstat(fh.fileno()).st_size < SEGMENT_BYTES:
            fh.truncate(SEGMENT_BYTES)
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            fh.seek(0)
            _, used, prealloc = struct.unpack(_FMT, fh.read(SEGMENT_BYTES))
            fh.seek(0)
            fh.write(struct.pack(_FMT, int(total_bytes), used, prealloc))
            fh.flush()
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
    return KvcachedMemInfo(int(total_bytes), used, prealloc)


def enabled(env: "os._Environ[str] | dict[str, str]") -> bool:
    """kvcached's own switch (``ENABLE_KVCACHED``, read by its vLLM patches) is on."""
    return env.get(ENV_ENABLE, "false").strip().lower() in ("true", "1")
