"""vLLM general plugin entry point: ``vllm.general_plugins`` -> ``vllm_patches.plugin:register``.

vLLM calls :func:`register` in every process it starts (API server / process 0, engine core,
workers), possibly more than once per process, so it is idempotent. It does nothing unless the
container has a quota (``VRAMSHARE_MEMORY_LIMIT_MIB`` or the quota file), so the same image runs
unchanged outside vramshare. ``VLLM_PLUGINS`` (vLLM's allowlist) can switch it off by name:
``vramshare_quota``.

Tested with vLLM 0.32.0 (see ``vllm_patches/README.md``).
"""
from __future__ import annotations

import os
import threading

from vramshare import logs

from . import metrics, release, settings

log = logs.get(__name__)

_lock = threading.Lock()
_installed: dict[str, bool] | None = None


def register() -> None:
    """Install the quota hooks once per process; a no-op without a quota."""
    global _installed
    with _lock:
        if _installed is not None:
            return
        found = settings.from_env()
        if found is None:
            _installed = {}
            log.debug("no vramshare quota; plugin inactive")
            return
        from . import vllm_glue

        release.ensure_ipc_name(os.environ)  # before any child process is spawned

        _installed = vllm_glue.install(found)
        # The collector serves the engine core's published state from this process's default
        # registry; harmless in processes that do not serve /metrics.
        metrics.register_collector(metrics.ensure_state_dir(os.environ))


def installed_hooks() -> dict[str, bool] | None:
    """Which hooks took in this process (None before :func:`register` ran, {} when inactive)."""
    return _installed
