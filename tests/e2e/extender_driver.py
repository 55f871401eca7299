"""A scheduler-like driver for end-to-end tests: filter -> prioritize -> bind, as kube-scheduler calls them.

kube-scheduler runs the extender after its in-tree filters, skips prioritize when one node is left,
adds ``score x weight`` to its own scores, and binds asynchronously through the extender's bind verb;
a bind error makes it forget the pod and retry. This driver does the same over real HTTP (one keep-alive
pool), so a test sees exactly the traffic a real scheduler would cause. Also: per-GPU usage recomputed
from the pods' assignment annotations, the ground truth every e2e test checks against.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import orjson
import urllib3

from vramshare import contract, inventory

Obj = dict[str, Any]


@dataclass
class Outcome:
    pod: str
    node: str = ""  # empty: unschedulable
    attempts: int = 0
    error: str = ""


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

    def schedule(self, pod: Obj, max_attempts: int = 20) -> Outcome:
        """One pod until bound or no node fits; bind errors (lost races) are retried like the scheduler does."""
        meta = pod["metadata"]
        out = Outcome(f"{meta.get('namespace', 'default')}/{meta['name']}")
        while out.attempts < max_attempts:
            out.attempts += 1
            result = self._post("filter", {"Pod": pod, "Nodes": None, "NodeNames": self.node_names})
            if result["Error"]:
                raise RuntimeError(f"filter {out.pod}: {result['Error']}")
            fitting = result["NodeNames"]
            assert fitting is not None and set(fitting) <= set(self.node_names)
            if not fitting:
                return out
            node = fitting[0]
            if len(fitting) > 1:  # kube-scheduler skips prioritize when one node is feasible
                scores = self._post("prioritize", {"Pod": pod, "Nodes": None, "NodeNames": fitting})
                best = max(s["Score"] for s in scores)
                node = next(s["Host"] for s in scores if s["Score"] == best)
            bound = self._post("bind", {"PodName": meta["name"], "PodNamespace": meta.get("namespace", "default"),
                                        "PodUID": meta.get("uid", ""), "Node": node})
            if not bound["Error"]:
                out.node = node
                return out
            out.error = bound["Error"]
        return out

    def close(self) -> None:
        self.http.clear()


def usage_from_annotations(pods: Iterable[Obj], names: contract.Names = contract.Names()) -> dict[str, int]:
    """MiB per GPU/MIG uuid held by live pods, from their ``assignment`` annotations alone."""
    used: dict[str, int] = {}
    for pod in pods:
        if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            continue
        text = ((pod.get("metadata") or {}).get("annotations") or {}).get(names.assignment)
        for entries in (orjson.loads(text) if text else {}).values():
            for e in entries:
                used[e["uuid"]] = used.get(e["uuid"], 0) + e["mib"]
    return used


def capacity_from_inventories(nodes: Iterable[Obj], names: contract.Names = contract.Names()) -> dict[str, Obj]:
    """Per schedulable uuid: node, model, kind and capacity (MiB), read straight from the annotations."""
    out: dict[str, Obj] = {}
    for node in nodes:
        text = ((node.get("metadata") or {}).get("annotations") or {}).get(names.inventory)
        if not text:
            continue
        inv = inventory.NodeInventory.from_json(text)
        for g in inv.gpus:
            if g.mode is inventory.GpuMode.SHARED:
                out[g.uuid] = {"node": node["metadata"]["name"], "model": g.model, "kind": "shared",
                               "capacity": inv.capacity_mib(g), "healthy": g.healthy}
            elif g.mode is inventory.GpuMode.EXCLUSIVE:
                out[g.uuid] = {"node": node["metadata"]["name"], "model": g.model, "kind": "exclusive",
                               "capacity": g.memory_mib, "healthy": g.healthy}
            else:
                for m in g.mig:
                    out[m.uuid] = {"node": node["metadata"]["name"], "model": g.model, "kind": f"mig:{m.profile}",
                                   "capacity": m.memory_mib, "healthy": g.healthy and m.healthy}
    return out
