"""``vramshare demo``: the whole stack on loopback, no cluster and no GPU, ending by itself.

What runs, each the real thing except the two peers no laptop has:
  * a local stand-in for the API server (``standins.apiserver``), reached with the official client;
  * two simulated GPU nodes, each with the real device plugin daemon serving gRPC on unix sockets to a
    stand-in kubelet (``standins.kubelet``) that registers it, watches devices and calls Allocate;
  * the real extender over HTTP, driven the way kube-scheduler drives it (``standins.scheduler``).
It submits inference pods of realistic sizes, says where each landed and why, shows what the kubelet
handed each container, prints the ``/inspect`` table, deletes a pod to show the memory coming back,
and ends with the quota loop moving three tenants' limits on one shared GPU as their demand swings
(:func:`show_quota`; ``vramshare demo --quota`` runs that part alone).
"""
from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import textwrap
import time
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, TextIO

from deviceplugin import enforcement
from deviceplugin.devices import build_inventory
from deviceplugin.quota.classes import PodMeta
from deviceplugin.quota.loop import LoopSettings, QuotaLoop
from deviceplugin.quota.model import PolicyParams, Tenant, TenantKey
from deviceplugin.simulated_backend import SimulatedBackend
from deviceplugin.simulated_usage import BUILTIN, UsageReplay
from extender import inspection
from extender.main import start_for_url
from standins.apiserver import ApiServerDouble
from standins.demo_args import pod_count
from standins.scheduler import SchedulerDriver
from standins.simnode import SimulatedNode
from vramshare import contract
from vramshare.config import Config, ConfigError, load_config
from vramshare.errors import UsageError
from vramshare.inventory import GpuMode

NAMES = contract.Names()
GIB = 1024

# A second node of a different GPU class, so placement has a real choice to make.
L40S_NODE = {"gpus": [
    {"model": "NVIDIA L40S", "memoryMiB": 46068, "numaNode": 0, "uuid": "GPU-6f708192-a3b4-45c6-97e8-f90a1b2c3d45"},
    {"model": "NVIDIA L40S", "memoryMiB": 46068, "numaNode": 1, "uuid": "GPU-708192a3-b4c5-46d7-a8f9-0a1b2c3d4e56"},
]}


@dataclass(frozen=True)
class DemoPod:
    name: str
    what: str
    gib: int = 0  # vramshare.io/gpu-memory units (1 GiB each)
    gpus: int = 1  # vramshare.io/gpu-count
    mig: str = ""  # a MIG profile instead of memory units
    models: str = ""  # vramshare.io/gpu-models constraint


PODS = [
    DemoPod("llama3-8b-chat", "Llama-3-8B bf16, 8k context", 22),
    DemoPod("mistral-7b-rag", "Mistral-7B bf16", 18),
    DemoPod("qwen2-72b-awq", "Qwen2-72B AWQ int4, needs the big card", 60, models="H200|H100"),
    DemoPod("bge-embedder", "BGE-large embeddings", 4),
    DemoPod("whisper-asr", "Whisper large-v3 on a MIG slice", mig="1g.10gb"),
    DemoPod("mixtral-tp2", "Mixtral-8x7B, tensor-parallel over 2 GPUs", 2 * 48, gpus=2),
    DemoPod("phi3-mini", "Phi-3-mini", 10),
    DemoPod("llama3-70b-fp16", "Llama-3-70B fp16 on one GPU: too big anywhere", 150),
]


def pod_manifest(p: DemoPod) -> dict[str, Any]:
    resources = {NAMES.mig(p.mig): "1"} if p.mig else {NAMES.gpu_memory: str(p.gib)}
    ann = {"demo/what": p.what}
    if p.gpus > 1:
        ann[NAMES.gpu_count] = str(p.gpus)
    if p.models:
        ann[NAMES.gpu_models] = p.models
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": p.name, "namespace": "inference", "annotations": ann},
            "spec": {"schedulerName": "vramshare-scheduler",
                     "containers": [{"name": "server", "image": "vllm/vllm-openai",
                                     "resources": {"limits": resources}}]}}


def _say(out: TextIO, text: str = "") -> None:
    print(text, file=out, flush=True)


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    if getattr(args, "dra", False):  # the DRA path (Kubernetes 1.36+): its own module
        from standins import demo_dra
        return demo_dra.run(args, out)
    if getattr(args, "mig", False):  # dynamic MIG on the device-plugin path (issue 24): its own module
        from standins import demo_mig
        return demo_mig.run(args, out)
    out = out or sys.stdout
    t0 = time.monotonic()
    if not getattr(args, "verbose", False):  # the narration says what happened; logs on request
        logging.getLogger().setLevel(logging.WARNING)
    if getattr(args, "quota", False):
        show_quota(out, classes=getattr(args, "classes", None))
        return 0
    pods = PODS[:pod_count(getattr(args, "pods", None), len(PODS))]
    # The directory outlives the daemons: removing sockets under a running plugin makes it re-register.
    with tempfile.TemporaryDirectory(prefix="vramshare-demo-") as root, ExitStack() as stack:
        _say(out, "vramshare demo: an API server stand-in, 2 simulated GPU nodes with the device plugin and a "
                  "stand-in kubelet, and the extender, all on loopback.")
        api = stack.enter_context(ApiServerDouble())
        nodes = {}
        for name, backend in (("gpu-node-a", SimulatedBackend.demo()),
                              ("gpu-node-b", SimulatedBackend.from_dict(L40S_NODE))):
            api.create_node({"metadata": {"name": name, "labels": {"nvidia.com/gpu.present": "true"}}})
            node = SimulatedNode(name, backend, api.url, root)
            stack.callback(node.close)
            node.start()
            nodes[name] = node
            inv = node.daemon.state.snapshot.inventory
            _say(out, f"  {name}: device plugin registered {', '.join(sorted(node.daemon.state.snapshot.devices))}")
            for g in inv.gpus:
                extra = f"{g.units} x 1 GiB units" if g.units else "MIG " + ", ".join(m.profile for m in g.mig)
                _say(out, f"    GPU {g.index} {g.model} ({g.memory_mib / GIB:.0f} GiB, NUMA {g.numa_node}): {extra}")
        ext = start_for_url(api.url)
        stack.callback(ext.stop)
        if not ext.wait_ready(10) or not api.wait_for(
                lambda a: all(contract.Names().inventory in (n["metadata"].get("annotations") or {})
                              for n in a.nodes()), 10):
            _say(out, "demo: the extender did not see the GPU inventories in time")
            return 1
        _wait(lambda: all(inspection.render(ext.acct, n) for n in nodes), 10)  # the extender knows both nodes
        _say(out, f"  extender: {ext.url} (policy {ext.app.policy.value})")
        driver = SchedulerDriver(ext.url, sorted(nodes))
        stack.callback(driver.close)
        _say(out)
        _say(out, f"Submitting {len(pods)} inference pods (schedulerName: vramshare-scheduler):")
        placed = []
        for p in pods:
            manifest = api.create_pod(pod_manifest(p))
            ask = f"MIG {p.mig}" if p.mig else (f"{p.gib} GiB" + (f" over {p.gpus} GPUs" if p.gpus > 1 else ""))
            _say(out, f"\n* {p.name}: {p.what}; asks {ask}" + (f", models {p.models}" if p.models else ""))
            res = driver.schedule(manifest)
            for n, why in sorted(res.failed.items()):
                _say(out, f"    filter: {n} rejected: {why}")
            if not res.node:
                _say(out, f"    => stays Pending: {res.error}")
                continue
            if len(res.scores) > 1:
                _say(out, "    prioritize: " + ", ".join(f"{n}={s}" for n, s in sorted(res.scores.items())))
            bound = api.get_pod("inference", p.name) or {}
            ann = bound["metadata"]["annotations"]
            _say(out, f"    bind: {res.node}, assignment {ann[NAMES.assignment]}")
            for container, env in nodes[res.node].admit(bound):
                _say(out, f"    kubelet Allocate ({container}): {contract.ENV_VISIBLE_DEVICES}="
                          f"{env.get(contract.ENV_VISIBLE_DEVICES)} {contract.ENV_MEMORY_LIMIT_MIB}="
                          f"{env.get(contract.ENV_MEMORY_LIMIT_MIB)}")
            state = (api.get_pod("inference", p.name) or {})["metadata"]["annotations"].get(NAMES.allocation_state)
            _say(out, f"    allocation-state: {state}")
            api.set_pod_phase("inference", p.name, "Running")
            placed.append((p, res.node))
        _say(out, "\nPer-GPU view from the extender (GET /inspect, as `vramshare inspect` prints it):")
        _say(out, inspection.format_table(inspection.fetch(ext.url)))
        if placed:
            gone, node = placed[0]
            before = _used(ext, node)
            pod = api.get_pod("inference", gone.name)
            api.finish_pod_deletion("inference", gone.name)  # the kubelet ends it: containers terminated, then gone
            nodes[node].release(pod or {})
            _wait(lambda: _used(ext, node) < before, 5)
            _say(out, f"\nDeleted {gone.name}: {node} used {before / GIB:.0f} GiB before, "
                      f"{_used(ext, node) / GIB:.0f} GiB now.")
        _say(out)
        show_quota(out)
        _say(out, f"\nDemo finished in {time.monotonic() - t0:.1f} s: {len(placed)} of {len(pods)} pods placed.")
    return 0


def quota_config(path: str | None) -> Config:
    """``--classes FILE`` as a v1 config; a file that is missing or wrong is the user's to fix."""
    if not path:
        return Config()
    try:
        return load_config(path)
    except ConfigError as exc:
        raise UsageError(f"--classes {path}: {exc}; give a v1 config with quota.classes "
                         "(examples: deploy/examples/quota-classes/)") from None


def _used(ext: Any, node: str) -> int:
    doc = inspection.render(ext.acct, node)
    return int(doc["usedMiB"]) if doc else 0


def _wait(predicate: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if predicate():
                return True
        except (IndexError, KeyError, TypeError):
            pass
        time.sleep(0.05)
    return False


# -- the quota loop on one shared GPU -----------------------------------------------------------
QUOTA_TENANTS = ("chat-llama3", "job-summarizer", "rag-retriever")  # sorted: the replay deals series in key order


class _Tenants:
    def __init__(self, tenants: list[Tenant]) -> None:
        self.tenants = tenants

    def list_tenants(self) -> list[Tenant]:
        return self.tenants


# What the tenants' pods look like to quota-class selection (``--classes``): one per way of choosing.
QUOTA_META = {"chat-llama3": PodMeta.of("prod", {"app": "chat"}, "inference-critical"),
              "job-summarizer": PodMeta.of("batch", {"app": "summarizer", "team": "eval"}),
              "rag-retriever": PodMeta.of("inference", {"app": "rag"}, requested_class="burst")}
REASON_WIDTH = 110  # the why column: shortened at a word boundary, never mid-word
PRESSURE = 1.35  # --classes: the built-in day x this, so the GPU is over-committed around midday


class _Fenced:
    """The replay as a ``driver``-mode node sees it: a container holds at most its limit in force
    (allocations beyond the hard limit fail); what it wanted beyond that is demand the limit denied."""

    name = "fenced-replay"

    def __init__(self, replay: UsageReplay, limits: Any, requests: dict[str, int]) -> None:
        self._replay, self._limits, self._requests = replay, limits, requests
        self.demand: dict[str, int] = {}

    def read_usage(self) -> list[Any]:
        import dataclasses
        limits = {(k.pod, gpu): mib for (k, gpu), mib in self._limits().items()}
        out = []
        for smp in self._replay.read_usage():
            self.demand[smp.pod] = smp.used_mib
            cap = limits.get((smp.pod, smp.gpu_uuid), self._requests.get(smp.pod or ""))  # Allocate: the request
            out.append(smp if cap is None else dataclasses.replace(smp, used_mib=min(smp.used_mib, cap)))
        return out


def show_quota(out: TextIO, ticks: int = 16, classes: str | None = None) -> None:
    """The real quota loop (policy, writer, warmth) on the demo node's first H100, fed a replay of
    per-container use (a built-in day of three servers; ``simulated_usage.genai_series`` replays the
    GenAI trace the same way). Prints one row a tick: each tenant's use / limit and state.
    ``classes``: a v1 config file whose quota keys and classes apply, on a day that over-commits the GPU."""
    backend = SimulatedBackend.demo()
    discovered = backend.discover()
    cfg = quota_config(classes)
    chosen = enforcement.detect(backend, cfg, discovered)
    inv = build_inventory(discovered, enforcement.pin(cfg, chosen))
    gpu = next(g for g in inv.gpus if g.mode is GpuMode.SHARED)
    cap = inv.capacity_mib(gpu)
    series = [[int(v * (PRESSURE if classes else 1)) for v in s] for s in BUILTIN]  # UsageReplay also replays GenAI
    request = (cap // len(QUOTA_TENANTS)) // 1024 * 1024
    keys = [TenantKey(QUOTA_META[name].namespace if classes else "inference", name, "server", pod_uid=f"uid-{name}")
            for name in QUOTA_TENANTS]
    tenants = [Tenant(k, ((gpu.uuid, request),), metrics_url=str(k), meta=QUOTA_META[k.pod] if classes else None)
               for k in keys]
    replay = UsageReplay(series)
    params = PolicyParams.from_config(cfg.quota)
    clock = [0.0]
    with tempfile.TemporaryDirectory(prefix="vramshare-quota-") as root:
        settings = LoopSettings(params, peak_window_ticks=3, idle_seconds=180, grace_seconds=3600,
                                classes=cfg.quota.classes, startup_ticks=0)  # the servers run already
        holder: list[QuotaLoop] = []
        fenced = _Fenced(replay, lambda: holder[0].limits(), {k.pod: request for k in keys})
        loop = QuotaLoop(_Tenants(tenants), lambda: {gpu.uuid: cap}, [fenced if classes else replay], params, root,
                         signals=replay, settings=settings, mode=chosen.mode, clock=lambda: clock[0])
        holder.append(loop)
        replay.bind(lambda: loop.tenants_now)
        _say(out, f"Quota loop on one shared GPU ({gpu.model}, {cap / GIB:.0f} GiB schedulable), three tenants "
                  f"requesting {request / GIB:.0f} GiB each; use replayed from a day of three servers "
                  f"(one tick = 90 minutes{f', demand x {PRESSURE}' if classes else ''}).")
        _say(out, f"Enforcement here: {chosen.mode.value} ({chosen.reason}). On an R615+ node with cgroup v2 "
                  f"it would be driver: Allocate sets NVIDIA_GPU_MEMORY_REQUEST/LIMIT and the loop moves each "
                  f"container's hard limit with nvmlDeviceSetMemoryLimits_v1."
             + (" Replayed as driver mode would fence it: a container holds at most its limit, the columns "
                "show demand/limit." if classes else ""))
        over: dict[str, int] = {name: 0 for name in QUOTA_TENANTS}
        width = 24
        _say(out, "  tick  " + "".join(f"{n:<{width}}" for n in QUOTA_TENANTS) + "why (largest move, in MiB)")
        for tick in range(ticks):
            clock[0] = tick * 60.0
            report = loop.run_once()
            used = dict(fenced.demand) if classes else {s.pod: s.used_mib for s in replay_last(replay, tenants, tick)}
            cells, moves = [], []
            ordered = sorted(report.decisions, key=lambda d: QUOTA_TENANTS.index(d.key.pod))
            if tick == 0 and classes:
                names = [f"{loop.classes().get(d.key, '?')} (floor {d.floor_mib / GIB:.0f})" for d in ordered]
                _say(out, "  class " + "".join(f"{n:<{width}}" for n in names))
            for d in ordered:
                u = used.get(d.key.pod, 0)
                mark = "!" if u > d.previous_mib else " "
                over[d.key.pod] += u > d.previous_mib
                cells.append(f"{u / GIB:5.1f}/{d.limit_mib / GIB:4.1f} GiB {d.phase.value:<6}{mark}")
                if d.changed:
                    moves.append((abs(d.limit_mib - d.previous_mib), f"{d.key.pod}: {d.reason}"))
            why = max(moves)[1] if moves else "hold"
            _say(out, f"  {tick:>4}  " + "".join(f"{c:<{width}}" for c in cells)
                 + short_reason(why))
        _say(out, f"  ({'demand' if classes else 'use'}/limit after the tick; ! = the {'demand' if classes else 'use'} "
                  f"was above the limit in force before the tick)")
        _say(out, "  ticks over the limit: " + ", ".join(f"{n} {over[n]}" for n in QUOTA_TENANTS))


def short_reason(why: str) -> str:
    """The why column: at most REASON_WIDTH characters, shortened at a word boundary (never mid-word)."""
    return textwrap.shorten(why, REASON_WIDTH, placeholder=" ...")


def replay_last(replay: UsageReplay, tenants: list[Tenant], tick: int) -> list[Any]:
    """The samples the replay gave at ``tick`` (re-derived, the replay has moved on)."""
    from deviceplugin.quota.telemetry import UsageSample
    return [UsageSample(g, replay._value(t.key, tick), pod=t.key.pod) for t in tenants for g, _ in t.gpus[:1]]
