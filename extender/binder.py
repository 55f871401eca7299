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

Idempotent per pod UID: kube-scheduler retries a bind that timed out while the first attempt may still
be running here. A second bind of a UID whose bind is in flight waits for it and then answers from its
result (same node: done, nothing changed; another node: refused); a bind of a bound pod changes nothing.
The UID is the key whatever the caller sends: a request without one gets the UID of the pod the cache
(or, failing that, the API) holds under its name, so a retry that omits it still meets the attempt in
flight (issue 18).

Only what is ours: a pod of another scheduler profile (``extender.schedulerName``), a pod that asks none
of our resources and a node without a vramshare inventory are refused with the reason, so the endpoint
cannot be used to place arbitrary pods. A node where a pod of the same size is still assumed is refused
too, unless the pod can take the very GPUs held there for its size (:mod:`extender.holds`,
:mod:`extender.held_pick`); kube-scheduler then retries the pod.
"""
from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from extender import accounting, apicalls, cluster, held_pick, holds, mig_books, placement, translate, verbs, wire
from vramshare import contract, logs
from vramshare.config import Policy

__all__ = ["Binder", "BindOutcome"]

log = logs.get("vramshare.extender.binder")
Obj = dict[str, Any]
PATCH_ATTEMPTS = 5
#: How long a repeated bind waits for the attempt in flight (longer than kube-scheduler's bind timeout).
INFLIGHT_WAIT_S = 30.0


@dataclass(frozen=True)
class BindOutcome:
    """``error`` goes back to kube-scheduler (empty = bound); ``result`` labels the bind metric."""

    error: str = ""
    result: str = "bound"


class _BindFailed(Exception):
    def __init__(self, message: str, result: str, keep: bool = False) -> None:
        super().__init__(message)
        self.result = result
        self.keep = keep  # whether the pod got bound is unknown: keep its GPUs reserved


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
        self.scheduler_name = acct.config.extender.scheduler_name
        self._inflight: dict[str, threading.Event] = {}
        self._inflight_lock = threading.Lock()

    def bind(self, args: wire.BindingArgs) -> BindOutcome:
        key = args.pod_key
        if not args.pod_uid:
            try:
                args = dataclasses.replace(args, pod_uid=self._uid_of(args))
            except _BindFailed as exc:
                log.warning("bind failed", pod=key, node=args.node, error=str(exc))
                return BindOutcome(str(exc), exc.result)
        uid = args.pod_uid
        while True:
            with self._inflight_lock:
                running = self._inflight.get(uid)
                if running is None:
                    mine = self._inflight[uid] = threading.Event()
                    break
            if not running.wait(INFLIGHT_WAIT_S):  # the first attempt decides; then look again
                return BindOutcome(f"pod {key}: an earlier bind of this pod is still in progress", "conflict")
        try:
            return self._bind_once(args)
        finally:
            with self._inflight_lock:
                self._inflight.pop(uid, None)
            mine.set()

    def _bind_once(self, args: wire.BindingArgs) -> BindOutcome:
        key = args.pod_key
        try:
            pod = self._current_pod(args)
            spec = pod.get("spec") or {}
            scheduler = spec.get("schedulerName") or "default-scheduler"
            if scheduler != self.scheduler_name:
                raise _BindFailed(f"pod {key} uses scheduler {scheduler!r}, not {self.scheduler_name!r}: "
                                  "this extender binds only its own profile's pods", "refused")
            if not self.acct.pods_read.read(pod).wants_gpu:
                raise _BindFailed(f"pod {key} asks for no {self.names.domain} resource: "
                                  "this extender binds only GPU pods", "refused")
            with self.acct.lock:
                known = args.node in self.acct.slots
            if not known:
                raise _BindFailed(f"node {args.node} does not exist or publishes no vramshare GPU inventory",
                                  "refused")
            bound_to = spec.get("nodeName")
            if bound_to:
                if bound_to == args.node:
                    return BindOutcome(result="already_bound")
                raise _BindFailed(f"pod {key} is already bound to {bound_to}, not {args.node}", "conflict")
            return self._bind_gpu_pod(args, pod)
        except _BindFailed as exc:
            with self.acct.lock:
                self.acct.holds.release_expected(key)
            log.warning("bind failed", pod=key, node=args.node, error=str(exc))
            return BindOutcome(str(exc), exc.result)

    def _uid_of(self, args: wire.BindingArgs) -> str:
        """The UID of the pod named ``args`` (the cache's, else the API's): the in-flight key a caller
        cannot omit."""
        with self.acct.lock:
            pod = self.acct.pods.get(args.pod_key)
        uid = ((pod or {}).get("metadata") or {}).get("uid") or ""
        if not uid:
            uid = (self._read(args).get("metadata") or {}).get("uid") or ""
        if not uid:
            raise _BindFailed(f"pod {args.pod_key} has no UID in the cache or the API", "bad_request")
        return str(uid)

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
        read = self.acct.pods_read.read(pod)  # the reading filter and prioritize used (extender.parsed)
        if read.error is not None:
            raise _BindFailed(f"pod {key}: {read.error}", "bad_request")
        assert read.want is not None and read.host is not None and read.signature is not None
        want, asks, host, signature = read.want, list(read.asks), read.host, read.signature
        policy = verbs.policy_for(want.policy, self.policy)
        assume_ns = self.clock()
        with self.acct.lock:
            need = self.acct.hold_required(key, args.node, signature)
            if need.blocker is not None:
                raise _BindFailed(f"pod {key} not bound to {args.node}: {self.acct.hold_reason(need.blocker)}",
                                  "held")
            self.acct.release_unbound(key)  # a new bind supersedes any earlier assumption

            def policy_picks() -> list[list[tuple[str, int]]]:
                picks = placement.pick(self.acct.state, translate.demands_of(asks), args.node, policy.value, host)
                try:  # dynamic MIG: the placements the fragmentation term prefers, never overlapping
                    return mig_books.refine(self.acct.state, args.node, [a.demand.kind for a in asks], picks)
                except ValueError as exc:
                    raise cluster.NoFit(str(exc)) from None

            try:
                if need.plans:  # pods of its size are assumed here: only their GPUs keep steering unambiguous
                    choice = held_pick.follow(self.acct.state, args.node, pod, want, asks, self.names,
                                              need.plans, policy_picks)
                    if isinstance(choice, str):
                        holder = next(iter(need.holders.values()))
                        raise _BindFailed(f"pod {key} not bound to {args.node}: "
                                          f"{self.acct.hold_reason(holder)}; {choice}", "held")
                    text, allocations, plans = choice.text, choice.allocations, choice.plans
                else:
                    # no live hold: still take the GPUs of pending same-size pods whose hold ended, when
                    # they have room, so the device plugin's steering stays unambiguous
                    lingering = self.acct.lingering_plans(key, args.node, signature)
                    choice = (held_pick.follow(self.acct.state, args.node, pod, want, asks, self.names, lingering,
                                               policy_picks) if lingering else "")
                    if not isinstance(choice, str):
                        text, allocations, plans = choice.text, choice.allocations, choice.plans
                    else:
                        text = translate.encode_assignment(asks, policy_picks())
                        allocations = _allocations(pod, self.names, text)
                        plans = holds.plans_of(want, self.names, held_pick.containers_of(text))
                self.acct.reserve(key, args.node, allocations, assume_ns, signature, plans, host,
                                  uid=str((pod.get("metadata") or {}).get("uid") or ""))
            except (cluster.NoFit, cluster.OverCommit) as exc:
                raise _BindFailed(f"pod {key} does not fit node {args.node}: {exc}", "no_fit") from None
            except contract.AssignmentError as exc:  # a plan the node would refuse is never written
                raise _BindFailed(f"pod {key} not bound to {args.node}: {exc}", "no_fit") from None
        annotations = {
            self.names.assignment: text,
            self.names.assume_time: str(assume_ns),
            self.names.allocation_state: contract.STATE_ASSUMED,
        }
        try:
            self._patch(args, pod, annotations)
            self._bind(args)
        except _BindFailed as exc:
            if not exc.keep:
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
        """Create the Binding. A failed answer is not proof that nothing happened (a reply lost to a
        timeout, or an earlier attempt that bound it): the pod is read back before anything is undone,
        and if even that fails its GPUs stay reserved (expiry or the watch settles it), because
        freeing the memory of a pod that did bind is how a GPU ends up over-committed."""
        try:
            self.kube.bind_pod(args.pod_namespace, args.pod_name, args.pod_uid, args.node)
            return
        except apicalls.ApiException as exc:
            why = f"{exc.status} {exc.reason}"
        except Exception as exc:  # noqa: BLE001 - a timeout or a cut connection
            why = f"{type(exc).__name__}: {exc}"
        failed = f"cannot bind pod {args.pod_key} to {args.node}: {why}"
        try:
            fresh = self._read(args)
        except _BindFailed as exc:
            raise _BindFailed(f"{failed}; reading it back failed too ({exc}): its GPUs stay reserved "
                              "until the API says whether it is bound", "api_error", keep=True) from None
        bound_to = (fresh.get("spec") or {}).get("nodeName")
        if bound_to == args.node:
            log.info("binding answer lost, pod is bound", pod=args.pod_key, node=args.node, error=why)
            return
        if bound_to:
            raise _BindFailed(f"pod {args.pod_key} was bound to {bound_to} meanwhile", "conflict")
        raise _BindFailed(failed, "api_error")


def _allocations(pod: Obj, names: contract.Names, text: str) -> list[tuple[str, int]]:
    """What the pod will hold per GPU once the assignment ``text`` is on it: read back exactly as a
    restarted extender reads it (the kubelet's max rule over init containers), so books never drift."""
    meta = {**(pod.get("metadata") or {}), "annotations": {names.assignment: text}}
    asg = translate.decode_assignment({**pod, "metadata": meta}, names)
    assert asg is not None
    return asg.allocations(pod)
