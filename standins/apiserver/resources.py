"""Which resources the double serves, and how a request path names one of them.

One table instead of per-resource handlers: the store treats every resource alike and only the few
real-server quirks (pods' default phase, Binding, status subresources) are special-cased elsewhere.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import ApiError


@dataclass(frozen=True)
class ResourceType:
    """A served resource: where it lives in the URL space and what its objects are called."""

    prefix: str  # "/api/v1" or "/apis/<group>/<version>"
    plural: str
    kind: str
    namespaced: bool
    subresources: tuple[str, ...] = ()

    @property
    def api_version(self) -> str:
        return "v1" if self.prefix == "/api/v1" else self.prefix[len("/apis/"):]

    @property
    def list_kind(self) -> str:
        return f"{self.kind}List"


NODES = ResourceType("/api/v1", "nodes", "Node", namespaced=False, subresources=("status",))
PODS = ResourceType("/api/v1", "pods", "Pod", namespaced=True, subresources=("status", "binding", "eviction"))
EVENTS = ResourceType("/api/v1", "events", "Event", namespaced=True)
EVENTS_V1 = ResourceType("/apis/events.k8s.io/v1", "events", "Event", namespaced=True)
CONFIGMAPS = ResourceType("/api/v1", "configmaps", "ConfigMap", namespaced=True)
BINDINGS = ResourceType("/api/v1", "bindings", "Binding", namespaced=True)  # POST-only twin of pods/binding
# Dynamic Resource Allocation, resource.k8s.io/v1 (GA in 1.34)
RESOURCESLICES = ResourceType("/apis/resource.k8s.io/v1", "resourceslices", "ResourceSlice", namespaced=False)
RESOURCECLAIMS = ResourceType("/apis/resource.k8s.io/v1", "resourceclaims", "ResourceClaim", namespaced=True,
                              subresources=("status",))
RESOURCECLAIMTEMPLATES = ResourceType("/apis/resource.k8s.io/v1", "resourceclaimtemplates", "ResourceClaimTemplate",
                                      namespaced=True)
DEVICECLASSES = ResourceType("/apis/resource.k8s.io/v1", "deviceclasses", "DeviceClass", namespaced=False)
# What an install consists of (``vramshare check`` reads them; the extender's replicas share a Lease)
NAMESPACES = ResourceType("/api/v1", "namespaces", "Namespace", namespaced=False, subresources=("status",))
SECRETS = ResourceType("/api/v1", "secrets", "Secret", namespaced=True)
SERVICES = ResourceType("/api/v1", "services", "Service", namespaced=True, subresources=("status",))
ENDPOINTS = ResourceType("/api/v1", "endpoints", "Endpoints", namespaced=True)
DEPLOYMENTS = ResourceType("/apis/apps/v1", "deployments", "Deployment", namespaced=True, subresources=("status",))
DAEMONSETS = ResourceType("/apis/apps/v1", "daemonsets", "DaemonSet", namespaced=True, subresources=("status",))
VALIDATINGADMISSIONPOLICIES = ResourceType("/apis/admissionregistration.k8s.io/v1", "validatingadmissionpolicies",
                                           "ValidatingAdmissionPolicy", namespaced=False, subresources=("status",))
VALIDATINGADMISSIONPOLICYBINDINGS = ResourceType("/apis/admissionregistration.k8s.io/v1",
                                                 "validatingadmissionpolicybindings",
                                                 "ValidatingAdmissionPolicyBinding", namespaced=False)
LEASES = ResourceType("/apis/coordination.k8s.io/v1", "leases", "Lease", namespaced=True)
# POST-only: the answer is computed (access.py), never stored
SELFSUBJECTACCESSREVIEWS = ResourceType("/apis/authorization.k8s.io/v1", "selfsubjectaccessreviews",
                                        "SelfSubjectAccessReview", namespaced=False)
RESOURCE_TYPES: tuple[ResourceType, ...] = (NODES, PODS, EVENTS, EVENTS_V1, CONFIGMAPS, BINDINGS, RESOURCESLICES,
                                            RESOURCECLAIMS, RESOURCECLAIMTEMPLATES, DEVICECLASSES, NAMESPACES,
                                            SECRETS, SERVICES, ENDPOINTS, DEPLOYMENTS, DAEMONSETS,
                                            VALIDATINGADMISSIONPOLICIES, VALIDATINGADMISSIONPOLICYBINDINGS, LEASES,
                                            SELFSUBJECTACCESSREVIEWS)
BY_KIND = {(t.api_version, t.kind): t for t in RESOURCE_TYPES if t.kind != "Binding"}


@dataclass(frozen=True)
class Route:
    """What one request path addresses: a collection (name None) or an object, maybe a subresource."""

    rtype: ResourceType
    namespace: str | None  # None: all namespaces (or a cluster-scoped resource)
    name: str | None = None
    subresource: str | None = None


_SEGMENT = r"[A-Za-z0-9][A-Za-z0-9._-]*"
_PATH = re.compile(rf"^(?P<prefix>/api/v1|/apis/[a-z0-9.-]+/v[0-9a-z]+)"
                   rf"(?:/namespaces/(?P<ns>{_SEGMENT}))?/(?P<plural>[a-z]+)"
                   rf"(?:/(?P<name>{_SEGMENT})(?:/(?P<sub>[a-z]+))?)?/?$")


def route(path: str) -> Route:
    """Resolve ``path`` to a Route; an unknown resource is a 404 NotFound like on a real server."""
    m = _PATH.match(path)
    if m:
        for rtype in RESOURCE_TYPES:
            if rtype.prefix == m["prefix"] and rtype.plural == m["plural"]:
                return _checked(rtype, m)
    raise ApiError(404, "NotFound", f"the server could not find the requested resource ({path})")


def _checked(rtype: ResourceType, m: re.Match[str]) -> Route:
    ns, name, sub = m["ns"], m["name"], m["sub"]
    if ns is not None and not rtype.namespaced:
        raise ApiError(404, "NotFound", f"{rtype.plural} is not namespaced")
    if sub is not None and sub not in rtype.subresources:
        raise ApiError(404, "NotFound", f"{rtype.plural} has no subresource {sub!r}")
    return Route(rtype, ns if rtype.namespaced else None, name, sub)
