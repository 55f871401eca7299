"""End to end through every real part: API double + simulated device plugin + stand-in kubelet + extender.

One pod's life: asks 20 GiB, is filtered and scored by the extender, bound to a GPU with room, the
kubelet's Allocate on that node returns exactly that GPU with the quota, ``/inspect`` shows it, deleting
the pod frees the memory. And health: an Xid on a GPU reaches the extender through the device plugin's
inventory annotation, the GPU stops taking pods, and comes back when it recovers.
"""
from __future__ import annotations

import os
import tempfile
import time
from typing import Callable, Iterator

import orjson
import pytest

from deviceplugin.simulated_backend import SimulatedBackend
from extender import inspection
from extender.main import RunningExtender, start_for_url
from standins.apiserver import ApiServerDouble
from standins.scheduler import SchedulerDriver
from standins.simnode import SimulatedNode
from vramshare import contract

NAMES = contract.Names()
FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures", "inventories")
NS = "team-a"


def eventually(predicate: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def pod(name: str, gib: int) -> dict:
    return {"metadata": {"name": name, "namespace": NS},
            "spec": {"schedulerName": "vramshare-scheduler",
                     "containers": [{"name": "vllm", "image": "vllm",
                                     "resources": {"limits": {NAMES.gpu_memory: str(gib)}}}]}}


class Stack:
    def __init__(self, api: ApiServerDouble, nodes: dict[str, SimulatedNode], ext: RunningExtender) -> None:
        self.api, self.nodes, self.ext = api, nodes, ext
        self.driver = SchedulerDriver(ext.url, sorted(nodes))

    def gpu_usage(self, node: str) -> dict[str, int]:
        doc = inspection.fetch(self.ext.url, node)
        return {g["uuid"]: g["usedMiB"] for g in doc["gpus"]}


@pytest.fixture
def stack() -> Iterator[Stack]:
    # A short directory: unix socket paths are limited to 108 bytes, pytest's tmp_path is longer.
    with tempfile.TemporaryDirectory(prefix="vs-e2e-") as root, ApiServerDouble() as api:
        nodes = {}
        # Two nodes from one inventory file: their GPU UUIDs must still differ (salted by node name).
        for name, fixture in (("node-h200", "h200.yaml"), ("node-mixed", "mixed.yaml"),
                              ("node-mixed-2", "mixed.yaml")):
            api.create_node({"metadata": {"name": name}})
            nodes[name] = SimulatedNode(name, SimulatedBackend.from_file(os.path.join(FIXTURES, fixture), host=name),
                                        api.url, root)
        try:
            for node in nodes.values():
                node.start()
            ext = start_for_url(api.url)
            try:
                assert ext.wait_ready(10)
                eventually(lambda: all(inspection.render(ext.acct, n) for n in nodes), "inventories in the extender")
                s = Stack(api, nodes, ext)
                yield s
                s.driver.close()
            finally:
                ext.stop()
        finally:
            for node in nodes.values():
                node.close()


def test_a_pod_lands_on_a_gpu_with_room_gets_it_from_the_kubelet_and_frees_it_when_deleted(stack: Stack) -> None:
    # Fill most of the H200 node's first GPU through the same path, so "a GPU with room" means something.
    filler = stack.api.create_pod(pod("filler", 70))
    first = stack.driver.schedule(filler)
    assert first.node, first.error
    stack.nodes[first.node].admit(stack.api.get_pod(NS, "filler"))

    created = stack.api.create_pod(pod("llama", 20))
    outcome = stack.driver.schedule(created)
    assert outcome.node in stack.nodes and not outcome.error

    bound = stack.api.get_pod(NS, "llama")
    assert bound["spec"]["nodeName"] == outcome.node
    ann = bound["metadata"]["annotations"]
    assignment = orjson.loads(ann[NAMES.assignment])
    [(uuid, mib)] = [(e["uuid"], e["mib"]) for e in assignment["vllm"]]
    assert mib == 20 * 1024
    before = stack.gpu_usage(outcome.node)
    assert before[uuid] >= mib
    gpu = next(g for g in inspection.fetch(stack.ext.url, outcome.node)["gpus"] if g["uuid"] == uuid)
    assert gpu["usedMiB"] - 0 <= gpu["totalMiB"]  # never over capacity
    assert {"pod": f"{NS}/llama", "mib": mib} in gpu["pods"]

    [(container, env)] = stack.nodes[outcome.node].admit(bound)
    assert container == "vllm"
    assert env[contract.ENV_VISIBLE_DEVICES] == uuid
    assert env[contract.ENV_MEMORY_LIMIT_MIB] == str(mib)
    eventually(lambda: stack.api.get_pod(NS, "llama")["metadata"]["annotations"][NAMES.allocation_state]
               == contract.STATE_ALLOCATED, "allocation-state: allocated")

    stack.api.finish_pod_deletion(NS, "llama")  # the kubelet ends it: containers terminated, then gone
    stack.nodes[outcome.node].release(bound)
    eventually(lambda: stack.gpu_usage(outcome.node)[uuid] == before[uuid] - mib, "memory freed in /inspect")


def test_an_xid_takes_a_gpu_out_of_scheduling_until_it_recovers(stack: Stack) -> None:
    node = stack.nodes["node-h200"]
    [gpu] = node.daemon.state.snapshot.inventory.gpus
    node.backend.inject_xid(gpu.uuid, 79)  # "GPU has fallen off the bus": critical, not ignored

    def healthy_in_extender() -> bool:
        return next(g for g in inspection.fetch(stack.ext.url, "node-h200")["gpus"])["healthy"]

    eventually(lambda: not healthy_in_extender(), "the extender to see the GPU unhealthy")
    only_h200 = pod("h200-only", 10)
    only_h200["metadata"]["annotations"] = {NAMES.gpu_models: "H200"}
    outcome = stack.driver.schedule(stack.api.create_pod(only_h200))
    assert outcome.node == "" and "node-h200" in outcome.failed and "node-mixed" in outcome.failed

    node.backend.recover(gpu.uuid)
    eventually(healthy_in_extender, "the extender to see the GPU healthy again")
    outcome = stack.driver.schedule(stack.api.get_pod(NS, "h200-only"))
    assert outcome.node == "node-h200", outcome.error


def test_the_extenders_books_follow_what_the_kubelet_handed_out(stack: Stack) -> None:
    """Same-size pods bound by the real extender to a two-GPU node, admitted by the kubelet stand-in in its
    own order (ties in random order): after reconciliation the extender's per-GPU usage is what the device
    IDs say, GPU by GPU, whatever the extender planned."""
    import random
    import shutil
    rng = random.Random(8)
    root = tempfile.mkdtemp(prefix="vs-e2e2-")
    stack.api.create_node({"metadata": {"name": "node-l4"}})
    node = SimulatedNode("node-l4", SimulatedBackend.from_dict({"gpus": [
        {"model": "NVIDIA L4", "memoryMiB": 23034, "numaNode": 0, "uuid": "GPU-l4-0"},
        {"model": "NVIDIA L4", "memoryMiB": 23034, "numaNode": 0, "uuid": "GPU-l4-1"}]}), stack.api.url, root,
        rng=random.Random(8))
    try:
        node.start()
        eventually(lambda: inspection.render(stack.ext.acct, "node-l4") is not None, "the new node in the extender")
        driver = SchedulerDriver(stack.ext.url, ["node-l4"])
        live: list[dict] = []
        for round_ in range(5):
            batch = []
            for i in range(3):
                only = pod(f"r{round_}-{i}", rng.choice([4, 4, 8]))
                only["metadata"]["annotations"] = {NAMES.gpu_models: "L4"}
                # One attempt: a pod turned away by the same-size hold waits for a later round (as
                # kube-scheduler's backoff would), after the kubelet has admitted this round's pods.
                if driver.schedule(stack.api.create_pod(only), max_attempts=1).node:
                    batch.append(stack.api.get_pod(NS, only["metadata"]["name"]))
            results = node.kubelet.handle_pod_additions(batch)
            live += [p for p in batch if results[f"{NS}/{p['metadata']['name']}"] is None]
            node.daemon.reconciler.run_once()
            held: dict[str, int] = {"GPU-l4-0": 0, "GPU-l4-1": 0}
            for containers in node.kubelet.manager.holdings().values():
                for grants in containers.values():
                    for ids in grants.values():
                        for i in ids:
                            held[i.split("::")[0]] += 1024
            eventually(lambda: stack.gpu_usage("node-l4") == held,
                       f"the extender to count {held} (round {round_}; it has {stack.gpu_usage('node-l4')})")
            if live and rng.random() < 0.7:
                gone = live.pop(rng.randrange(len(live)))
                stack.api.finish_pod_deletion(NS, gone["metadata"]["name"])
                node.release(gone)
        driver.close()
    finally:
        node.close()
        shutil.rmtree(root, ignore_errors=True)
