"""The per-node, per-signature hold: same-size pods are ``assumed`` together on a node only on the same GPUs.

Why (DESIGN.md section 3, "allocation"): the GPU follows the device IDs. The kubelet asks the device
plugin for a preferred allocation per container with only a resource name and a device count (an
*element* of the pod's size signature, :func:`extender.translate.signature_of`), and it admits pods in
its own order; the extender's plan can steer that choice only when every pod the request may come from
is planned on the same GPUs.

The rule. Pod P may be assumed on node N (filter passes N, bind goes ahead) while pods Q1..Qk are
assumed there (bound or about to be, not yet reported ``allocated`` by the device plugin) iff for every
element e that P shares with some Qi:

* every container of P asking e is planned on the same GPUs and MiB (its *plan for e*, :func:`plans_of`),
  and so is every container of each Qi asking e; and
* those plans are all equal: P gets exactly the GPUs the Qi already hold for e.

Then any GetPreferredAllocation for e on N, whichever pod the kubelet is admitting, steers to that one GPU
set, which the extender reserved once per pod: each container lands on the GPUs its own plan names, and
the books equal reality before the reconcile even reports it. Otherwise P waits: filter passes over N
(a ``FailedNodes`` reason naming the pod it waits for) and bind refuses it; it goes elsewhere or waits
briefly. Consequences:

* At bind, a pod whose element is held on the node *takes the held plan* when it still fits (the
  binder's :mod:`extender.held_pick`, also what filter checks), instead of the policy's own choice: a
  burst of same-size replicas fills one GPU per node at once instead of one replica per node.
* ``gpu-count`` > 1: the plan is the whole GPU set with the MiB on each, so ``2 x 11`` units on GPUs
  a+b and 22 units on GPU a (both ``(gpu-memory, 22)``) differ and wait for each other, as before.
* Whole GPUs and MIG instances cannot be shared: two pods never hold the same device, so their plans
  always differ and the hold works as it always did (one assumed pod per element per node).
* A container asking two resources has one plan for all of them: a whole GPU or MIG instance in it
  makes it differ from every other pod's.
* Init containers and sidecars are containers like the others: each element they ask needs the same
  plan. A pod whose own containers of one size are planned on different GPUs is ambiguous by itself
  (the device plugin cannot tell its containers apart either): no other pod of that size joins it.
* An *expected* hold (below) has no plan yet: it blocks same-size pods as a hold always did.

Narrow on purpose: other sizes keep binding to the node, and nothing is ever locked. A hold ends when
the pod is reconciled as ``allocated``, is deleted or finishes, or ``timeout_ns`` after it began (the
config key ``extender.holdTimeoutSeconds``; 0 turns holds off), whichever comes first: a device plugin
that never reconciles (an older one) delays different-plan same-size pods by at most that. A hold that
ended with its pod still pending leaves its plan written on the pod, which the device plugin still steers
by: the binder prefers it for the next pod of that size when it has room
(:meth:`extender.accounting.Accounting.lingering_plans`), never waits for it.

A node whose device plugin does not report (issue 18: the plugin is down, or cannot reach the API
server) would hold every same-size pod for the whole timeout: one replica per node per 30 s. So a
node is *silent* once one of its holds has waited :data:`SILENT_AFTER_NS` with no ``allocated``
report from that node since the hold began, or since this extender began listening if that is later
(a restarted extender's rebuilt holds began in its past; a working plugin reports within a second); while
it is silent, its holds last :data:`SILENT_HOLD_NS` from their start (the one that found it silent
ends at once), so a burst there binds a replica every couple of seconds instead of every timeout. The
next ``allocated`` report from the node (:meth:`Holds.reported`) ends the silence. Prioritize scores a
silent node the minimum when a candidate that reports exists (extender.verbs; filter still passes it),
so a pod goes elsewhere first. Steering on a
silent node is what it can be without reports: the plans still written on the pods, for the plugin's
next GetPreferredAllocation; the hold only stops waiting for a report that does not come.

An *expected* hold closes the gap before the bind: kube-scheduler binds asynchronously, so the next
pod's filter can arrive before the previous pod's bind. When the extender answers prioritize (or a
filter that leaves one node), the node it scored best is where the bind will almost surely go (its weight
outvotes the other score plugins): the pod holds that node for ``EXPECT_NS`` or until its bind
decides, so filter sends a same-size replica elsewhere at once instead of into a bind race it may lose
and kube-scheduler's backoff. Expected holds only route filter: a bind decides under the accounting lock
from the real holds alone (two pods that both passed filter before either was expected must not refuse
each other; the first bound takes a plan and the second follows it). Pure: no I/O, the caller passes the
time.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

from extender.translate import Signature, container_signature
from vramshare import contract, logs, podspec

__all__ = ["Holds", "Hold", "Required", "Element", "Plan", "Plans", "plans_of", "EXPECT_NS"]

log = logs.get("vramshare.extender.holds")

#: How long an expected hold lasts without its bind (kube-scheduler binds within milliseconds).
EXPECT_NS = 2_000_000_000
#: A hold that waited this long with no ``allocated`` report from its node marks the node silent
#: (the device plugin reconciles every 2 s and on each Allocate: a report normally follows in ~1 s).
SILENT_AFTER_NS = 5_000_000_000
#: How long a hold lasts on a silent node.
SILENT_HOLD_NS = 2_000_000_000

Element = tuple[str, int]  # (resource name, devices): one element of a size signature
Plan = tuple[tuple[str, int], ...]  # one container's (GPU or device UUID, MiB), sorted
Plans = Mapping[Element, "Plan | None"]  # per element; None: the pod's own containers of that size differ


def plans_of(want: podspec.PodDemand, names: contract.Names,
             containers: Mapping[str, Sequence[tuple[str, int]]]) -> dict[Element, Plan | None]:
    """Per element of the pod's signature, the plan its containers of that size share (from the
    assignment ``containers``: name -> [(uuid, MiB)]); ``None`` where they differ or one has none."""
    out: dict[Element, Plan | None] = {}
    for c in (*want.init_containers, *want.containers):
        plan: Plan = tuple(sorted((str(u), int(m)) for u, m in containers.get(c.container, ())))
        for e in container_signature(c, names).values():
            if not plan or (e in out and out[e] != plan):
                out[e] = None
            else:
                out.setdefault(e, plan)
    return out


@dataclass(frozen=True)
class Hold:
    pod: str
    node: str
    signature: Signature
    since_ns: int
    until_ns: int
    expected: bool = False  # taken at prioritize, before any bind
    plans: Plans | None = field(default=None, compare=False)  # None: not known yet (expected holds)


@dataclass(frozen=True)
class Required:
    """What a pod must do to be assumed on a node: wait for ``blocker``, or take ``plans`` (element ->
    the held plan; empty: nothing of its size is held there). ``holders`` names a hold per element."""

    blocker: Hold | None = None
    plans: dict[Element, Plan] = field(default_factory=dict)
    holders: dict[Element, Hold] = field(default_factory=dict)


#: Every this many new holds, the expired ones are dropped (also done by the accounting's expiry loop):
#: filter walks the held nodes, so stale entries would cost every cycle.
PURGE_EVERY = 64


class Holds:
    def __init__(self, timeout_ns: int, started_ns: int | None = None) -> None:
        self.timeout_ns = timeout_ns
        #: When this process began listening for reports (None: always). A restarted extender rebuilds
        #: holds from assume times in its past: a node is judged silent only over time a report could
        #: have reached it, or every node with an older hold would be silent at once and lose its plans.
        self.started_ns = started_ns
        self._by_pod: dict[str, Hold] = {}
        self._by_node: dict[str, dict[str, Hold]] = {}
        #: element -> {node: how many holds there share it}: the only nodes where a pod of that size
        #: may have to wait or follow (a hold sharing no element with the pod never changes its answer)
        self._by_element: dict[Element, dict[str, int]] = {}
        self._puts = 0
        self._reported: dict[str, int] = {}  # node -> when its device plugin last reported an allocation
        self.silent: dict[str, int] = {}  # node -> since when its device plugin is known not to report
        # pod -> start of its hold that a silent node cut short: the same hold (a later event, a
        # relist) is not taken again, so a plan that gave way never comes back beside a newer one
        self._cut: dict[str, int] = {}

    def reported(self, node: str, now_ns: int) -> None:
        """The device plugin of ``node`` reported a pod ``allocated``: its node is not silent."""
        self._reported[node] = now_ns
        if self.silent.pop(node, None) is not None:
            # holds that gave way while the node was silent stay ended (others may hold other plans now)
            for h in list(self._by_node.get(node, {}).values()):
                if not h.expected and now_ns >= h.since_ns + SILENT_HOLD_NS:
                    self._cut[h.pod] = h.since_ns
                    self.release(h.pod)
            log.info("device plugin reports again; holds there last the full timeout", node=node)

    def until(self, h: Hold, now_ns: int, record: bool = True) -> int:
        """When ``h`` ends: its timeout, or :data:`SILENT_HOLD_NS` after it began on a silent node
        (found silent here, from ``h`` itself, when it waited :data:`SILENT_AFTER_NS` unreported).

        ``record=False`` (filter and prioritize, which change no state): the same answer, but what it
        finds (the node silent, the hold cut) is left for the next recording call (the accounting's
        expiry loop, a bind) to write down."""
        if h.expected:
            return h.until_ns
        node = h.node
        heard = h.since_ns if self.started_ns is None else max(h.since_ns, self.started_ns)
        found = (node not in self.silent and now_ns - heard >= SILENT_AFTER_NS
                 and self._reported.get(node, -1) < heard)
        if found and record:
            self.silent[node] = now_ns
            log.warning("device plugin does not report: holds on the node are shortened", node=node,
                        pod=h.pod, waited_s=round((now_ns - h.since_ns) / 1e9, 1),
                        hold_s=SILENT_HOLD_NS / 1e9)
        if found or node in self.silent:
            cut = min(h.until_ns, h.since_ns + SILENT_HOLD_NS)
            if now_ns >= cut and record:
                self._cut[h.pod] = h.since_ns
                while len(self._cut) > 10_000:
                    self._cut.pop(next(iter(self._cut)))
            return cut
        return h.until_ns

    def __len__(self) -> int:
        return len(self._by_pod)

    def hold(self, pod: str, node: str, signature: Signature, since_ns: int, plans: Plans | None = None) -> None:
        """``pod`` is assumed on ``node`` from ``since_ns`` with ``plans`` (:func:`plans_of`; None:
        unknown, blocks every same-size pod); a repeat keeps the earlier start."""
        if self.timeout_ns <= 0 or not signature or not node or self._cut.get(pod) == since_ns:
            return
        old = self._by_pod.get(pod)
        if old is not None and old.node == node and old.signature == signature and not old.expected:
            if old.plans != plans:
                self._put(Hold(pod, node, signature, old.since_ns, old.until_ns, plans=plans))
            return
        self.release(pod)
        self._put(Hold(pod, node, signature, since_ns, since_ns + self.timeout_ns, plans=plans))

    def expect(self, pod: str, node: str, signature: Signature, now_ns: int) -> None:
        """The pod's bind will most likely name ``node``: hold it there briefly (never over a real hold)."""
        if self.timeout_ns <= 0 or not signature or not node:
            return
        old = self._by_pod.get(pod)
        if old is not None and not old.expected:
            return
        self.release(pod)
        self._put(Hold(pod, node, signature, now_ns, now_ns + min(EXPECT_NS, self.timeout_ns), expected=True))

    def _put(self, h: Hold) -> None:
        old = self._by_pod.get(h.pod)
        if old is not None:  # the same hold with its plans now known: re-index, do not count it twice
            self._unindex(old)
        self._by_pod[h.pod] = h
        self._by_node.setdefault(h.node, {})[h.pod] = h
        for e in h.signature:
            on = self._by_element.setdefault(e, {})
            on[h.node] = on.get(h.node, 0) + 1
        self._puts += 1
        if self._puts % PURGE_EVERY == 0:  # expected holds of pods never bound must not pile up
            self.expire(h.since_ns)

    def release_expected(self, pod: str) -> None:
        h = self._by_pod.get(pod)
        if h is not None and h.expected:
            self.release(pod)

    def release(self, pod: str) -> None:
        h = self._by_pod.pop(pod, None)
        if h is not None:
            on_node = self._by_node.get(h.node, {})
            on_node.pop(pod, None)
            if not on_node:
                self._by_node.pop(h.node, None)
            self._unindex(h)

    def _unindex(self, h: Hold) -> None:
        for e in h.signature:
            on = self._by_element.get(e)
            if on is None:
                continue
            left = on.get(h.node, 0) - 1
            if left > 0:
                on[h.node] = left
            else:
                on.pop(h.node, None)
                if not on:
                    del self._by_element[e]

    def required(self, node: str, pod: str, signature: Signature, now_ns: int, binding: bool = False,
                 record: bool = True) -> Required:
        """What ``pod`` (of ``signature``) needs to be assumed on ``node`` now (the rule above).

        ``binding``: asked by the bind itself, which decides under the accounting lock from the real
        holds alone; expected holds only route filter (a pod bound first takes a plan, and the expected
        one then follows it at its own bind, or waits if it no longer fits)."""
        on_node = self._by_node.get(node)
        if not on_node:
            return Required()
        need: dict[Element, Plan] = {}
        holders: dict[Element, Hold] = {}
        for h in on_node.values():
            shared = h.signature & signature
            if h.pod == pod or not shared or (binding and h.expected) or now_ns >= self.until(h, now_ns, record):
                continue
            if h.expected or h.plans is None:
                return Required(blocker=h)
            for e in sorted(shared):
                plan = h.plans.get(e)
                if plan is None or need.get(e, plan) != plan:
                    return Required(blocker=h)
                need[e] = plan
                holders.setdefault(e, h)
        return Required(plans=need, holders=holders)

    def reason(self, h: Hold, now_ns: int, record: bool = True) -> str:
        left = max(0.0, (self.until(h, now_ns, record) - now_ns) / 1e9)
        sizes = ", ".join(f"{n} x {r}" for r, n in sorted(h.signature))
        if h.expected:
            return f"held for pod {h.pod} of the same size ({sizes}), being bound here (at most {left:.0f}s more)"
        return (f"held for pod {h.pod} of the same size ({sizes}) until the device plugin reports it "
                f"allocated (at most {left:.0f}s more)")

    def expire(self, now_ns: int) -> list[str]:
        """Drop holds past the timeout; returns their pods."""
        gone = [p for p, h in self._by_pod.items() if now_ns >= self.until(h, now_ns)]
        for p in gone:
            self.release(p)
        return gone

    def held_pods(self) -> list[str]:
        return list(self._by_pod)

    def held_nodes(self, signature: Signature | None = None) -> list[str]:
        """The nodes holding any pod (a few among thousands); with ``signature``, only those where a
        hold shares an element with it: the only nodes where :meth:`required` may ask anything of a
        pod of that signature (filter looks only at these)."""
        if signature is None:
            return list(self._by_node)
        if len(signature) == 1:
            return list(self._by_element.get(next(iter(signature)), ()))
        return list(dict.fromkeys(n for e in signature for n in self._by_element.get(e, ())))
