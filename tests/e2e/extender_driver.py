"""Ground truth for end-to-end tests: per-GPU usage and capacity recomputed from the API objects alone.

The scheduler-like driver is :class:`standins.scheduler.SchedulerDriver`, shared with the demo.
"""
from __future__ import annotations

from typing import Any, Iterable

import orjson

from vramshare import contract, inventory

__all__ = ["usage_from_annotations", "capacity_from_inventories"]

Obj = dict[str, Any]


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
