"""Giving the physical memory of capped KV blocks back, where the platform allows it.

A cap alone keeps the memory allocated: the engine stops *using* the blocks above it, but the KV
tensor still holds them, so the GPU's free memory does not grow until the engine restarts. Two
implementations, chosen once per engine (:func:`choose`) and exported as the metric
``vramshare_vllm_release_mode{mode=...,reason=...}`` so the quota loop knows what a shrink buys:

* ``unmap`` (:class:`KvcachedRelease`): kvcached (CUDA virtual memory) backs the KV cache and maps
  pages only for blocks in use. The cap goes to kvcached through its in-process API,
  ``kvcached.control.set_instance_memory_limit(bytes, revision=...)`` (kvcached splits it over its
  pools and unmaps down to it, at once or lazily as blocks are freed); its block pool then offers
  exactly what the limit allows, so **the plugin deducts nothing more** (the cap counts once) and
  reads the mapped bytes back from the same call.
* ``throttle`` (:class:`KeepMapped`): stock vLLM (plain ``torch.empty``), or kvcached switched off
  because it cannot run this vLLM (``reason`` says why). A shrink caps the blocks the scheduler
  may use; **no memory is released** until the engine restarts. The quota loop must not hand the
  difference to a co-tenant on the strength of the cap alone.

Each releaser also says which quota generation it has *applied*: throttle at once (the cap is all
it does), unmap once kvcached reports the limit ``applied`` (mapped bytes under it), not while it
is ``deferred`` behind blocks still in use (``vramshare_vllm_quota_generation_applied``).
"""
from __future__ import annotations

import importlib
import os
from typing import Any, Mapping, Protocol

from vramshare import logs

from . import kvcached_compat

log = logs.get(__name__)

MODE_UNMAP = "unmap"
MODE_THROTTLE = "throttle"


class Releaser(Protocol):
    """Called by the engine cap after every cap change and on every watcher tick."""

    mode: str
    reason: str  # why this mode ("" when it is the natural one)
    pool_limits: bool  # the block pool enforces the cap itself: the plugin must not deduct again

    def apply(self, cap_blocks: int, block_bytes: int, floor_blocks: int = 1) -> int:
        """Put ``cap_blocks`` in force; return the blocks the pool will offer under it (at least
        ``floor_blocks`` when the cap allows them)."""
        ...

    def pending(self) -> bool:
        """A shrink is applied to the scheduler but its memory is not given back yet."""
        ...

    def tick(self) -> None:
        """Every watcher poll."""
        ...

    def held_bytes(self, usable_blocks: int, block_bytes: int) -> int:
        """KV bytes the engine holds on the device right now."""
        ...


class KeepMapped:
    """Stock vLLM: the cap is the only lever; every allocated block stays in device memory."""

    mode = MODE_THROTTLE
    pool_limits = False

    def __init__(self, reason: str = "") -> None:
        self.reason = reason
        self.unreleased_bytes = 0

    def apply(self, cap_blocks: int, block_bytes: int, floor_blocks: int = 1) -> int:
        return cap_blocks

    def on_cap(self, old_cap: int, new_cap: int, usable_blocks: int, block_bytes: int) -> None:
        self.unreleased_bytes = max(0, usable_blocks - new_cap) * block_bytes

    def pending(self) -> bool:
        return False

    def tick(self) -> None:
        pass

    def held_bytes(self, usable_blocks: int, block_bytes: int) -> int:
        return usable_blocks * block_bytes


class KvcachedRelease:
    """kvcached backs the pool: its instance memory limit is the cap, set in-process.

    ``control`` is the ``kvcached.control`` module (``set_instance_memory_limit``). Each apply uses
    a new revision (kvcached refuses a reused revision with another limit: ``conflict``). The limit
    includes vLLM's null block, which kvcached allocates from the same pool; kvcached rounds it down
    to whole pages (``page size x layers x K/V``), and the blocks offered follow from its answer.
    """

    mode = MODE_UNMAP
    reason = ""
    pool_limits = True
    NULL_BLOCKS = 1

    def __init__(self, control: Any) -> None:
        self.control = control
        self.revision = 0
        self.limit_bytes: int | None = None
        self.state: dict[str, Any] = {}

    def apply(self, cap_blocks: int, block_bytes: int, floor_blocks: int = 1) -> int:
        """Set kvcached's limit to the cap (rounded down to its pages, so within the quota), or up
        to the fewest pages that hold ``floor_blocks`` when rounding down would leave less."""
        want = (cap_blocks + self.NULL_BLOCKS) * block_bytes
        offered = self._set(want, block_bytes)
        step = block_bytes
        while offered < min(floor_blocks, cap_blocks) and step < (1 << 40):
            want += step
            step *= 2
            offered = self._set(want, block_bytes)
        log.info("kvcached kv limit set", release_mode=self.mode, status=self.state.get("status"),
                 limit_mib=round(want / (1 << 20), 1),
                 mapped_mib=round(int(self.state.get("mapped_bytes") or 0) / (1 << 20), 1),
                 blocks=cap_blocks, offered_blocks=offered)
        return offered

    def _set(self, limit_bytes: int, block_bytes: int) -> int:
        self.limit_bytes = limit_bytes
        self.revision += 1
        self.state = self.control.set_instance_memory_limit(limit_bytes, revision=self.revision)
        return self.offered(block_bytes)

    def offered(self, block_bytes: int) -> int:
        """Blocks kvcached's pool offers under its effective limit (less vLLM's null block)."""
        return max(0, int(self.state.get("effective_limit_bytes") or 0) // block_bytes
                   - self.NULL_BLOCKS)

    def pending(self) -> bool:
        return self.state.get("status") in ("deferred", "unavailable")

    def tick(self) -> None:
        """Re-read kvcached's state (same revision and limit: kvcached answers without changing it)."""
        if self.limit_bytes is not None:
            self.state = self.control.set_instance_memory_limit(self.limit_bytes,
                                                                revision=self.revision)

    def held_bytes(self, usable_blocks: int, block_bytes: int) -> int:
        if "mapped_bytes" not in self.state:  # kvcached has not answered yet: assume the worst
            return usable_blocks * block_bytes
        return int(self.state["mapped_bytes"])


def choose(env: Mapping[str, str], pool: Any) -> KeepMapped | KvcachedRelease:
    """kvcached when it really manages this engine's block pool; else throttle, saying why."""
    fallback = env.get(kvcached_compat.ENV_FALLBACK, "").strip()
    if fallback:
        log.warning("kvcached switched off; shrinks will not release memory",
                    release_mode=MODE_THROTTLE, reason=fallback)
        return KeepMapped(fallback)
    if not kvcached_compat.enabled(env):
        return KeepMapped()
    if getattr(pool, "kv_cache_manager", None) is None:
        reason = "ENABLE_KVCACHED is set but kvcached did not patch this engine's block pool"
        log.warning(reason, release_mode=MODE_THROTTLE,
                    fix="install kvcached with its autopatch (KVCACHED_AUTOPATCH=1)")
        return KeepMapped(reason)
    try:
        control = importlib.import_module("kvcached.control")
    except ImportError as exc:
        reason = f"kvcached has no in-process limit API (kvcached.control: {exc}); need kvcached>=0.1.6"
        log.warning(reason, release_mode=MODE_THROTTLE)
        return KeepMapped(reason)
    return KvcachedRelease(control)


def check_ipc_name(env: "os._Environ[str] | dict[str, str]") -> str | None:
    """In process 0: make every process of the engine use kvcached's segment name of this one.

    kvcached fixes its segment name (``kvcached.utils.DEFAULT_IPC_NAME``) when it is imported,
    which its import hook does on ``import vllm``, before any plugin runs; so the name must come
    from the container's environment, where the node agent puts it (``KVCACHED_IPC_NAME``, one per
    allocation: ``deviceplugin/allocation.py``). When it is missing (a container not started by
    vramshare) and kvcached is already loaded here, hand kvcached's own choice to the child
    processes so the engine tree still agrees; returns the name in force, or None.
    """
    if not kvcached_compat.enabled(env):
        return None
    name = env.get(kvcached_compat.ENV_IPC_NAME, "").strip()
    if name:
        return name
    import sys

    chosen = getattr(sys.modules.get("kvcached.utils"), "DEFAULT_IPC_NAME", None)
    log.warning("KVCACHED_IPC_NAME not set by the node agent", adopted=chosen,
                fix="run under vramshare's device plugin, or set KVCACHED_IPC_NAME for the container")
    if isinstance(chosen, str) and chosen:
        env[kvcached_compat.ENV_IPC_NAME] = chosen
        return chosen
    return None
