"""``vramshare demo --dra``: the DRA path on loopback, no cluster and no GPU, ending by itself.

What runs: the API server stand-in serving ``resource.k8s.io/v1``; on each of two simulated GPU
nodes the real DRA plugin daemon (``deviceplugin.dra.main``: ResourceSlices by server-side apply,
registration and the DRA gRPC service on unix sockets); the stand-ins for kube-scheduler's claim
controller and DRA allocator (``dra_scheduler``, ``dra_allocator``: any feasible node, first-fit
devices, consumable capacity), the kubelet's DRA manager (``dra_kubelet``) and the container
runtime's CDI registry (``cdi_registry``). It submits inference pods asking GPU memory through
ResourceClaimTemplates, shows where each landed and what its container got, prints the memory
consumed per GPU, then deletes a pod to show its share and its CDI spec go.
"""
from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, TextIO

from kubernetes import client
from kubernetes.utils import parse_quantity

from deviceplugin.backend import DiscoveredGpu
from deviceplugin.dra.main import DraPluginDaemon
from deviceplugin.simulated_backend import SimulatedBackend
from standins.apiserver import RESOURCECLAIMS, RESOURCESLICES, ApiServerDouble
from standins.cdi_registry import Registry
from standins.demo_args import pod_count
from standins.dra_kubelet import DraKubelet, PrepareError
from standins.dra_scheduler import DraScheduler
from vramshare import contract
from vramshare.config import Config, DraConfig
from vramshare.kube import api_client_for

NAMES = contract.Names()
L40S = [DiscoveredGpu(index=i, uuid=u, model="NVIDIA L40S", memory_mib=46068, numa_node=i)
        for i, u in enumerate(["GPU-6f708192-a3b4-45c6-97e8-f90a1b2c3d45", "GPU-708192a3-b4c5-46d7-a8f9-0a1b2c3d4e56"])]


@dataclass(frozen=True)
class DemoClaim:
    pod: str
    what: str
    gib: int = 0
    count: int = 1
    mig: str = ""


PODS = [
    DemoClaim("llama3-8b-chat", "Llama-3-8B bf16, 8k context", 22),
    DemoClaim("mistral-7b-rag", "Mistral-7B bf16", 18),
    DemoClaim("mixtral-tp2", "Mixtral-8x7B, 48 GiB on each of 2 GPUs of one node", 48, count=2),
    DemoClaim("whisper-asr", "Whisper large-v3 on a 1g.10gb MIG instance", mig="1g.10gb"),
    DemoClaim("phi3-mini", "Phi-3-mini", 10),
    DemoClaim("llama3-70b-fp16", "Llama-3-70B fp16 on one GPU: too big anywhere", 150),
]


def device_classes(names: contract.Names = NAMES) -> list[dict[str, Any]]:
    """The DeviceClasses of deploy/daemonset/dra/deviceclasses.yaml (a test keeps the two equal)."""
    driver = names.dra_driver
    out = []
    for what, mode in (("gpu-memory", "shared"), ("gpu", "exclusive"), ("mig", "mig")):
        expr = f'device.driver == "{driver}" && device.attributes["{driver}"].mode == "{mode}"'
        out.append({"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
                    "metadata": {"name": names.device_class(what),
                                 "labels": {"app.kubernetes.io/part-of": "vramshare"}},
                    "spec": {"selectors": [{"cel": {"expression": expr}}]}})
    return out


def template(c: DemoClaim, names: contract.Names = NAMES) -> dict[str, Any]:
    if c.mig:
        exactly: dict[str, Any] = {"deviceClassName": names.device_class("mig"), "selectors": [{"cel": {
            "expression": f'device.attributes["{names.dra_driver}"].profile == "{c.mig}"'}}]}
    else:
        exactly = {"deviceClassName": names.device_class("gpu-memory"), "count": c.count,
                   "capacity": {"requests": {"memory": f"{c.gib}Gi"}}}
    devices: dict[str, Any] = {"requests": [{"name": "gpu", "exactly": exactly}]}
    if c.count > 1:
        devices["constraints"] = [{"requests": ["gpu"], "matchAttribute": f"{names.dra_driver}/node"},
                                  {"requests": ["gpu"], "distinctAttribute": f"{names.dra_driver}/uuid"}]
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
            "metadata": {"name": c.pod, "namespace": "default"}, "spec": {"spec": {"devices": devices}}}


def _say(out: TextIO, text: str = "") -> None:
    out.write(text + "\n")
    out.flush()


def _per_gpu(api: ApiServerDouble) -> list[tuple[str, str, str, int, int]]:
    """(node, device, model, consumed MiB, capacity MiB) of every shared device."""
    used: dict[tuple[str, str], int] = {}
    for c in api.objects(RESOURCECLAIMS):
        for r in ((c.get("status") or {}).get("allocation") or {}).get("devices", {}).get("results") or ():
            mem = (r.get("consumedCapacity") or {}).get("memory")
            if mem:
                key = (r["pool"], r["device"])
                used[key] = used.get(key, 0) + int(parse_quantity(mem)) // 2**20
    rows = []
    for s in api.objects(RESOURCESLICES):
        for d in s["spec"].get("devices") or ():
            if d.get("allowMultipleAllocations"):
                cap = int(parse_quantity(d["capacity"]["memory"]["value"])) // 2**20
                rows.append((s["spec"]["nodeName"], d["name"], d["attributes"]["model"]["string"],
                             used.get((s["spec"]["pool"]["name"], d["name"]), 0), cap))
    return sorted(rows)


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    if not getattr(args, "verbose", False):
        logging.getLogger().setLevel(logging.WARNING)
    pods = PODS[:pod_count(getattr(args, "pods", None), len(PODS))]
    work = tempfile.mkdtemp(prefix="vsdra", dir="/tmp")  # short: unix socket paths
    try:
        with ExitStack() as stack:
            api = stack.enter_context(ApiServerDouble())
            http = stack.enter_context(api_client_for(api.url))
            nodes = {"gpu-node-1": SimulatedBackend.demo(), "gpu-node-2": SimulatedBackend(L40S)}
            kubelets = {}
            for node, backend in nodes.items():
                api.create_node({"metadata": {"name": node}})
                root = os.path.join(work, node)
                config = Config(quota_host_dir=f"{root}/quota", dra=DraConfig(
                    gpus=("all",), cdi_root=f"{root}/cdi", state_dir=f"{root}/state"))
                daemon = DraPluginDaemon(backend, config, http, node, plugin_dir=f"{root}/plugins/{NAMES.dra_driver}",
                                         registry_dir=f"{root}/registry", retry_seconds=0.1)
                stack.enter_context(daemon)
                kubelets[node] = (DraKubelet(http, node, f"{root}/registry"), f"{root}/cdi")
            resource = client.ResourceV1Api(http)
            for dc in device_classes():
                resource.create_device_class(dc)
            for c in pods:
                resource.create_namespaced_resource_claim_template("default", template(c))
            if not api.wait_for(lambda a: len(a.objects(RESOURCESLICES)) == len(nodes), timeout=10):
                _say(out, "the DRA plugins did not publish their ResourceSlices")
                return 1
            for node, (kubelet, _) in kubelets.items():
                kubelet.sync_plugins()
            devices = sum(len(s["spec"].get("devices") or ()) for s in api.objects(RESOURCESLICES))
            _say(out, f"vramshare demo --dra: 2 nodes, {devices} devices published as resource.k8s.io/v1 "
                      f"ResourceSlices by the DRA plugin ({NAMES.dra_driver}); kube-scheduler stand-in: any "
                      "feasible node, first-fit devices (DRA has no packing scorer)\n")
            scheduler = DraScheduler(http, list(nodes), seed=7)
            placed: dict[str, dict[str, Any]] = {}
            for c in pods:
                pod = api.create_pod({"metadata": {"name": c.pod, "namespace": "default"}, "spec": {
                    "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": c.pod}],
                    "containers": [{"name": "server", "image": "vllm", "resources": {"claims": [{"name": "gpu"}]}}]}})
                pod = scheduler.create_claims(pod)
                placement = scheduler.schedule(pod)
                ask = f"{c.count} x {c.gib} GiB" if c.gib else f"MIG {c.mig}"
                if placement is None:
                    _say(out, f"  {c.pod:<16} {ask:<12} pending: no node has a device with that much free memory")
                    continue
                kubelet, cdi_root = kubelets[placement.node]
                pod = api.get_pod("default", c.pod)
                try:
                    names = kubelet.prepare_pod(pod)["server"]
                except PrepareError as exc:
                    _say(out, f"  {c.pod:<16} {ask:<12} prepare failed: {exc}")
                    continue
                env = Registry([cdi_root]).inject(names).env
                devs = [r["device"] for cl in placement.claims
                        for r in cl["status"]["allocation"]["devices"]["results"]]
                _say(out, f"  {c.pod:<16} {ask:<12} -> {placement.node} {','.join(devs):<16} container gets "
                          f"{contract.ENV_MEMORY_LIMIT_MIB}={env.get(contract.ENV_MEMORY_LIMIT_MIB)} "
                          f"{contract.ENV_VISIBLE_DEVICES}={env.get(contract.ENV_VISIBLE_DEVICES, '')[:12]}...")
                placed[c.pod] = pod
            _say(out, "\nmemory consumed per shared GPU (from the claims' consumedCapacity):")
            for node, dev, model, used, cap in _per_gpu(api):
                _say(out, f"  {node} {dev:<6} {model:<22} {used:>6} / {cap:>6} MiB")
            if placed:
                gone = next(iter(placed))
                kubelet, cdi_root = kubelets[api.get_pod("default", gone)["spec"]["nodeName"]]
                kubelet.unprepare_pod(placed[gone])
                scheduler.release(placed[gone])
                api.finish_pod_deletion("default", gone)
                left = len([f for f in os.listdir(cdi_root) if f.endswith(".json")])
                _say(out, f"\ndeleted {gone}: its claim was unprepared (CDI specs left on its node: {left}) and "
                          "deallocated:")
                for node, dev, model, used, cap in _per_gpu(api):
                    _say(out, f"  {node} {dev:<6} {model:<22} {used:>6} / {cap:>6} MiB")
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)
