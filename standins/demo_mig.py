"""``vramshare demo --mig``: dynamic MIG on the device-plugin path, a partition made for each pod that asks.

One simulated node with an H100 already in MIG mode, cut by its admin into one ``3g.40gb``, and
``dynamicMig.gpus: all``. Pods ask ``vramshare.io/mig-<profile>``; the real extender chooses the GPU,
profile and placement (the fragmentation term keeps the largest profiles creatable) and writes the plan
as the pod's assignment; the stand-in kubelet allocates the steered device; the real device plugin makes
the GPU and compute instance at Allocate and hands the container the new MIG device. A deleted pod's
instance is destroyed once no container holds it. Everything else as ``vramshare demo``.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import tempfile
import time
from contextlib import ExitStack
from typing import Any, TextIO

from deviceplugin.simulated_backend import SimulatedBackend
from extender import inspection
from extender.main import start_for_url
from standins.apiserver import ApiServerDouble
from standins.demo_args import pod_count
from standins.scheduler import SchedulerDriver
from standins.simnode import SimulatedNode
from vramshare import contract, mig, mig_plan
from vramshare.config import Config, DynamicMigConfig

NAMES = contract.Names()
H100 = "GPU-8192a3b4-c5d6-47e8-b9fa-0b1c2d3e4f67"
NODE = {"gpus": [{"model": "NVIDIA H100 80GB HBM3", "memoryMiB": 81559, "numaNode": 0, "uuid": H100,
                  "mig": ["3g.40gb"]}]}
PODS = [  # name, profile, what
    ("whisper-asr", "1g.10gb", "Whisper large-v3"),
    ("llama3-8b-chat", "3g.40gb", "Llama-3-8B bf16: the admin's 3g.40gb is free, it is adopted"),
    ("bge-embedder", "2g.20gb", "BGE-large embeddings"),
    ("qwen2-14b", "4g.40gb", "Qwen2-14B: no 4g.40gb placement is left"),
]
#: After the first pod is deleted: a plain memory ask with ``isolation: mig`` (name, GiB, what).
ISOLATED = ("phi3-mini-iso", 6, "Phi-3-mini, 6 GiB, isolation: mig: the smallest fitting profile, 1g.10gb")
#: Then the same ask without the annotation: shared memory, which a MIG GPU never lends (name, GiB, what).
PLAIN = ("phi3-mini-shared", 6, "Phi-3-mini, 6 GiB of shared memory: a MIG GPU has none to lend")


def _say(out: TextIO, text: str = "") -> None:
    print(text, file=out, flush=True)


def manifest(name: str, profile: str, what: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "inference", "annotations": {"demo/what": what}},
            "spec": {"schedulerName": "vramshare-scheduler",
                     "containers": [{"name": "server", "image": "vllm/vllm-openai",
                                     "resources": {"limits": {NAMES.mig(profile): "1"}}}]}}


def isolated_manifest(name: str, gib: int, what: str) -> dict[str, Any]:
    """A gpu-memory ask (1 GiB units) annotated ``isolation: mig``: a partition of the smallest fitting profile."""
    pod = manifest(name, "1g.10gb", what)
    pod["metadata"]["annotations"][NAMES.isolation] = "mig"
    pod["spec"]["containers"][0]["resources"]["limits"] = {NAMES.gpu_memory: str(gib)}
    return pod


def layout(backend: SimulatedBackend) -> str:
    return mig.layout_name(backend.mig_nvml.layout(H100))


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    t0 = time.monotonic()
    if not getattr(args, "verbose", False):
        logging.getLogger().setLevel(logging.WARNING)
    pods = PODS[:pod_count(getattr(args, "pods", None), len(PODS))]
    config = dataclasses.replace(Config(), dynamic_mig=DynamicMigConfig(gpus=("all",), grace_seconds=600.0))
    with tempfile.TemporaryDirectory(prefix="vramshare-demo-mig-") as root, ExitStack() as stack:
        _say(out, "vramshare demo --mig: dynamic MIG on the device-plugin path (an API server stand-in, one "
                  "simulated node with the device plugin and a stand-in kubelet, the extender).")
        api = stack.enter_context(ApiServerDouble())
        backend = SimulatedBackend.from_dict(NODE)
        api.create_node({"metadata": {"name": "mig-node"}})
        node = SimulatedNode("mig-node", backend, api.url, root, config=config)
        stack.callback(node.close)
        node.start()
        assert node.daemon.mig is not None
        gpu = node.daemon.state.snapshot.inventory.gpus[0]
        assert gpu.dynamic_mig is not None
        _say(out, f"  GPU 0 {gpu.model}, MIG mode, dynamicMig allowed; instances now: {layout(backend)} "
                  "(the admin's)")
        _say(out, "  could still be created: " + ", ".join(
            f"{p}@{{{','.join(map(str, s))}}}" for p, s in gpu.dynamic_mig.free if s and "+me" not in p))
        ext = start_for_url(api.url)
        stack.callback(ext.stop)
        if not ext.wait_ready(10) or not api.wait_for(
                lambda a: all(NAMES.inventory in (n["metadata"].get("annotations") or {}) for n in a.nodes()), 10):
            _say(out, "demo: the extender did not see the GPU inventory in time")
            return 1
        _wait(lambda: ext.acct.state.mig_geometry("mig-node"), 10)
        driver = SchedulerDriver(ext.url, ["mig-node"])
        stack.callback(driver.close)
        placed = []

        def place(name: str, pod: dict[str, Any]) -> bool:
            before = layout(backend)
            res = driver.schedule(api.create_pod(pod))
            if not res.node:
                why = next(iter(res.failed.values()), res.error)
                _say(out, f"    => stays Pending: {why}")
                return False
            bound = api.get_pod("inference", name) or {}
            plan = next(mig_plan.parse(e) for e in _uuids(bound["metadata"]["annotations"][NAMES.assignment]))
            _say(out, f"    extender plan: GPU {plan.gpu_uuid[:12]}..., {plan.profile} at memory slot {plan.start}")
            for container, env in node.admit(bound):
                _say(out, f"    kubelet Allocate ({container}): {contract.ENV_VISIBLE_DEVICES}="
                          f"{env.get(contract.ENV_VISIBLE_DEVICES)} {contract.ENV_MEMORY_LIMIT_MIB}="
                          f"{env.get(contract.ENV_MEMORY_LIMIT_MIB)}")
            after = layout(backend)
            _say(out, f"    partition {'made for it' if after != before else 'adopted (it existed)'}: "
                      f"instances now {after}")
            api.set_pod_phase("inference", name, "Running")
            return True

        for name, profile, what in pods:
            _say(out, f"\n* {name}: {what}; asks {NAMES.mig(profile)}")
            if place(name, manifest(name, profile, what)):
                placed.append(name)
        _say(out, "\nPer-GPU view from the extender (GET /inspect; one row per booked partition):")
        _say(out, inspection.format_table(inspection.fetch(ext.url)).split("\n\n")[0])
        made = node.daemon.metrics.registry.get_sample_value
        _say(out, f"\nMIG instances created: {made('vramshare_mig_instances_created_total', {'gpu': H100}) or 0:.0f}, "
                  f"adopted: {made('vramshare_mig_instances_adopted_total', {'gpu': H100}) or 0:.0f}")
        if placed:
            gone = api.get_pod("inference", placed[0]) or {}
            api.finish_pod_deletion("inference", placed[0])  # the kubelet ends it: containers terminated, then gone
            node.release(gone)
            # the demo does not wait out dynamicMig.graceSeconds (600 s here) and the just-made guard
            node.daemon.mig.fresh_seconds = node.daemon.mig.dynamic.grace_seconds = 0.0
            node.daemon.reconciler.run_once()  # PodResources no longer lists it: unheld
            _say(out, f"Deleted {placed[0]}: no container holds its instance, so it is destroyed (after "
                      f"dynamicMig.graceSeconds, 0 for the demo); instances now {layout(backend)}")
            name, gib, what = ISOLATED
            _say(out, f"\n* {name}: {what}; asks {NAMES.gpu_memory}: {gib} with {NAMES.isolation}: mig")
            if place(name, isolated_manifest(name, gib, what)):
                placed.append(name)
                ann = (api.get_pod("inference", name) or {})["metadata"].get("annotations") or {}
                _say(out, f"    device plugin recorded: {ann.get(NAMES.allocation_state)}, holds "
                          f"{', '.join(_uuids(ann.get(NAMES.assignment) or '{}'))} (the partition, not shared memory)")
            name, gib, what = PLAIN
            _say(out, f"\n* {name}: {what}; asks {NAMES.gpu_memory}: {gib}, no {NAMES.isolation}")
            plain = isolated_manifest(name, gib, what)
            del plain["metadata"]["annotations"][NAMES.isolation]
            place(name, plain)
        _say(out, f"\nDemo finished in {time.monotonic() - t0:.1f} s: {len(placed)} of {len(pods) + 2 * bool(placed)} pods got a "
                  "MIG partition.")
    return 0


def _wait(predicate: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def _uuids(text: str) -> list[str]:
    import json
    return [e["uuid"] for entries in json.loads(text).values() for e in entries]
