"""Where the weights are (issue 23 item 3): the cache scan's layouts, bounds and bad input; the models
section of the inventory (additive, lenient); the residency term's bound."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from deviceplugin import residency as scan
from extender import residency
from vramshare import contract
from vramshare.inventory import (MAX_MODELS, EngineState, Gpu, NodeInventory, ResidentModel,
                                 models_from_list)

REV = "0123456789abcdef0123456789abcdef01234567"


def _hf(root, name, rev=REV, files=(("model.safetensors", 1000), ("config.json", 10))):
    base = root / f"models--{name.replace('/', '--')}"
    (base / "blobs").mkdir(parents=True, exist_ok=True)
    snap = base / "snapshots" / rev
    snap.mkdir(parents=True)
    for i, (fname, size) in enumerate(files):
        blob = base / "blobs" / f"{rev[:6]}{i}"
        blob.write_bytes(b"x" * size)
        os.symlink(os.path.relpath(blob, snap), snap / fname)
    return snap


def test_hugging_face_layout_counts_blob_bytes(tmp_path):
    _hf(tmp_path, "meta-llama/Llama-3.1-8B")
    (tmp_path / "models--meta-llama--Llama-3.1-8B" / "refs").mkdir()
    got = scan.scan_cache(str(tmp_path))
    assert got.models == (ResidentModel("meta-llama/Llama-3.1-8B", REV, 1010),)
    assert not got.truncated


def test_plain_tree_layout(tmp_path):
    d = tmp_path / "qwen2.5-14b" / "v1"
    (d / "shards").mkdir(parents=True)
    (d / "shards" / "a.safetensors").write_bytes(b"y" * 300)
    (d / "tokenizer.json").write_bytes(b"z" * 5)
    assert scan.scan_cache(str(tmp_path)).models == (ResidentModel("qwen2.5-14b", "v1", 305),)


def test_junk_is_skipped_with_a_reason(tmp_path):
    _hf(tmp_path, "org/good")
    (tmp_path / "stray.txt").write_text("x")
    (tmp_path / "notamodel" / "rev").mkdir(parents=True)
    (tmp_path / "notamodel" / "rev" / "README").write_text("x")
    (tmp_path / "bad name!" / "r").mkdir(parents=True)
    (tmp_path / "bad name!" / "r" / "w.bin").write_bytes(b"1")
    (tmp_path / "models--org--partial" / "snapshots" / REV).mkdir(parents=True)
    os.symlink("/nonexistent/blob", tmp_path / "models--org--partial" / "snapshots" / REV / "w.safetensors")
    os.symlink("/", tmp_path / "loop")  # a directory link is never followed
    got = scan.scan_cache(str(tmp_path))
    assert [m.name for m in got.models] == ["org/good"]
    reasons = " ".join(got.skipped)
    assert "notamodel" in reasons and "bad name!" in reasons and "partial" in reasons


def test_missing_root_is_empty(tmp_path):
    assert scan.scan_cache(str(tmp_path / "absent")).models == ()


def test_huge_listing_is_bounded(tmp_path):
    for i in range(80):
        d = tmp_path / f"m{i:03d}" / "r"
        d.mkdir(parents=True)
        (d / "w.bin").write_bytes(b"x" * (i + 1))
    got = scan.scan_cache(str(tmp_path), max_entries=100_000)
    assert len(got.models) == MAX_MODELS and got.truncated
    assert got.models[0].bytes == 80  # largest first
    small = scan.scan_cache(str(tmp_path), max_entries=50)
    assert small.truncated and len(small.models) < 50


def test_engines_merge_first():
    files = (ResidentModel("org/a", "r", 100), ResidentModel("org/b", "r", 500))
    merged = scan.with_engines(files, [(contract.ModelRef("org/a", "r"), "GPU-1", EngineState.SLEEPING),
                                       (contract.ModelRef("org/c"), "GPU-2", EngineState.AWAKE)])
    assert [m.name for m in merged] == ["org/a", "org/c", "org/b"]
    assert merged[0].engines == (("GPU-1", EngineState.SLEEPING),)


def _inv(models=()):
    return NodeInventory(unit_mib=1024, gpus=(Gpu(0, "GPU-0", "H100", 81920, units=80),), models=models)


def test_inventory_models_round_trip_and_absent_for_old_readers():
    inv = _inv((ResidentModel("org/a", "r", 123, (("GPU-0", EngineState.SLEEPING),)),))
    assert NodeInventory.from_json(inv.to_json()) == inv
    assert "models" not in json.loads(_inv().to_json())  # unchanged for nodes without a cache


def test_inventory_models_bad_entries_are_dropped_not_the_node():
    doc = json.loads(_inv().to_json())
    doc["models"] = [{"name": "../x"}, {"name": "ok", "bytes": -1}, {"name": "ok", "bytes": True}, 7,
                     {"name": "good", "revision": "r", "bytes": 5, "engines": [{"gpu": "G", "state": "dreaming"}]}]
    inv = NodeInventory.from_json(json.dumps(doc))
    assert inv.gpus and inv.models == (ResidentModel("good", "r", 5),)
    doc["models"] = "garbage"
    assert NodeInventory.from_json(json.dumps(doc)).models == ()
    doc["models"] = [{"name": f"m{i}", "bytes": 1} for i in range(1000)]
    assert len(NodeInventory.from_json(json.dumps(doc)).models) == MAX_MODELS


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.tuples(st.sampled_from(["org/a", "org/b"]), st.sampled_from(["", "r1"]),
                                   st.integers(0, 1 << 45), st.booleans()), max_size=4), min_size=1, max_size=8),
       st.floats(0, 5))
def test_bonus_is_bounded_and_zero_without_the_model(nodes, max_steps):
    cfg = residency.ResidencyConfig(max_steps=max_steps)
    per_node = [[ResidentModel(n, r, b, (("G", EngineState.AWAKE),) if e else ()) for n, r, b, e in node]
                for node in nodes]
    b = residency.bonus(contract.ModelRef("org/a"), per_node, cfg)
    assert ((b >= 0) & (b <= max_steps + 1e-12)).all()
    for i, node in enumerate(per_node):
        if not any(m.name == "org/a" for m in node):
            assert b[i] == 0
    assert (residency.bonus(None, per_node, cfg) == 0).all()


def test_bonus_grows_with_the_load_time_saved():
    cfg = residency.ResidencyConfig(max_steps=0.9, saturate_s=1e9)
    ask = contract.ModelRef("m")
    files, engine = [ResidentModel("m", "", 10 << 30)], [ResidentModel("m", "", 10 << 30, (("G", EngineState.SLEEPING),))]
    big = [ResidentModel("m", "", 40 << 30)]
    b = residency.bonus(ask, [[], files, engine, big], cfg)
    assert b[0] == 0 < b[1] < b[2] and b[1] < b[3]


def test_bonus_below_one_step_never_beats_a_better_fgd_step():
    raw = np.array([3.0, 2.0])  # fgd: whole steps
    assert np.argmax(residency.with_bonus(raw, np.array([0.0, 0.9]))) == 0


def test_an_engine_that_sleeps_reaches_the_residency_report_at_once(tmp_path):
    """The node agent merged the warm broker's engines into its inventory every 5 s (hard-coded), so a
    new, sleeping or woken engine reached the extender that much late. The broker now says when what it
    reports changed (``on_engines``) and the reporter merges at once; nothing changes without a change."""
    import threading
    import time

    from deviceplugin.quota.model import TenantKey
    from deviceplugin.quota.warm import WarmBroker

    key = TenantKey("llm", "m", "vllm", pod_uid="uid-m")
    broker = WarmBroker(send=lambda k, m: True)
    reports: list = []
    reporter = scan.ResidencyReporter(None, reports.append, lambda: broker.engines({key: ["GPU-0"]}),
                                      engines_interval_s=3600.0)
    calls: list = []
    broker.on_engines = lambda: (calls.append(1), reporter.poke())
    stop = threading.Event()
    thread = threading.Thread(target=reporter.run, args=(stop,), daemon=True)
    thread.start()

    def wait(cond) -> bool:
        end = time.monotonic() + 5
        while time.monotonic() < end and not cond():
            time.sleep(0.01)
        return cond()
    try:
        hello = contract.WarmMessage.of(contract.WARM_HELLO, engine="0", canSleep=True, weightsBytes=1 << 30,
                                        model="meta-llama/Llama-3.1-8B", state="awake")
        broker.receive(key, hello, 0.0)
        assert wait(lambda: reports and reports[-1][0].engines[0][1] is EngineState.AWAKE), reports
        broker.receive(key, hello, 1.0)  # the same hello again: nothing it reports changed
        assert len(calls) == 1
        broker.receive(key, contract.WarmMessage.of(contract.WARM_HELLO, engine="0", canSleep=True,
                                                    weightsBytes=1 << 30, model="meta-llama/Llama-3.1-8B",
                                                    state="sleeping"), 2.0)  # a reconnecting sleeper
        assert wait(lambda: reports[-1][0].engines[0][1] is EngineState.SLEEPING), reports
        broker.disconnected(key)  # its process is gone
        assert wait(lambda: reports[-1] == ()), reports
        assert len(calls) == 3
    finally:
        stop.set()
        thread.join(5)
