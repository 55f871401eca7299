"""Issue 24, ``isolation: mig`` end to end: the real extender (filter, prioritize, bind over HTTP), the real
device plugin over gRPC, the stand-in kubelet's device manager and the API server double.

Two same-size isolated pods on one MIG GPU never share a partition: the second waits on the extender's
same-size hold until the first is allocated (so the device plugin can tell whose plan an Allocate is),
then gets its own instance; a pod no free placement can hold stays Pending with the reason. On main the
annotation was ignored and a gpu-memory pod fit no MIG-only node.
"""
from __future__ import annotations

import dataclasses
import json
import tempfile
import time

from deviceplugin.simulated_backend import SimulatedBackend
from extender.main import start_for_url
from standins.apiserver import ApiServerDouble
from standins.scheduler import SchedulerDriver
from standins.simnode import SimulatedNode
from vramshare import contract, mig, mig_plan
from vramshare.config import Config, DynamicMigConfig

NAMES = contract.Names()
H100 = "GPU-8192a3b4-c5d6-47e8-b9fa-0b1c2d3e4f67"
NODE = {"gpus": [{"model": "NVIDIA H100 80GB HBM3", "memoryMiB": 81559, "numaNode": 0, "uuid": H100,
                  "mig": ["3g.40gb"]}]}


def iso_pod(name: str, gib: int) -> dict:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "inference", "annotations": {NAMES.isolation: "mig"}},
            "spec": {"schedulerName": "vramshare-scheduler", "containers": [
                {"name": "server", "image": "vllm", "resources": {"limits": {NAMES.gpu_memory: str(gib)}}}]}}


def plan_of(api: ApiServerDouble, name: str) -> tuple[str, str]:
    ann = api.get_pod("inference", name)["metadata"]["annotations"]
    [entry] = json.loads(ann[NAMES.assignment])["server"]
    return ann[NAMES.allocation_state], entry["uuid"]


def test_same_size_isolated_pods_get_their_own_partitions_and_an_unholdable_one_stays_pending():
    config = dataclasses.replace(Config(), dynamic_mig=DynamicMigConfig(gpus=("all",), grace_seconds=600.0))
    with tempfile.TemporaryDirectory() as root, ApiServerDouble() as api:
        backend = SimulatedBackend.from_dict(NODE)
        api.create_node({"metadata": {"name": "n"}})
        node = SimulatedNode("n", backend, api.url, root, config=config)
        ext = start_for_url(api.url)
        driver = SchedulerDriver(ext.url, ["n"])
        try:
            node.start()
            assert ext.wait_ready(10) and api.wait_for(
                lambda a: all(NAMES.inventory in (n["metadata"].get("annotations") or {}) for n in a.nodes()), 10)
            deadline = time.monotonic() + 10
            while not ext.acct.state.mig_geometry("n") and time.monotonic() < deadline:
                time.sleep(0.05)
            assert driver.schedule(api.create_pod(iso_pod("a", 8))).node == "n"
            # b has a's size signature: while a is assumed the extender holds b back (never guessed apart)
            b = api.create_pod(iso_pod("b", 8))
            held = driver.schedule(b, max_attempts=1)
            assert not held.node and "held for pod inference/a" in held.error
            [(_, env)] = node.admit(api.get_pod("inference", "a"))
            assert plan_of(api, "a")[0] == contract.STATE_ALLOCATED
            assert driver.schedule(b).node == "n"
            [(_, env_b)] = node.admit(api.get_pod("inference", "b"))
            a_plan, b_plan = mig_plan.parse(plan_of(api, "a")[1]), mig_plan.parse(plan_of(api, "b")[1])
            assert a_plan.profile == b_plan.profile == "1g.10gb" and a_plan != b_plan
            assert env[contract.ENV_VISIBLE_DEVICES] != env_b[contract.ENV_VISIBLE_DEVICES]
            assert env_b[contract.ENV_MEMORY_LIMIT_MIB] == "10240"
            made = backend.mig_nvml.layout(H100)
            assert {a_plan.placed, b_plan.placed} <= set(made) and len(made) == 3
            assert mig.check_layout(mig.MODELS["H100-SXM5-80GB"], made) == []
            # 50 GiB: more than any 4g.40gb, so 7g.80gb, and the GPU is already cut: no placement is left
            big = driver.schedule(api.create_pod(iso_pod("big", 50)))
            assert not big.node
            assert "no free MIG placement of the smallest profile holding 50 GiB (isolation: mig)" in big.error
        finally:
            driver.close()
            ext.stop()
            node.close()
