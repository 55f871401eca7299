"""The extender as one function: ``(method, path, body) -> Response``, transport-free.

Routes: POST /filter, /prioritize, /bind, /preempt; GET /healthz, /readyz, /metrics, /inspect[/<node>], /config.
Every kube-scheduler verb answers HTTP 200, also on failure, with the reason in ``Error``: any other
status is an opaque error to the scheduler, and a body it can read tells the operator what went wrong.
Bad input (not JSON, a missing key) is answered the same way and changes nothing. The HTTP module only
moves bytes; this module times each request and counts it.

No verb is answered from a cache that has not synced: until the first node and pod lists are in, the
books are empty and a filter would pass full GPUs and a bind would over-commit them. Filter and bind
answer an ``Error`` that says so (kube-scheduler retries the pod), prioritize an empty list, preempt no
candidates.
"""
from __future__ import annotations

import http.client

import time
import urllib.parse
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import orjson

from extender import accounting, binder, cache, dra_scoring, inspection, metrics, preemption, tls, verbs, wire
from vramshare import config as vconfig, logs
from vramshare.config import Policy

__all__ = ["Extender", "Response"]

log = logs.get("vramshare.extender.app")
JSON = "application/json"
TEXT = "text/plain; charset=utf-8"
NOT_SYNCED = ("vramshare extender: cache not synced with the API server yet (nodes and pods not listed); "
              "retry shortly")


@dataclass(frozen=True)
class Response:
    status: int
    body: bytes
    content_type: str = JSON


class Extender:
    """Wires the pure verbs to the live accounting, the binder, the cache's readiness and the metrics."""

    def __init__(self, acct: accounting.Accounting, bind: binder.Binder, watcher: cache.Cache | None,
                 stats: metrics.ExtenderMetrics, policy: Policy) -> None:
        self.acct, self.binder, self.cache, self.stats, self.policy = acct, bind, watcher, stats, policy
        self.dra: dra_scoring.DraCluster | None = None  # set when DRA pods are scored (Kubernetes 1.36+)
        # With two replicas (extender.leader): the standby hands each verb to the leader, so one set of
        # books decides every placement; ``peer_tls`` gives the client context it calls the leader with.
        self.leader: Any = None
        self.peer_tls: tls.Reloader | None = None
        self._priorities = wire.HostFragments()  # each node's encoded HostPriority entries, per row
        self.name_lists = wire.NameLists()  # the NodeNames lists lately sent and answered, decoded
        self._post: dict[str, Callable[[bytes], bytes]] = {
            "/filter": self._filter, "/prioritize": self._prioritize, "/bind": self._bind,
            "/preempt": self._preempt,
        }

    def prepare(self) -> None:
        """Once the books are in (before :func:`extender.main.settle_heap` freezes them): encode every
        node's HostPriority entries now, in row order, rather than all in the first prioritize (~4 ms
        at 5,000 nodes); later nodes are encoded as they first come."""
        with self.acct.lock:
            state = self.acct.state
            names = state.nodes()
            rows, epoch = state.rows_of(names, remember=False), state.names_epoch
        self._priorities.prepare(names, rows, epoch)

    def handle(self, method: str, path: str, body: bytes) -> Response:
        path = path.split("?", 1)[0].rstrip("/") or "/"
        if method == "POST" and path in self._post:
            if self.leader is not None and not self.leader.is_leader():
                return self._forward(path, body)
            if self.cache is not None and not self.cache.ready.is_set():
                self.stats.observe(path[1:], "not_ready", 0.0)
                log.warning("verb refused: cache not synced", verb=path[1:])
                return Response(200, self._error(path[1:], NOT_SYNCED))
            return self._verb(path[1:], self._post[path], body)
        if method == "GET":
            if path == "/healthz":
                return Response(200, b"ok", TEXT)
            if path == "/readyz":
                ready = self.cache is None or self.cache.ready.is_set()
                return Response(200, b"ok", TEXT) if ready else Response(503, b"cache not synced yet", TEXT)
            if path == "/metrics":
                return Response(200, self.stats.render(), metrics.CONTENT_TYPE_LATEST)
            if path == "/config":  # the keys it read at start: `vramshare check` compares them with the ConfigMap
                return Response(200, orjson.dumps(vconfig.file_values(self.acct.config, vconfig.EXTENDER_READS)))
            if path == "/inspect" or path.startswith("/inspect/"):
                node = urllib.parse.unquote(path[len("/inspect/"):]) if path != "/inspect" else None
                doc = inspection.render(self.acct, node, dra=self.dra)
                if doc is None:
                    return Response(404, orjson.dumps({"error": f"node {node} has no vramshare GPUs"}))
                return Response(200, orjson.dumps(doc))
        return Response(404, orjson.dumps({"error": f"no route {method} {path}"}))

    def _forward(self, path: str, body: bytes) -> Response:
        """A standby's answer: the leader's, or an Error kube-scheduler retries (no leader right now)."""
        url = self.leader.leader_url()
        if not url or url == getattr(self.leader, "url", None):
            self.stats.observe(path[1:], "no_leader", 0.0)
            return Response(200, self._error(path[1:], "no extender leader yet (election in progress); retry"))
        parts = urllib.parse.urlsplit(url)
        context = self.peer_tls.current(time.monotonic()) if self.peer_tls is not None else None
        conn: Any = (http.client.HTTPSConnection(parts.hostname, parts.port, timeout=5, context=context)
                     if parts.scheme == "https" else http.client.HTTPConnection(parts.hostname, parts.port, timeout=5))
        try:
            conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            data = resp.read()
            self.stats.observe(path[1:], "forwarded", 0.0)
            return Response(resp.status, data)
        except (OSError, http.client.HTTPException) as exc:
            self.stats.observe(path[1:], "no_leader", 0.0)
            log.warning("leader unreachable", verb=path[1:], leader=url, error=str(exc))
            return Response(200, self._error(path[1:], f"extender leader {url} unreachable ({exc}); retry"))
        finally:
            conn.close()

    def _verb(self, verb: str, fn: Callable[[bytes], bytes], body: bytes) -> Response:
        self.acct.last_verb = time.monotonic()  # the warmer waits for a lull (Accounting.warm_loop)
        start = time.perf_counter()
        outcome = "ok"
        try:
            out = fn(body)
        except wire.WireError as exc:
            outcome, out = "bad_request", self._error(verb, str(exc))
            log.warning("bad request", verb=verb, error=str(exc))
        except Exception as exc:  # noqa: BLE001 - the scheduler gets a reason, never a 500
            outcome, out = "error", self._error(verb, f"{type(exc).__name__}: {exc}")
            log.error("verb failed", verb=verb, exc_info=True)
        self.stats.observe(verb, outcome, time.perf_counter() - start)
        return Response(200, out)

    @staticmethod
    def _error(verb: str, message: str) -> bytes:
        if verb == "bind":
            return wire.encode_binding_result(message)
        if verb == "prioritize":  # HostPriorityList has no error field; kube-scheduler ignores its errors
            return b"[]"
        if verb == "preempt":  # no error field either: no candidate node, so nothing is evicted
            return wire.encode_preemption_result({}, {})
        return wire.encode_filter_result(wire.FilterResult(error=message), None)

    # -- verbs -------------------------------------------------------------------------------
    def _filter(self, body: bytes) -> bytes:
        args = wire.decode_extender_args(body, self.name_lists)
        with self.acct.lock:
            view = self.acct.view(self.policy)
            result = verbs.filter_pod(view, args)
            # kube-scheduler skips prioritize with one feasible node and binds there
            self.acct.commit(verbs.expectation(view, args, result.passed[0] if len(result.passed) == 1 else None))
        return wire.encode_filter_result(result, args, self.name_lists)

    def _prioritize(self, body: bytes) -> bytes:
        args = wire.decode_extender_args(body, self.name_lists)
        dra = dra_scoring.scores_for(self.dra, args.pod, args.names, self.policy.value, self.acct.models,
                                     self.acct.config.warm_tier.residency_max_steps)  # issue 23: models
        if dra is not None:  # a pod whose ResourceClaims use our DeviceClasses
            return wire.encode_host_priorities(dra)
        with self.acct.lock:
            view = self.acct.view(self.policy)
            rows, scores = verbs.prioritize_rows(view, args)
            best = int(np.argmax(scores)) if len(scores) else 0  # the first best-scored, as max(key=score)
            top = int(scores[best]) if len(scores) else 0
            self.acct.commit(verbs.expectation(view, args, args.names[best] if top > 0 else None))
            epoch = self.acct.state.names_epoch
        return self._priorities.encode(args.names, rows, scores, epoch)

    def _preempt(self, body: bytes) -> bytes:
        args = wire.decode_preemption_args(body)
        return wire.encode_preemption_result(preemption.preempt_pod(self.acct, args), args.pdb_violations)

    def _bind(self, body: bytes) -> bytes:
        args = wire.decode_binding_args(body)
        outcome = self.binder.bind(args)
        self.stats.binds.labels(outcome.result).inc()
        return wire.encode_binding_result(outcome.error)
