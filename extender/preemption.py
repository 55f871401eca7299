"""The preempt verb: keep only the candidate nodes where evicting the proposed victims frees a GPU.

kube-scheduler's default preemption picks victims by priority with its in-tree filters, which see a
node's *total* ``gpu-memory`` but not how it is split over GPUs: evicting two 10 GiB pods on two
different GPUs does not make room for one 20 GiB pod. For each candidate node we take the victims'
holdings off the accounting, ask the placement core whether the pod fits, and put them back, all under
the accounting lock so nobody sees the what-if. Nodes where it still does not fit are dropped; the
victims of the others are returned unchanged (kube-scheduler already chose the fewest by priority).
"""
from __future__ import annotations

from extender import accounting, placement, translate, wire
from vramshare import logs, podspec

__all__ = ["preempt_pod"]

log = logs.get("vramshare.extender.preemption")


def _holdings(acct: accounting.Accounting, node: str, keys: set[str]) -> dict[str, list[tuple[str, int]]]:
    held: dict[str, list[tuple[str, int]]] = {}
    for use in acct.state.node_usage(node):
        for key, amount in use.pods.items():
            if key in keys:
                held.setdefault(key, []).append((use.slot.uuid, amount))
    return held


def preempt_pod(acct: accounting.Accounting, args: wire.PreemptionArgs) -> dict[str, list[str]]:
    """``{node: victim UIDs}`` for the nodes where the pod fits once those victims are gone."""
    if not podspec.wants_gpu(args.pod, acct.names):
        return dict(args.victims)
    try:
        demands = translate.demands_of(translate.pod_asks(args.pod, acct.names, acct.config.memory_unit_mib))
    except podspec.PodSpecError:
        return {}
    keep: dict[str, list[str]] = {}
    with acct.lock:
        by_uid = {(p.get("metadata") or {}).get("uid"): key for key, p in acct.pods.items()}
        for node, uids in args.victims.items():
            if node not in acct.slots:
                continue
            held = _holdings(acct, node, {by_uid[u] for u in uids if u in by_uid})
            for key in held:
                acct.state.remove_pod(key)
            try:
                fits, _ = placement.filter_nodes(acct.state, demands, [node])
            finally:
                for key, allocations in held.items():
                    acct.state.add_pod(key, node, allocations)
            if fits:
                keep[node] = list(uids)
    log.debug("preempt", pod=wire.ExtenderArgs(pod=args.pod).pod_key, candidates=len(args.victims), kept=len(keep))
    return keep
