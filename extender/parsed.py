"""A pod read once: what it asks of vramshare, cached by UID and resourceVersion.

kube-scheduler sends the same pod object (its informer's copy, one resourceVersion) to filter, then to
prioritize, and the extender's own watch saw that very object before either: every one of them used to
read it again (``wants_gpu``, ``pod_demand``, ``effective_requests`` twice, the signature), 4-6 times
per filter. Here it is read once per (UID, resourceVersion) and every verb and the watch share the
result. The API server gives each write of an object a new resourceVersion, so a pod with the same UID
and resourceVersion is the same pod; a new resourceVersion replaces the entry. A pod without both (a
hand-made object, a test's) is read afresh every time, never cached. Bounded: the least recently used
entries go first. Pure apart from the cache itself (a memo: what it returns never depends on it).
"""
from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Mapping

from extender import cluster, translate
from vramshare import contract, podspec

__all__ = ["ParsedPod", "PodReader", "parse_pod", "MAX_PODS"]

Obj = Mapping[str, Any]
#: Pods remembered at once: pending pods being scheduled plus the live ones the watch reported.
MAX_PODS = 20_000


@dataclass(frozen=True)
class ParsedPod:
    """Everything the verbs and the books read from a pod; a field that could not be read says why.

    ``error`` is what filter answers (unresolvable) and why prioritize scores 0: the first failure of
    demand, asks and host requests, in the order the verbs always read them.
    """

    key: str  # namespace/name
    uid: str
    resource_version: str
    wants_gpu: bool  # kube-scheduler's IsInterested for our names (init containers included)
    want: podspec.PodDemand | None = None  # None: ``want_error``
    want_error: str | None = None
    asks: tuple[translate.ContainerAsk, ...] = ()
    demands: tuple[cluster.Demand, ...] = ()
    signature: translate.Signature | None = None  # None when the demand could not be read
    host: cluster.HostDemand | None = None  # None: ``host_error``
    host_error: str | None = None

    @property
    def error(self) -> str | None:
        return self.want_error or self.host_error


def parse_pod(pod: Obj, names: contract.Names, unit_mib: int) -> ParsedPod:
    """Read ``pod`` once (no cache): the one place the verbs' pod fields are computed."""
    meta = pod.get("metadata") or {}
    key = f"{meta.get('namespace') or 'default'}/{meta.get('name', '')}"
    uid, rv = str(meta.get("uid") or ""), str(meta.get("resourceVersion") or "")
    wants = podspec.wants_gpu(pod, names)
    want = want_error = signature = None
    asks: tuple[translate.ContainerAsk, ...] = ()
    try:
        want = podspec.pod_demand(pod, names)
        asks = tuple(translate.asks_of(want, unit_mib))
        signature = translate.signature_of(want, names)
    except (podspec.PodSpecError, translate.TranslateError) as exc:
        want, want_error, asks = None, str(exc), ()
    host: cluster.HostDemand | None = None
    host_error = None
    try:
        host = translate.pod_host(pod)
    except translate.TranslateError as exc:
        host_error = str(exc)
    return ParsedPod(key, uid, rv, wants, want, want_error, asks, tuple(a.demand for a in asks), signature,
                     host, host_error)


def _inputs(pod: Obj, state_keys: frozenset[str]) -> tuple[Any, ...]:
    """What :func:`parse_pod` may read of a pod, by reference (compared by value when a new
    resourceVersion comes): namespace, name and UID, the annotations but vramshare's own assignment
    state, and the spec but ``nodeName``. Everything else (status, labels, managedFields, the
    resourceVersion itself) is never read."""
    meta = pod.get("metadata") or {}
    ann = meta.get("annotations") or {}
    spec = pod.get("spec") or {}
    return (meta.get("namespace"), meta.get("name"), meta.get("uid"),
            {k: v for k, v in ann.items() if k not in state_keys} if isinstance(ann, Mapping) else ann,
            {k: v for k, v in spec.items() if k != "nodeName"} if isinstance(spec, Mapping) else spec)


class PodReader:
    """``read(pod)``: the :class:`ParsedPod`, from the cache when UID and resourceVersion match."""

    def __init__(self, names: contract.Names, unit_mib: int, max_pods: int = MAX_PODS) -> None:
        self.names, self.unit_mib, self.max_pods = names, unit_mib, max_pods
        self._by_uid: OrderedDict[str, ParsedPod] = OrderedDict()
        self._lock = threading.Lock()  # the HTTP loop and the watch thread both read pods
        #: uid -> what :func:`parse_pod` read of the cached version (:func:`_inputs`)
        self._source: dict[str, tuple[Any, ...]] = {}
        #: annotations vramshare writes on a pod it binds, which no reading of a pod depends on
        self._state_keys = frozenset((names.assignment, names.assume_time, names.allocation_state))
        self.hits = self.misses = self.rereads = 0

    def read(self, pod: Obj) -> ParsedPod:
        meta = pod.get("metadata") or {}
        uid, rv = meta.get("uid"), meta.get("resourceVersion")
        if not uid or not rv:
            return parse_pod(pod, self.names, self.unit_mib)
        uid, rv = str(uid), str(rv)
        with self._lock:
            hit = self._by_uid.get(uid)
            if hit is not None and hit.resource_version == rv:
                self._by_uid.move_to_end(uid)
                self.hits += 1
                return hit
            source = self._source.get(uid)
        read = _inputs(pod, self._state_keys)
        if hit is not None and source == read:
            # A new resourceVersion that changed nothing a pod is read from: the bind's own writes
            # (nodeName, the assignment and its state), a status update. Same reading, new version.
            parsed = dataclasses.replace(hit, resource_version=rv)
            self.rereads += 1
        else:
            parsed = parse_pod(pod, self.names, self.unit_mib)
            self.misses += 1
        with self._lock:
            self._by_uid[uid] = parsed
            self._source[uid] = read
            self._by_uid.move_to_end(uid)
            while len(self._by_uid) > self.max_pods:
                old, _ = self._by_uid.popitem(last=False)
                self._source.pop(old, None)
        return parsed

    def forget(self, pod: Obj) -> None:
        """The pod is gone (deleted, finished): its entry is not needed again."""
        uid = (pod.get("metadata") or {}).get("uid")
        if uid:
            with self._lock:
                self._by_uid.pop(str(uid), None)
                self._source.pop(str(uid), None)

    def __len__(self) -> int:
        return len(self._by_uid)
