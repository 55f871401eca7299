"""Property: the books (pod annotations after reconciliation) equal what containers actually got, on every
GPU, after every step, and never exceed capacity; and every container got exactly the GPUs its IDs name.

Many seeds of random pod mixes (same-size pods, ``gpu-count: 2`` next to single-GPU pods of the same
total, MIG, whole GPUs), created in few distinct seconds (creation-time ties), bound in random order by a
naive planner whose plans are often wrong or ambiguous, admitted by the kubelet's device manager model
(``standins.devicemanager``: its own accounting, the plugin's preference as a hint), deleted,
re-Allocated late, GPUs turning unhealthy and back (the kubelet hands out healthy IDs only), with plugin
restarts with and without PodResources; and bursts of same-size replicas assumed together on one plan (the
extender's narrower hold), each of which must land on exactly that plan. The plugin's real core runs
in-process (Allocator, steering, :func:`deviceplugin.kubelet.reconcile.plan`); only gRPC and HTTP are left out,
and they have their own tests. A failure prints its seed and step.
"""
from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass, field
from typing import Any

import pytest

from deviceplugin.backend import DiscoveredGpu, DiscoveredMig, HealthEvent
from deviceplugin.kubelet import podresources, reconcile
from deviceplugin.kubelet.allocator import Allocator
from deviceplugin.metrics import PluginMetrics
from deviceplugin.node_state import NodeState
from deviceplugin.quota_files import QuotaFiles, allocation_key
from standins.devicemanager import AdmissionError, DeviceManager, FnEndpoint
from standins.kubelet import admission_order, list_response
from vramshare import contract
from vramshare.config import Config
from vramshare.inventory import GpuMode

NAMES = contract.Names()
MEM, WHOLE = NAMES.gpu_memory, NAMES.gpu
NODE = "node-1"
GPUS = [DiscoveredGpu(0, "GPU-s0", "H100", 16 * 1024), DiscoveredGpu(1, "GPU-s1", "H100", 16 * 1024),
        DiscoveredGpu(2, "GPU-s2", "H100", 12 * 1024), DiscoveredGpu(3, "GPU-x3", "H100", 16 * 1024),
        DiscoveredGpu(4, "GPU-m4", "A100", 40 * 1024, mig_enabled=True, mig=(
            DiscoveredMig("MIG-a", "1g.10gb", 10 * 1024), DiscoveredMig("MIG-b", "1g.10gb", 10 * 1024),
            DiscoveredMig("MIG-c", "2g.20gb", 20 * 1024)))]
SEEDS = range(int(os.environ.get("VRAMSHARE_PROPERTY_SEEDS", "60")))
STEPS = 30


@dataclass
class World:
    """API server (a dict of pods with resourceVersions), the node's plugin core and kubelet model."""

    rng: random.Random
    root: str
    config: Config
    pods: dict[tuple[str, str], dict] = field(default_factory=dict)
    rv: int = 0
    pod_resources: bool = True
    responses: dict[tuple[str, str, str], Any] = field(default_factory=dict)  # (uid, container, resource)

    def __post_init__(self) -> None:
        self.dm = DeviceManager(self.rng)
        self.start_plugin()

    # -- the plugin (a restart is a new process: new state, same quota root) -------------------
    def start_plugin(self) -> None:
        self.state = NodeState(GPUS, self.config)
        self.quota = QuotaFiles(self.config.quota_host_dir, self.config.quota)
        self.allocator = Allocator(self.state, self.quota, PluginMetrics(), NODE, PodView(self))
        for resource, devs in self.state.snapshot.devices.items():
            self.dm.register(resource, FnEndpoint(
                lambda a, m, s, r=resource: self.allocator.preferred(r, a, m, s),
                lambda ids, r=resource: self.allocator.allocate(r, ids)))
            self.dm.update_devices(resource, [(d.id, d.healthy, (d.numa_node,) if d.numa_node is not None else ())
                                              for d in devs])
        self.reconcile()  # start-up round, before serving

    def pods_list(self) -> list[dict]:
        return [json.loads(json.dumps(p)) for p in self.pods.values()]

    def reconcile(self) -> reconcile.Plan | None:
        if not self.pod_resources:
            return None
        # the kubelet's own answer (one entry per device ID), through the plugin's own reading of it
        held = podresources.held(list_response(self.dm.pod_resources()), NAMES)
        snap = self.state.snapshot
        devices = {d.id: d for ds in snap.devices.values() for d in ds}
        plan = reconcile.plan(held, self.pods_list(), devices, NAMES, NODE, snap.inventory.unit_mib)
        for patch in plan.patches:
            pod = self.pods.get((patch.pod.namespace, patch.pod.name))
            if pod is None or pod["metadata"]["resourceVersion"] != patch.pod.resource_version:
                continue  # 409: the next round retries
            pod["metadata"]["annotations"].update({NAMES.assignment: patch.assignment,
                                                   NAMES.allocation_state: patch.state})
            wrote(pod, contract.FIELD_MANAGER_DEVICE_PLUGIN)
            self.bump(pod)
        return plan

    def bump(self, pod: dict) -> None:
        self.rv += 1
        pod["metadata"]["resourceVersion"] = str(self.rv)


class PodView:
    """The allocator's pod source: the API's pods as the watch-fed cache would have them."""

    def __init__(self, world: World) -> None:
        self._world = world

    def pods(self) -> list[dict]:
        return self._world.pods_list()


def make_pod(rng: random.Random, i: int) -> dict:
    kind = rng.choice(["units", "units", "units", "tp2", "mig", "whole", "two-containers"])
    ann: dict[str, str] = {}
    containers = []
    if kind == "units":
        containers.append({"name": "c", "resources": {"limits": {MEM: str(rng.choice([2, 4, 4, 6, 8]))}}})
    elif kind == "tp2":
        ann[NAMES.gpu_count] = "2"
        containers.append({"name": "c", "resources": {"limits": {MEM: str(2 * rng.choice([2, 3, 4]))}}})
    elif kind == "mig":
        containers.append({"name": "c", "resources": {"limits": {NAMES.mig("1g.10gb"): "1"}}})
    elif kind == "whole":
        containers.append({"name": "c", "resources": {"limits": {WHOLE: "1"}}})
    else:
        containers += [{"name": "a", "resources": {"limits": {MEM: "2"}}},
                       {"name": "b", "resources": {"limits": {MEM: "2"}}}]
    spec: dict[str, Any] = {"containers": containers}
    if kind in ("units", "tp2", "two-containers") and rng.random() < 0.2:
        # an init container whose devices the app containers reuse (the kubelet's devicesToReuse); an
        # init container holding devices nobody reuses is invisible to PodResources (see reconcile.py)
        spec["initContainers"] = [{"name": "init", "resources": {"limits": {MEM: "2"}}}]
    second = rng.randrange(3)  # few distinct seconds: creation-time ties are common
    return {"metadata": {"name": f"p{i}", "namespace": "default", "uid": f"uid-{i}", "annotations": ann,
                         "creationTimestamp": f"2026-11-30T12:00:0{second}Z", "resourceVersion": "0"},
            "spec": spec, "status": {"phase": "Pending"}}


def plan_for(rng: random.Random, pod: dict) -> str | None:
    """A naive extender: random GPUs, often not where the kubelet will put the pod. ``None``: bypassed it."""
    if rng.random() < 0.15:
        return None
    out = {}
    count = int(pod["metadata"]["annotations"].get(NAMES.gpu_count, "1"))
    for c in pod["spec"]["containers"]:
        limits = c["resources"]["limits"]
        if MEM in limits:
            gpus = rng.sample(["GPU-s0", "GPU-s1", "GPU-s2"], count)
            out[c["name"]] = [{"uuid": g, "mib": int(limits[MEM]) * 1024 // count} for g in gpus]
        elif WHOLE in limits:
            out[c["name"]] = [{"uuid": "GPU-x3", "mib": 16 * 1024}]
        else:
            out[c["name"]] = [{"uuid": rng.choice(["MIG-a", "MIG-b"]), "mib": 10 * 1024}]
    return json.dumps(out)


def reality(world: World, running_only: bool = True) -> dict[str, int]:
    """MiB per GPU (or MIG instance) from the device IDs the kubelet model says containers hold.

    ``running_only``: containers that run (app containers and restartable init containers). A finished
    init container's devices stay in the kubelet's accounting (nobody else gets them) but use no
    memory, and PodResources does not list them: that part is checked against capacity only."""
    devices = {d.id: d for ds in world.state.snapshot.devices.values() for d in ds}
    out: dict[str, int] = {}
    for uid, entry in world.dm.pods.items():
        if uid not in world.dm.active:
            continue
        done = {c["name"] for c in entry.pod["spec"].get("initContainers") or [] if c.get("restartPolicy") != "Always"}
        seen: set[str] = set()
        for container, grants in entry.containers.items():
            if running_only and container in done:
                continue
            for resource, grant in grants.items():
                for i in grant.device_ids - seen:
                    seen.add(i)
                    d = devices[i]
                    key = d.gpu_uuid if resource == MEM else d.id
                    out[key] = out.get(key, 0) + d.mib
    return out


def books(world: World) -> dict[str, int]:
    out: dict[str, int] = {}
    active = set(world.dm.holdings())
    for key, pod in world.pods.items():
        ann = pod["metadata"]["annotations"]
        if key in active and ann.get(NAMES.allocation_state) == contract.STATE_ALLOCATED:
            for gpus in json.loads(ann[NAMES.assignment]).values():
                for g in gpus:
                    out[g["uuid"]] = out.get(g["uuid"], 0) + g["mib"]
    return out


def capacity(world: World) -> dict[str, int]:
    inv = world.state.snapshot.inventory
    out = {}
    for g in inv.gpus:
        if g.mode is GpuMode.SHARED:
            out[g.uuid] = inv.capacity_mib(g)
        elif g.mode is GpuMode.EXCLUSIVE:
            out[g.uuid] = g.memory_mib
        for m in g.mig:
            out[m.uuid] = m.memory_mib
    return out


def check(world: World, where: str) -> None:
    real = reality(world)
    cap = capacity(world)
    for gpu, mib in reality(world, running_only=False).items():
        assert mib <= cap[gpu], f"{where}: GPU {gpu} holds {mib} of {cap[gpu]} MiB"
    # every container got exactly what its IDs name, and its own quota directory
    devices = {d.id: d for ds in world.state.snapshot.devices.values() for d in ds}
    dirs: dict[str, tuple[str, str]] = {}
    for uid, entry in world.dm.pods.items():
        if uid not in world.dm.active:
            continue
        for container, grants in entry.containers.items():
            for resource, grant in grants.items():
                spec = grant.response
                gpus = sorted({devices[i].gpu_uuid if resource == MEM else i for i in grant.device_ids})
                assert sorted(spec.envs[contract.ENV_GPU_UUIDS].split(",")) == gpus, f"{where}: {uid}/{container}"
                assert sum(int(m) for m in spec.envs[contract.ENV_MEMORY_LIMIT_MIB].split(",")) * \
                    (len(gpus) if "," not in spec.envs[contract.ENV_MEMORY_LIMIT_MIB] else 1) == \
                    sum(devices[i].mib for i in grant.device_ids), f"{where}: {uid}/{container} MiB"
                host = spec.mounts[-1][1]
                assert host.endswith(allocation_key(sorted(grant.device_ids)))
                if host in dirs and dirs[host][0] != uid:
                    raise AssertionError(f"{where}: {host} shared by {dirs[host]} and {uid}/{container}")
                dirs[host] = (uid, container)
    if world.pod_resources:
        assert books(world) == {g: m for g, m in real.items() if m}, f"{where}: books differ from reality"
        for key in world.dm.holdings():
            state = world.pods[key]["metadata"]["annotations"].get(NAMES.allocation_state)
            assert state == contract.STATE_ALLOCATED, f"{where}: admitted pod {key} is {state}"


def wrote(pod: dict, manager: str) -> None:
    """Record, as the API server does in managedFields, that ``manager`` wrote the assignment annotations."""
    keys = [k for k in (NAMES.assignment, NAMES.assume_time, NAMES.allocation_state) if k in pod["metadata"]["annotations"]]
    entries = [e for e in pod["metadata"].get("managedFields", []) if e["manager"] != manager]
    for e in entries:
        for k in keys:
            e["fieldsV1"]["f:metadata"]["f:annotations"].pop(f"f:{k}", None)
    entries.append({"manager": manager, "operation": "Update", "apiVersion": "v1", "fieldsType": "FieldsV1",
                    "fieldsV1": {"f:metadata": {"f:annotations": {f"f:{k}": {} for k in keys}}}})
    pod["metadata"]["managedFields"] = entries


def assumed_plans(world: World, units: int) -> set[tuple]:
    """The plans of the node's assumed pods for containers asking ``units`` of gpu-memory."""
    out = set()
    for pod in world.pods.values():
        ann = pod["metadata"]["annotations"]
        if ann.get(NAMES.allocation_state) != contract.STATE_ASSUMED:
            continue
        plan = json.loads(ann[NAMES.assignment])
        for c in [*(pod["spec"].get("initContainers") or []), *pod["spec"]["containers"]]:
            if c["resources"]["limits"].get(MEM) == str(units):
                out.add(tuple(sorted((g["uuid"], g["mib"]) for g in plan.get(c["name"], []))))
    return out


def replicas(world: World, rng: random.Random, made: int, step: int, where: str) -> int:
    """The narrower hold: 2-3 same-size replicas assumed together, all planned on the same GPU(s) with
    room for all (as the extender plans them), bound in any order and admitted in the kubelet's order.
    Whichever the kubelet admits first, each must land on exactly the plan's GPUs and devices per GPU.
    Skipped where an assumed pod of that size has another plan (the hold would keep these away)."""
    units, count, k = rng.choice([2, 4, 6]), rng.choice([1, 1, 2]), rng.randint(2, 3)
    per = units // count
    snap = world.state.snapshot
    world.dm.update_allocated_devices()
    in_use = world.dm.allocated_devices.get(MEM, set())
    free: dict[str, int] = {}
    for d in snap.devices[MEM]:
        if d.healthy and d.id not in in_use:
            free[d.gpu_uuid] = free.get(d.gpu_uuid, 0) + 1
    room = sorted(g for g, n in free.items() if n >= k * per)
    if len(room) < count:
        return made
    gpus = rng.sample(room, count)
    plan = [{"uuid": g, "mib": per * 1024} for g in gpus]
    mine = tuple(sorted((g["uuid"], g["mib"]) for g in plan))
    if assumed_plans(world, units) - {mine}:
        return made
    batch = []
    for _ in range(k):
        pod = {"metadata": {"name": f"p{made}", "namespace": "default", "uid": f"uid-{made}",
                            "annotations": {NAMES.assignment: json.dumps({"c": plan}), NAMES.assume_time: str(step),
                                            NAMES.allocation_state: contract.STATE_ASSUMED},
                            "creationTimestamp": f"2026-11-30T12:00:0{rng.randrange(2)}Z", "resourceVersion": "0"},
               "spec": {"nodeName": NODE, "containers": [{"name": "c", "resources": {"limits": {MEM: str(units)}}}]},
               "status": {"phase": "Pending"}}
        if count > 1:
            pod["metadata"]["annotations"][NAMES.gpu_count] = str(count)
        wrote(pod, contract.FIELD_MANAGER_EXTENDER)
        made += 1
        batch.append(pod)
    rng.shuffle(batch)  # binds complete in any order
    for pod in batch:
        world.pods[("default", pod["metadata"]["name"])] = pod
        world.bump(pod)
    devices = {d.id: d for d in snap.devices[MEM]}
    for pod in admission_order(batch, rng):
        world.dm.admit(pod)  # room for all: admission cannot fail
        ids = world.dm.pods[pod["metadata"]["uid"]].containers["c"][MEM].device_ids
        got: dict[str, int] = {}
        for i in ids:
            got[devices[i].gpu_uuid] = got.get(devices[i].gpu_uuid, 0) + 1
        assert got == {g: per for g in gpus}, f"{where}: replica {pod['metadata']['name']} got {got}, plan {gpus}"
    return made


@pytest.mark.parametrize("seed", SEEDS)
def test_books_equal_reality_after_every_step(seed: int, tmp_path) -> None:
    rng = random.Random(seed)
    config = Config(quota_host_dir=str(tmp_path / "q"), gpu_modes={"3": GpuMode.EXCLUSIVE})
    world = World(rng, str(tmp_path), config)
    made = 0
    for step in range(STEPS):
        action = rng.choices(["batch", "replicas", "delete", "late", "restart", "podresources", "xid"],
                             [5, 2, 2, 1, 1, 1, 1])[0]
        where = f"seed {seed} step {step} ({action})"
        if action == "batch":
            batch = []
            for _ in range(rng.randint(1, 4)):
                pod = make_pod(rng, made)
                made += 1
                text = plan_for(rng, pod)
                if text is not None:
                    pod["metadata"]["annotations"].update({NAMES.assignment: text, NAMES.assume_time: str(step),
                                                           NAMES.allocation_state: contract.STATE_ASSUMED})
                    wrote(pod, contract.FIELD_MANAGER_EXTENDER)
                batch.append(pod)
            rng.shuffle(batch)  # binds complete in any order
            for pod in batch:
                pod["spec"]["nodeName"] = NODE
                world.pods[("default", pod["metadata"]["name"])] = pod
                world.bump(pod)
            for pod in admission_order(batch, rng):  # HandlePodAdditions
                try:
                    world.dm.admit(pod)
                except AdmissionError:
                    world.pods.pop(("default", pod["metadata"]["name"]))  # the pod fails; its controller deletes it
        elif action == "replicas":
            made = replicas(world, rng, made, step, where)
        elif action == "delete" and world.dm.holdings():
            ns, name = rng.choice(sorted(world.dm.holdings()))
            pod = world.pods.pop((ns, name))
            world.dm.remove_pod(pod["metadata"]["uid"])
        elif action == "late" and world.dm.holdings():
            ns, name = rng.choice(sorted(world.dm.holdings()))
            uid = world.pods[(ns, name)]["metadata"]["uid"]
            container = rng.choice(sorted(world.dm.pods[uid].containers))
            world.dm.lose_container(uid, container)
            try:
                world.dm.reallocate(uid)
            except AdmissionError:
                pod = world.pods.pop((ns, name))  # the container cannot start again: the pod fails
                world.dm.remove_pod(uid)
        elif action == "restart":
            world.start_plugin()
        elif action == "podresources":
            world.pod_resources = not world.pod_resources
        elif action == "xid":  # a GPU turns unhealthy or recovers; ListAndWatch resends, the kubelet follows
            gpu = rng.choice(GPUS)
            healthy = not world.state.snapshot.inventory.gpu(gpu.uuid).healthy
            world.state.on_health(HealthEvent(gpu.uuid, healthy, "xid 79" if not healthy else "recovered"))
            for resource, devs in world.state.snapshot.devices.items():
                world.dm.update_devices(resource, [(d.id, d.healthy) for d in devs])
        world.reconcile()
        check(world, where)
    world.pod_resources = True
    world.reconcile()
    check(world, f"seed {seed} end")
