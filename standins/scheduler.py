"""A stand-in for kube-scheduler's extender client, for end-to-end tests and ``vramshare demo``.

Never on a production path. kube-scheduler runs the extender after its in-tree filters, skips
prioritize when one node is left, and binds through the extender's bind verb; a bind error makes it
forget the pod and retry. This driver does the same over real HTTP (one keep-alive pool), so a test sees
exactly the traffic a real scheduler would cause, and records each step so the demo can say why a pod
landed where it did.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import orjson
import urllib3

from extender.simulation.kube_model import KubeModel, PodRequest
from vramshare import podspec, quantity

Obj = dict[str, Any]


#: events/v1 ``NoteLengthLimit`` (k8s.io/api/events/v1 validation): kube-scheduler cuts the FailedScheduling
#: event's message there (schedule_one.go ``truncateMessage``); the PodScheduled condition keeps it whole.
NOTE_LENGTH_LIMIT = 1024


def fit_error(num_all_nodes: int, statuses: dict[str, str]) -> str:
    """The message kube-scheduler writes for a pod no node fits (pkg/scheduler/framework/types.go
    ``FitError.Error``): every node's reasons counted by identical string, ``"<count> <reason>"`` sorted
    as strings, after ``"0/<all> nodes are available:"``. This is the PodScheduled condition's message."""
    counts: dict[str, int] = {}
    for reason in statuses.values():
        counts[reason] = counts.get(reason, 0) + 1
    msg = f"0/{num_all_nodes} nodes are available:"
    histogram = sorted(f"{n} {reason}" for reason, n in counts.items())
    return msg + (f" {', '.join(histogram)}." if histogram else "")


def failed_scheduling_note(message: str) -> str:
    """The FailedScheduling event's note: :func:`fit_error`'s message cut to NoteLengthLimit with " ..."
    (schedule_one.go ``truncateMessage``)."""
    if len(message) <= NOTE_LENGTH_LIMIT:
        return message
    return message[:NOTE_LENGTH_LIMIT - 4] + " ..."


@dataclass
class Outcome:
    """What happened to one pod: the node it was bound to (empty: unschedulable) and why."""

    pod: str
    node: str = ""
    attempts: int = 0
    error: str = ""  # the last bind error, or the reason no node fits
    failed: dict[str, str] = field(default_factory=dict)  # FailedNodes + FailedAndUnresolvableNodes of the last filter
    scores: dict[str, int] = field(default_factory=dict)  # the last prioritize answer


class SchedulerDriver:
    def __init__(self, extender_url: str, node_names: list[str], pool_size: int = 16) -> None:
        self.url = extender_url
        self.node_names = node_names
        self.http = urllib3.PoolManager(maxsize=pool_size, retries=False)

    def _post(self, verb: str, body: Obj) -> Any:
        resp = self.http.request("POST", f"{self.url}/{verb}", body=orjson.dumps(body),
                                 headers={"Content-Type": "application/json"})
        if resp.status != 200:
            raise RuntimeError(f"/{verb}: HTTP {resp.status}: {resp.data[:200]!r}")
        return orjson.loads(resp.data)

    def schedule(self, pod: Obj, max_attempts: int = 20, hold_backoff_s: float = 0.2) -> Outcome:
        """One pod until bound or no node fits; bind errors (lost races) are retried like the scheduler does.

        A node the extender passes over only because a same-size pod is still assumed there (a hold,
        extender/holds.py) is not a lasting no-fit: kube-scheduler retries such a pod after its backoff
        (``podInitialBackoffSeconds``, doubling), so this waits ``hold_backoff_s`` (doubling) and tries again."""
        meta = pod["metadata"]
        out = Outcome(f"{meta.get('namespace', 'default')}/{meta['name']}")
        while out.attempts < max_attempts:
            out.attempts += 1
            result = self._post("filter", {"Pod": pod, "Nodes": None, "NodeNames": self.node_names})
            if result["Error"]:
                raise RuntimeError(f"filter {out.pod}: {result['Error']}")
            fitting = result["NodeNames"]
            assert fitting is not None and set(fitting) <= set(self.node_names)
            out.failed = {**(result.get("FailedNodes") or {}), **(result.get("FailedAndUnresolvableNodes") or {})}
            if not fitting:
                out.error = fit_error(len(self.node_names), out.failed)
                held = any("held for pod" in why for why in (result.get("FailedNodes") or {}).values())
                if held and out.attempts < max_attempts:
                    time.sleep(hold_backoff_s * 2 ** min(out.attempts - 1, 5))
                    continue
                return out
            node = fitting[0]
            out.scores = {node: 0}
            if len(fitting) > 1:  # kube-scheduler skips prioritize when one node is feasible
                scores = self._post("prioritize", {"Pod": pod, "Nodes": None, "NodeNames": fitting})
                out.scores = {s["Host"]: s["Score"] for s in scores}
                best = max(out.scores.values())
                node = next(s["Host"] for s in scores if s["Score"] == best)
            bound = self._post("bind", {"PodName": meta["name"], "PodNamespace": meta.get("namespace", "default"),
                                        "PodUID": meta.get("uid", ""), "Node": node})
            if not bound["Error"]:
                out.node, out.error = node, ""
                return out
            out.error = bound["Error"]
            if "held for pod" in out.error:
                time.sleep(hold_backoff_s * 2 ** min(out.attempts - 1, 5))
        return out

    def close(self) -> None:
        self.http.clear()


def pod_request(pod: Obj) -> PodRequest:
    """The pod's CPU millicores and memory bytes as kube-scheduler's Fit counts them (init containers,
    sidecars, overhead: ``effective_requests``); non-zero defaults for the scores at pod level."""
    total = podspec.effective_requests(pod, lambda c: {
        "cpu": quantity.cpu_millis(podspec.container_requests(c).get("cpu", 0), "cpu"),
        "memory": quantity.byte_count(podspec.container_requests(c).get("memory", 0), "memory")})
    return PodRequest.of(total.get("cpu", 0), total.get("memory", 0))


def pod_resources(pod: Obj) -> list[str]:
    """Every resource name a container or init container requests or limits (``hasManagedResources``)."""
    spec = pod.get("spec") or {}
    out: list[str] = []
    for c in (spec.get("containers") or []) + (spec.get("initContainers") or []):
        res = c.get("resources") or {}
        out += list(res.get("requests") or {}) + list(res.get("limits") or {})
    return out


class ProfileDriver(SchedulerDriver):
    """kube-scheduler's cycle for one profile, over real HTTP: what :mod:`extender.simulation.kube_model`
    models, with the extender reached on the wire (``schedule_one.go``: in-tree filters, then the
    extender's filter on the nodes that pass, ``prioritizeNodes`` combining the extender's 0..10 x weight
    x 10 with the default scores, ``selectHost``; bind through the extender when it is interested,
    else the default binder: a Binding through ``bind_direct``). One cycle at a time, as kube-scheduler
    runs them; the model's cache is updated at bind (``AssumePod``)."""

    def __init__(self, extender_url: str, node_names: list[str], model: KubeModel,
                 bind_direct: Callable[[Obj, str], None], pool_size: int = 4) -> None:
        super().__init__(extender_url, node_names, pool_size)
        self.model = model
        self.bind_direct = bind_direct
        self.row_of = {n: i for i, n in enumerate(node_names)}

    def schedule_one(self, pod: Obj) -> Outcome:
        meta = pod["metadata"]
        out = Outcome(f"{meta.get('namespace', 'default')}/{meta['name']}", attempts=1)
        req = pod_request(pod)
        feasible = np.flatnonzero(self.model.fits(req))
        if not len(feasible):
            out.error = "in-tree Fit: no node has the CPU, memory or pod room"
            return out
        names = [self.node_names[i] for i in feasible]
        if self.model.profile.interested(pod_resources(pod)):
            result = self._post("filter", {"Pod": pod, "Nodes": None, "NodeNames": names})
            if result["Error"]:
                raise RuntimeError(f"filter {out.pod}: {result['Error']}")
            fitting = result["NodeNames"] or []
            out.failed = {**(result.get("FailedNodes") or {}), **(result.get("FailedAndUnresolvableNodes") or {})}
            if not fitting:
                out.error = "no node fits"
                return out
            rows = np.fromiter((self.row_of[n] for n in fitting), np.int64, len(fitting))
            ext = None
            if len(fitting) > 1:  # findNodesThatFitPod: one feasible node is taken without scoring
                scores = self._post("prioritize", {"Pod": pod, "Nodes": None, "NodeNames": fitting})
                out.scores = {s["Host"]: s["Score"] for s in scores}
                ext = np.array([out.scores.get(n, 0) for n in fitting])
            node = self.node_names[int(rows[self.model.select(rows, req, ext)])]
            bound = self._post("bind", {"PodName": meta["name"], "PodNamespace": meta.get("namespace", "default"),
                                        "PodUID": meta.get("uid", ""), "Node": node})
            if bound["Error"]:  # kube-scheduler forgets the assumed pod and retries it later
                out.error = bound["Error"]
                return out
        else:
            node = self.node_names[int(feasible[self.model.select(feasible, req)])]
            self.bind_direct(pod, node)
        self.model.bind(self.row_of[node], req)
        out.node = node
        return out
