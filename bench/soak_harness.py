"""Pieces shared by bench_soak.py and bench_hold.py: the extender as a killable process, a stand-in for
the kubelets and device plugins of a cluster (what the extender side needs of them: admission and the
``allocated`` report), and a kube-scheduler-like caller loop. Never imported by a daemon.

The kubelet stand-in reproduces what makes placement hard on a real node:

* admission in creation-time order, ties (one-second timestamps) in random order
  (``kubelet.HandlePodAdditions`` sorts with ``sort.Sort(sliceutils.PodsByCreationTime)``, not stable);
* devices are counted per GPU (``devicemanager``: a container gets device IDs that are free, never more
  than exist), so reality never exceeds a GPU; a pod for which the node has too few free devices fails
  admission (``UnexpectedAdmissionError``);
* the device plugin steers ``GetPreferredAllocation`` with its real rule (``deviceplugin.kubelet.steering``): the
  plan of the assumed pods of that size on the node when they are one pod or all share one plan (the
  extender's narrower hold), else no preference; without one, or when the preferred GPU lacks free
  devices, the kubelet's choice falls on whatever is free, so same-size pods with different plans may
  swap GPUs (what the hold's baseline shows);
* after admission the device plugin writes the pod's actual GPUs into ``vramshare.io/assignment`` with
  ``allocation-state: allocated`` (the reconcile of DESIGN.md section 3);
* pods are known by UID (``kubelet/config/config.go podStorage.merge``): a pod deleted and recreated
  under its name between two looks frees the old UID's devices (``devicemanager.ManagerImpl.
  UpdateAllocatedDevices``) and is admitted anew, and nothing written for a pod lands on its successor
  (``status_manager.go syncPod`` skips a recreated pod). Keyed by name until round 14, the successor
  inherited its predecessor's devices and was never admitted: the "mismatches after settle" of the model
  soak. A forced deletion is still modelled as the containers stopping at once (no termination grace).
"""
from __future__ import annotations

import atexit
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import orjson
import urllib3

from deviceplugin.kubelet import steering
from standins.apiserver import PODS, ApiServerDouble
from vramshare import contract

N = contract.Names()
Obj = dict[str, Any]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ExtenderProcess:
    """``vramshare extender`` as a child process on a fixed port; :meth:`kill` is SIGKILL."""

    def __init__(self, api_url: str, config_yaml: str, root: str | None = None) -> None:
        self.root = root  # the source tree to run (default: this one); a baseline tree to compare with
        self.dir = tempfile.mkdtemp(prefix="vramshare-soak-")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        kubeconfig = os.path.join(self.dir, "kubeconfig")
        with open(kubeconfig, "w", encoding="utf-8") as fh:
            fh.write(f"apiVersion: v1\nkind: Config\nclusters: [{{name: d, cluster: {{server: \"{api_url}\"}}}}]\n"
                     "users: [{name: u, user: {}}]\ncontexts: [{name: c, context: {cluster: d, user: u}}]\n"
                     "current-context: c\n")
        config = os.path.join(self.dir, "config.yaml")
        with open(config, "w", encoding="utf-8") as fh:
            fh.write(config_yaml)
        self.cmd = [sys.executable, "-c", "import sys; from vramshare_cli.main import main; sys.exit(main())",
                    "--log-level", os.environ.get("VRAMSHARE_SOAK_LOG_LEVEL", "warning"), "extender", "--listen", f"127.0.0.1:{self.port}",
                    "--kubeconfig", kubeconfig, "--config", config]
        self.proc: subprocess.Popen[bytes] | None = None
        self.http = urllib3.PoolManager(retries=False, timeout=urllib3.Timeout(connect=0.5, read=5))

    def start(self) -> None:
        if self.proc is None:
            atexit.register(self.kill)  # never leave an extender behind, however the bench ends
        root = self.root or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
        # cwd too: ``python -c`` puts the working directory first on sys.path, before PYTHONPATH
        logs = os.environ.get("VRAMSHARE_SOAK_LOGS")  # a directory: keep each run's warnings to read a fault
        err: Any = subprocess.DEVNULL
        if logs:
            os.makedirs(logs, exist_ok=True)
            err = open(os.path.join(logs, f"extender-{self.port}.log"), "ab")  # noqa: SIM115 - the child keeps it
        self.proc = subprocess.Popen(self.cmd, env=env, cwd=root, stdout=subprocess.DEVNULL, stderr=err)
        if logs:
            err.close()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def ready(self) -> bool:
        try:
            return self.http.request("GET", f"{self.url}/readyz").status == 200
        except urllib3.exceptions.HTTPError:
            return False

    def wait_ready(self, timeout: float = 60) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.ready():
                return True
            time.sleep(0.05)
        return False

    def books(self) -> dict[str, tuple[int, int, int]] | None:
        """Per GPU (used, total, foreign) MiB from /inspect, None while the extender is down; ``used``
        includes the memory the node reports no pod holds (``foreign``, vramshare.foreign)."""
        try:
            resp = self.http.request("GET", f"{self.url}/inspect")
            if resp.status != 200:
                return None
            doc = orjson.loads(resp.data)
        except (urllib3.exceptions.HTTPError, orjson.JSONDecodeError):
            return None
        return {g["uuid"]: (g["usedMiB"], g["totalMiB"], g.get("foreignMiB", 0)) for n in doc["nodes"] for g in n["gpus"]}

    def book_pods(self) -> dict[str, dict[str, int]]:
        """Per GPU the pods the books hold there (pod key -> MiB), for explaining a mismatch; {} while down."""
        try:
            resp = self.http.request("GET", f"{self.url}/inspect")
            doc = orjson.loads(resp.data) if resp.status == 200 else {"nodes": []}
        except (urllib3.exceptions.HTTPError, orjson.JSONDecodeError):
            return {}
        return {g["uuid"]: {p["pod"]: p["mib"] for p in g["pods"]} for n in doc["nodes"] for g in n["gpus"]}


def signature(pod: Obj) -> tuple[str, int]:
    """The (resource, devices) the kubelet asks for the pod's single container."""
    c = pod["spec"]["containers"][0]
    return (N.gpu_memory, int(c["resources"]["limits"][N.gpu_memory]))


@dataclass
class KubeletStats:
    admitted: int = 0
    admission_failures: int = 0
    steering_misses: int = 0  # actual GPUs differ from the pod's own assignment
    ambiguous: int = 0  # admissions where several assumed pods shared the size
    unsteered: int = 0  # admissions the device plugin had no preference for (no plan, or plans differ)
    # "<key>@<uid>" of pods recreated under their name before the kubelet's next look: the earlier UID is
    # removed and its devices freed, the new one admitted on its own (until round 14 it inherited them)
    successor_unseen: set[str] = field(default_factory=set)
    admit_latency_s: list[float] = field(default_factory=list)


class KubeletSim(threading.Thread):
    """All nodes' kubelets + device plugins, as seen through the API (see the module docstring)."""

    def __init__(self, api: ApiServerDouble, capacity: dict[str, dict[str, int]], unit_mib: int,
                 admit_delay_s: tuple[float, float], seed: int, tick_s: float = 0.02, report: bool = True) -> None:
        super().__init__(name="kubelet-sim", daemon=True)
        self.api, self.unit = api, unit_mib
        self.capacity = capacity  # node -> gpu uuid -> units
        self.node_of = {g: n for n, gpus in capacity.items() for g in gpus}
        self.delay, self.tick = admit_delay_s, tick_s
        self.rng = random.Random(seed)
        # Pods are known by UID, as the kubelet knows them (``kubelet/config/config.go podStorage.merge``
        # keys pods by UID: a name deleted and recreated between two looks is a REMOVE and an ADD).
        self.real: dict[str, dict[str, int]] = {}  # pod UID -> gpu -> units (what containers got)
        self.key_of: dict[str, str] = {}  # pod UID -> namespace/name
        self.seen_bound: dict[str, float] = {}  # pod UID -> when first seen bound, until admitted
        self.due: dict[str, float] = {}
        self.stats = KubeletStats()
        self.stop_event = threading.Event()
        self.lock = threading.Lock()
        self.report = report  # False: the device plugins run Allocate but never report (reconciler down)

    def used_units(self, gpu: str) -> int:
        return sum(r.get(gpu, 0) for r in self.real.values())

    def reality_mib(self) -> dict[str, int]:
        with self.lock:
            return {g: self.used_units(g) * self.unit for g in self.node_of}

    def holders(self, gpu: str) -> list[tuple[str, str, int]]:
        """(pod key, UID, MiB) of what the containers hold on ``gpu``, for explaining a mismatch."""
        with self.lock:
            return sorted((self.key_of[u], u, r[gpu] * self.unit) for u, r in self.real.items() if gpu in r)

    def running_names(self) -> list[str]:
        """namespace/name of the pods whose containers run (admitted, holding devices)."""
        with self.lock:
            return sorted(self.key_of[u] for u, r in self.real.items() if r)

    def pending_admissions(self) -> int:
        with self.lock:
            return len(self.seen_bound)

    def run(self) -> None:
        while not self.stop_event.wait(self.tick):
            self.step()

    def step(self) -> None:
        pods = self.api.pods()
        now = time.monotonic()
        live: dict[str, Obj] = {}  # UID -> pod
        names: dict[str, str] = {}  # namespace/name -> UID
        for p in pods:
            if (p.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
                continue
            uid = p["metadata"]["uid"]
            live[uid] = p
            names[f"{p['metadata'].get('namespace', 'default')}/{p['metadata']['name']}"] = uid
        with self.lock:
            # ``devicemanager.ManagerImpl.UpdateAllocatedDevices``: the devices of every pod UID no longer
            # active are free; a pod recreated under its name is another UID, admitted on its own
            for uid in [u for u in self.real if u not in live]:
                key = self.key_of.pop(uid)
                del self.real[uid]
                if key in names:  # the name came back under a new UID before this look
                    self.stats.successor_unseen.add(f"{key}@{names[key]}")
            for uid in [u for u in self.seen_bound if u not in live]:
                del self.seen_bound[uid]
                self.due.pop(uid, None)
            by_node: dict[str, list[Obj]] = {}
            for uid, p in live.items():
                node = p["spec"].get("nodeName")
                if not node or uid in self.real:
                    continue
                if uid not in self.seen_bound:
                    self.seen_bound[uid] = now
                    self.due[uid] = now + self.rng.uniform(*self.delay)
                if self.due[uid] <= now:
                    by_node.setdefault(node, []).append(p)
            for node, ready in by_node.items():
                # creation-time order at one-second resolution, ties in random order
                self.rng.shuffle(ready)
                ready.sort(key=lambda p: p["metadata"].get("creationTimestamp", ""))
                assumed = [p for u, p in live.items() if p["spec"].get("nodeName") == node and u not in self.real
                           and (p["metadata"].get("annotations") or {}).get(N.allocation_state) == "assumed"]
                for p in ready:
                    self._admit(node, p, assumed, now)

    def _steer(self, node: str, p: Obj, assumed: list[Obj], free: dict[str, int]) -> list[tuple[str, int]]:
        """The device plugin's preferred GPUs for the pod's container, known only by its size."""
        resource, size = signature(p)
        if sum(1 for q in assumed if signature(q) == (resource, size)) > 1:
            self.stats.ambiguous += 1
        hint = steering.steer(assumed, N, node, resource, size, self.unit, free)
        if hint.targets is None:
            self.stats.unsteered += 1
            return []
        return list(hint.targets.items())

    def _admit(self, node: str, p: Obj, assumed: list[Obj], now: float) -> None:
        key = f"{p['metadata'].get('namespace', 'default')}/{p['metadata']['name']}"
        want = signature(p)[1]
        free = {g: units - self.used_units(g) for g, units in self.capacity[node].items()}
        got: dict[str, int] = {}
        for gpu, units in self._steer(node, p, assumed, free):
            if free.get(gpu, 0) >= units and gpu not in got and sum(got.values()) + units <= want:
                got[gpu] = units
                free[gpu] -= units
        if sum(got.values()) < want:  # the kubelet takes whatever devices are free
            for gpu in sorted(free, key=lambda g: -free[g]):
                take = min(free[gpu], want - sum(got.values()))
                if take > 0:
                    got[gpu] = got.get(gpu, 0) + take
                    free[gpu] -= take
        own = {e["uuid"]: e["mib"] // self.unit for es in orjson.loads(
            (p["metadata"].get("annotations") or {}).get(N.assignment, "{}")).values() for e in es}
        uid = p["metadata"]["uid"]
        waited = now - self.seen_bound.pop(uid, now)
        self.due.pop(uid, None)
        self.key_of[uid] = key
        ns, name = p["metadata"].get("namespace", "default"), p["metadata"]["name"]
        if sum(got.values()) < want:
            self.stats.admission_failures += 1
            self.real[uid] = {}
            self._write(ns, name, uid, _phase_failed)
            return
        self.real[uid] = got
        if got != own:
            self.stats.steering_misses += 1
        self.stats.admitted += 1
        self.stats.admit_latency_s.append(waited)
        cname = p["spec"]["containers"][0]["name"]
        actual = orjson.dumps({cname: [{"uuid": g, "mib": u * self.unit} for g, u in sorted(got.items())]}).decode()

        def report(obj: Obj) -> None:
            ann = obj["metadata"].setdefault("annotations", {})
            ann[N.assignment] = actual
            ann[N.allocation_state] = contract.STATE_ALLOCATED

        if self.report:
            self._write(ns, name, uid, report, manager=contract.FIELD_MANAGER_DEVICE_PLUGIN)  # as the plugin writes it

    def _write(self, ns: str, name: str, uid: str, change: Callable[[Obj], None], manager: str | None = None) -> None:
        """Write for the pod ``uid`` only: gone, or recreated under its name since the List, nothing is
        written. The kubelet's status manager skips a pod whose UID changed (``status_manager.go
        syncPod``: "Pod was deleted and then recreated, skipping status update"); the device plugin's
        report carries the resourceVersion it read (``kube_adapter.PodPatcher.apply``: 409)."""
        def guarded(obj: Obj) -> None:
            if obj["metadata"].get("uid") != uid:
                raise _Replaced(f"{ns}/{name} is now {obj['metadata'].get('uid')}, not {uid}")
            change(obj)

        try:
            self.api.update(PODS, ns, name, guarded, manager=manager)
        except Exception:  # noqa: BLE001 - deleted or replaced meanwhile
            pass


class _Replaced(Exception):
    """The pod a write was for is no longer the one of that name."""


def _phase_failed(obj: Obj) -> None:
    obj.setdefault("status", {})["phase"] = "Failed"


def post(http: urllib3.PoolManager, url: str, verb: str, body: Obj) -> Any:
    resp = http.request("POST", f"{url}/{verb}", body=orjson.dumps(body),
                        headers={"Content-Type": "application/json"})
    if resp.status != 200:
        raise RuntimeError(f"/{verb}: HTTP {resp.status}")
    return orjson.loads(resp.data)


def bind_body(pod: Obj, node: str) -> Obj:
    meta = pod["metadata"]
    return {"PodName": meta["name"], "PodNamespace": meta.get("namespace", "default"), "PodUID": meta["uid"],
            "Node": node}


class Replica(ExtenderProcess):
    """An extender process that takes part in the leader election (``--leader-elect``) under its own
    name; each start is a new pod (a new name), as a Deployment's replacement would be."""

    def __init__(self, api_url: str, config_yaml: str, name: str) -> None:
        super().__init__(api_url, config_yaml)
        self.base, self.generation = name, 0
        self.name = name
        self.cmd += ["--leader-elect", "--advertise-url", self.url]

    def start(self) -> None:
        if self.proc is None:
            atexit.register(self.kill)
        self.generation += 1
        self.name = f"{self.base}-{self.generation}"
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", ""),
               "POD_NAME": self.name, "POD_NAMESPACE": "vramshare-system"}
        self.proc = subprocess.Popen(self.cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class ReplicatedExtender:
    """Two or more :class:`Replica` behind a "Service": :attr:`url` is a Ready replica at random (as
    kube-proxy picks among ready endpoints); :meth:`kill` SIGKILLs the Lease's holder, :meth:`start`
    brings every dead replica back as a new pod. Duck-types :class:`ExtenderProcess` for the soak."""

    def __init__(self, api: ApiServerDouble, config_yaml: str, replicas: int, seed: int = 0) -> None:
        self.api = api
        self.members = [Replica(api.url, config_yaml, f"extender-{chr(97 + i)}") for i in range(replicas)]
        self.rng = random.Random(seed)
        self._ready: dict[str, bool] = {}
        self._stop = threading.Event()
        self.kill_times: list[float] = []
        self._probe = threading.Thread(target=self._probe_loop, name="soak-endpoints", daemon=True)

    def _probe_loop(self) -> None:  # the readiness probe and the Endpoints controller, every 100 ms
        while not self._stop.wait(0.1):
            for m in self.members:
                self._ready[m.url] = m.alive() and m.ready()

    @property
    def url(self) -> str:
        ready = [m.url for m in self.members if self._ready.get(m.url)]
        return self.rng.choice(ready) if ready else self.members[0].url

    def leader(self) -> Replica | None:
        from standins.apiserver import LEASES
        leases = self.api.objects(LEASES, "vramshare-system")
        holder = leases[0]["spec"].get("holderIdentity") if leases else None
        return next((m for m in self.members if m.name == holder and m.alive()), None)

    def start(self) -> None:
        for m in self.members:
            if not m.alive():
                m.start()
        if not self._probe.is_alive() and not self._stop.is_set():
            self._probe.start()

    def kill(self) -> None:
        victim = self.leader()
        if victim is not None:
            self._ready[victim.url] = False
            victim.kill()
            self.kill_times.append(time.monotonic())

    def shutdown(self) -> None:
        self._stop.set()
        for m in self.members:
            m.kill()

    def wait_ready(self, timeout: float = 60) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(m.alive() and m.ready() for m in self.members) and self.leader() is not None:
                return True
            time.sleep(0.05)
        return False

    def books(self) -> dict[str, tuple[int, int, int]] | None:
        lead = self.leader()
        return lead.books() if lead is not None else None
