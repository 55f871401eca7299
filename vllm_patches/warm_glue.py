"""The warm tier inside vLLM 0.32 (issue 23): the engine boundary on ``EngineCore`` and four hooks.

* ``EngineCore.__init__`` (engine-core process, or in-process engine): after vLLM's own init, attach a
  :class:`~vllm_patches.warm.WarmTier` whose channel is the warm socket next to the quota file, and start
  its reader thread. Without a socket (no node agent serving one) the tier stays silent: today's
  behaviour.
* ``EngineCore.add_request``: :meth:`WarmTier.before_request` first, so a request that arrives while
  asleep wakes the engine (after the agent's grant) and is then added: never refused. vLLM's own
  ``sleep`` pauses the scheduler and queues new adds; ours wakes before the add, so nothing sits in a
  paused queue.
* ``EngineCore.shutdown``: stop the reader thread and close the socket.
* ``EngineCoreProc._handle_client_request``: runs the tier's jobs (a ``sleep`` from the agent) on the
  engine-core thread. The reader thread puts ``(JOB, callable)`` on vLLM's ``input_queue``, which the
  busy loop drains even when idle (``_process_input_queue`` blocks on it), so the engine is never
  touched from another thread. An in-process engine has no queue: the job runs under the tier's lock.

Sleep itself is vLLM's: ``EngineCore.sleep(level=1)`` (pause the scheduler, clear the prefix cache, the
executor's ``sleep``: weights to host RAM through the cumem allocator, KV cache discarded) and
``wake_up(None)``. It needs ``enable_sleep_mode`` and a platform with sleep mode
(``current_platform.is_sleep_mode_available()``: CUDA, ROCm, XPU). On the CPU build the engine cannot
be started with ``enable_sleep_mode`` at all (``ModelConfig`` raises "Sleep mode is not supported on
current platform."), so :meth:`VllmEngine.can_sleep` answers no and the tier only says ``hello``.
"""
from __future__ import annotations

import os
import threading
from typing import Any, Callable

from vramshare import contract, logs

from . import metrics
from .settings import QuotaSettings
from .warm import SocketChannel, WarmTier, start_reader

log = logs.get(__name__)

ENV_MODEL = "VRAMSHARE_MODEL"
JOB = object()  # the request type of our jobs on vLLM's input queue
_ATTR = "_vramshare_warm"


class VllmEngine:
    """:class:`vllm_patches.warm.Engine` on vLLM 0.32's ``EngineCore``."""

    def __init__(self, core: Any) -> None:
        self.core = core

    def can_sleep(self) -> tuple[bool, str]:
        try:
            from vllm.platforms import current_platform
        except ImportError as exc:  # pragma: no cover - vLLM is there when this runs
            return False, str(exc)
        if not current_platform.is_sleep_mode_available():
            return False, f"sleep mode unavailable on this platform ({current_platform.device_type})"
        if not getattr(self.core.vllm_config.model_config, "enable_sleep_mode", False):
            return False, "vLLM started without --enable-sleep-mode"
        return True, ""

    def model_name(self) -> str | None:
        """``VRAMSHARE_MODEL`` (the pod's ``vramshare.io/model`` annotation through the downward API),
        else the model vLLM was started with and its revision."""
        if os.environ.get(ENV_MODEL):
            return os.environ[ENV_MODEL]
        mc = self.core.vllm_config.model_config
        rev = getattr(mc, "revision", None)
        return f"{mc.model}@{rev}" if rev else str(mc.model)

    def weights_bytes(self) -> int:
        try:
            from .vllm_glue import model_shape
            from .budget import weights_bytes
            return int(weights_bytes(model_shape(self.core.vllm_config)))
        except Exception:  # an architecture the estimate does not know: the agent uses the request
            return 0

    def idle(self) -> bool:
        sched = self.core.scheduler
        has = getattr(sched, "has_requests", None)
        return not (has() if has is not None else sched.get_num_unfinished_requests())

    def sleep(self) -> int:
        before = _device_free()
        result = self.core.sleep(level=1, mode="abort")  # idle: nothing to abort
        if result is not None and hasattr(result, "result"):
            result.result(timeout=600)
        after = _device_free()
        return max(0, after - before) if before is not None and after is not None else 0

    def wake_up(self) -> None:
        # the grant follows the quota file that restored the limit: read it now, so the KV cap is back
        # before the first request is scheduled (instead of at the watcher's next poll)
        ec = getattr(getattr(self.core, "scheduler", None), "_vramshare", None)
        if ec is not None:
            ec.watcher.poll_once()
        self.core.wake_up(None)


def _device_free() -> int | None:
    try:
        import torch
        if torch.cuda.is_available():
            return int(torch.cuda.mem_get_info()[0])
    except Exception:
        return None
    return None


def socket_path(settings: QuotaSettings) -> str:
    return os.path.join(os.path.dirname(settings.path) or contract.CONTAINER_QUOTA_DIR, contract.WARM_SOCKET_NAME)


def attach(core: Any, settings: QuotaSettings) -> WarmTier | None:
    """Give ``core`` a warm tier when the agent serves a warm socket next to the quota file."""
    path = socket_path(settings)
    if not os.path.exists(path):
        log.debug("no warm socket; the engine stays awake", path=path)
        return None
    engine = str(getattr(core.vllm_config.parallel_config, "data_parallel_rank", 0) or 0)
    state_dir = metrics.ensure_state_dir(os.environ)
    holder: list[WarmTier] = []
    channel = SocketChannel(path, on_connect=lambda: holder[0].hello() if holder else None)
    tier = WarmTier(VllmEngine(core), channel, engine,
                    publish=lambda state: metrics.publish_warm(state_dir, engine, state))
    holder.append(tier)
    setattr(core, _ATTR, tier)
    tier.hello()
    stop = threading.Event()
    setattr(core, _ATTR + "_stop", (stop, channel))
    start_reader(tier, channel, lambda job: run_on_engine(core, tier, job), stop)
    log.info("warm tier attached", engine=engine, path=path)
    return tier


def detach(core: Any) -> None:
    """Stop the reader thread and close the socket (engine shutdown, tests)."""
    found = getattr(core, _ATTR + "_stop", None)
    if found is not None:
        stop, channel = found
        stop.set()
        channel.close()
    for attr in (_ATTR, _ATTR + "_stop"):
        if hasattr(core, attr):
            delattr(core, attr)


def run_on_engine(core: Any, tier: WarmTier, job: Callable[[], None]) -> None:
    q = getattr(core, "input_queue", None)
    if q is not None:
        q.put_nowait((JOB, job))
    else:
        with tier._lock:  # in-process engine: no loop to hand it to
            job()


def install(settings: QuotaSettings) -> bool:
    from vllm.v1.engine import core as core_mod

    from .vllm_glue import _wrap, current_settings

    def make_init(original: Callable[..., Any]) -> Callable[..., Any]:
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            original(self, *args, **kwargs)
            try:  # the settings in force now (plugin.register(force=True) re-points them), not the first ones
                attach(self, current_settings())
            except Exception as exc:  # the warm tier must never keep an engine from starting
                log.warning("warm tier not attached", error=str(exc))
        return __init__

    def make_add(original: Callable[..., Any]) -> Callable[..., Any]:
        def add_request(self: Any, *args: Any, **kwargs: Any) -> Any:
            tier = getattr(self, _ATTR, None)
            if tier is not None:
                tier.before_request()
            return original(self, *args, **kwargs)
        return add_request

    def make_handle(original: Callable[..., Any]) -> Callable[..., Any]:
        def _handle_client_request(self: Any, request_type: Any, request: Any) -> Any:
            if request_type is JOB:
                return request()
            return original(self, request_type, request)
        return _handle_client_request

    def make_shutdown(original: Callable[..., Any]) -> Callable[..., Any]:
        def shutdown(self: Any, *args: Any, **kwargs: Any) -> Any:
            detach(self)
            return original(self, *args, **kwargs)
        return shutdown

    ok = _wrap(core_mod.EngineCore, "__init__", make_init)
    ok = _wrap(core_mod.EngineCore, "shutdown", make_shutdown) and ok
    ok = _wrap(core_mod.EngineCore, "add_request", make_add) and ok
    ok = _wrap(core_mod.EngineCoreProc, "_handle_client_request", make_handle) and ok
    return ok


def install_guarded(settings: QuotaSettings) -> bool:
    """:func:`install`, logging instead of failing when vLLM moved a target."""
    try:
        return install(settings)
    except (ImportError, AttributeError) as exc:
        log.warning("vllm hook skipped", hook="warm_tier", error=str(exc))
        return False
