"""Quota classes (issue 14): which class a pod is in, and what that class means for one tenant. Pure.

The order a pod's class is chosen in (first match wins):

1. the pod's ``<domain>/quota-class`` annotation, when it names a class that allows pod selection
   (``allowPodSelection: true``; ``default`` always does). A name that is unknown or not allowed is
   ignored (the resolution's ``note`` says why) and the rules below decide;
2. the classes of ``quota.classes`` in list order: a class matches when any of its ``match`` terms
   does; a term matches when every field it sets does (namespace in ``namespaces``, the labels
   satisfy ``selector`` as a Kubernetes LabelSelector, ``priorityClassName`` in ``priorityClassNames``);
3. otherwise the ``default`` class: the global ``quota.*`` keys, i.e. the behaviour without classes.

A class's omitted keys inherit the global ones, so ``default`` is a class with nothing set.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

from vramshare.config import DEFAULT_CLASS, ClassMatch, LabelExpression, OverLimitAction, QuotaClass


@dataclass(frozen=True)
class PodMeta:
    """What class selection reads from a pod: kept on each tenant by the tenant sources."""

    namespace: str = ""
    labels: tuple[tuple[str, str], ...] = ()
    priority_class: str = ""
    requested_class: str | None = None  # the <domain>/quota-class annotation
    model: str = ""  # the <domain>/model annotation as written (the warm tier's fallback for the resident model)

    @classmethod
    def of(cls, namespace: str, labels: Mapping[str, str] | None = None, priority_class: str | None = None,
           requested_class: str | None = None, model: str | None = None) -> "PodMeta":
        return cls(namespace, tuple(sorted((labels or {}).items())), priority_class or "", requested_class,
                   str(model or ""))


@dataclass(frozen=True)
class Resolution:
    qclass: QuotaClass
    via: str  # annotation | match | default
    note: str = ""  # why an annotation was ignored, when it was


def _expression(e: LabelExpression, labels: Mapping[str, str]) -> bool:
    """metav1.LabelSelector semantics (apimachinery labels.Requirement.Matches)."""
    if e.operator == "In":
        return e.key in labels and labels[e.key] in e.values
    if e.operator == "NotIn":
        return e.key not in labels or labels[e.key] not in e.values
    if e.operator == "Exists":
        return e.key in labels
    return e.key not in labels  # DoesNotExist


def term_matches(term: ClassMatch, pod: PodMeta) -> bool:
    labels = dict(pod.labels)
    if term.namespaces and pod.namespace not in term.namespaces:
        return False
    if term.priority_class_names and pod.priority_class not in term.priority_class_names:
        return False
    if any(labels.get(k) != v for k, v in term.match_labels):
        return False
    return all(_expression(e, labels) for e in term.match_expressions)


DEFAULT = QuotaClass(DEFAULT_CLASS, allow_pod_selection=True)


def class_named(classes: Sequence[QuotaClass], name: str) -> QuotaClass | None:
    """The class of that name; ``default`` (the global keys) always exists."""
    if name == DEFAULT_CLASS:
        return DEFAULT
    return next((c for c in classes if c.name == name), None)


def resolve(pod: PodMeta, classes: Sequence[QuotaClass]) -> Resolution:
    """The pod's class, in the order of the module docstring."""
    note = ""
    if pod.requested_class:
        wanted = class_named(classes, pod.requested_class)
        if wanted is None:
            note = f"annotation names unknown class {pod.requested_class!r}"
        elif not wanted.allow_pod_selection:
            note = f"class {pod.requested_class!r} does not allow pod selection"
        else:
            return Resolution(wanted, "annotation")
    for qc in classes:
        if any(term_matches(t, pod) for t in qc.match):
            return Resolution(qc, "match", note)
    return Resolution(DEFAULT, "default", note)


@dataclass(frozen=True)
class ClassTerms:
    """One class made concrete against the global keys: what the loop and the policy use."""

    name: str
    floor_fraction: float | None
    floor_mib: int | None
    ceiling_fraction: float | None
    ceiling_mib: int | None
    margin_mib: int
    idle_seconds: float
    lending_priority: int
    over_limit_action: OverLimitAction
    sleep_booked_fraction: float | None = None  # issue 23 item 5: overcommit of this class's sleeping pods
    wake_reserve: int = 1
    wake_ahead: bool = False  # issue 23: wake its sleepers ahead of their forecast request (warm.py)

    def floor_of(self, request_mib: int) -> int:
        """Rounded down, as the default class's floor (PolicyParams.floor_of)."""
        return self.floor_mib if self.floor_mib is not None else math.floor((self.floor_fraction or 0) * request_mib)

    def ceiling_of(self, request_mib: int) -> int:
        c = self.ceiling_mib if self.ceiling_mib is not None else math.floor((self.ceiling_fraction or 0) * request_mib)
        return max(self.floor_of(request_mib), c)


def terms(qc: QuotaClass, base: ClassTerms) -> ClassTerms:
    """``qc`` with every omitted key taken from ``base`` (the default class: the global keys)."""
    floor_given = qc.floor_fraction is not None or qc.floor_mib is not None
    ceiling_given = qc.ceiling_fraction is not None or qc.ceiling_mib is not None
    return ClassTerms(
        name=qc.name,
        floor_fraction=qc.floor_fraction if floor_given else base.floor_fraction,
        floor_mib=qc.floor_mib if floor_given else base.floor_mib,
        ceiling_fraction=qc.ceiling_fraction if ceiling_given else base.ceiling_fraction,
        ceiling_mib=qc.ceiling_mib if ceiling_given else base.ceiling_mib,
        margin_mib=base.margin_mib if qc.margin_mib is None else qc.margin_mib,
        idle_seconds=base.idle_seconds if qc.idle_seconds is None else qc.idle_seconds,
        lending_priority=qc.lending_priority,
        over_limit_action=qc.over_limit_action or base.over_limit_action,
        sleep_booked_fraction=qc.sleep_booked_fraction, wake_reserve=qc.wake_reserve,
        wake_ahead=qc.wake_ahead)
