"""Giving the physical memory of capped KV blocks back, where the platform allows it.

A cap alone keeps the memory allocated: the engine stops *using* the blocks above it, but the KV
tensor still holds them, so the GPU's free memory does not grow until the engine restarts. Two
implementations, chosen once per engine (:func:`choose`) and exported as the metric
``vramshare_vllm_release_mode{mode=...}`` so the quota loop knows what a shrink buys:

* ``unmap`` (:class:`KvcachedRelease`): kvcached (CUDA virtual memory) backs the KV cache and maps
  pages only for blocks in use. We write the capped KV bytes into kvcached's per-engine limit and
  read back what it has mapped, which is then the engine's KV memory for real.
* ``throttle`` (:class:`KeepMapped`): stock vLLM (plain ``torch.empty``). A shrink caps the blocks
  the scheduler may use; **no memory is released** until the engine restarts. The quota loop must
  not hand the difference to a co-tenant on the strength of the cap alone.
"""
from __future__ import annotations

import importlib.util
import os
from typing import Mapping, Protocol

from vramshare import logs

from . import kvcached_limit

log = logs.get(__name__)

MODE_UNMAP = "unmap"
MODE_THROTTLE = "throttle"


class Releaser(Protocol):
    """Called by the engine cap after every cap change and on every watcher tick."""

    mode: str

    def on_cap(self, old_cap: int, new_cap: int, usable_blocks: int, block_bytes: int) -> None:
        ...

    def held_bytes(self, usable_blocks: int, block_bytes: int) -> int:
        """KV bytes the engine holds on the device right now."""
        ...


class KeepMapped:
    """No physical release (no CUDA VMM): every allocated block stays mapped."""

    mode = MODE_THROTTLE

    def __init__(self) -> None:
        self.unreleased_bytes = 0

    def on_cap(self, old_cap: int, new_cap: int, usable_blocks: int, block_bytes: int) -> None:
        self.unreleased_bytes = (usable_blocks - new_cap) * block_bytes
        if new_cap < old_cap:
            log.info("kv blocks capped but memory kept mapped (no CUDA VMM backend)",
                     release_mode=self.mode,
                     unreleased_mib=round(self.unreleased_bytes / (1 << 20), 1),
                     blocks_above_cap=usable_blocks - new_cap)

    def held_bytes(self, usable_blocks: int, block_bytes: int) -> int:
        return usable_blocks * block_bytes


class KvcachedRelease:
    """Translate the cap into kvcached's per-engine limit; kvcached unmaps what is above it."""

    mode = MODE_UNMAP

    def __init__(self, ipc_name: str, shm_dir: str = kvcached_limit.SHM_DIR) -> None:
        self.ipc_name = ipc_name
        self.shm_dir = shm_dir
        self.limit_bytes: int | None = None

    def on_cap(self, old_cap: int, new_cap: int, usable_blocks: int, block_bytes: int) -> None:
        self.limit_bytes = new_cap * block_bytes
        info = kvcached_limit.write_limit(self.ipc_name, self.limit_bytes, self.shm_dir)
        log.info("kvcached kv limit set", release_mode=self.mode, ipc=self.ipc_name,
                 limit_mib=round(self.limit_bytes / (1 << 20), 1),
                 used_mib=round(info.used_size / (1 << 20), 1), blocks=new_cap)

    def reassert(self) -> None:
        """Put our limit back if something else (kvcached's start-up init, ``kvctl``) changed it."""
        if self.limit_bytes is None:
            return
        info = kvcached_limit.read(self.ipc_name, self.shm_dir)
        if info is None or info.total_size != self.limit_bytes:
            log.warning("kvcached kv limit differs from the quota; rewriting", ipc=self.ipc_name,
                        found=None if info is None else info.total_size, want=self.limit_bytes)
            kvcached_limit.write_limit(self.ipc_name, self.limit_bytes, self.shm_dir)

    def held_bytes(self, usable_blocks: int, block_bytes: int) -> int:
        info = kvcached_limit.read(self.ipc_name, self.shm_dir)
        if info is None:  # kvcached has not published yet: assume the worst
            return usable_blocks * block_bytes
        return info.used_size + info.prealloc_size


def choose(env: Mapping[str, str]) -> KeepMapped | KvcachedRelease:
    """kvcached when it is switched on, installed, and its segment name is known; else throttle."""
    if not kvcached_limit.enabled(env):
        return KeepMapped()
    if importlib.util.find_spec("kvcached") is None:
        log.warning("ENABLE_KVCACHED is set but kvcached is not installed; shrinks will not "
                    "release memory", release_mode=MODE_THROTTLE,
                    fix="pip install 'vramshare[kvcached]'")
        return KeepMapped()
    name = env.get(kvcached_limit.ENV_IPC_NAME, "").strip()
    if not name:
        log.warning("kvcached enabled but KVCACHED_IPC_NAME unset; cannot set its limit",
                    release_mode=MODE_THROTTLE)
        return KeepMapped()
    return KvcachedRelease(name)


def ensure_ipc_name(env: "os._Environ[str] | dict[str, str]") -> str | None:
    """In process 0: name kvcached's segment for this engine tree when kvcached is on.

    kvcached derives a default from the process group and probes for collisions, which we cannot
    reproduce from outside; an explicit name is, in kvcached's words, "a contract between all
    processes in one serving instance", and children inherit it from the environment.
    """
    if not kvcached_limit.enabled(env):
        return None
    name = env.get(kvcached_limit.ENV_IPC_NAME, "").strip()
    if not name:
        name = f"vramshare_vLLM_{os.getpid()}"
        env[kvcached_limit.ENV_IPC_NAME] = name
    return name
