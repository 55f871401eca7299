"""filter and prioritize as pure functions: decoded ExtenderArgs plus a cluster view in, plain results out.

This is the scheduling hot path: kube-scheduler serialises every managed pod's cycle on it, so nothing
here calls the API server or takes a lock longer than the placement core needs. Every name we answer
with comes from the request; a pod that asks for none of our resources passes through untouched.

A node fails *unresolvably* (``FailedAndUnresolvableNodes``) when no eviction could ever make room:
it publishes no GPU inventory, or none of its healthy GPUs of the right kind and model is big enough
even when empty. Every other miss is an ordinary ``FailedNodes`` entry, which preemption may fix.
"""
from __future__ import annotations

import itertools

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping, Sequence

import numpy as np

from extender import cluster, held_pick, parsed, placement, residency, translate, wire
from vramshare import contract, logs
from vramshare.config import Policy

if TYPE_CHECKING:
    from extender.holds import Holds

__all__ = ["View", "Expectation", "filter_pod", "prioritize_pod", "prioritize_rows", "expectation", "policy_for", "NOT_A_GPU_NODE"]

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
    holds: "Holds | None" = None  # live same-size holds (None: none at all, the common case)
    now_ns: int = 0
    models: Mapping[str, Sequence] | None = None  # node -> resident models (issue 23), None: no report
    residency_max_steps: float = 0.9  # the residency bonus's bound, in steps of the policy's score
    silent: frozenset[str] = frozenset()  # nodes whose device plugin does not report (extender.holds)
    #: How pods are read: the accounting's cache (by UID and resourceVersion), shared with its watch.
    pods: parsed.PodReader | None = None
    hold_timeout_ns: int = 0  # extender.holdTimeoutSeconds; 0: holds are off, nothing is expected
    #: Filter's answers of :func:`extender.held_pick.follow` per node and pod template (None: computed
    #: afresh each time); the accounting keeps one across requests.
    follows: held_pick.FollowMemo | None = None
    #: Nodes whose device plugin counts gpu-memory in another unit (node -> its MiB per unit): an ask of n
    #: units is another size there, so no gpu-memory pod is placed on them (Accounting._set_unit).
    other_unit: Mapping[str, int] = field(default_factory=dict)

    def read(self, pod: wire.Obj) -> parsed.ParsedPod:
        return self.pods.read(pod) if self.pods is not None else parsed.parse_pod(pod, self.names, self.unit_mib)


@dataclass(frozen=True)
class Expectation:
    """The one state change a filter or prioritize answer implies: kube-scheduler will most likely bind
    ``pod`` to ``node`` next, so it is held there briefly (:meth:`extender.holds.Holds.expect`). The
    verbs only say so; the caller commits it (:meth:`extender.accounting.Accounting.commit`)."""

    pod: str
    node: str
    signature: translate.Signature


def policy_for(pod_policy: str | None, default: Policy) -> Policy:
    """The pod's ``vramshare.io/policy`` annotation if it names a policy, else the configured one."""
    if pod_policy:
        try:
            return Policy(pod_policy.strip().lower())
        except ValueError:
            log.warning("unknown pod policy ignored", policy=pod_policy, using=default.value)
    return default


def never_fit(state: cluster.ClusterState, demands: Sequence[cluster.Demand], rows: np.ndarray) -> np.ndarray:
    """``[n]`` bool: even empty, the node at each row lacks enough healthy GPUs of the right kind, model
    and size for some demand, so no preemption can help. Vectorised: it runs on every failed node."""
    out = np.zeros(len(rows), bool)
    if not len(rows):
        return out
    cap, kind, healthy = state.capacity[rows], state.kind[rows], state.healthy[rows]
    for d in demands:
        usable = state.kind_mask(d, rows) & healthy & (cap >= max(1, d.per_gpu))
        if d.models:
            usable &= state.model_mask(d.models)[state.model[rows]]
        out |= usable.sum(axis=1) < max(1, d.count)
    return out


def filter_pod(view: View, args: wire.ExtenderArgs) -> wire.FilterResult:
    """Which of the candidate nodes have GPU room for the pod, in the input order."""
    names = args.names
    pod = view.read(args.pod)
    if not pod.wants_gpu:
        return wire.FilterResult(passed=list(names))
    if pod.error is not None:
        return wire.FilterResult(unresolvable={n: pod.error for n in names})
    assert pod.want is not None and pod.host is not None
    demands = list(pod.demands)
    if not demands:  # asked for zero of our resources: nothing to place
        return wire.FilterResult(passed=list(names))
    found = placement.filter_rows(view.state, demands, names, pod.host)
    fitting, failed, failed_rows = found.fitting, found.failed, found.failed_rows
    if view.holds is not None and fitting:
        fitting, failed, failed_rows = _apply_holds(view, args, pod, found)
    unit_refused: dict[str, str] = {}
    if view.other_unit and fitting and any(d.kind == cluster.SHARED for d in demands):
        unit_refused = {n: _other_unit_reason(view, view.other_unit[n]) for n in fitting if n in view.other_unit}
        fitting = [n for n in fitting if n not in unit_refused]
    result = wire.FilterResult(passed=fitting)
    if failed:
        if len(failed_rows) != len(failed):  # a name sent twice: one entry per name, look them up again
            failed_rows = view.state.rows_of(list(failed), remember=False)
        # By row, never by name: a node is known iff it has a row (the accounting adds and drops a
        # node's slots and its row together), and whether no eviction could help reads the row alone.
        known = failed_rows >= 0
        hopeless = np.zeros(len(failed_rows), bool)
        hopeless[known] = never_fit(view.state, demands, failed_rows[known])
        if not hopeless.any() and known.all():
            result.failed = failed if isinstance(failed, dict) else dict(failed)
        else:
            items = list(failed.items())  # input order
            unresolvable = hopeless | ~known
            result.failed = dict(itertools.compress(items, (~unresolvable).tolist()))
            result.unresolvable = {n: (why if k else NOT_A_GPU_NODE) for (n, why), k in
                                   itertools.compress(zip(items, known.tolist()), unresolvable.tolist())}
    if unit_refused:
        result.unresolvable = {**(result.unresolvable or {}), **unit_refused}
    log.debug("filter", pod=args.pod_key, candidates=len(names), passed=len(result.passed))
    return result


def _other_unit_reason(view: View, unit_mib: int) -> str:
    """Why a node counting gpu-memory in another unit than the extender takes no gpu-memory pod."""
    return (f"node counts {view.names.gpu_memory} in units of {unit_mib} MiB, the extender in {view.unit_mib} MiB: "
            "restart the device plugin there and the extender after changing memoryUnitMiB")


def _apply_holds(view: View, args: wire.ExtenderArgs, pod: parsed.ParsedPod,
                 found: placement.Filtered) -> tuple[list[str], dict[str, str], np.ndarray]:
    """Fitting nodes where a same-size pod is still assumed on other terms (extender.holds), or whose
    held GPUs lack room for this pod too (extender.held_pick), become ordinary failures (not
    unresolvable: the hold ends within seconds), with a reason naming the pod it waits for. Returns
    the passed names, the failed ones with their reasons and the failed ones' rows (that order)."""
    assert view.holds is not None and pod.want is not None and pod.signature is not None
    want, asks, host, signature = pod.want, pod.asks, pod.host or cluster.HostDemand(), pod.signature
    fitting, rows, failed = found.fitting, found.fitting_rows, found.failed
    # Only held nodes need a look: find them among the candidates by row, in numpy (filter_rows
    # found the candidates' rows), never by hashing thousands of names.
    held_rows = [r for r in map(view.state.row, view.holds.held_nodes(signature)) if r is not None]
    if not held_rows:
        return fitting, failed, found.failed_rows
    policy = policy_for(want.policy, view.policy).value
    demands = list(pod.demands)
    held = np.zeros(len(view.state.row_version), bool)
    held[held_rows] = True
    waiting: dict[str, str] = {}
    blocked: list[int] = []
    memo, pod_template = view.follows, None
    for i in np.flatnonzero(held[rows]).tolist():
        n = fitting[i]
        need = view.holds.required(n, args.pod_key, signature, view.now_ns, record=False)
        if need.blocker is not None:
            waiting[n] = view.holds.reason(need.blocker, view.now_ns, record=False)
        elif need.plans:
            picks = lambda n=n: placement.pick(view.state, demands, n, policy, host)  # noqa: E731
            if memo is None:
                choice = held_pick.follow(view.state, n, args.pod, want, asks, view.names, need.plans, picks)
            else:
                if pod_template is None:
                    pod_template = memo.intern(held_pick.template(args.pod, want, asks, demands, policy, host))
                choice = memo.follow(view.state, n, args.pod, want, asks, view.names, need.plans, picks,
                                     pod_template)
            if isinstance(choice, str):
                holder = next(iter(need.holders.values()))
                waiting[n] = f"{view.holds.reason(holder, view.now_ns, record=False)}; {choice}"
        if n in waiting:
            blocked.append(i)
    if not waiting:
        return fitting, failed, found.failed_rows
    passed = placement.without(fitting, blocked)
    # kube-scheduler sends exactly this list to prioritize: remember its rows, as filter_rows did for
    # the list before the holds (rows_of finds it then without hashing 5,000 names again).
    view.state.remember_rows(passed, np.delete(rows, blocked))
    return passed, {**failed, **waiting}, np.concatenate([found.failed_rows, rows[blocked]])


def prioritize_pod(view: View, args: wire.ExtenderArgs) -> list[tuple[str, int]]:
    """Scores 0..10 for every candidate (0 where the pod does not fit); a pod that asks no GPU is scored
    by where its CPU and memory strand the fewest GPUs (fgd), as the simulator places it."""
    _, scores = prioritize_rows(view, args)
    return list(zip(args.names, scores.tolist()))


def prioritize_rows(view: View, args: wire.ExtenderArgs) -> tuple[np.ndarray, np.ndarray]:
    """:func:`prioritize_pod` as arrays: each candidate's row in the books (-1: unknown) and its score,
    so the app encodes the answer without a Python object per node (:class:`wire.HostFragments`)."""
    names = args.names
    # A pod that asks no GPU is scored too (kube-scheduler only sends it when the profile's
    # managedResources include one it asks, e.g. cpu): its CPU and memory strand GPUs as well.
    pod = view.read(args.pod)
    if pod.error is not None:
        return view.state.rows_of(names), np.zeros(len(names), np.int64)
    assert pod.want is not None and pod.host is not None
    want, demands, host = pod.want, list(pod.demands), pod.host
    # placement.score_rows answers every input name with an integer in MIN..MAX_EXTENDER_PRIORITY
    # (0 where the pod does not fit or the node is unknown): already the wire's HostPriorityList.
    bonus = None
    if want.model_error:
        log.info("model annotation ignored", pod=want.key, reason=want.model_error)
    if want.model is not None and view.models:
        bonus = _residency(view, want.model, names)
    rows, scores = placement.score_rows(view.state, demands, names, policy_for(want.policy, view.policy).value,
                                        host, bonus=bonus)
    if view.silent and demands:
        silent = np.fromiter((n in view.silent for n in names), bool, len(names))
        if not silent.all():
            # placement elsewhere first: a node whose plugin does not report scores the minimum (its pods
            # may not start, its books cannot be confirmed; filter still passes it). Where every candidate
            # is silent the policy's own scores stand: flattening them would pile a burst onto one node.
            scores = np.where(silent, contract.MIN_EXTENDER_PRIORITY, scores)
    return rows, scores


def expectation(view: View, args: wire.ExtenderArgs, node: str | None) -> Expectation | None:
    """What answering ``args`` with ``node`` as the one passed (filter) or the best scored
    (prioritize) implies: hold it for the pod's size until its bind comes, or ``None`` (no node, holds
    off, a pod that asks no GPU or whose demand cannot be read)."""
    if node is None or view.hold_timeout_ns <= 0:
        return None
    pod = view.read(args.pod)
    if not pod.wants_gpu or pod.signature is None:
        return None
    return Expectation(args.pod_key, node, pod.signature)


def _residency(view: View, model: contract.ModelRef, names: Sequence[str]) -> np.ndarray | None:
    """The residency bonus per name (:func:`extender.residency.bonus_for`, the DRA path's too), found by
    the names' rows (remembered from filter), not by a step per name."""
    return residency.bonus_for(model, names, view.models or {},
                               residency.ResidencyConfig(max_steps=view.residency_max_steps),
                               rows=(view.state.rows_of(names), view.state.row))
