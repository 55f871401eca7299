"""Whether this plugin may do what its config asks of the quota loop: evicting needs ``pods/eviction
create``, which only the opt-in component deploy/components/over-limit-evict grants (issue 17: the
right reaches every pod in the cluster, so it exists only where ``overLimitAction: evict`` is set).

The answer comes from the API server itself, a SelfSubjectAccessReview (authorization.k8s.io/v1; every
authenticated identity may create one through the built-in ``system:basic-user`` role, so it needs no
RBAC of ours), asked once at start and again when a reload turns eviction on. A config asking for evict
without the right is refused with the reason, like an enforcement mode the node cannot honour: a
plugin that would try to evict and fail with 403 at the worst moment, every grace period, helps nobody.
"""
from __future__ import annotations

from typing import Any

from kubernetes import client
from kubernetes.client.rest import ApiException

from vramshare import logs
from vramshare.config import Config, ConfigError, OverLimitAction

log = logs.get("vramshare.quota.rights")
COMPONENT = "deploy/components/over-limit-evict"
TIMEOUT_S = 10


class RightRefused(ConfigError):
    """The config asks for something this plugin's identity may not do; ``str()`` says what and the fix.
    A :class:`ConfigError`, so a live reload asking for it is refused and the last good config stays."""


def evicting(cfg: Config) -> list[str]:
    """Where ``cfg`` sets ``overLimitAction: evict`` (config paths), empty when nowhere."""
    where = ["enforcement.overLimitAction"] if cfg.enforcement.over_limit_action is OverLimitAction.EVICT else []
    return where + [f"quota.classes[{c.name}].overLimitAction" for c in cfg.quota.classes
                    if c.over_limit_action is OverLimitAction.EVICT]


def may_evict(api: Any) -> tuple[bool, str]:
    """(allowed, the API server's reason) for ``create pods/eviction`` in every namespace."""
    review = client.V1SelfSubjectAccessReview(spec=client.V1SelfSubjectAccessReviewSpec(
        resource_attributes=client.V1ResourceAttributes(group="", resource="pods", subresource="eviction",
                                                        verb="create", namespace="")))
    got = client.AuthorizationV1Api(api).create_self_subject_access_review(review, _request_timeout=TIMEOUT_S)
    status = got.status
    return bool(status and status.allowed), (status.reason or status.evaluation_error or "") if status else ""


def check(cfg: Config, api: Any, running: Config | None = None) -> None:
    """Raise :class:`RightRefused` when ``cfg`` asks for eviction and the identity may not evict. Asks only
    when eviction is wanted (and, on a reload, only when ``running`` did not already want it)."""
    where = evicting(cfg)
    if api is None or not where or (running is not None and evicting(running)):
        return
    try:
        allowed, reason = may_evict(api)
    except (ApiException, OSError, ValueError) as exc:
        raise RightRefused(f"{where[0]}: evict refused: could not ask the API server whether this plugin may "
                           f"evict pods (SelfSubjectAccessReview: {exc})") from exc
    if not allowed:
        raise RightRefused(f"{where[0]}: evict refused: this plugin's service account may not create "
                           f"pods/eviction ({reason or 'no RBAC rule allows it'}); install the component "
                           f"{COMPONENT} to grant it, or set overLimitAction: event")
    log.info("overLimitAction evict: the eviction right is granted", configured=",".join(where))
