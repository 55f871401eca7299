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
from typing import Any

import orjson
import urllib3

Obj = dict[str, Any]


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
                out.error = "; ".join(f"{n}: {why}" for n, why in sorted(out.failed.items())) or "no node fits"
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
