"""KV-cache budget arithmetic: how much of a memory quota the KV cache may take.

Pure core, no vLLM. vLLM sizes its KV cache as a fraction of the *whole* device; on a shared GPU the
only number that matters is this container's slice, so we size it ourselves::

    kv_bytes = quota - weights - activations - cuda_graphs - runtime_overhead

* weights: parameter count x bytes per parameter, estimated from the model config before loading
  (so a model that cannot fit is refused in the API process with both numbers, before anything is
  allocated), and re-measured from the loaded parameters in the worker.
* activations: the peak of one forward pass over ``max_num_batched_tokens`` tokens plus the fp32
  logits and sampler temporaries of ``max_num_seqs`` sequences, times a safety factor for allocator
  fragmentation. All of it is overridable from the environment, because a wrong guess here is either
  an OOM (too small) or wasted KV (too large) and only the operator knows which hurts more.
* cuda graphs and runtime overhead (CUDA context, NCCL, cuBLAS workspaces): fixed headrooms that
  NVML charges to the process and therefore to its quota; zero on CPU and with ``enforce_eager``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

MIB = 1 << 20

ENV_ACTIVATION_MIB = "VRAMSHARE_ACTIVATION_MIB"  # override the activation estimate outright
ENV_ACTIVATION_FACTOR = "VRAMSHARE_ACTIVATION_FACTOR"  # multiply the estimate (default 2.0)
ENV_CUDAGRAPH_MIB = "VRAMSHARE_CUDAGRAPH_MIB"  # default 512 with CUDA graphs, 0 without
ENV_RUNTIME_OVERHEAD_MIB = "VRAMSHARE_RUNTIME_OVERHEAD_MIB"  # default 512 on CUDA, 0 on CPU

DEFAULT_ACTIVATION_FACTOR = 2.0
DEFAULT_CUDAGRAPH_MIB = 512
DEFAULT_RUNTIME_OVERHEAD_MIB = 512


class QuotaTooSmall(ValueError):
    """The model (plus its headroom) does not fit the quota; the message names both numbers."""


@dataclass(frozen=True)
class ModelShape:
    """The handful of config numbers the budget needs (per tensor-parallel rank)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    vocab_size: int
    dtype_bytes: int
    tie_word_embeddings: bool = False


@dataclass(frozen=True)
class Headroom:
    """Non-KV, non-weight memory the engine needs, in bytes."""

    activation_bytes: int
    cudagraph_bytes: int
    runtime_bytes: int

    @property
    def total(self) -> int:
        return self.activation_bytes + self.cudagraph_bytes + self.runtime_bytes


@dataclass(frozen=True)
class KvPlan:
    """The budget decision, logged and exported so an operator can see where the quota went."""

    quota_bytes: int
    weights_bytes: int
    headroom: Headroom
    kv_bytes: int

    @property
    def non_kv_bytes(self) -> int:
        return self.weights_bytes + self.headroom.total


def llama_param_count(shape: ModelShape) -> int:
    """Parameters of a Llama-style decoder (embeddings, attention, gated MLP, RMSNorms, LM head).

    Most vLLM decoder models (Llama, Mistral, Qwen2, Gemma without extras) share this layout; for
    others the estimate is a lower bound and the worker's post-load measurement corrects it.
    """
    h, i = shape.hidden_size, shape.intermediate_size
    qkv = h * (shape.num_heads + 2 * shape.num_kv_heads) * shape.head_size
    o_proj = shape.num_heads * shape.head_size * h
    mlp = 3 * h * i
    per_layer = qkv + o_proj + mlp + 2 * h
    embed = shape.vocab_size * h
    lm_head = 0 if shape.tie_word_embeddings else shape.vocab_size * h
    return embed + shape.num_layers * per_layer + h + lm_head


def weights_bytes(shape: ModelShape, bits_per_param: float | None = None) -> int:
    """Parameter count x bytes per parameter (``bits_per_param`` for quantized checkpoints)."""
    per_param = shape.dtype_bytes if bits_per_param is None else bits_per_param / 8
    return int(math.ceil(llama_param_count(shape) * per_param))


def activation_bytes(shape: ModelShape, max_num_batched_tokens: int, max_num_seqs: int,
                     factor: float = DEFAULT_ACTIVATION_FACTOR) -> int:
    """Peak activation memory of one scheduler step, times ``factor``.

    Per token: residual + normed hidden + attention output + o_proj output (4 x hidden), the fused
    QKV projection, and the gated MLP (gate+up, then the activated half: 3 x intermediate). Logits
    are fp32 for the last token of each sequence, and the sampler holds about three copies of them
    (logits, probabilities, log-probabilities).
    """
    qkv = (shape.num_heads + 2 * shape.num_kv_heads) * shape.head_size
    per_token = (4 * shape.hidden_size + qkv + 3 * shape.intermediate_size) * shape.dtype_bytes
    logits = 3 * max_num_seqs * shape.vocab_size * 4
    return int(math.ceil(factor * (max_num_batched_tokens * per_token + logits)))


def _env_mib(env: Mapping[str, str], key: str, default: int) -> int:
    raw = env.get(key, "").strip()
    if not raw:
        return default * MIB
    value = float(raw)
    if value < 0:
        raise ValueError(f"{key}={raw!r} must be >= 0")
    return int(value * MIB)


def headroom_from_env(env: Mapping[str, str], shape: ModelShape, max_num_batched_tokens: int,
                      max_num_seqs: int, *, on_cuda: bool, cuda_graphs: bool) -> Headroom:
    """Headroom with the operator's overrides applied (``VRAMSHARE_*_MIB``, ``*_FACTOR``)."""
    if env.get(ENV_ACTIVATION_MIB, "").strip():
        act = _env_mib(env, ENV_ACTIVATION_MIB, 0)
    else:
        factor = float(env.get(ENV_ACTIVATION_FACTOR, "") or DEFAULT_ACTIVATION_FACTOR)
        act = activation_bytes(shape, max_num_batched_tokens, max_num_seqs, factor)
    graphs = _env_mib(env, ENV_CUDAGRAPH_MIB, DEFAULT_CUDAGRAPH_MIB if (on_cuda and cuda_graphs) else 0)
    runtime = _env_mib(env, ENV_RUNTIME_OVERHEAD_MIB, DEFAULT_RUNTIME_OVERHEAD_MIB if on_cuda else 0)
    return Headroom(act, graphs, runtime)


def plan_kv(quota_mib: int, weights: int, headroom: Headroom, min_kv_bytes: int = 0,
            max_model_len: int | None = None) -> KvPlan:
    """The KV budget for a quota; raise :class:`QuotaTooSmall` when the KV cache would be useless.

    Useless is "no bytes left" and also "less than one request of ``max_model_len`` tokens"
    (``min_kv_bytes``, see :func:`min_kv_bytes`): vLLM refuses that too, but with
    "0.0 GiB > 0.0 GiB" on a small model. The error names the quota, the weights, the headroom and
    what one full-length request needs, so the operator knows which knob to turn.
    """
    quota = quota_mib * MIB
    if weights >= quota:
        raise QuotaTooSmall(
            f"model weights need {weights / MIB:.1f} MiB but the GPU memory quota is {quota_mib} MiB; "
            f"request more vramshare.io/gpu-memory or use a smaller/quantized model")
    kv = quota - weights - headroom.total
    parts = (f"weights {weights / MIB:.1f} MiB + headroom {headroom.total / MIB:.1f} MiB "
             f"(activations {headroom.activation_bytes / MIB:.1f}, cuda graphs "
             f"{headroom.cudagraph_bytes / MIB:.1f}, runtime {headroom.runtime_bytes / MIB:.1f})")
    if kv <= 0:
        raise QuotaTooSmall(
            f"quota {quota_mib} MiB leaves no KV cache: {parts}"
            f"; raise the quota or lower max_num_batched_tokens / VRAMSHARE_ACTIVATION_MIB")
    if kv < min_kv_bytes:
        per_token = min_kv_bytes / max(1, max_model_len or 1)
        fits = int(kv // per_token) if per_token else 0
        raise QuotaTooSmall(
            f"quota {quota_mib} MiB leaves {kv / MIB:.2f} MiB for the KV cache after {parts}, but "
            f"one request of max_model_len {max_model_len} needs {min_kv_bytes / MIB:.2f} MiB; "
            f"raise the quota by {(min_kv_bytes - kv) / MIB:.1f} MiB or lower max_model_len "
            f"(about {fits} tokens fit)")
    return KvPlan(quota, weights, headroom, kv)


def kv_bytes_per_token(shape: ModelShape, cache_elem_bytes: int) -> int:
    """K and V of every layer for one token (per tensor-parallel rank as given)."""
    return 2 * shape.num_layers * shape.num_kv_heads * shape.head_size * cache_elem_bytes


def min_kv_bytes(max_model_len: int, block_size: int, bytes_per_token: int) -> int:
    """What vLLM requires at start: one ``max_model_len`` request in whole blocks, plus the null
    block the pool holds back (``check_enough_kv_cache_memory`` in vLLM 0.32)."""
    return (min_blocks_for(max_model_len, block_size) + 1) * block_size * bytes_per_token


def min_blocks_for(max_model_len: int, block_size: int) -> int:
    """Blocks one full-length request needs; the cap never goes below it, or nothing could run."""
    return max(1, -(-max_model_len // block_size))


def slice_request(free_bytes: int, total_bytes: int, quota_bytes: int, device: str = "") -> int:
    """vLLM's start-up memory check, judged against the slice instead of the whole GPU.

    Stock vLLM asks for ``gpu_memory_utilization x total`` and refuses to start when less than that
    is free, which fails for every tenant after the first. On a shared GPU what this engine may use
    is its quota; it starts when the quota is free, and raises with the three numbers otherwise (the
    other tenants then hold more than the scheduler granted them).
    """
    requested = min(quota_bytes, total_bytes)
    if free_bytes < requested:
        raise ValueError(
            f"free memory on device {device} ({free_bytes / MIB:.0f}/{total_bytes / MIB:.0f} MiB) "
            f"is less than this container's GPU memory quota ({quota_bytes / MIB:.0f} MiB); "
            f"other tenants use more than their share")
    return requested
