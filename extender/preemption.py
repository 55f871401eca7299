"""The preempt verb: name the victims per GPU, not per node.

kube-scheduler's default preemption picks victims with its in-tree filters, which see a node's *total*
``gpu-memory`` and not how it is split over GPUs: on a fragmented node (room enough in total, on no single
GPU) it finds the pod already fits and proposes no victims at all (1.28-1.34), and elsewhere it may
propose pods spread over GPUs whose eviction frees no one GPU enough. So for every candidate node we
choose the victims ourselves, from the pods it could evict there (lower priority than the preemptor, or
proposed by kube-scheduler): for each GPU, and for the node as a whole, evict in order of priority
(lowest first, larger holdings first) until the pod fits, then reprieve from the highest priority down
every victim the pod does not need (kube-scheduler's own ``SelectVictimsOnNode`` rule). The set kept is
the one with the lowest highest priority, then the fewest pods, then the least memory. Nodes where no
set makes room are dropped.

Everything runs on the live accounting under its lock and is put back before the lock is released, so
nobody sees the what-if. ``NumPDBViolations`` is passed through as kube-scheduler counted it for the node
(we cannot see PodDisruptionBudgets).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from extender import accounting, cluster, placement, wire
from vramshare import logs

__all__ = ["preempt_pod", "priority_of"]

log = logs.get("vramshare.extender.preemption")


@dataclass(frozen=True)
class _Candidate:
    key: str
    uid: str
    priority: int
    holdings: tuple[tuple[str, int], ...]  # (slot uuid, MiB) on this node
    host: cluster.HostDemand = cluster.HostDemand()  # its CPU and memory, put back with its GPUs

    @property
    def mib(self) -> int:
        return sum(m for _, m in self.holdings)


def priority_of(pod: Mapping[str, Any]) -> int:
    """``spec.priority`` as the priority admission plugin sets it (0 when absent)."""
    value = (pod.get("spec") or {}).get("priority")
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _candidates(acct: accounting.Accounting, node: str, preemptor_priority: int,
                proposed: set[str]) -> list[_Candidate]:
    held: dict[str, list[tuple[str, int]]] = {}
    for use in acct.state.node_usage(node):
        for key, amount in use.pods.items():
            held.setdefault(key, []).append((use.slot.uuid, amount))
    out = []
    for key, pairs in held.items():
        pod = acct.pods.get(key)
        if pod is None:
            continue  # a reservation of a bind in flight: not a pod kube-scheduler could evict
        uid = str((pod.get("metadata") or {}).get("uid", ""))
        prio = priority_of(pod)
        if prio < preemptor_priority or uid in proposed:
            out.append(_Candidate(key, uid, prio, tuple(pairs), acct.state.pod_host(key) or cluster.HostDemand()))
    return out


def _fits(state: cluster.ClusterState, demands: list[cluster.Demand], node: str, host: cluster.HostDemand) -> bool:
    fitting, _ = placement.filter_nodes(state, demands, [node], host)
    return bool(fitting)


def _put_back(state: cluster.ClusterState, c: _Candidate, node: str) -> None:
    """Restore a candidate exactly as it was booked: its GPUs and its CPU and memory (it runs)."""
    state.add_pod(c.key, node, c.holdings, c.host, strict_host=False, force=True)


def _victims(state: cluster.ClusterState, demands: list[cluster.Demand], node: str, host: cluster.HostDemand,
             order: Sequence[_Candidate]) -> list[_Candidate] | None:
    """Evict along ``order`` until the pod fits, then reprieve what it does not need; all put back."""
    removed: list[_Candidate] = []
    try:
        for c in order:
            state.remove_pod(c.key)
            removed.append(c)
            if _fits(state, demands, node, host):
                break
        else:
            return None
        victims = list(removed)
        for c in sorted(removed, key=lambda c: (-c.priority, c.mib)):  # reprieve the most important first
            _put_back(state, c, node)
            if _fits(state, demands, node, host):
                victims.remove(c)
            else:
                state.remove_pod(c.key)
        return victims
    finally:
        for c in removed:
            if not state.has_pod(c.key):
                _put_back(state, c, node)


def _best_on_node(acct: accounting.Accounting, demands: list[cluster.Demand], host: cluster.HostDemand, node: str,
                  cands: list[_Candidate]) -> list[_Candidate] | None:
    if _fits(acct.state, demands, node, host):
        return []
    ranked = sorted(cands, key=lambda c: (c.priority, -c.mib, c.key))
    groups = [ranked] + [[c for c in ranked if any(u == s.uuid for u, _ in c.holdings)]
                         for s in acct.slots.get(node, ())]
    best: list[_Candidate] | None = None
    for order in groups:
        found = _victims(acct.state, demands, node, host, order) if order else None
        if found is None:
            continue
        rank = (max((c.priority for c in found), default=-2**63), len(found), sum(c.mib for c in found))
        if best is None or rank < (max((c.priority for c in best), default=-2**63), len(best),
                                   sum(c.mib for c in best)):
            best = found
    return best


def preempt_pod(acct: accounting.Accounting, args: wire.PreemptionArgs) -> dict[str, list[str]]:
    """``{node: victim UIDs}`` for the nodes where evicting those victims makes the pod fit.

    Never a node with no victims: kube-scheduler's ``callExtenders`` (pkg/scheduler/framework/
    preemption) fails the whole preemption of a non-ignorable extender that returns one ("expected
    at least one victim pod on node"). Where our books say the pod's GPUs already fit, what
    kube-scheduler proposed stands (its reason is not a GPU); with nothing proposed the node goes."""
    pod = acct.pods_read.read(args.pod)  # the reading filter and prioritize used (extender.parsed)
    if not pod.wants_gpu:
        return {node: list(uids) for node, uids in args.victims.items() if uids}
    if pod.error is not None or pod.host is None:
        return {}
    demands, host = list(pod.demands), pod.host
    mine = priority_of(args.pod)
    keep: dict[str, list[str]] = {}
    with acct.lock:
        for node, uids in args.victims.items():
            if node not in acct.slots:
                continue
            found = _best_on_node(acct, demands, host, node, _candidates(acct, node, mine, set(uids)))
            if found:
                keep[node] = [c.uid for c in found]
            elif found is not None and uids:
                keep[node] = list(uids)
    log.debug("preempt", pod=wire.ExtenderArgs(pod=args.pod).pod_key, candidates=len(args.victims), kept=len(keep))
    return keep
