"""filter and prioritize as pure functions: decoded ExtenderArgs plus a cluster view in, plain results out.

This is the scheduling hot path: kube-scheduler serialises every managed pod's cycle on it, so nothing
here calls the API server or takes a lock longer than the placement core needs. Every name we answer
with comes from the request; a pod that asks for none of our resources passes through untouched.

A node fails *unresolvably* (``FailedAndUnresolvableNodes``) when no eviction could ever make room:
it publishes no GPU inventory, or none of its healthy GPUs of the right kind and model is big enough
even when empty. Every other miss is an ordinary ``FailedNodes`` entry, which preemption may fix.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from extender import cluster, placement, translate, wire
from vramshare import contract, inventory, logs, podspec
from vramshare.config import Policy

__all__ = ["View", "filter_pod", "prioritize_pod", "policy_for", "NOT_A_GPU_NODE"]

log = logs.get("vramshare.extender.verbs")
NOT_A_GPU_NODE = "node publishes no vramshare GPU inventory"


@dataclass(frozen=True)
class View:
    """What the verbs read: the live accounting plus each node's slots, and how to read a pod."""

    state: cluster.ClusterState
    slots: Mapping[str, Sequence[cluster.Slot]]
    names: contract.Names
    unit_mib: int
    policy: Policy


def policy_for(pod_policy: str | None, default: Policy) -> Policy:
    """The pod's ``vramshare.io/policy`` annotation if it names a policy, else the configured one."""
    if pod_policy:
        try:
            return Policy(pod_policy.strip().lower())
        except ValueError:
            log.warning("unknown pod policy ignored", policy=pod_policy, using=default.value)
    return default


def never_fits(slots: Sequence[cluster.Slot], demands: Sequence[cluster.Demand]) -> str | None:
    """Why this node could not host the pod even if it were empty, or ``None`` if it could."""
    for d in demands:
        usable = [s for s in slots if s.healthy and s.kind == d.kind and inventory.model_matches(s.model, d.models)]
        big = [s for s in usable if s.capacity >= d.per_gpu]
        if len(big) < d.count:
            what = f"{d.count} {d.kind} GPU(s)" + (f" of {d.per_gpu} MiB" if d.per_gpu else "")
            models = f" matching {'|'.join(d.models)}" if d.models else ""
            largest = max((s.capacity for s in usable), default=0)
            return (f"needs {what}{models}; node has {len(big)} healthy such GPU(s) "
                    f"(largest {largest} MiB)")
    return None


def filter_pod(view: View, args: wire.ExtenderArgs) -> wire.FilterResult:
    """Which of the candidate nodes have GPU room for the pod, in the input order."""
    names = args.names
    if not podspec.wants_gpu(args.pod, view.names):
        return wire.FilterResult(passed=list(names))
    try:
        demands = translate.demands_of(translate.pod_asks(args.pod, view.names, view.unit_mib))
    except podspec.PodSpecError as exc:
        return wire.FilterResult(unresolvable={n: str(exc) for n in names})
    if not demands:  # asked for zero of our resources: nothing to place
        return wire.FilterResult(passed=list(names))
    known = [n for n in names if n in view.slots]
    result = wire.FilterResult()
    fitting, failed = placement.filter_nodes(view.state, demands, known)
    fit = set(fitting)
    for name in names:
        if name in fit:
            result.passed.append(name)
        elif name not in view.slots:
            result.unresolvable[name] = NOT_A_GPU_NODE
        else:
            reason = never_fits(view.slots[name], demands)
            if reason is not None:
                result.unresolvable[name] = reason
            else:
                result.failed[name] = failed.get(name) or "not enough free GPU memory"
    log.debug("filter", pod=args.pod_key, candidates=len(names), passed=len(result.passed))
    return result


def prioritize_pod(view: View, args: wire.ExtenderArgs) -> list[tuple[str, int]]:
    """Scores 0..10 for every candidate (0 where the pod does not fit or wants no GPU)."""
    names = args.names
    if not podspec.wants_gpu(args.pod, view.names):
        return [(n, 0) for n in names]
    try:
        want = podspec.pod_demand(args.pod, view.names)
        demands = translate.demands_of(translate.pod_asks(args.pod, view.names, view.unit_mib))
    except podspec.PodSpecError:
        return [(n, 0) for n in names]
    known = [n for n in names if n in view.slots]
    scores = dict(placement.score_nodes(view.state, demands, known,
                                           policy_for(want.policy, view.policy).value))
    lo, hi = contract.MIN_EXTENDER_PRIORITY, contract.MAX_EXTENDER_PRIORITY
    return [(n, min(hi, max(lo, int(scores.get(n, 0))))) for n in names]
