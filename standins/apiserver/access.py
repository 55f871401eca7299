"""SelfSubjectAccessReview, as the API server answers it, over the double's rules.

Upstream ``pkg/registry/authorization/selfsubjectaccessreview/rest.go`` ``REST.Create``: validate the
spec (``ValidateSelfSubjectAccessReviewSpec``: exactly one of resourceAttributes and
nonResourceAttributes, else 422 Invalid), ask the authorizer for the requesting user, and answer the
review itself (201) with ``status.allowed`` (decision Allow), ``status.denied`` (decision Deny, which
RBAC never gives: it has no opinion on what no rule grants) and ``status.reason``. The double has no
users and no RBAC: like an API server with ``--authorization-mode=AlwaysAllow`` it allows everything,
except the rights a test takes away with :meth:`AccessRules.deny` (answered as RBAC answers a right no
rule grants: not allowed, not denied, no reason).
"""
from __future__ import annotations

import copy
import threading
from typing import Any

from .errors import ApiError, invalid

Obj = dict[str, Any]
Right = tuple[str, str, str, str]  # (group, resource, subresource, verb)


class AccessRules:
    """Which rights the double's one identity lacks; thread-safe."""

    def __init__(self) -> None:
        self._denied: set[Right] = set()
        self._lock = threading.Lock()

    def deny(self, verb: str, resource: str, subresource: str = "", group: str = "") -> None:
        with self._lock:
            self._denied.add((group, resource, subresource, verb))

    def allow_all(self) -> None:
        with self._lock:
            self._denied.clear()

    def allows(self, right: Right) -> bool:
        with self._lock:
            return right not in self._denied

    def review(self, body: Any) -> Obj:
        """The answer to POST selfsubjectaccessreviews with ``body``."""
        if not isinstance(body, dict) or body.get("kind") not in (None, "SelfSubjectAccessReview"):
            raise ApiError(400, "BadRequest", "the body is not a SelfSubjectAccessReview")
        spec = body.get("spec") or {}
        res, non = spec.get("resourceAttributes"), spec.get("nonResourceAttributes")
        if (res is None) == (non is None):
            raise invalid("selfsubjectaccessreviews", "", "spec.resourceAttributes: Invalid value: \"null\": "
                          "exactly one of nonResourceAttributes or resourceAttributes must be specified")
        out = copy.deepcopy(body)
        out.setdefault("apiVersion", "authorization.k8s.io/v1")
        out.setdefault("kind", "SelfSubjectAccessReview")
        out.setdefault("metadata", {})
        if res is not None:
            allowed = self.allows((res.get("group", ""), res.get("resource", ""), res.get("subresource", ""),
                                   res.get("verb", "")))
        else:
            allowed = True
        out["status"] = {"allowed": allowed}
        if allowed:
            out["status"]["reason"] = "apiserver double: AlwaysAllow"
        return out
