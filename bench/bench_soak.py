"""Over-commit soak: bind storms with duplicate binds, extender kill -9s, deletions, 1,000+ pods, 20 nodes.

Everything goes through the wire: the real extender (``vramshare extender``, its own process, killed
with SIGKILL and restarted on the same port), the API server double, kube-scheduler-like callers (filter,
prioritize, bind; a share of binds is sent twice at once, as kube-scheduler's retry of a timed-out bind
races the first attempt, and some again later), a churn thread deleting and finishing pods, and the
kubelet/device-plugin stand-in of bench/soak_harness.py (admission in its own order, devices counted
per GPU, the ``allocated`` report).

Figures (aims: 0, 0, 0):

* ``gpus_over_capacity_assigned``: GPUs that at any sample carried more in the assignment annotations
  of the pods bound to their node than they hold (what the first design's allocator would have granted;
  an unbound pod's assignment steers nothing);
* ``gpus_over_capacity_books``: GPUs the extender's books (/inspect) ever showed over capacity by what
  they hold for pods (memory the node reports no pod holds, ``foreignMiB``, may come on top);
* ``gpus_over_capacity_real``: GPUs whose containers ever held more than the GPU has (the node model's
  truth, a force-deleted pod's containers included while they run);
* ``mismatched_gpus_after_settle``: GPUs whose books differ from what the containers really got, once
  callers stop, unbound pods are deleted and every bound pod is admitted and reported.

With ``--nodes plugin`` (the default, issue 17) every node runs the device plugin's real core
(bench/soak_nodes.py): the kubelet's device manager model admits, the plugin's Allocator grants, and its
Reconciler reads PodResources exactly as a real kubelet answers it (one entry per device ID and NUMA node,
no pod UID), records the pods and links the quota directories; pods are deleted and *recreated under the
same name* (a StatefulSet; the kubelet still runs the old one for a termination grace, so List names the
pod twice), and PodResources goes down now and then. Further figures (aims: 0): ``dangling_links``,
``links_to_other_pods``, ``pods_recorded_on_other_gpus`` (a pod recorded on GPUs its UID does not hold:
another pod's, or the previous pod's of its name), ``links_missing_after_settle``; and what the refusal of
unexplained Allocates while PodResources is down cost (``refused_while_pod_resources_down``).
``--nodes model`` keeps the older in-harness kubelet (bench/soak_harness.py). ``--stuck-share S``: that
share of force-deleted pods keeps its containers' memory 10-30 s past the grace (a process stuck in the
driver); the node agents publish the memory no pod holds (the inventory's ``foreignMiB``, vramshare/foreign.py)
unless ``--no-foreign-report``.

Also: admissions that failed because a node had too few free devices (the extender sent a pod where
there was no room), steering misses (the GPU a pod got is not the one assigned; the hold's baseline
shows why it exists). Run twice in one process: ``hold`` (the default config) and ``no_hold``
(``holdTimeoutSeconds: 0``), the same seed.

    python bench/bench_soak.py                 # 1,200 pods per run, a kill -9 every 6 s, at most 300 s each
    python bench/bench_soak.py --quick         # 300 pods, a kill every 5 s, at most 90 s
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import threading
import time
from typing import Any

import urllib3

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.soak_harness import N, ExtenderProcess, KubeletSim, ReplicatedExtender, bind_body, post  # noqa: E402
from bench.soak_nodes import PluginNodeSim  # noqa: E402
from deviceplugin.backend import DiscoveredGpu  # noqa: E402
from standins.apiserver import PODS, ApiServerDouble  # noqa: E402
from vramshare import inventory  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "soak.json")
UNIT = 1024
SIZES_GIB = [2, 4, 4, 8, 8, 10, 16, 20, 24, 40]


def node_obj(name: str, model: str, mib: int, gpus: int) -> dict[str, Any]:
    inv = inventory.NodeInventory(unit_mib=UNIT, gpus=tuple(
        inventory.Gpu(index=i, uuid=f"GPU-{name}-{i}", model=model, memory_mib=mib,
                      units=inventory.units_for(mib, 0, UNIT)) for i in range(gpus)))
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "annotations": {N.inventory: inv.to_json()}}}


def pod_obj(name: str, gib: int, count: int) -> dict[str, Any]:
    ann = {N.gpu_count: str(count)} if count > 1 else {}
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "default", "annotations": ann},
            # the kubelet stands-in stop a deleted pod's containers within 0-2 s: the grace says so
            "spec": {"schedulerName": "vramshare-scheduler", "terminationGracePeriodSeconds": 2, "containers": [
                {"name": "vllm", "image": "vllm/vllm-openai", "resources": {"limits": {N.gpu_memory: str(gib)}}}]},
            "status": {"phase": "Pending"}}


def _mark_deleted(pod: dict[str, Any]) -> None:
    """A graceful DELETE of a bound pod: the API keeps it with a deletionTimestamp until its kubelet is done."""
    pod["metadata"]["deletionTimestamp"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


class Soak:
    def __init__(self, args: argparse.Namespace, hold: bool) -> None:
        self.args, self.hold = args, hold
        self.rng = random.Random(args.seed)
        self.counts: dict[str, int] = {k: 0 for k in (
            "created", "bound", "bind_errors", "filter_errors", "held", "filter_none", "not_synced", "duplicates_sent",
            "late_duplicates_sent", "late_duplicate_errors", "deleted", "finished", "kills", "down",
            "recreated_same_name", "force_deleted")}
        self.lock = threading.Lock()
        self.bind_error_kinds: dict[str, int] = {}
        self.late_duplicate_error_kinds: dict[str, int] = {}  # why a retry of a bind that succeeded was refused
        self.error_examples: dict[str, list[str]] = {}  # the first few reasons of each kind
        self.over_assigned: set[str] = set()
        self.over_books: set[str] = set()
        self.over_real: set[str] = set()  # GPUs whose containers ever held more than the GPU has
        self.over_real_examples: list[dict[str, Any]] = []
        self.over_examples: list[dict[str, Any]] = []
        self.over_with_unbound: set[str] = set()
        self.stop = threading.Event()
        self.bound_at: list[float] = []

    def bump(self, key: str, n: int = 1) -> None:
        with self.lock:
            self.counts[key] += n

    def _why(self, error: str, into: dict[str, int] | None = None) -> None:
        """Bind errors by kind (the extender's reason, without pod and node names), into ``into``
        (default: :attr:`bind_error_kinds`)."""
        kinds = ("no extender leader", "unreachable", "held for pod", "not synced", "does not fit", "in progress",
                 "already bound", "cannot", "was bound")  # the most specific first ("election in progress")
        kind = next((k for k in kinds if k in error), "other")
        into = self.bind_error_kinds if into is None else into
        with self.lock:
            into[kind] = into.get(kind, 0) + 1
            kept = self.error_examples.setdefault(kind, [])
            if len(kept) < 3:  # a few of each, to be read
                kept.append(error[:300])

    # -- actors --------------------------------------------------------------------------------
    def creator(self, api: ApiServerDouble, queue: list[dict], cv: threading.Condition) -> None:
        i = 0
        while not self.stop.is_set() and i < self.args.pods:
            gib = self.rng.choice(SIZES_GIB)
            count = 2 if gib >= 8 and self.rng.random() < 0.15 else 1
            burst = self.rng.choice([1, 1, 1, 4, 8])  # replicas of one Deployment: the same size
            for _ in range(burst):
                if i >= self.args.pods:
                    break
                p = api.create_pod(pod_obj(f"p{i}", gib, count))
                i += 1
                self.bump("created")
                with cv:
                    queue.append(p)
                    cv.notify()
            time.sleep(self.args.create_interval_s * burst)

    def caller(self, ext: ExtenderProcess, api: ApiServerDouble, nodes: list[str], queue: list[dict],
               cv: threading.Condition, seed: int) -> None:
        rng = random.Random(seed)
        http = urllib3.PoolManager(retries=False, maxsize=4, timeout=urllib3.Timeout(connect=0.5, read=10))
        while not self.stop.is_set():
            with cv:
                while not queue and not self.stop.is_set():
                    cv.wait(0.1)
                if self.stop.is_set():
                    return
                pod = queue.pop(0)
            if not self._schedule(http, ext, pod, nodes, rng):
                if api.get_pod("default", pod["metadata"]["name"]) is not None:
                    threading.Timer(self.args.backoff_s, self._requeue, (queue, cv, pod)).start()

    def _requeue(self, queue: list[dict], cv: threading.Condition, pod: dict) -> None:
        with cv:
            queue.append(pod)
            cv.notify()

    def _schedule(self, http: urllib3.PoolManager, ext: ExtenderProcess, pod: dict, nodes: list[str],
                  rng: random.Random) -> bool:
        try:
            out = post(http, ext.url, "filter", {"Pod": pod, "NodeNames": nodes})
            if out["Error"]:
                self.bump("not_synced" if "not synced" in out["Error"] else "filter_errors")  # no leader, mostly
                return False
            fitting = out["NodeNames"] or []
            if not fitting:
                failed = out.get("FailedNodes") or {}
                self.bump("held" if any("held for pod" in r for r in failed.values()) else "filter_none")
                return False
            node = fitting[0]
            if len(fitting) > 1:
                scores = post(http, ext.url, "prioritize", {"Pod": pod, "NodeNames": fitting})
                node = max(scores, key=lambda s: s["Score"])["Host"] if scores else fitting[0]
            body = bind_body(pod, node)
            twin: threading.Thread | None = None
            if rng.random() < self.args.duplicate_share:  # kube-scheduler's retry races the first attempt
                self.bump("duplicates_sent")
                twin = threading.Thread(target=self._quiet_bind, args=(ext, body))
                twin.start()
            res = post(http, ext.url, "bind", body)
            if twin is not None:
                twin.join()
            if res["Error"]:
                self.bump("held" if "held for pod" in res["Error"] else "bind_errors")
                self._why(res["Error"])
                return False
            self.bump("bound")
            with self.lock:
                self.bound_at.append(time.monotonic())
            if rng.random() < 0.1:  # a late retry of a bind that already succeeded: must change nothing
                self.bump("late_duplicates_sent")
                again = post(http, ext.url, "bind", body)
                if again["Error"]:  # refused, not a change: the books are checked for that after settling
                    self.bump("late_duplicate_errors")
                    self._why(again["Error"], self.late_duplicate_error_kinds)
            return True
        except (urllib3.exceptions.HTTPError, RuntimeError, ValueError, KeyError):
            self.bump("down")
            return False

    def _quiet_bind(self, ext: ExtenderProcess, body: dict) -> None:
        http = urllib3.PoolManager(retries=False, timeout=urllib3.Timeout(connect=0.5, read=10))
        try:
            post(http, ext.url, "bind", body)
        except (urllib3.exceptions.HTTPError, RuntimeError, ValueError):
            pass

    def churn(self, api: ApiServerDouble, kubelet: Any, queue: list[dict], cv: threading.Condition) -> None:
        rng = random.Random(self.args.seed + 1)
        recreate: dict[str, dict] = {}  # name -> the pod a StatefulSet makes again once the name is free

        def again(name: str, spec: dict) -> None:
            p = api.create_pod(spec)
            self.bump("recreated_same_name")
            with cv:
                queue.append(p)
                cv.notify()

        while not self.stop.wait(self.args.churn_interval_s):
            for name in [n for n in recreate if api.get_pod("default", n) is None]:
                again(name, recreate.pop(name))
            running = [k for k in kubelet.running_names() if k.split("/", 1)[1] not in recreate]
            if not running:
                continue
            key = rng.choice(sorted(running))
            name = key.split("/", 1)[1]
            try:
                roll = rng.random()
                if roll < 0.2:
                    api.set_pod_phase("default", name, "Succeeded")
                    self.bump("finished")
                    continue
                old = api.get_pod("default", name)
                if old is None or old["metadata"].get("deletionTimestamp"):
                    continue
                same = roll < 0.2 + self.args.recreate_share
                if same:
                    c = old["spec"]["containers"][0]["resources"]["limits"][N.gpu_memory]
                    count = int((old["metadata"].get("annotations") or {}).get(N.gpu_count, "1"))
                    spec = pod_obj(name, int(c), count)
                if same and rng.random() < self.args.force_share:  # kubectl delete --force: the API forgets it now
                    api.delete_pod("default", name)
                    self.bump("force_deleted")
                    again(name, spec)
                    continue
                if self.args.nodes_sim == "plugin":  # graceful: the kubelet stops it, then removes it
                    api.update(PODS, "default", name, _mark_deleted)
                else:  # the model kubelet stops it at once: containers terminated, then gone
                    api.finish_pod_deletion("default", name)
                self.bump("deleted")
                if same:
                    recreate[name] = spec
            except Exception:  # noqa: BLE001 - already gone
                pass

    def killer(self, ext: ExtenderProcess) -> None:
        while not self.stop.wait(self.args.kill_every_s):
            ext.kill()
            self.bump("kills")
            ext.start()

    def sampler(self, api: ApiServerDouble, ext: ExtenderProcess, capacity_mib: dict[str, int],
                kubelet: Any = None) -> None:
        import orjson

        while not self.stop.wait(0.25):
            for g, m in (kubelet.reality_mib() if kubelet is not None else {}).items():
                if m > capacity_mib[g] and g not in self.over_real:
                    self.over_real.add(g)
                    self.over_real_examples.append({
                        "gpu": g, "mib": m, "capacity": capacity_mib[g], "at": round(time.time(), 2),
                        **({"holders": kubelet.who_holds(g)} if hasattr(kubelet, "who_holds") else {}),
                        "books": ext.book_pods().get(g), "books_used_total": (ext.books() or {}).get(g)})
            per_gpu: dict[str, int] = {}
            holders: dict[str, list[str]] = {}
            every: dict[str, int] = {}
            for p in api.pods():  # what a device plugin acts on: pods bound to its node
                if (p.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
                    continue
                ann = p["metadata"].get("annotations") or {}
                text = ann.get(N.assignment)
                for es in orjson.loads(text).values() if text else ():
                    for e in es:
                        every[e["uuid"]] = every.get(e["uuid"], 0) + e["mib"]
                if not p["spec"].get("nodeName"):
                    continue
                for es in orjson.loads(text).values() if text else ():
                    for e in es:
                        per_gpu[e["uuid"]] = per_gpu.get(e["uuid"], 0) + e["mib"]
                        holders.setdefault(e["uuid"], []).append(
                            f"{p['metadata']['name']}:{e['mib']}:{ann.get(N.allocation_state)}")
            self.over_with_unbound.update(g for g, m in every.items() if m > capacity_mib[g])
            for g, m in per_gpu.items():
                if m > capacity_mib[g] and g not in self.over_assigned:
                    self.over_assigned.add(g)
                    self.over_examples.append({"gpu": g, "mib": m, "capacity": capacity_mib[g], "pods": holders[g], "at": round(time.time(), 2)})
            books = ext.books()
            if books:
                # what the extender booked for pods (departing ones included): foreign memory is reported
                # by the node and may come on top of pods already there, as the GPU really holds it
                self.over_books.update(g for g, (used, total, foreign) in books.items() if used - foreign > total)

    @staticmethod
    def _explain(api: ApiServerDouble, ext: Any, kubelet: Any, gpus: list[str]) -> list[dict[str, Any]]:
        """Why each mismatched GPU differs: the pods the books hold there, what the containers hold (pod,
        UID admitted), and each named pod as the API has it now (UID, node, state, assignment)."""
        books = ext.book_pods()
        out = []
        for g in gpus:
            real = kubelet.holders(g) if hasattr(kubelet, "holders") else []  # the model kubelet's
            names = sorted({k for k in books.get(g, {})} | {k for k, _, _ in real})
            api_now = {}
            for key in names:
                ns, _, name = key.partition("/")
                p = api.get_pod(ns, name.split("@")[0])
                ann = (p or {}).get("metadata", {}).get("annotations") or {}
                api_now[key] = None if p is None else {
                    "uid": p["metadata"].get("uid"), "node": p["spec"].get("nodeName"),
                    "phase": (p.get("status") or {}).get("phase"), "state": ann.get(N.allocation_state),
                    "assignment": ann.get(N.assignment)}
            out.append({"gpu": g, "books": books.get(g, {}), "real": [list(r) for r in real], "api": api_now})
        return out

    # -- the run -------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        a = self.args
        with ApiServerDouble() as api:
            capacity: dict[str, dict[str, int]] = {}
            discovered: dict[str, list[DiscoveredGpu]] = {}
            for i in range(a.nodes):
                model, mib, gpus = ("NVIDIA A100-SXM4-80GB", 81920, 4) if i % 2 == 0 else ("NVIDIA L4", 23034, 4)
                discovered[f"node-{i:02d}"] = [DiscoveredGpu(g, f"GPU-node-{i:02d}-{g}", model, mib, numa_node=g // 2)
                                               for g in range(gpus)]
                node = api.create_node(node_obj(f"node-{i:02d}", model, mib, gpus))
                inv = inventory.NodeInventory.from_json(node["metadata"]["annotations"][N.inventory])
                capacity[f"node-{i:02d}"] = {g.uuid: g.units for g in inv.gpus}
            capacity_mib = {g: u * UNIT for gpus in capacity.values() for g, u in gpus.items()}
            nodes = sorted(capacity)
            config = ("version: v1\nextender:\n  policy: fgd\n  assumeTimeoutSeconds: 5\n"
                      f"  holdTimeoutSeconds: {30 if self.hold else 0}\n")
            ext: Any = (ReplicatedExtender(api, config, a.replicas, a.seed) if a.replicas > 1
                        else ExtenderProcess(api.url, config))
            ext.start()
            assert ext.wait_ready(), "extender did not start"
            kubelet: Any
            if a.nodes_sim == "plugin":
                kubelet = PluginNodeSim(api, capacity, discovered, UNIT, (a.admit_min_s, a.admit_max_s), a.seed,
                                        outage_per_s=a.outage_per_s, report_departing=not a.no_departing_report,
                                        stuck_share=a.stuck_share, report_foreign=not a.no_foreign_report)
            else:
                kubelet = KubeletSim(api, capacity, UNIT, (a.admit_min_s, a.admit_max_s), a.seed)
            kubelet.start()
            queue: list[dict] = []
            cv = threading.Condition()
            actors = [threading.Thread(target=self.creator, args=(api, queue, cv)),
                      threading.Thread(target=self.churn, args=(api, kubelet, queue, cv)),
                      threading.Thread(target=self.killer, args=(ext,)),
                      threading.Thread(target=self.sampler, args=(api, ext, capacity_mib, kubelet))]
            actors += [threading.Thread(target=self.caller, args=(ext, api, nodes, queue, cv, s))
                       for s in range(a.callers)]
            t0 = time.monotonic()
            for t in actors:
                t.start()
            while time.monotonic() - t0 < a.max_seconds:
                with self.lock:
                    created = self.counts["created"] >= a.pods
                if created and all(p["spec"].get("nodeName") for p in api.pods()):
                    break  # every pod created was bound (or is gone)
                time.sleep(0.2)
            storm_s = time.monotonic() - t0
            self.stop.set()
            for t in actors:
                t.join(30)
            # settle: the last extender runs to the end; unbound pods go; every bound pod is admitted
            assert ext.wait_ready(), "extender did not come back"
            unbound = [p for p in api.pods() if not p["spec"].get("nodeName")]
            for p in unbound:
                api.delete_pod("default", p["metadata"]["name"])
            plugin = isinstance(kubelet, PluginNodeSim)
            if plugin:
                kubelet.end_outages()  # PodResources back everywhere: what was not recorded gets recorded
            t1 = time.monotonic()
            while kubelet.pending_admissions() and time.monotonic() - t1 < 30:
                time.sleep(0.05)
            mismatched: dict[str, tuple[int, int]] = {}
            while time.monotonic() - t1 < 30:
                books, real = ext.books() or {}, kubelet.reality_mib()
                mismatched = {g: (books.get(g, (0, 0, 0))[0], real[g]) for g in real
                              if books.get(g, (0, 0, 0))[0] != real[g]}
                if not mismatched:
                    break
                time.sleep(0.2)
            settle_s = time.monotonic() - t1
            mismatch_details = self._explain(api, ext, kubelet, sorted(mismatched)[:5]) if mismatched else []
            kubelet.stop_event.set()
            kubelet.join(5)
            node_figures: dict[str, Any] = {}
            if plugin:
                kubelet.settle_rounds()
                st = kubelet.stats
                missing = kubelet.missing_links()
                node_figures = {
                    "dangling_links": len(st.dangling_links), "links_to_other_pods": len(st.links_to_other_pods),
                    "pods_recorded_on_other_gpus": len(st.pods_recorded_on_other_gpus),
                    "links_missing_after_settle": len(missing),
                    "examples": {"dangling": sorted(st.dangling_links)[:3], "other": sorted(st.links_to_other_pods)[:3],
                                 "recorded": sorted(st.pods_recorded_on_other_gpus)[:3], "missing": missing[:3]},
                    "recreated_same_name": self.counts["recreated_same_name"],
                    "rounds_listing_a_name_twice": st.names_listed_twice,
                    "rounds_a_pod_waited_for_an_earlier_pods_devices": st.same_name_waits,
                    "reconcile_rounds": st.rounds,
                    "pod_resources_outages": st.pod_resources_outages,
                    "admitted_while_pod_resources_down": st.admitted_while_down,
                    "refused_while_pod_resources_down": st.refused_unrecorded,
                    "departing_reported": st.departing_reported, "departures_lost": st.departures_lost,
                    "stuck_past_grace": st.stuck, "foreign_reports": st.foreign_reports,
                }
                kubelet.cleanup()
            if isinstance(ext, ReplicatedExtender):
                kill_times = list(ext.kill_times)
                ext.shutdown()
            else:
                kill_times = []
                ext.kill()
        lat = sorted(kubelet.stats.admit_latency_s)
        return {
            "config": {"hold_timeout_s": 30 if self.hold else 0},
            "counts": self.counts,
            "bind_error_kinds": self.bind_error_kinds,
            "late_duplicate_error_kinds": self.late_duplicate_error_kinds,
            "error_examples": self.error_examples,
            "kubelet": {"admitted": kubelet.stats.admitted, "admission_failures": kubelet.stats.admission_failures,
                        "steering_misses": kubelet.stats.steering_misses,
                        "steering_examples": getattr(kubelet.stats, "steering_examples", []),
                        "ambiguous_admissions": kubelet.stats.ambiguous,
                        "unsteered_admissions": kubelet.stats.unsteered,
                        **({"successors_unseen": len(kubelet.stats.successor_unseen)}
                           if hasattr(kubelet.stats, "successor_unseen") else {}),
                        "admit_after_bind_p50_s": round(lat[len(lat) // 2], 3) if lat else None},
            "gpus_over_capacity_assigned": len(self.over_assigned),
            "gpus_over_capacity_books": len(self.over_books),
            # what the containers really held (a force-deleted pod's included, for its grace)
            "gpus_over_capacity_real": len(self.over_real),
            "over_capacity_real_examples": self.over_real_examples[:3],
            # also counting assignments left on pods that never bound (a killed extender's patch; they
            # steer nothing, and the books free them after assumeTimeoutSeconds)
            "gpus_over_capacity_assigned_incl_unbound": len(self.over_with_unbound),
            "mismatched_gpus_after_settle": len(mismatched),
            "mismatch_examples": dict(list(mismatched.items())[:5]),
            "mismatch_details": mismatch_details,
            "over_capacity_examples": self.over_examples[:3],
            "pods_unbound_at_end_of_storm": len(unbound),
            "nodes": node_figures,
            "storm_seconds": round(storm_s, 1), "settle_seconds": round(settle_s, 1),
            "replicas": a.replicas,
            "leader_kills": len(kill_times),
            # the scheduling gap after each kill: from the kill to the next successful bind
            "gaps_after_kills_s": [round(next((b for b in sorted(self.bound_at) if b > k), t0 + storm_s) - k, 2)
                                   for k in kill_times],
        }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--pods", type=int, default=1200)
    ap.add_argument("--nodes", type=int, default=20)
    ap.add_argument("--callers", type=int, default=4)
    ap.add_argument("--max-seconds", type=float, default=300)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--kill-every-s", type=float, default=6)
    ap.add_argument("--churn-interval-s", type=float, default=0.03)
    ap.add_argument("--create-interval-s", type=float, default=0.02)
    ap.add_argument("--duplicate-share", type=float, default=0.3)
    ap.add_argument("--backoff-s", type=float, default=0.3, help="retry delay of a pod that did not bind")
    ap.add_argument("--admit-min-s", type=float, default=0.05)
    ap.add_argument("--admit-max-s", type=float, default=0.5)
    ap.add_argument("--only", choices=["hold", "no_hold"])
    ap.add_argument("--nodes-sim", choices=["plugin", "model"], default="plugin",
                    help="plugin: the device plugin's real core per node (issue 17); model: the older harness")
    ap.add_argument("--recreate-share", type=float, default=0.3,
                    help="share of churn that deletes a pod and recreates it under its name at once")
    ap.add_argument("--no-departing-report", action="store_true",
                    help="baseline: node agents do not report force-deleted pods that may still run (the inventory's "
                         "departing section), so only the extender's in-memory booking keeps their GPUs")
    ap.add_argument("--force-share", type=float, default=0.0,
                    help="share of same-name recreations done with a forced delete (the kubelet still runs the "
                         "old pod, PodResources lists the name twice)")
    ap.add_argument("--stuck-share", type=float, default=0.0,
                    help="share of force-deleted pods whose containers keep their memory 10-30 s past the grace "
                         "(a process stuck in the driver): only the node's foreign-memory report books it then")
    ap.add_argument("--no-foreign-report", action="store_true",
                    help="baseline: node agents do not publish memory no pod holds (the inventory's foreignMiB)")
    ap.add_argument("--outage-per-s", type=float, default=0.02, help="PodResources outages per node per second")
    ap.add_argument("--replicas", type=int, default=1,
                    help="extender replicas; 2+: leader election, the kill is a SIGKILL of the leader, pods "
                         "reach a random ready replica (kube-proxy), each killed replica comes back as a new pod")
    ap.add_argument("--out", default=RESULTS)
    args = ap.parse_args(argv)
    if args.quick:
        args.pods, args.max_seconds, args.kill_every_s = 300, 90, 4
    runs = {}
    for name in (args.only,) if args.only else ("hold", "no_hold"):
        print(f"soak {name} ...", file=sys.stderr, flush=True)
        runs[name] = Soak(args, hold=name == "hold").run()
        print(json.dumps(runs[name]["counts"]), file=sys.stderr)
    doc = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "note": "shared 2-core machine, other work running: counts, not timings, are the figures"},
        # the output path as given relative to the checkout: no machine's absolute path in a result
        "args": {k: (os.path.relpath(os.path.abspath(v), os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
                     if k == "out" else v) for k, v in vars(args).items()},
        "runs": runs,
        "summary": {f"{name}.{k}": r[k] for name, r in runs.items() for k in (
            "gpus_over_capacity_assigned", "gpus_over_capacity_books", "gpus_over_capacity_real",
            "mismatched_gpus_after_settle")}
        | {f"{name}.pods_bound": r["counts"]["bound"] for name, r in runs.items()}
        | {f"{name}.kills": r["counts"]["kills"] for name, r in runs.items()}
        | {f"{name}.steering_misses": r["kubelet"]["steering_misses"] for name, r in runs.items()}
        | {f"{name}.admission_failures": r["kubelet"]["admission_failures"] for name, r in runs.items()}
        | {f"{name}.{k}": v for name, r in runs.items() for k, v in r["nodes"].items() if k != "examples"},
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump(doc, fh, indent=2)
    print(json.dumps(doc["summary"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
