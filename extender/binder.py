"""The bind verb: choose the GPU(s) on the node kube-scheduler chose, write them on the pod, bind it.

Order matters (DESIGN.md section 3, "assignment"):

1. under the accounting lock, ``placement.pick`` chooses slots with the pod's policy and the memory is
   reserved at once, so any number of concurrent binds to one node can never over-commit a GPU;
2. outside any lock, the assignment annotations are written with a resourceVersion-checked merge patch
   (a 409 re-reads the pod and retries), so the device plugin finds them when Allocate comes;
3. then the Binding is created. If 2 or 3 fails, the reservation is released and the error returned:
   kube-scheduler forgets the pod and retries it.

No lock is held across an API call and none outlives the request (HAMi's 5-minute node lock stalls whole
nodes; we never lock anything in the API).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

from extender import accounting, apicalls, cluster, placement, translate, verbs, wire
from vramshare import contract, logs, podspec
from vramshare.config import Policy

__all__ = ["Binder", "BindOutcome"]

log = logs.get("vramshare.extender.binder")
Obj = dict[str, Any]
PATCH_ATTEMPTS = 5


@dataclass(frozen=True)
class BindOutcome:
    """``error`` goes back to kube-scheduler (empty = bound); ``result`` labels the bind metric."""

    error: str = ""
    result: str = "bound"


class _BindFailed(Exception):
    def __init__(self, message: str, result: str) -> None:
        super().__init__(message)
        self.result = result


class _AlreadyBound(Exception):
    """An earlier attempt (whose answer kube-scheduler never got) bound the pod to this very node."""

    def __init__(self, pod: Obj) -> None:
        super().__init__("already bound")
        self.pod = pod


class Binder:
    def __init__(self, acct: accounting.Accounting, kube: apicalls.Kube, policy: Policy,
                 clock: Callable[[], int] = time.time_ns) -> None:
        self.acct = acct
        self.kube = kube
        self.policy = policy
        self.names: contract.Names = acct.names
        self.clock = clock

    def bind(self, args: wire.BindingArgs) -> BindOutcome:
        key = args.pod_key
        try:
            pod = self._current_pod(args)
            bound_to = (pod.get("spec") or {}).get("nodeName")
            if bound_to:
                if bound_to == args.node:
                    return BindOutcome(result="already_bound")
                raise _BindFailed(f"pod {key} is already bound to {bound_to}, not {args.node}", "conflict")
            if not podspec.wants_gpu(pod, self.names):
                self._bind(args)
                self.acct.assume_bound(key, args.node, pod)
                return BindOutcome(result="passthrough")
            return self._bind_gpu_pod(args, pod)
        except _BindFailed as exc:
            log.warning("bind failed", pod=key, node=args.node, error=str(exc))
            return BindOutcome(str(exc), exc.result)

    def _current_pod(self, args: wire.BindingArgs) -> Obj:
        """The cached pod when it is the one asked for, else a fresh read (a bind is not the hot path)."""
        with self.acct.lock:
            pod = self.acct.pods.get(args.pod_key)
        if pod is None or (args.pod_uid and (pod.get("metadata") or {}).get("uid") != args.pod_uid):
            pod = self._read(args)
        return dict(pod)

    def _read(self, args: wire.BindingArgs) -> Obj:
        try:
            pod = self.kube.get_pod(args.pod_namespace, args.pod_name)
        except apicalls.ApiException as exc:
            raise _BindFailed(f"cannot read pod {args.pod_key}: {exc.status} {exc.reason}", "api_error") from None
        uid = (pod.get("metadata") or {}).get("uid")
        if args.pod_uid and uid != args.pod_uid:
            raise _BindFailed(f"pod {args.pod_key} was replaced (uid {uid}, asked {args.pod_uid})", "conflict")
        return pod

    def _bind_gpu_pod(self, args: wire.BindingArgs, pod: Obj) -> BindOutcome:
        key = args.pod_key
        try:
            want = podspec.pod_demand(pod, self.names)
            asks = translate.pod_asks(pod, self.names, self.acct.config.memory_unit_mib)
            host = translate.pod_host(pod)
        except (podspec.PodSpecError, translate.TranslateError) as exc:
            raise _BindFailed(f"pod {key}: {exc}", "bad_request") from None
        policy = verbs.policy_for(want.policy, self.policy)
        assume_ns = self.clock()
        with self.acct.lock:
            self.acct.release_unbound(key)  # a new bind supersedes any earlier assumption
            try:
                picks = placement.pick(self.acct.state, translate.demands_of(asks), args.node, policy.value, host)
                allocations = _per_slot(picks)
                self.acct.reserve(key, args.node, allocations, assume_ns, host)
            except (cluster.NoFit, cluster.OverCommit) as exc:
                raise _BindFailed(f"pod {key} does not fit node {args.node}: {exc}", "no_fit") from None
        annotations = {
            self.names.assignment: translate.encode_assignment(asks, picks),
            self.names.assume_time: str(assume_ns),
            self.names.allocation_state: contract.STATE_ASSUMED,
        }
        try:
            self._patch(args, pod, annotations)
            self._bind(args)
        except _BindFailed:
            self.acct.release(key, assume_ns)
            raise
        except _AlreadyBound as done:  # keep the assignment it carries: the device plugin may have used it
            self.acct.release(key, assume_ns)
            self.acct.apply_pod("MODIFIED", done.pod)
            log.info("already bound", pod=key, node=args.node)
            return BindOutcome(result="already_bound")
        self.acct.mark_bound(key, args.node)
        log.info("bound", pod=key, node=args.node, policy=policy.value,
                 gpus=",".join(f"{u}:{m}MiB" for u, m in allocations))
        return BindOutcome()

    def _patch(self, args: wire.BindingArgs, pod: Obj, annotations: dict[str, str]) -> None:
        rv = (pod.get("metadata") or {}).get("resourceVersion", "")
        for _ in range(PATCH_ATTEMPTS):
            try:
                self.kube.patch_pod_annotations(args.pod_namespace, args.pod_name, rv, annotations)
                return
            except apicalls.ApiException as exc:
                if exc.status != apicalls.CONFLICT:
                    raise _BindFailed(f"cannot annotate pod {args.pod_key}: {exc.status} {exc.reason}",
                                      "api_error") from None
            fresh = self._read(args)  # someone else wrote the pod: re-read, check, retry
            bound_to = (fresh.get("spec") or {}).get("nodeName")
            if bound_to == args.node:
                raise _AlreadyBound(fresh)
            if bound_to:
                raise _BindFailed(f"pod {args.pod_key} was bound to {bound_to} meanwhile", "conflict")
            rv = (fresh.get("metadata") or {}).get("resourceVersion", "")
        raise _BindFailed(f"pod {args.pod_key} kept changing: {PATCH_ATTEMPTS} patch conflicts", "conflict")

    def _bind(self, args: wire.BindingArgs) -> None:
        try:
            self.kube.bind_pod(args.pod_namespace, args.pod_name, args.pod_uid, args.node)
        except apicalls.ApiException as exc:
            if exc.status == apicalls.CONFLICT:  # a timed-out earlier attempt may have bound it already
                fresh = self._read(args)
                if (fresh.get("spec") or {}).get("nodeName") == args.node:
                    return
            raise _BindFailed(f"cannot bind pod {args.pod_key} to {args.node}: {exc.status} {exc.reason}",
                              "api_error") from None


def _per_slot(picks: list[list[tuple[str, int]]]) -> list[tuple[str, int]]:
    total: dict[str, int] = {}
    for pairs in picks:
        for uuid, amount in pairs:
            total[uuid] = total.get(uuid, 0) + int(amount)
    return list(total.items())
