"""Builders for the Kubernetes objects the extender reads: GPU nodes with an inventory annotation, pods.

Literal, readable inventories (``gpu_node("n1", a100(), a100(mode="exclusive"))``) are the fixtures of
every extender test and of the end-to-end suites; they produce exactly the JSON the device plugin and
kube-scheduler send, through the shared inventory codec.
"""
from __future__ import annotations

import itertools
from typing import Any

from vramshare import contract, inventory

Obj = dict[str, Any]
NAMES = contract.Names()
_serial = itertools.count()


def gpu(model: str = "NVIDIA A100-SXM4-80GB", memory_mib: int = 81920, mode: str = "shared",
        healthy: bool = True, mig: tuple[tuple[str, int], ...] = (), unit_mib: int = 1024) -> dict[str, Any]:
    """One GPU's fields; ``mig`` as (profile, MiB) pairs makes it a MIG GPU."""
    return {"model": model, "memory_mib": memory_mib, "mode": "mig" if mig else mode, "healthy": healthy,
            "mig": mig, "unit_mib": unit_mib}


def a100(**kw: Any) -> dict[str, Any]:
    return gpu("NVIDIA A100-SXM4-80GB", 81920, **kw)


def l4(**kw: Any) -> dict[str, Any]:
    return gpu("NVIDIA L4", 23034, **kw)


def h100(**kw: Any) -> dict[str, Any]:
    return gpu("NVIDIA H100 80GB HBM3", 81559, **kw)


def uuid_of(node: str, index: int) -> str:
    return f"GPU-{node}-{index}"


def node_inventory(name: str, *gpus: dict[str, Any], unit_mib: int = 1024) -> inventory.NodeInventory:
    out = []
    for i, g in enumerate(gpus):
        mode = inventory.GpuMode(g["mode"])
        migs = tuple(inventory.MigInstance(f"MIG-{name}-{i}-{j}", p, m) for j, (p, m) in enumerate(g["mig"]))
        out.append(inventory.Gpu(index=i, uuid=uuid_of(name, i), model=g["model"], memory_mib=g["memory_mib"],
                                 mode=mode, healthy=g["healthy"], mig=migs,
                                 units=inventory.units_for(g["memory_mib"], 0, unit_mib)
                                 if mode is inventory.GpuMode.SHARED else 0))
    return inventory.NodeInventory(unit_mib=unit_mib, gpus=tuple(out))


def gpu_node(name: str, *gpus: dict[str, Any], unit_mib: int = 1024, annotation: str | None = None) -> Obj:
    """A Node with the inventory annotation (or a given raw ``annotation`` text, to test bad ones)."""
    text = annotation if annotation is not None else node_inventory(name, *gpus, unit_mib=unit_mib).to_json()
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "annotations": {NAMES.inventory: text}},
            "status": {"allocatable": {NAMES.gpu_memory: str(sum(g["memory_mib"] // unit_mib for g in gpus))}}}


def plain_node(name: str) -> Obj:
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}}


def pod(name: str, gib: int = 0, *, count: int = 1, namespace: str = "default", models: str | None = None,
        whole: int = 0, mig: dict[str, int] | None = None, containers: int = 1, policy: str | None = None,
        uid: str | None = None, node: str = "", annotations: dict[str, str] | None = None) -> Obj:
    """A pending pod asking ``gib`` units of gpu-memory per container (split over ``count`` GPUs)."""
    ann = dict(annotations or {})
    if count != 1:
        ann[NAMES.gpu_count] = str(count)
    if models:
        ann[NAMES.gpu_models] = models
    if policy:
        ann[NAMES.policy] = policy
    res: dict[str, str] = {}
    if gib:
        res[NAMES.gpu_memory] = str(gib)
    if whole:
        res[NAMES.gpu] = str(whole)
    for profile, n in (mig or {}).items():
        res[NAMES.mig(profile)] = str(n)
    spec: Obj = {"schedulerName": "vramshare-scheduler",
                 "containers": [{"name": f"c{i}", "image": "vllm/vllm-openai",
                                 "resources": {"limits": dict(res)} if res else {}} for i in range(containers)]}
    if node:
        spec["nodeName"] = node
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "uid": uid or f"uid-{name}-{next(_serial)}",
                         "annotations": ann},
            "spec": spec, "status": {"phase": "Pending"}}


def managed_entry(manager: str, operation: str, *keys: str) -> Obj:
    """A managedFields entry owning annotation ``keys``, as the API server records it."""
    return {"manager": manager, "operation": operation, "apiVersion": "v1", "time": "2026-01-01T00:00:00Z",
            "fieldsType": "FieldsV1",
            "fieldsV1": {"f:metadata": {"f:annotations": {f"f:{k}": {} for k in keys}}}}


def written_by_vramshare(state: str = "assumed") -> list[Obj]:
    """managedFields of a pod whose assignment vramshare wrote: the extender's patch at bind, then (for
    ``allocated``) the device plugin's server-side apply of the actual assignment and the state."""
    from vramshare import contract
    if state == "allocated":
        return [managed_entry(contract.FIELD_MANAGER_DEVICE_PLUGIN, "Apply", NAMES.assignment, NAMES.allocation_state),
                managed_entry(contract.FIELD_MANAGER_EXTENDER, "Update", NAMES.assume_time)]
    return [managed_entry(contract.FIELD_MANAGER_EXTENDER, "Update", NAMES.assignment, NAMES.assume_time,
                          NAMES.allocation_state)]


def ended(p: Obj) -> Obj:
    """``p`` as the watch delivers its deletion once its kubelet ended it: every container terminated
    (``status_manager.go TerminatePod``, then ``canBeDeleted``). A DELETED without that is a forced one."""
    containers = (p.get("spec") or {}).get("containers") or []
    return {**p, "status": {**(p.get("status") or {}), "containerStatuses": [
        {"name": c["name"], "state": {"terminated": {"exitCode": 0, "reason": "Completed"}}} for c in containers]}}


def assigned(p: Obj, node: str, gpus: list[tuple[str, int]], assume_ns: int, state: str = "assumed",
             container: str = "c0") -> Obj:
    """``p`` as the binder leaves it: assignment annotations, and bound to ``node`` when ``node``."""
    import orjson

    out = {**p, "metadata": {**p["metadata"], "annotations": {
        **p["metadata"].get("annotations", {}),
        NAMES.assignment: orjson.dumps({container: [{"uuid": u, "mib": m} for u, m in gpus]}).decode(),
        NAMES.assume_time: str(assume_ns), NAMES.allocation_state: state},
        "managedFields": written_by_vramshare(state)}}
    if node:
        out["spec"] = {**p["spec"], "nodeName": node}
    return out
