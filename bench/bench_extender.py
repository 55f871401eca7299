"""Extender scheduling cycles over HTTP(S), the way kube-scheduler calls it, side by side with a baseline commit.

For 5,000 (and 500) nodes of 8 GPUs, populated with a realistic mix of used memory, a client plays
kube-scheduler (nodeCacheCapable: NodeNames, as deploy/daemonset/scheduler-config.yaml sets): per pod,
POST /filter with every node name, POST /prioritize with every node that passed (skipped when one
passed), then POST /bind to the best-scored node on a second connection, asynchronously (the
scheduler's binding cycle runs beside the next scheduling cycle). Each extender runs in its own
process (its own GIL, its background warmer on) and the same pods go to every server, interleaved
run by run (new, baseline, new, baseline...), so a busy machine slows both alike.

``--mix real`` (the default) is what a live cluster sends, and what the project's bench left out until
issue 21 (an outside measurement saw 190 cycles/s and prioritize p99 12.4 ms where the bench said 232
and 4.66 ms):

* real pod objects (~6 KB: labels, ownerReferences, managedFields, env, probes, volumes, tolerations,
  a Pending status with its Unschedulable condition, a ``model`` hint) from a few Deployments of
  varied sizes, ``gpu-count: 2`` for some, a sidecar for others, CPU and memory requests, and nodes
  with ``status.allocatable`` (so the host term of FGD runs), with a resourceVersion, as the API
  server always gives;
* binds, so the books change every cycle (every memo keyed on the state's version is cold for the
  next pod), and the watch events that follow a bind (the assumed pod, then the device plugin's
  ``allocated`` report about a second later), applied in the extender's process as its watch would:
  same-size holds with plans are live and filter walks them;
* kube-scheduler's own filter before the extender: its NodeResourcesFit drops a node whose allocatable
  ``vramshare.io/gpu-memory`` less the requests of its pods (bound or assumed) is short of the pod's
  (:class:`KubeFit`, the profile's ``ignoredByScheduler: false``), and each request is encoded in its
  cycle, as kube-scheduler marshals it;
* mutual TLS on both connections (``--no-tls`` to drop it), keep-alive as Go's transport does;
* p50/p99 per verb over every cycle of every run (not the fastest run's), and cycles/s per run; the
  ratio to the baseline is the median over pairs of adjacent runs (the machine's other work drifts
  between pairs more than within one).

``--mix bench`` replays the old bench's mix (small pods without a resourceVersion, no binds, plain
HTTP) with the same servers, to show what it left out. Reported per server: p50/p99/max per verb,
cycles/s (median and best run), the server process's CPU ms per cycle and its split per thread (the HTTP
loop that answers filter and prioritize, the bind workers, the watch feed, the warmer) and the GC's share,
binds bound/refused, and for servers that have one, the parsed-pod cache's hits and misses.

    python bench/bench_extender.py --sizes 5000 --baseline d7ebb75          # the issue's comparison
    python bench/bench_extender.py --sizes 5000 --mix bench --baseline d7ebb75
    python bench/bench_extender.py --quick --sizes 500                      # a short check
    python bench/bench_extender.py --profile --sizes 5000                   # cProfile one server's cycles
    python bench/bench_extender.py --sizes 5000 --node-order fixed          # one fixed name order (rounds 1-4)
    python bench/bench_extender.py --wire --sizes 5000                      # the wire's pieces, memo vs none
    python bench/bench_extender.py --sizes 5000 --baseline d7ebb75 --floor  # + a server that does no work

``--floor`` serves, beside the others, canned answers of the real sizes (no extender work at all): the
cycles/s that kube-scheduler's side (this client), HTTP and TLS leave on this machine, the ceiling of
any extender measured here.

``--node-order scheduler``: kube-scheduler's filter runs 16 goroutines over chunks of the node list and
appends each feasible node as its check ends, so the NodeNames of two cycles are never in the same order
(:func:`scheduler_order`). That is the default: ``--node-order fixed`` sends one order every cycle, as the
bench did until round 5, which every memo keyed on the list favours (~3.8 ms less per filter on 93ecc60).

``--baseline REV`` extracts ``git archive REV`` to a temporary folder and serves its extender
(this file drives both: its pods, its API double, its watch feed; the extender code is the tree's).

Aims (issue 21): >= 300 cycles/s at 5,000 nodes with p99 < 5 ms per verb, holds and mTLS included.
The machine this runs on is usually shared: every figure is an upper bound of latency (and a lower
bound of throughput); quote the ratio to the baseline measured in the same run.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import cProfile
import heapq
import io
import json
import logging
import operator
import os
import platform
import pstats
import queue
import random
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from typing import Any

import msgspec
import numpy as np
import orjson

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A server child serves the extender of BENCH_EXTENDER_TREE (a baseline commit) with this file's driver.
sys.path.insert(0, os.environ.get("BENCH_EXTENDER_TREE") or ROOT)

from extender import accounting, apicalls, app, binder, http_server, metrics  # noqa: E402
from vramshare import contract, inventory, podspec  # noqa: E402
from vramshare.config import Config, Policy  # noqa: E402

NAMES = contract.Names()
RESULTS_DIR = os.path.join(ROOT, "bench", "results")
MODELS = [("NVIDIA A100-SXM4-80GB", 81920), ("NVIDIA H100 80GB HBM3", 81559), ("NVIDIA L40S", 46068)]
SIZES_GIB = [4, 8, 10, 16, 20, 24, 40]  # typical inference replicas
SCHEDULER = "vramshare-scheduler"
#: The Deployments the real mix's pending pods come from: (name, GiB per GPU, gpu-count, sidecar, model).
DEPLOYMENTS = [("llama-8b", 20, 1, True, "meta-llama/Llama-3.1-8B-Instruct"),
               ("qwen-7b", 16, 1, False, "Qwen/Qwen2.5-7B-Instruct"),
               ("mistral-7b", 16, 1, True, "mistralai/Mistral-7B-Instruct-v0.3"),
               ("phi-mini", 8, 1, False, "microsoft/Phi-3.5-mini-instruct"),
               ("gemma-2b", 4, 1, False, "google/gemma-2-2b-it"),
               ("embed", 4, 1, True, "BAAI/bge-large-en-v1.5"),
               ("llama-70b-awq", 40, 2, True, "hugging-quants/Llama-3.1-70B-AWQ"),
               ("qwen-32b", 24, 2, False, "Qwen/Qwen2.5-32B-Instruct-AWQ"),
               ("mixtral", 40, 1, True, "mistralai/Mixtral-8x7B-Instruct-v0.1"),
               ("rerank", 10, 1, False, "BAAI/bge-reranker-v2-m3")]
SETTLE_S = 2.0  # the pods exist a moment before kube-scheduler asks; the extender's warmer uses it
API_LATENCY_S = 0.002  # each API call of a bind (patch, Binding)
REPORT_S = 1.0  # the device plugin reports a bound pod allocated about a second after its bind


# -- the cluster ------------------------------------------------------------------------------
def node_obj(name: str, model: str, mib: int, real: bool) -> dict[str, Any]:
    gpus = tuple(inventory.Gpu(index=i, uuid=f"GPU-{name}-{i}", model=model, memory_mib=mib,
                               units=inventory.units_for(mib, 0, 1024)) for i in range(8))
    node: dict[str, Any] = {"metadata": {"name": name, "annotations": {
        NAMES.inventory: inventory.NodeInventory(unit_mib=1024, gpus=gpus).to_json()}}}
    if real:
        node["status"] = {"allocatable": {"cpu": "190", "memory": "2000Gi", "pods": "110"}}
    return node


def pod_obj(name: str, gib: int, count: int = 1) -> dict[str, Any]:
    """The old bench's pod: one container, no resourceVersion, nothing else."""
    ann = {NAMES.gpu_count: str(count)} if count > 1 else {}
    return {"metadata": {"name": name, "namespace": "bench", "uid": f"uid-{name}", "annotations": ann},
            "spec": {"schedulerName": SCHEDULER, "containers": [
                {"name": "vllm", "resources": {"limits": {NAMES.gpu_memory: str(gib * count)}}}]},
            "status": {"phase": "Running"}}


def _env(i: int) -> list[dict[str, Any]]:
    return [{"name": "HF_HOME", "value": "/cache/hf"}, {"name": "VLLM_PORT", "value": "8000"},
            {"name": "VLLM_LOGGING_LEVEL", "value": "INFO"}, {"name": "OMP_NUM_THREADS", "value": "8"},
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.name"}}},
            {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.namespace"}}},
            {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}}},
            *({"name": f"FEATURE_FLAG_{k}", "value": "true" if (i + k) % 2 else "false"} for k in range(8))]


def real_pod(dep: tuple[str, int, int, bool, str], serial: int, namespace: str = "inference") -> dict[str, Any]:
    """A pending replica of ``dep`` as the API server sends it (kube-scheduler's informer copy)."""
    name, gib, count, sidecar, model = dep
    pod_name = f"{name}-6d5f7c9b8-{serial:05d}"
    limits = {NAMES.gpu_memory: str(gib * count), "cpu": "8", "memory": "64Gi"}
    requests = {NAMES.gpu_memory: str(gib * count), "cpu": "4", "memory": "32Gi"}
    ann = {NAMES.model: model, "prometheus.io/scrape": "true", "prometheus.io/port": "8000",
           "kubectl.kubernetes.io/restartedAt": "2026-11-30T10:00:00Z"}
    if count > 1:
        ann[NAMES.gpu_count] = str(count)
    containers: list[dict[str, Any]] = [{
        "name": "vllm", "image": "vllm/vllm-openai:v0.8.5", "imagePullPolicy": "IfNotPresent",
        "args": ["--model", model, "--port", "8000", "--max-model-len", "8192", "--enable-prefix-caching"],
        "env": _env(serial), "ports": [{"name": "http", "containerPort": 8000, "protocol": "TCP"}],
        "resources": {"limits": limits, "requests": requests},
        "readinessProbe": {"httpGet": {"path": "/health", "port": 8000, "scheme": "HTTP"}, "periodSeconds": 5,
                           "timeoutSeconds": 1, "successThreshold": 1, "failureThreshold": 3},
        "livenessProbe": {"httpGet": {"path": "/health", "port": 8000, "scheme": "HTTP"}, "initialDelaySeconds": 120,
                          "periodSeconds": 10, "timeoutSeconds": 1, "successThreshold": 1, "failureThreshold": 3},
        "volumeMounts": [{"name": "cache", "mountPath": "/cache"}, {"name": "shm", "mountPath": "/dev/shm"},
                         {"name": "kube-api-access-x7k2p", "readOnly": True,
                          "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount"}],
        "terminationMessagePath": "/dev/termination-log", "terminationMessagePolicy": "File"}]
    if sidecar:
        containers.append({"name": "metrics", "image": "prom/statsd-exporter:v0.27.1", "imagePullPolicy": "IfNotPresent",
                           "ports": [{"containerPort": 9102, "protocol": "TCP"}],
                           "resources": {"requests": {"cpu": "100m", "memory": "64Mi"}, "limits": {"memory": "128Mi"}},
                           "terminationMessagePath": "/dev/termination-log", "terminationMessagePolicy": "File"})
    rs = f"{name}-6d5f7c9b8"
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {
            "name": pod_name, "generateName": f"{rs}-", "namespace": namespace,
            "uid": f"5b1c{serial:08d}-1f0e-4c3b-9a1d-{zlib.crc32(name.encode()):012d}",
            "resourceVersion": str(1_000_000 + serial), "creationTimestamp": "2026-12-01T12:00:00Z",
            "labels": {"app": name, "app.kubernetes.io/name": "vllm", "app.kubernetes.io/instance": name,
                       "pod-template-hash": "6d5f7c9b8"},
            "annotations": ann,
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": rs,
                                 "uid": "0c9e2a44-7e0b-4b43-8f65-2d1f3a9b7c11", "controller": True,
                                 "blockOwnerDeletion": True}],
            "managedFields": [{"manager": "kube-controller-manager", "operation": "Update", "apiVersion": "v1",
                               "time": "2026-12-01T12:00:00Z", "fieldsType": "FieldsV1", "fieldsV1": {
                                   "f:metadata": {"f:annotations": {f"f:{k}": {} for k in ann},
                                                  "f:generateName": {}, "f:labels": {"f:app": {}, "f:pod-template-hash": {}},
                                                  "f:ownerReferences": {}},
                                   "f:spec": {"f:containers": {'k:{"name":"vllm"}': {
                                       "f:args": {}, "f:env": {}, "f:image": {}, "f:ports": {}, "f:resources": {}}}}}},
                              {"manager": "kube-scheduler", "operation": "Update", "apiVersion": "v1",
                               "time": "2026-12-01T12:00:01Z", "fieldsType": "FieldsV1", "subresource": "status",
                               "fieldsV1": {"f:status": {"f:conditions": {}}}}]},
        "spec": {
            "schedulerName": SCHEDULER, "containers": containers,
            "volumes": [{"name": "cache", "hostPath": {"path": "/var/cache/models", "type": "DirectoryOrCreate"}},
                        {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}},
                        {"name": "kube-api-access-x7k2p", "projected": {"defaultMode": 420, "sources": [
                            {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}},
                            {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
                            {"downwardAPI": {"items": [{"path": "namespace", "fieldRef": {
                                "apiVersion": "v1", "fieldPath": "metadata.namespace"}}]}}]}}],
            "tolerations": [{"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute",
                             "tolerationSeconds": 300},
                            {"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute",
                             "tolerationSeconds": 300},
                            {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{
                "weight": 50, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname",
                                                  "labelSelector": {"matchLabels": {"app": name}}}}]}},
            "restartPolicy": "Always", "terminationGracePeriodSeconds": 30, "dnsPolicy": "ClusterFirst",
            "serviceAccountName": "default", "serviceAccount": "default", "securityContext": {},
            "priority": 0, "enableServiceLinks": True, "preemptionPolicy": "PreemptLowerPriority"},
        "status": {"phase": "Pending", "qosClass": "Burstable", "conditions": [{
            "type": "PodScheduled", "status": "False", "lastProbeTime": None,
            "lastTransitionTime": "2026-12-01T12:00:01Z", "reason": "Unschedulable",
            "message": "0/5000 nodes are available: 5000 Insufficient vramshare.io/gpu-memory. preemption: "
                       "0/5000 nodes are available: 5000 No preemption victims found for incoming pod."}]}}


def populate(nodes: int, rng: random.Random, real: bool) -> accounting.Accounting:
    """``nodes`` 8-GPU nodes, each GPU filled to a random level by running pods of typical sizes."""
    acct = accounting.Accounting(Config())
    serial = 0
    for n in range(nodes):
        model, mib = MODELS[n % len(MODELS)]
        name = f"node-{n:05d}"
        acct.apply_node("ADDED", node_obj(name, model, mib, real))
        for g in range(8):
            cap = (mib // 1024) * 1024
            used = 0
            target = cap * rng.choice([0.0, 0.3, 0.5, 0.7, 0.9, 1.0, 1.0, 1.0])
            while True:
                gib = rng.choice(SIZES_GIB)
                if used + gib * 1024 > target:
                    break
                serial += 1
                pod = pod_obj(f"p{serial}", gib)
                if real:
                    pod["metadata"]["resourceVersion"] = str(serial)
                    pod["spec"]["containers"][0]["resources"]["requests"] = {"cpu": "2", "memory": "16Gi"}
                asg = {"vllm": [{"uuid": f"GPU-{name}-{g}", "mib": gib * 1024}]}
                # Running pods: the device plugin has reported their GPUs (allocated), so they hold
                # no same-size hold on their node (only pods being bound do, for about a second).
                pod["metadata"]["annotations"].update({NAMES.assignment: orjson.dumps(asg).decode(),
                                                       NAMES.assume_time: "1",
                                                       NAMES.allocation_state: "allocated"})
                pod["metadata"]["managedFields"] = _written_by(allocated=True)
                pod["spec"]["nodeName"] = name
                acct.apply_pod("ADDED", pod)  # also feeds FGD's workload window
                used += gib * 1024
    return acct


def _written_by(allocated: bool) -> list[dict[str, Any]]:
    """managedFields as the API server records vramshare's writes (issue 18: only these are believed)."""
    def entry(manager: str, op: str, *keys: str) -> dict[str, Any]:
        return {"manager": manager, "operation": op, "apiVersion": "v1", "fieldsType": "FieldsV1",
                "fieldsV1": {"f:metadata": {"f:annotations": {f"f:{k}": {} for k in keys}}}}
    if allocated:
        return [entry(contract.FIELD_MANAGER_DEVICE_PLUGIN, "Apply", NAMES.assignment, NAMES.allocation_state),
                entry(contract.FIELD_MANAGER_EXTENDER, "Update", NAMES.assume_time)]
    return [entry(contract.FIELD_MANAGER_EXTENDER, "Update", NAMES.assignment, NAMES.assume_time,
                  NAMES.allocation_state)]


def pending_pods(nodes: int, count: int, mix: str) -> list[dict[str, Any]]:
    """The pods to schedule, the same for every server (seeded)."""
    rng = random.Random(nodes * 7919 + 1)
    if mix == "bench":
        return [pod_obj(f"q{i}", rng.choice(SIZES_GIB), 2 if rng.random() < 0.1 else 1) for i in range(count)]
    # Deployments scale up in bursts: runs of replicas of one Deployment (same size: holds matter).
    out: list[dict[str, Any]] = []
    while len(out) < count:
        dep = rng.choice(DEPLOYMENTS)
        for _ in range(rng.randint(1, 8)):
            out.append(real_pod(dep, len(out)))
    return out[:count]


# -- the API server and the watch, at the edge of the extender's process -------------------------
class Feed:
    """The extender's watch, for the bench: pod events applied to the books when they are due."""

    def __init__(self, acct: accounting.Accounting) -> None:
        self.acct = acct
        self._due: list[tuple[float, int, str, dict[str, Any]]] = []
        self._cv = threading.Condition()
        self._seq = 0
        self.applied = 0

    def put(self, at: float, event: str, pod: dict[str, Any]) -> None:
        with self._cv:
            self._seq += 1
            heapq.heappush(self._due, (at, self._seq, event, pod))
            self._cv.notify()

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            with self._cv:
                wait = (self._due[0][0] - time.monotonic()) if self._due else 0.1
                if wait > 0:
                    self._cv.wait(min(wait, 0.1))
                    continue
                _, _, event, pod = heapq.heappop(self._due)
            self.acct.apply_pod(event, pod)
            self.applied += 1


class BenchKube:
    """The API server the binder writes to: each call takes ``latency_s``; a Binding makes the watch
    report the bound pod a few ms later and the device plugin report it ``allocated`` ``report_s`` later."""

    def __init__(self, acct: accounting.Accounting, feed: Feed, latency_s: float = API_LATENCY_S,
                 report_s: float = REPORT_S) -> None:
        self.acct, self.feed, self.latency_s, self.report_s = acct, feed, latency_s, report_s
        self._patched: dict[str, dict[str, str]] = {}
        self._lock = threading.Lock()

    def get_pod(self, namespace: str, name: str) -> dict[str, Any]:
        time.sleep(self.latency_s)
        with self.acct.lock:
            pod = self.acct.pods.get(f"{namespace}/{name}")
        if pod is None:
            raise apicalls.ApiException(status=404, reason="Not Found")
        return pod

    def patch_pod_annotations(self, namespace: str, name: str, resource_version: str,
                              annotations: dict[str, str]) -> dict[str, Any]:
        time.sleep(self.latency_s)
        with self._lock:
            self._patched[f"{namespace}/{name}"] = dict(annotations)
        return {}

    def bind_pod(self, namespace: str, name: str, uid: str, node: str) -> None:
        time.sleep(self.latency_s)
        key = f"{namespace}/{name}"
        with self._lock:
            ann = self._patched.pop(key, {})
        with self.acct.lock:
            pod = self.acct.pods.get(key)
        if pod is None:
            return
        meta = pod["metadata"]
        rv = int(meta.get("resourceVersion") or 0)
        bound = {**pod, "metadata": {**meta, "resourceVersion": str(rv + 1),
                                     "annotations": {**(meta.get("annotations") or {}), **ann},
                                     "managedFields": [*(meta.get("managedFields") or ()), *_written_by(False)]},
                 "spec": {**pod["spec"], "nodeName": node}}
        allocated = {**bound, "metadata": {**bound["metadata"], "resourceVersion": str(rv + 2),
                                           "annotations": {**bound["metadata"]["annotations"],
                                                           NAMES.allocation_state: contract.STATE_ALLOCATED},
                                           "managedFields": _written_by(True)},
                     "status": {"phase": "Running"}}
        now = time.monotonic()
        self.feed.put(now + 0.005, "MODIFIED", bound)
        self.feed.put(now + self.report_s, "MODIFIED", allocated)


# -- a server: this driver, the extender of a tree --------------------------------------------
def serve_child(argv: list[str]) -> None:
    """In a server process: build the books, serve the extender, answer ``cpu``/``stats``, stop on EOF."""
    import gc

    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int)
    ap.add_argument("--mix")
    ap.add_argument("--pods", type=int)
    ap.add_argument("--tls-dir", default="")
    ap.add_argument("--policy", default="fgd")
    ap.add_argument("--profile", default="")
    ap.add_argument("--canned", action="store_true")
    a = ap.parse_args(argv)
    logging.getLogger().setLevel(logging.WARNING)
    if a.canned:
        serve_canned(a.nodes, a.tls_dir)
        return
    policy = Policy(a.policy)
    acct = populate(a.nodes, random.Random(a.nodes), a.mix == "real")
    for pod in pending_pods(a.nodes, a.pods, a.mix):  # the watch has reported them (ADDED, pending)
        acct.apply_pod("ADDED", {**pod, "status": {**pod["status"], "phase": "Pending"}})
    feed = Feed(acct)
    stop = threading.Event()
    bind = binder.Binder(acct, BenchKube(acct, feed), policy)  # type: ignore[arg-type]
    ext = app.Extender(acct, bind, None, metrics.ExtenderMetrics(acct), policy)
    try:  # as the tree's extender.main does once the cache is in (a tree without settle_heap: freeze)
        from extender.main import settle_heap
    except ImportError:
        def settle_heap() -> None:
            gc.collect()
            gc.freeze()
    getattr(ext, "prepare", lambda: None)()  # as the tree's extender.main does once the books are in
    settle_heap()
    server = http_server.ExtenderHTTPServer(ext, "127.0.0.1", 0, tls=server_tls(a.tls_dir))
    prof = cProfile.Profile(time.thread_time) if a.profile else None  # CPU, not GIL waits

    def serve() -> None:  # the loop thread answers filter and prioritize: profile it there
        if prof is not None:
            prof.enable()
        server.serve_forever(poll_interval=0.1)
        if prof is not None:
            prof.disable()

    serving = threading.Thread(target=serve, daemon=True, name="http-loop")
    serving.start()
    threading.Thread(target=acct.warm_loop, args=(stop,), daemon=True, name="warmer").start()
    threading.Thread(target=feed.run, args=(stop,), daemon=True, name="watch-feed").start()
    print(server.url, flush=True)
    gc_time = GcTime()
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "cpu":
            print(json.dumps({"process_s": time.process_time(), "threads_s": thread_cpu(),
                              "gc_s": gc_time.seconds, "gc_collections": gc_time.counts}), flush=True)
        elif cmd == "stats":
            reader = getattr(acct, "pods_read", None)
            lists = getattr(ext, "name_lists", None)
            print(json.dumps({"parsed_pod_hits": getattr(reader, "hits", None),
                              "parsed_pod_misses": getattr(reader, "misses", None),
                              "node_name_list_hits": getattr(lists, "hits", None),
                              "node_name_list_misses": getattr(lists, "misses", None),
                              "prioritize_ahead_served": getattr(ext, "ahead_served", None),
                              "prioritize_ahead_recomputed": getattr(ext, "ahead_missed", None),
                              "holds": len(acct.holds), "watch_events_applied": feed.applied,
                              "thread_cpu_s": {k: round(v, 2) for k, v in thread_cpu().items()},
                              "gc_s": round(gc_time.seconds, 3), "gc_collections": gc_time.counts}), flush=True)
        else:
            break
    stop.set()
    server.close()
    serving.join(30)
    if prof is not None:
        buf = io.StringIO()
        for key in ("tottime", "cumulative"):
            pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(35)
        with open(a.profile, "w", encoding="utf-8") as fh:
            fh.write(buf.getvalue())


class Canned:
    """The floor (``--floor``): answers of the real sizes, worked out once, whatever is asked. What a
    cycle costs with no extender work at all: kube-scheduler's side (this file's client), HTTP, TLS."""

    def __init__(self, nodes: int) -> None:
        names = [f"node-{n:05d}" for n in range(nodes)]
        failed = max(1, nodes // 100)  # about as many as a real pod's filter fails (bench: ~1%)
        passed = names[failed:]
        self.filter = orjson.dumps({"Nodes": None, "NodeNames": passed, "FailedNodes": {
            n: "GPU memory: the pod needs 20 GiB on one GPU; the most free on one GPU here is 12 GiB" for n in names[:failed]},
            "FailedAndUnresolvableNodes": {}, "Error": ""})
        self.prioritize = b"[" + b",".join(b'{"Host":"%s","Score":%d}' % (n.encode(), i % 10)
                                           for i, n in enumerate(passed)) + b"]"

    def handle(self, method: str, path: str, body: bytes) -> app.Response:
        verb = path.rstrip("/")
        return app.Response(200, self.filter if verb == "/filter" else self.prioritize if verb == "/prioritize"
                        else b'{"Error":""}')


def server_tls(tls_dir: str) -> Any:
    """The extender's serving TLS from :func:`make_tls`'s files (None: plain HTTP)."""
    if not tls_dir:
        return None
    from extender.tls import Reloader, TlsFiles  # the tree's (a baseline may predate it)

    return Reloader(TlsFiles(f"{tls_dir}/server.crt", f"{tls_dir}/server.key", f"{tls_dir}/ca.crt"))


def serve_canned(nodes: int, tls_dir: str) -> None:
    server = http_server.ExtenderHTTPServer(Canned(nodes), "127.0.0.1", 0, tls=server_tls(tls_dir))  # type: ignore[arg-type]
    serving = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True, name="http-loop")
    serving.start()
    print(server.url, flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "cpu":
            print(json.dumps({"process_s": time.process_time(), "threads_s": thread_cpu(), "gc_s": 0.0,
                              "gc_collections": [0, 0, 0]}), flush=True)
        elif cmd == "stats":
            print(json.dumps({"canned": True}), flush=True)
        else:
            break
    server.close()
    serving.join(30)


def thread_cpu() -> dict[str, float]:
    """CPU seconds per thread of this process so far (each thread's CPU clock, ns resolution), by
    thread name (a pool's ``name_<n>`` threads summed): where the server's CPU goes besides the verbs
    (TLS, HTTP and the inline verbs in the loop, bind workers, the watch feed, the warmer)."""
    out: dict[str, float] = {}
    for t in threading.enumerate():
        try:
            used = time.clock_gettime(time.pthread_getcpuclockid(t.ident or 0))
        except OSError:  # ended meanwhile
            continue
        name = t.name.split(" (")[0].rstrip("0123456789").rstrip("_")
        out[name] = out.get(name, 0.0) + used
    return out


class GcTime:
    """Time the collector spends (``gc.callbacks``), per generation: it runs on whichever thread
    allocated last, so the per-thread split counts it there; this says how much of it was GC."""

    def __init__(self) -> None:
        import gc

        self.seconds = 0.0
        self.counts = [0, 0, 0]
        self._start = 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._start
            self.counts[info["generation"]] += 1


def cpu_split(before: dict[str, Any], after: dict[str, Any], cycles: int) -> dict[str, Any]:
    """Server CPU ms per cycle between two ``cpu`` answers: the process, each thread, and GC."""
    per = 1000 / cycles
    threads = {name: round((used - before["threads_s"].get(name, 0.0)) * per, 3)
               for name, used in after["threads_s"].items()}
    threads = {name: ms for name, ms in sorted(threads.items(), key=lambda kv: -kv[1]) if ms >= 0.001}
    process = (after["process_s"] - before["process_s"]) * per
    threads["other (ended threads)"] = round(max(process - sum(threads.values()), 0.0), 3)
    return {"server_cpu_ms_per_cycle": round(process, 3), "thread_cpu_ms_per_cycle": threads,
            "gc_ms_per_cycle": round((after["gc_s"] - before["gc_s"]) * per, 3),
            "gc_collections": [a - b for a, b in zip(after["gc_collections"], before["gc_collections"])]}


class Server:
    """The extender of ``tree`` in a subprocess driven by this file (same pods, same feed)."""

    def __init__(self, label: str, tree: str, nodes: int, mix: str, pods: int, tls_dir: str, policy: str,
                 profile: str = "") -> None:
        self.label = label
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env["BENCH_EXTENDER_TREE"] = tree
        cmd = [sys.executable, os.path.abspath(__file__), "--serve", "--nodes", str(nodes), "--mix", mix,
               "--pods", str(pods), "--tls-dir", tls_dir, "--policy", policy, "--profile", profile]
        if label == "floor":
            cmd.append("--canned")
        self._proc = subprocess.Popen(cmd, cwd=tree, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.address: tuple[str, int] | None = None

    def wait_ready(self) -> None:
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline().strip()
        if not line:
            raise RuntimeError(f"server {self.label} did not start")
        host, port = line.split("://", 1)[1].split(":")
        self.address = (host, int(port))

    def ask(self, cmd: str) -> str:
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._proc.stdin.write(cmd + "\n")
        self._proc.stdin.flush()
        return self._proc.stdout.readline().strip() if cmd in ("cpu", "stats") else ""

    def stop(self) -> None:
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        self._proc.wait(60)


# -- kube-scheduler's side ----------------------------------------------------------------------
class RawClient:
    """A minimal HTTP/1.1 keep-alive client (TLS optional): one ``sendall`` per request, Content-Length
    framing only. ``http.client`` costs about as much CPU per request as the server; the client must
    not be what is measured."""

    def __init__(self, address: tuple[str, int], tls: ssl.SSLContext | None) -> None:
        sock = socket.create_connection(address, timeout=30)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = tls.wrap_socket(sock, server_hostname="localhost") if tls is not None else sock
        self.buf = bytearray()

    def post(self, path: bytes, body: bytes) -> tuple[float, bytes]:
        start = time.perf_counter()
        self.sock.sendall(b"POST %s HTTP/1.1\r\nHost: vramshare-extender\r\nContent-Type: application/json\r\n"
                          b"Content-Length: %d\r\n\r\n%s" % (path, len(body), body))
        buf = self.buf
        while (end := buf.find(b"\r\n\r\n")) < 0:
            buf += self._recv()
        head = bytes(buf[:end]).lower()
        if not head.startswith(b"http/1.1 200"):
            raise RuntimeError(f"server answered {head[:60]!r}")
        at = head.index(b"\r\ncontent-length:") + 17
        eol = head.find(b"\r\n", at)
        stop = end + 4 + int(head[at:eol if eol >= 0 else len(head)])
        while len(buf) < stop:
            buf += self._recv()
        data = bytes(buf[end + 4:stop])
        del buf[:stop]
        return time.perf_counter() - start, data

    def _recv(self) -> bytes:
        chunk = self.sock.recv(1 << 20)
        if not chunk:
            raise ConnectionError("server closed the connection")
        return chunk

    def close(self) -> None:
        self.sock.close()


class Binds:
    """kube-scheduler's binding cycles: asynchronous, on a connection of their own."""

    def __init__(self, address: tuple[str, int], tls: ssl.SSLContext | None) -> None:
        self.client = RawClient(address, tls)
        self.jobs: queue.Queue[tuple[dict[str, Any], str] | None] = queue.Queue()
        self.lat: list[float] = []
        self.errors: dict[str, int] = {}
        self.bound = 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (job := self.jobs.get()) is not None:
            pod, node = job
            meta = pod["metadata"]
            body = orjson.dumps({"PodName": meta["name"], "PodNamespace": meta["namespace"],
                                 "PodUID": meta["uid"], "Node": node})
            dt, raw = self.client.post(b"/bind", body)
            self.lat.append(dt)
            err = orjson.loads(raw).get("Error") or ""
            if err:
                why = "held" if "held for pod" in err else ("no_fit" if "does not fit" in err else err[:40])
                self.errors[why] = self.errors.get(why, 0) + 1
            else:
                self.bound += 1

    def close(self) -> None:
        self.jobs.put(None)
        self.thread.join(120)
        self.client.close()


class HostPriority(msgspec.Struct):
    """extender/v1 HostPriority, decoded into a typed struct as kube-scheduler's Go client does (a dict
    per node costs the client ~0.4 ms more per cycle at 5,000 nodes: the client must not be what is measured)."""

    Host: str
    Score: int


class FilterAnswer(msgspec.Struct):
    """The part of extender/v1 ExtenderFilterResult the client reads (``nodeCacheCapable``)."""

    NodeNames: list[str] | None = None


_SCORES = msgspec.json.Decoder(list[HostPriority])
_FILTERED = msgspec.json.Decoder(FilterAnswer)


def scheduler_order(names: list[str], rng: random.Random, workers: int = 16) -> list[str]:
    """The order kube-scheduler sends the feasible nodes in: its filter runs ``workers`` goroutines
    (``parallelism``, 16 by default) over chunks of the node list (``chunkSizeFor``: sqrt(n), at most
    n/parallelism + 1) and each appends a node that passes at an atomic counter
    (``findNodesThatPassFilters``, pkg/scheduler/schedule_one.go), so the list is the workers' streams
    interleaved by when each check finished: a different order every cycle (a 5,000-node list is never
    sent twice alike). Modelled with a random check time per node."""
    n = len(names)
    chunk = max(1, min(int(n ** 0.5), n // workers + 1))
    free = [(0.0, w) for w in range(workers)]  # (when each worker is free, id)
    done = np.empty(n)
    for start in range(0, n, chunk):
        at, w = heapq.heappop(free)
        cost = np.cumsum([rng.expovariate(1.0) for _ in range(min(chunk, n - start))])
        done[start:start + len(cost)] = at + cost
        heapq.heappush(free, (at + float(cost[-1]), w))
    return [names[i] for i in np.argsort(done, kind="stable").tolist()]


class KubeFit:
    """kube-scheduler's own NodeResourcesFit for ``vramshare.io/gpu-memory``, which runs before the
    extender (the profile's managedResources say ``ignoredByScheduler: false``): a node whose allocatable
    units, less the requests of the pods on it (bound or assumed), are short of the pod's request never
    reaches the extender. Kept from the same cluster the servers build (:func:`populate`, same seed) and
    from the binds of one server (kube-scheduler assumes a pod on its node before binding it)."""

    def __init__(self, names: list[str], acct: accounting.Accounting) -> None:
        self.names = np.array(names, dtype=object)
        self.free = np.array([sum(inventory.units_for(u.slot.capacity, 0, 1024) - u.used // 1024
                                  for u in acct.state.node_usage(n)) for n in names], np.int64)
        self.row = {n: i for i, n in enumerate(names)}

    @staticmethod
    def request(pod: dict[str, Any]) -> int:
        """The pod's gpu-memory request as kube-scheduler counts it (``PodRequests``)."""
        return podspec.effective_requests(pod, lambda c: {"units": int(podspec.container_requests(c).get(
            NAMES.gpu_memory, 0))}).get("units", 0)

    def feasible(self, order: np.ndarray, pod: dict[str, Any]) -> list[str]:
        """The nodes of ``order`` (rows, in the order kube-scheduler's filter appends them) that fit."""
        return self.names[order[self.free[order] >= self.request(pod)]].tolist()  # type: ignore[no-any-return]

    def assume(self, node: str, pod: dict[str, Any]) -> None:
        self.free[self.row[node]] -= self.request(pod)


def run_cycles(server: Server, names: list[str], pods: list[dict[str, Any]], tls: ssl.SSLContext | None,
               bind: bool, node_order: str = "fixed", kube: KubeFit | None = None) -> dict[str, Any]:
    assert server.address is not None
    rng = random.Random(len(pods) * 31 + len(names))  # the same orders for every server
    rows = np.arange(len(names))
    orders = [rows if node_order == "fixed" else
              np.array(scheduler_order(list(range(len(names))), rng), np.int64) for _ in pods]
    client = RawClient(server.address, tls)
    binds = Binds(server.address, tls) if bind else None
    lat: dict[str, list[float]] = {"filter": [], "prioritize": []}
    fitting_counts: list[int] = []
    sent_counts: list[int] = []
    try:
        cpu0, wall0 = json.loads(server.ask("cpu")), time.perf_counter()
        for pod, order in zip(pods, orders):
            sent = kube.feasible(order, pod) if kube is not None else [names[i] for i in order.tolist()]
            sent_counts.append(len(sent))
            dt, raw = client.post(b"/filter", orjson.dumps({"Pod": pod, "Nodes": None, "NodeNames": sent}))
            lat["filter"].append(dt)
            fitting = _FILTERED.decode(raw).NodeNames or []
            fitting_counts.append(len(fitting))
            node = fitting[0] if len(fitting) == 1 else None
            if len(fitting) > 1:  # kube-scheduler skips prioritize with one feasible node
                dt, raw = client.post(b"/prioritize", orjson.dumps({"Pod": pod, "Nodes": None, "NodeNames": fitting}))
                lat["prioritize"].append(dt)
                scores = _SCORES.decode(raw)
                if scores:
                    node = max(scores, key=operator.attrgetter("Score")).Host  # its weight outvotes the rest
            if binds is not None and node is not None:
                binds.jobs.put((pod, node))
                if kube is not None:
                    kube.assume(node, pod)
        wall = time.perf_counter() - wall0
        split = cpu_split(cpu0, json.loads(server.ask("cpu")), len(pods))
    finally:
        client.close()
        if binds is not None:
            binds.close()
    out: dict[str, Any] = {"cycles": len(pods), "cycles_per_s": round(len(pods) / wall, 1),
                           **split,
                           "mean_fitting_nodes": round(float(np.mean(fitting_counts)), 1),
                           "mean_sent_nodes": round(float(np.mean(sent_counts)), 1),
                           "latencies_ms": {v: [round(x * 1000, 4) for x in xs] for v, xs in lat.items()}}
    if binds is not None:
        out["binds"] = {"bound": binds.bound, "refused": binds.errors,
                        "p50_ms": round(float(np.percentile(binds.lat, 50)) * 1000, 3) if binds.lat else None}
    return out


def pooled(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """p50/p99/max per verb over every cycle of every run; cycles/s per run (median and best)."""
    out: dict[str, Any] = {"runs": len(runs), "cycles": sum(r["cycles"] for r in runs),
                           "cycles_per_s_median": float(np.median([r["cycles_per_s"] for r in runs])),
                           "cycles_per_s_best": max(r["cycles_per_s"] for r in runs),
                           "cycles_per_s_runs": [r["cycles_per_s"] for r in runs],
                           "server_cpu_ms_per_cycle_median": float(np.median([r["server_cpu_ms_per_cycle"] for r in runs])),
                           "server_cpu_ms_per_cycle_min": min(r["server_cpu_ms_per_cycle"] for r in runs),
                           "mean_fitting_nodes": float(np.mean([r["mean_fitting_nodes"] for r in runs])),
                           "mean_sent_nodes": float(np.mean([r["mean_sent_nodes"] for r in runs])),
                           "gc_ms_per_cycle_median": float(np.median([r["gc_ms_per_cycle"] for r in runs]))}
    names = {name for r in runs for name in r["thread_cpu_ms_per_cycle"]}
    split = {name: round(float(np.median([r["thread_cpu_ms_per_cycle"].get(name, 0.0) for r in runs])), 3)
             for name in names}
    out["thread_cpu_ms_per_cycle_median"] = dict(sorted(split.items(), key=lambda kv: -kv[1]))
    for verb in ("filter", "prioritize"):
        xs = np.array([x for r in runs for x in r["latencies_ms"][verb]])
        if len(xs):
            out[verb] = {"p50_ms": round(float(np.percentile(xs, 50)), 3), "p99_ms": round(float(np.percentile(xs, 99)), 3),
                         "max_ms": round(float(xs.max()), 3), "n": int(len(xs))}
    if "binds" in runs[0]:
        refused: dict[str, int] = {}
        for r in runs:
            for k, v in r["binds"]["refused"].items():
                refused[k] = refused.get(k, 0) + v
        out["binds"] = {"bound": sum(r["binds"]["bound"] for r in runs), "refused": refused}
    return out


# -- mutual TLS -----------------------------------------------------------------------------------
def make_tls(into: str) -> ssl.SSLContext:
    """A throw-away CA, the extender's serving certificate and kube-scheduler's client certificate (as
    ``vramshare install`` makes them); returns the client's context."""
    from vramshare_cli import certs

    pki = certs.generate("vramshare-system")
    files = {"ca.crt": pki.ca, "server.crt": pki.server.cert, "server.key": pki.server.key,
             "client.crt": pki.client.cert, "client.key": pki.client.key}
    for name, data in files.items():
        with open(os.path.join(into, name), "wb") as fh:
            fh.write(data)
    ctx = ssl.create_default_context(cafile=os.path.join(into, "ca.crt"))
    ctx.load_cert_chain(os.path.join(into, "client.crt"), os.path.join(into, "client.key"))
    return ctx


def baseline_tree(rev: str, into: str) -> str:
    """``git archive rev`` extracted under ``into``; returns the folder."""
    import tarfile

    data = subprocess.run(["git", "-C", ROOT, "archive", "--format=tar", rev], check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(into, filter="data")
    return into


def bench_size(nodes: int, cycles: int, repeat: int, mix: str, tls_on: bool, policy: str,
               trees: dict[str, str], profile: bool, node_order: str = "fixed") -> dict[str, Any]:
    total = cycles * repeat
    pods = pending_pods(nodes, total, mix)
    names = [f"node-{n:05d}" for n in range(nodes)]
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-extender-"))
        tls = make_tls(tmp) if tls_on else None
        servers = {}
        for label, tree in trees.items():
            prof = os.path.join(tempfile.gettempdir(), f"bench-extender-profile-{label}-{nodes}.txt") if profile else ""
            servers[label] = Server(label, tree, nodes, mix, total, tmp if tls_on else "", policy, prof)
            stack.callback(servers[label].stop)
        t0 = time.perf_counter()
        # kube-scheduler's own fit check, per server (its binds differ): the same books the servers build
        fit = KubeFit(names, populate(nodes, random.Random(nodes), mix == "real"))
        kube = {label: copy.copy(fit) for label in servers}
        for k in kube.values():
            k.free = k.free.copy()
        for s in servers.values():
            s.wait_ready()
        build_s = time.perf_counter() - t0
        time.sleep(SETTLE_S)
        runs: dict[str, list[dict[str, Any]]] = {label: [] for label in servers}
        for r in range(repeat):
            batch = pods[r * cycles:(r + 1) * cycles]
            order = list(servers.items()) if r % 2 == 0 else list(servers.items())[::-1]
            for label, s in order:
                runs[label].append(run_cycles(s, names, batch, tls, bind=mix == "real", node_order=node_order,
                                              kube=kube[label]))
                time.sleep(0.2)
        stats = {label: json.loads(s.ask("stats")) for label, s in servers.items()}
    result = {"nodes": nodes, "gpus": nodes * 8, "mix": mix, "tls": tls_on, "policy": policy, "node_order": node_order,
              "cycles_per_run": cycles, "repeat": repeat, "build_s": round(build_s, 1),
              "servers": {label: {**pooled(rs), "server_stats": stats[label],
                                  "per_run": [{k: v for k, v in r.items() if k != "latencies_ms"} for r in rs]}
                          for label, rs in runs.items()}}
    if "floor" in runs:
        result["floor_cycles_per_s"] = round(float(np.median([r["cycles_per_s"] for r in runs["floor"]])), 1)
    if "new" in runs and "baseline" in runs:
        # Per pair of adjacent runs (same pods, moments apart): other work on the machine drifts between
        # pairs much more than within one, so the median of the pairs' ratios is what to quote.
        pairs = list(zip(runs["new"], runs["baseline"]))
        result["ratio_cycles_per_s_pairs"] = [round(a["cycles_per_s"] / b["cycles_per_s"], 2) for a, b in pairs]
        result["ratio_cycles_per_s"] = round(float(np.median(result["ratio_cycles_per_s_pairs"])), 2)
        result["ratio_server_cpu"] = round(float(np.median([b["server_cpu_ms_per_cycle"] / a["server_cpu_ms_per_cycle"]
                                                            for a, b in pairs])), 2)
    return result


def line(nodes: int, label: str, s: dict[str, Any]) -> str:
    f, p = s.get("filter", {}), s.get("prioritize", {})
    binds = f" | binds {s['binds']['bound']} bound, refused {s['binds']['refused']}" if "binds" in s else ""
    return (f"{nodes:>5} nodes {label:>8}: filter p50 {f.get('p50_ms')} p99 {f.get('p99_ms')} ms | prioritize p50 "
            f"{p.get('p50_ms')} p99 {p.get('p99_ms')} ms | {s['cycles_per_s_median']} cycles/s (runs "
            f"{s['cycles_per_s_runs']}) | server {s['server_cpu_ms_per_cycle_median']} CPU ms/cycle "
            f"(per thread {s['thread_cpu_ms_per_cycle_median']}, of which GC {s['gc_ms_per_cycle_median']}) | fitting "
            f"{s['mean_fitting_nodes']:.0f} of {s['mean_sent_nodes']:.0f} sent{binds} | {s['server_stats']}")


def _median_us(fn: Any, reps: int) -> float:
    """Median thread CPU of ``fn(i)`` over ``reps`` calls, in microseconds."""
    xs = []
    for i in range(reps):
        t0 = time.thread_time_ns()
        fn(i)
        xs.append(time.thread_time_ns() - t0)
    return round(float(np.median(xs)) / 1000, 1)


def bench_wire(nodes: int, reps: int) -> dict[str, Any]:
    """The request/response path's pieces in this process, each beside the same work without its memo
    (thread CPU, median): what a cycle pays for JSON outside the placement compute."""
    from extender import parsed, wire

    rng = random.Random(nodes)
    names = [f"node-{n:05d}" for n in range(nodes)]
    pods = pending_pods(nodes, 20, "real")
    fixed = [orjson.dumps({"Pod": p, "Nodes": None, "NodeNames": names}) for p in pods]
    shuffled = [orjson.dumps({"Pod": p, "Nodes": None, "NodeNames": scheduler_order(names, rng)}) for p in pods]
    lists = wire.NameLists()
    passed = names[nodes // 100:]
    result = wire.FilterResult(passed=passed, failed={n: "Insufficient vramshare.io/gpu-memory" for n in names[:nodes // 100]})
    args = wire.decode_extender_args(fixed[0])
    answered = orjson.dumps({"Pod": pods[0], "Nodes": None,
                             "NodeNames": orjson.loads(wire.encode_filter_result(result, args, lists))["NodeNames"]})
    out: dict[str, Any] = {"nodes": nodes, "decode_us": {
        "whole_body": _median_us(lambda i: wire.decode_extender_args(fixed[i % 20]), reps),
        "memo_filter_fixed_order": _median_us(lambda i: wire.decode_extender_args(fixed[i % 20], lists), reps),
        "memo_filter_scheduler_order": _median_us(lambda i: wire.decode_extender_args(shuffled[i % 20], lists), reps),
        "memo_prioritize_after_filter": _median_us(lambda i: wire.decode_extender_args(answered, lists), reps)},
        "encode_filter_us": {
            "plain": _median_us(lambda i: wire.encode_filter_result(result, args), reps),
            "remembering_the_answer": _median_us(lambda i: wire.encode_filter_result(result, args, lists), reps)}}
    acct = accounting.Accounting(Config())
    for n in range(nodes):
        model, mib = MODELS[n % len(MODELS)]
        acct.apply_node("ADDED", node_obj(names[n], model, mib, True))
    state = acct.state
    scores = np.array([rng.randrange(11) for _ in passed])
    rows = state.rows_of(passed, remember=False)
    epoch = state.names_epoch
    cold = _median_us(lambda i: wire.HostFragments().encode(passed, rows, scores, epoch), max(3, reps // 50))
    frags = wire.HostFragments()
    frags.prepare(state.nodes(), state.rows_of(state.nodes(), remember=False), epoch)
    warm = _median_us(lambda i: frags.encode(passed, rows, scores, epoch), reps)

    def after_a_new_node(i: int) -> None:  # a node joins: the epoch moves on, every row is checked again
        frags.encode(passed, rows, scores, (epoch, i))
    out["host_priorities_us"] = {"first_answer_unprepared": cold, "prepared": warm,
                                 "first_answer_after_a_node_joined": _median_us(after_a_new_node, max(3, reps // 10))}
    names_ = contract.Names()
    unseen = {"cpu": lambda i: f"{1000 + i}m", "memory": lambda i: f"{16384 + i}Mi"}  # never read before
    fresh = [{**p, "spec": {**p["spec"], "containers": [
        {**c, "resources": {k: {r: unseen[r](i) if r in unseen else v for r, v in q.items()}
                            for k, q in c["resources"].items()}} for c in p["spec"]["containers"]]}}
        for i, p in enumerate(pending_pods(nodes, reps, "real"))]
    out["parse_pod_us"] = {"quantities_never_seen": _median_us(lambda i: parsed.parse_pod(fresh[i], names_, 1024), reps),
                           "quantities_seen_lately": _median_us(lambda i: parsed.parse_pod(pods[i % 20], names_, 1024), reps)}
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--serve":
        serve_child(argv[1:])
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer cycles, two runs")
    ap.add_argument("--profile", action="store_true",
                    help="cProfile each server.s HTTP loop thread (filter, prioritize, TLS) to /tmp")
    ap.add_argument("--policy", default="fgd", choices=[p.value for p in Policy])
    ap.add_argument("--repeat", type=int, default=6, help="runs per server, interleaved (default 6)")
    ap.add_argument("--sizes", default="5000", help="comma-separated node counts (default 5000)")
    ap.add_argument("--mix", default="real", choices=["real", "bench"], help="request mix (see above)")
    ap.add_argument("--no-tls", action="store_true", help="plain HTTP (the real mix uses mutual TLS)")
    ap.add_argument("--node-order", default="scheduler", choices=["fixed", "scheduler"],
                    help="filter's NodeNames: kube-scheduler's order (default: its parallel filter's "
                         "interleaving, new every cycle), or the same order every cycle (as rounds 1-4 sent)")
    ap.add_argument("--baseline", metavar="REV", help="also serve this commit's extender, interleaved")
    ap.add_argument("--floor", action="store_true",
                    help="also serve canned answers of the real sizes (no extender work): the cycles/s that "
                         "the client, HTTP and TLS leave, interleaved like a baseline")
    ap.add_argument("--cycles", type=int, help="cycles per run (default 200 at <= 1,000 nodes, else 100)")
    ap.add_argument("--out", help="result file (default bench/results/extender[-<mix>].json)")
    ap.add_argument("--wire", action="store_true",
                    help="only the wire's pieces in process, with and without their memos (extender-wire.json)")
    args = ap.parse_args(argv)
    if args.wire:
        doc = {"benchmark": "extender-wire", "unit": "us of thread CPU, median",
               "runs": [bench_wire(int(n), 60 if args.quick else 300) for n in args.sizes.split(",")],
               "machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                           "loadavg_1m": round(os.getloadavg()[0], 2)},
               "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        out = args.out or os.path.join(RESULTS_DIR, "extender-wire.json")
        with open(out, "w", encoding="utf-8") as fh:
            json.dump(doc, fh, indent=2)
        print(json.dumps(doc["runs"], indent=1))
        print(f"wrote {out}")
        return 0
    logging.getLogger().setLevel(logging.WARNING)
    tls_on = args.mix == "real" and not args.no_tls
    with contextlib.ExitStack() as stack:
        trees = {"new": ROOT}
        if args.baseline:
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-baseline-"))
            trees["baseline"] = baseline_tree(args.baseline, tmp)
        if args.floor:
            trees["floor"] = ROOT
        runs = []
        for nodes in (int(n) for n in args.sizes.split(",")):
            cycles = args.cycles or ((100 if args.quick else 200) if nodes <= 1000 else (50 if args.quick else 100))
            r = bench_size(nodes, cycles, 2 if args.quick else args.repeat, args.mix, tls_on, args.policy, trees,
                           args.profile, args.node_order)
            if args.baseline:
                r["baseline_commit"] = args.baseline
            runs.append(r)
            for label, s in r["servers"].items():
                print(line(nodes, label, s), flush=True)
            if "ratio_cycles_per_s" in r:
                print(f"{nodes:>5} nodes: new/baseline x{r['ratio_cycles_per_s']} cycles/s (median of the run pairs "
                      f"{r['ratio_cycles_per_s_pairs']}), x{r['ratio_server_cpu']} less server CPU per cycle", flush=True)
    doc = {"benchmark": "extender", "mix": args.mix, "tls": tls_on, "runs": runs,
           "aims": {"5000_nodes_cycles_per_s": 300, "p99_ms_per_verb": 5},
           "note": "2-core machine shared with other work: latencies are upper bounds, cycles/s lower bounds; "
                   "quote the ratio to the baseline served in the same run",
           "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform(),
                       "loadavg_1m": round(os.getloadavg()[0], 2)},
           "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    out = args.out or os.path.join(RESULTS_DIR, "extender.json" if args.mix == "real" else f"extender-{args.mix}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w", encoding="utf-8") as fh:
        json.dump(doc, fh, indent=2)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
