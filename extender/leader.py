"""Leader election for extender replicas over a ``coordination.k8s.io/v1`` Lease, as client-go does it.

``try_acquire_or_renew`` follows k8s.io/client-go/tools/leaderelection/leaderelection.go
(``tryAcquireOrRenew``) with its ``LeaseLock``: create the Lease if there is none; a Lease held by
another is respected while ``observedTime + leaseDurationSeconds`` is ahead of the local clock (the
local time the record was last seen to change, so clocks of different nodes never compare); otherwise
take it over (``leaseTransitions + 1``) or renew it, with an optimistic-concurrency update (a 409 means
another replica won). A leader that cannot renew within ``renew_deadline_s`` stops leading.

One replica decides (filter, prioritize, bind run against one set of books); the other keeps its cache
warm and takes over when the Lease expires. The leader publishes the URL its verbs answer on in the
Lease's ``vramshare.io/leader-url`` annotation, so a standby can hand a verb to it (extender.app).
"""
from __future__ import annotations

import datetime
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import orjson

from vramshare import kube, logs
from vramshare.retry import Backoff

log = logs.get("vramshare.extender.leader")
LEADER_URL = "vramshare.io/leader-url"
Obj = dict[str, Any]


def _micro(t: float) -> str:
    """metav1.MicroTime: RFC 3339 with microseconds."""
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass(frozen=True)
class Settings:
    """client-go's defaults for kube-scheduler: 15 s lease, 10 s renew deadline, 2 s retry period."""

    lease_duration_s: int = 15
    renew_deadline_s: float = 10.0
    retry_period_s: float = 2.0


class LeaseElector:
    """One replica's side of the election; :meth:`run` on a thread, :meth:`is_leader` from anywhere."""

    def __init__(self, api: Any, namespace: str, name: str, identity: str, url: str = "",
                 settings: Settings = Settings(), clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time,
                 on_change: Callable[[bool], None] | None = None) -> None:
        from kubernetes import client
        self._api = client.CoordinationV1Api(api)
        self.namespace, self.name, self.identity, self.url = namespace, name, identity, url
        self.settings, self._clock, self._wall, self._on_change = settings, clock, wall, on_change
        self._observed: Obj | None = None  # the Lease spec last seen
        self._observed_raw: bytes = b""
        self._observed_at = 0.0
        self._leader = False
        self._renewed_at = 0.0
        self._lock = threading.Lock()
        self.transitions_seen = 0

    # -- state ------------------------------------------------------------------------------------
    def is_leader(self) -> bool:
        with self._lock:
            return self._leader

    def leader_url(self) -> str | None:
        """Where the current holder answers (its Lease annotation), ``None`` when unknown."""
        with self._lock:
            return (self._observed or {}).get("_url") or None

    def _set_leader(self, value: bool) -> None:
        with self._lock:
            changed, self._leader = self._leader != value, value
        if changed:
            log.info("leadership " + ("acquired" if value else "lost"), identity=self.identity, lease=self.name)
            if self._on_change is not None:
                self._on_change(value)

    # -- one round (tryAcquireOrRenew) -------------------------------------------------------------
    def try_acquire_or_renew(self) -> bool:
        from kubernetes.client.exceptions import ApiException
        now_wall, now = self._wall(), self._clock()
        record = {"holderIdentity": self.identity, "leaseDurationSeconds": self.settings.lease_duration_s,
                  "acquireTime": _micro(now_wall), "renewTime": _micro(now_wall)}
        try:
            resp = self._api.read_namespaced_lease(self.name, self.namespace, _preload_content=False,
                                                   _request_timeout=self.settings.renew_deadline_s)
            raw = kube.body(resp)
            current = orjson.loads(raw)
        except ApiException as exc:
            if exc.status != 404:
                return False
            body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                    "metadata": {"name": self.name, "namespace": self.namespace,
                                 "annotations": {LEADER_URL: self.url}}, "spec": record}
            try:
                kube.body(self._api.create_namespaced_lease(self.namespace, body, _preload_content=False,
                                                            _request_timeout=self.settings.renew_deadline_s))
            except (ApiException, OSError):
                return False
            self._observe({**record, "_url": self.url}, b"", now)
            return True
        except OSError:
            return False
        spec = current.get("spec") or {}
        url = ((current.get("metadata") or {}).get("annotations") or {}).get(LEADER_URL, "")
        if raw != self._observed_raw:
            self._observe({**spec, "_url": url}, raw, now)
        holder = spec.get("holderIdentity") or ""
        duration = int(spec.get("leaseDurationSeconds") or self.settings.lease_duration_s)
        valid = self._observed_at + duration > now
        if holder and valid and holder != self.identity:
            return False
        if holder == self.identity:
            record["acquireTime"] = spec.get("acquireTime") or record["acquireTime"]
            record["leaseTransitions"] = int(spec.get("leaseTransitions") or 0)
        else:
            record["leaseTransitions"] = int(spec.get("leaseTransitions") or 0) + 1
        current["spec"] = record
        current.setdefault("metadata", {}).setdefault("annotations", {})[LEADER_URL] = self.url
        try:  # PUT with the resourceVersion read: a 409 means another replica moved first
            kube.body(self._api.replace_namespaced_lease(self.name, self.namespace, current, _preload_content=False,
                                                         _request_timeout=self.settings.renew_deadline_s))
        except (ApiException, OSError):
            return False
        self._observe({**record, "_url": self.url}, b"", now)
        return True

    def _observe(self, spec: Obj, raw: bytes, now: float) -> None:
        with self._lock:
            if (self._observed or {}).get("holderIdentity") != spec.get("holderIdentity"):
                self.transitions_seen += 1
            self._observed, self._observed_raw, self._observed_at = spec, raw, now

    # -- the loop -----------------------------------------------------------------------------------
    def step(self) -> None:
        """One round: acquire or renew, and lose leadership past the renew deadline."""
        if self.try_acquire_or_renew():
            self._renewed_at = self._clock()
            self._set_leader(self._observed is not None and self._observed.get("holderIdentity") == self.identity)
        elif self.is_leader() and self._clock() - self._renewed_at > self.settings.renew_deadline_s:
            self._set_leader(False)
        elif not self.is_leader():
            self._set_leader(False)

    def run(self, stop: threading.Event) -> None:
        jitter = Backoff(self.settings.retry_period_s, self.settings.retry_period_s, jitter=1.2)  # JitterUntil
        while not stop.is_set():
            try:
                self.step()
            except Exception as exc:  # noqa: BLE001 - one failed round is a missed renewal, not a crash
                log.warning("lease round failed", identity=self.identity, error=f"{type(exc).__name__}: {exc}")
            stop.wait(self.settings.retry_period_s if self.is_leader() else jitter.next())
        if self.is_leader():
            self.release()

    def release(self) -> None:
        """On a clean stop: give the Lease up (holder emptied) so a standby takes over at once
        (client-go's ReleaseOnCancel)."""
        from kubernetes.client.exceptions import ApiException
        try:
            resp = self._api.read_namespaced_lease(self.name, self.namespace, _preload_content=False)
            lease = kube.decode(resp)
            if (lease.get("spec") or {}).get("holderIdentity") == self.identity:
                lease["spec"] = {**lease["spec"], "holderIdentity": "", "leaseDurationSeconds": 1,
                                 "renewTime": _micro(self._wall())}
                kube.body(self._api.replace_namespaced_lease(self.name, self.namespace, lease, _preload_content=False))
        except (ApiException, OSError) as exc:
            log.warning("lease not released", identity=self.identity, error=str(exc))
        self._set_leader(False)
