"""A tiny Llama with random (non-dummy) weights, for tests and benches that need real KV.

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
