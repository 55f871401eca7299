"""Field and label selectors, the subset our callers send.

The extender lists unbound pods (``spec.nodeName=``), the device plugin its node's live pods
(``spec.nodeName=X,status.phase!=Succeeded,status.phase!=Failed``). Anything the double cannot honour
is a 400, as on a real server, so a caller never silently gets an unfiltered list.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

from .errors import bad_request

Obj = dict[str, Any]

# field label -> how to read it from an object; per resource plural, as the real server allows per kind
_COMMON_FIELDS: dict[str, Callable[[Obj], str]] = {
    "metadata.name": lambda o: o.get("metadata", {}).get("name", ""),
    "metadata.namespace": lambda o: o.get("metadata", {}).get("namespace", ""),
}
_POD_FIELDS: dict[str, Callable[[Obj], str]] = {
    **_COMMON_FIELDS,
    "spec.nodeName": lambda o: (o.get("spec") or {}).get("nodeName") or "",
    "spec.schedulerName": lambda o: (o.get("spec") or {}).get("schedulerName") or "",
    "status.phase": lambda o: (o.get("status") or {}).get("phase") or "",
}
_NODE_FIELDS: dict[str, Callable[[Obj], str]] = {
    **_COMMON_FIELDS,
    "spec.unschedulable": lambda o: str(bool((o.get("spec") or {}).get("unschedulable"))).lower(),
}
# the real server's field selectors for ResourceSlices (pkg/registry/resource/resourceslice/strategy.go)
_SLICE_FIELDS: dict[str, Callable[[Obj], str]] = {
    **_COMMON_FIELDS,
    "spec.nodeName": lambda o: (o.get("spec") or {}).get("nodeName") or "",
    "spec.driver": lambda o: (o.get("spec") or {}).get("driver") or "",
    "spec.pool.name": lambda o: ((o.get("spec") or {}).get("pool") or {}).get("name") or "",
}
# core v1 Events (pkg/apis/core/v1/conversion.go, AddFieldLabelConversionFunc for Event)
_EVENT_FIELDS: dict[str, Callable[[Obj], str]] = {
    **_COMMON_FIELDS,
    **{f"involvedObject.{k}": (lambda o, k=k: str((o.get("involvedObject") or {}).get(k) or ""))
       for k in ("kind", "namespace", "name", "uid", "apiVersion", "resourceVersion", "fieldPath")},
    "reason": lambda o: o.get("reason") or "",
    "reportingComponent": lambda o: o.get("reportingComponent") or "",
    "source": lambda o: (o.get("source") or {}).get("component") or "",
    "type": lambda o: o.get("type") or "",
}
FIELDS_BY_PLURAL: dict[str, dict[str, Callable[[Obj], str]]] = {"pods": _POD_FIELDS, "nodes": _NODE_FIELDS,
                                                                "resourceslices": _SLICE_FIELDS,
                                                                "events": _EVENT_FIELDS}


@dataclass(frozen=True)
class Requirement:
    """One ``key=value`` / ``key!=value`` / ``key`` / ``!key`` term."""

    key: str
    op: str  # "=", "!=", "exists", "!exists"
    value: str = ""


@dataclass(frozen=True)
class Selector:
    """A parsed field selector and label selector; ``matches`` decides for one object."""

    fields: tuple[Requirement, ...] = ()
    labels: tuple[Requirement, ...] = ()
    readers: tuple[Callable[[Obj], str], ...] = ()

    def matches(self, obj: Obj) -> bool:
        for req, read in zip(self.fields, self.readers):
            if not _holds(req, read(obj)):
                return False
        labels = (obj.get("metadata") or {}).get("labels") or {}
        for req in self.labels:
            if req.op == "exists":
                if req.key not in labels:
                    return False
            elif req.op == "!exists":
                if req.key in labels:
                    return False
            elif not _holds(req, labels.get(req.key)):
                return False
        return True


def _holds(req: Requirement, actual: str | None) -> bool:
    if req.op == "=":
        return actual is not None and actual == req.value
    return actual != req.value  # "!=": a missing label also satisfies it, as in Kubernetes


_TERM = re.compile(r"^\s*(!?)([A-Za-z0-9_./-]+)\s*(?:(==|=|!=)\s*([A-Za-z0-9_.-]*))?\s*$")


def _parse(text: str, what: str) -> list[Requirement]:
    reqs: list[Requirement] = []
    for term in filter(None, (t.strip() for t in text.split(","))):
        m = _TERM.match(term)
        if not m:
            raise bad_request(f"unable to parse requirement: {what} {term!r} is not supported by this server")
        neg, key, op, value = m.groups()
        if op is None:
            reqs.append(Requirement(key, "!exists" if neg else "exists"))
        elif neg:
            raise bad_request(f"unable to parse requirement: {term!r}")
        else:
            reqs.append(Requirement(key, "!=" if op == "!=" else "=", value or ""))
    return reqs


def parse_selector(plural: str, field_selector: str | None, label_selector: str | None) -> Selector:
    """Parse both selectors for ``plural``; an unsupported field label or syntax is a 400."""
    fields = _parse(field_selector or "", "field selector")
    known = FIELDS_BY_PLURAL.get(plural, _COMMON_FIELDS)
    readers = []
    for req in fields:
        if req.op not in ("=", "!=") or req.key not in known:
            raise bad_request(f'"{req.key}" is not a known field selector: only "{", ".join(sorted(known))}"')
        readers.append(known[req.key])
    return Selector(tuple(fields), tuple(_parse(label_selector or "", "label selector")), tuple(readers))
