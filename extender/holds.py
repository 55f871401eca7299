"""The per-node, per-signature hold: at most one ``assumed`` pod of a size signature per node.

Why (DESIGN.md section 3, "allocation"): the GPU follows the device IDs. The kubelet asks the device
plugin for a preferred allocation per container with only a resource name and a device count, and it
admits pods in its own order; the extender's assignment can steer that choice only when the size
(:func:`extender.translate.signature_of`) names one pod. So while a pod is assumed on a node (bound or
about to be, not yet reported ``allocated`` by the device plugin), filter passes over that node for any
other pod sharing an element of its signature, and bind refuses it: the later pod goes elsewhere or waits
briefly. Narrow on purpose: other sizes keep binding to the node, and nothing is ever locked.

A hold ends when the pod is reconciled as ``allocated``, is deleted or finishes, or ``timeout_ns``
after it began (the config key ``extender.holdTimeoutSeconds``; 0 turns holds off), whichever comes
first: a device plugin that never reconciles (an older one) delays same-size pods by at most that.

An *expected* hold closes the gap before the bind: kube-scheduler binds asynchronously, so the next
pod's filter can arrive before the previous pod's bind. When the extender answers prioritize (or a
filter that leaves one node), the node it scored best is where the bind will almost surely go (its weight
outvotes the other score plugins): the pod holds that node for ``EXPECT_NS`` or until its bind
decides, so a same-size replica goes elsewhere at once instead of losing the bind race and waiting out
kube-scheduler's backoff. Pure: no I/O, the caller passes the time.
"""
from __future__ import annotations

from dataclasses import dataclass

from extender.translate import Signature

__all__ = ["Holds", "Hold", "EXPECT_NS"]

#: How long an expected hold lasts without its bind (kube-scheduler binds within milliseconds).
EXPECT_NS = 2_000_000_000


@dataclass(frozen=True)
class Hold:
    pod: str
    node: str
    signature: Signature
    since_ns: int
    until_ns: int
    expected: bool = False  # taken at prioritize, before any bind


class Holds:
    def __init__(self, timeout_ns: int) -> None:
        self.timeout_ns = timeout_ns
        self._by_pod: dict[str, Hold] = {}
        self._by_node: dict[str, dict[str, Hold]] = {}

    def __len__(self) -> int:
        return len(self._by_pod)

    def hold(self, pod: str, node: str, signature: Signature, since_ns: int) -> None:
        """``pod`` is assumed on ``node`` from ``since_ns``; a repeat keeps the earlier start."""
        if self.timeout_ns <= 0 or not signature or not node:
            return
        old = self._by_pod.get(pod)
        if old is not None and old.node == node and old.signature == signature and not old.expected:
            return
        self.release(pod)
        h = Hold(pod, node, signature, since_ns, since_ns + self.timeout_ns)
        self._by_pod[pod] = h
        self._by_node.setdefault(node, {})[pod] = h

    def expect(self, pod: str, node: str, signature: Signature, now_ns: int) -> None:
        """The pod's bind will most likely name ``node``: hold it there briefly (never over a real hold)."""
        if self.timeout_ns <= 0 or not signature or not node:
            return
        old = self._by_pod.get(pod)
        if old is not None and not old.expected:
            return
        self.release(pod)
        h = Hold(pod, node, signature, now_ns, now_ns + min(EXPECT_NS, self.timeout_ns), expected=True)
        self._by_pod[pod] = h
        self._by_node.setdefault(node, {})[pod] = h

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

    def blocking(self, node: str, pod: str, signature: Signature, now_ns: int) -> Hold | None:
        """The live hold on ``node`` that ``pod`` (of ``signature``) must wait for, if any."""
        on_node = self._by_node.get(node)
        if not on_node:
            return None
        for h in on_node.values():
            if h.pod != pod and now_ns < h.until_ns and h.signature & signature:
                return h
        return None

    def reason(self, h: Hold, now_ns: int) -> str:
        left = max(0.0, (h.until_ns - now_ns) / 1e9)
        sizes = ", ".join(f"{n} x {r}" for r, n in sorted(h.signature))
        if h.expected:
            return f"held for pod {h.pod} of the same size ({sizes}), being bound here (at most {left:.0f}s more)"
        return (f"held for pod {h.pod} of the same size ({sizes}) until the device plugin reports it "
                f"allocated (at most {left:.0f}s more)")

    def expire(self, now_ns: int) -> list[str]:
        """Drop holds past the timeout; returns their pods."""
        gone = [p for p, h in self._by_pod.items() if now_ns >= h.until_ns]
        for p in gone:
            self.release(p)
        return gone

    def held_pods(self) -> list[str]:
        return list(self._by_pod)
