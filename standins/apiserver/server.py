"""The HTTP face of the double: Kubernetes REST and watch over HTTP/1.1 keep-alive on a threaded server.

This module only translates requests into store calls and answers into JSON; the API semantics live
in ``store``, ``watch``, ``patches`` and ``selectors``. Every open connection is tracked so ``close()``
can end idle keep-alive connections and watches instead of waiting for clients to hang up.
"""
from __future__ import annotations

import base64
import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
import urllib.parse
from urllib.parse import parse_qs, urlsplit

import yaml

from vramshare import logs

from . import errors, proxy
from .errors import ApiError
from . import managedfields
from .patches import is_apply
from .access import AccessRules
from .resources import BINDINGS, PODS, SELFSUBJECTACCESSREVIEWS, Route, route
from .selectors import parse_selector
from .store import Store
from .traffic import FaultPlan, RequestLog, RequestRecord
from .watch import DISCONNECT, WatchHub, WatchRequest

log = logs.get("standins.apiserver")


class ApiHttpServer(ThreadingHTTPServer):
    """A ThreadingHTTPServer that knows its store and can cut every open connection on close."""

    daemon_threads = True
    request_queue_size = 512  # a storm of concurrent clients must not hit a tiny listen backlog

    def __init__(self, store: Store, hub: WatchHub, request_log: RequestLog, faults: FaultPlan,
                 graceful_pod_deletion: bool, host: str = "127.0.0.1", port: int = 0,
                 access: AccessRules | None = None) -> None:
        super().__init__((host, port), _Handler)
        self.store, self.hub, self.request_log, self.faults = store, hub, request_log, faults
        self.access = access if access is not None else AccessRules()
        self.graceful_pod_deletion = graceful_pod_deletion
        self.version_info: dict[str, str] = version_info("v1.33.2")
        self._connections: set[socket.socket] = set()
        self._connections_changed = threading.Condition()
        self._closing = False
        self._streaming = 0  # watch responses not yet ended by their final chunk (or cut)

    def track(self, conn: socket.socket) -> None:
        with self._connections_changed:
            self._connections.add(conn)
            closing = self._closing
        if closing:
            _cut(conn)

    def untrack(self, conn: socket.socket) -> None:
        with self._connections_changed:
            self._connections.discard(conn)
            self._connections_changed.notify_all()

    def watch_started(self) -> None:
        with self._connections_changed:
            self._streaming += 1

    def watch_ended(self) -> None:
        with self._connections_changed:
            self._streaming -= 1
            self._connections_changed.notify_all()

    def wait_watches_ended(self, wait_s: float) -> bool:
        """Wait until every watch the hub was told to end has written its final chunk: kube-apiserver's
        graceful termination ends watches cleanly before it closes connections
        (``--shutdown-watch-termination-grace-period``), so a client sees a clean end and re-watches,
        not a cut stream, whatever the thread scheduling."""
        with self._connections_changed:
            return self._connections_changed.wait_for(lambda: self._streaming == 0, timeout=wait_s)

    def cut_connections(self, wait_s: float = 0.0) -> bool:
        """Shut down every open connection so handler threads blocked on reads return; with ``wait_s``,
        wait that long for their handlers to finish (True when they all did)."""
        with self._connections_changed:
            self._closing = True
            open_now = list(self._connections)
        for conn in open_now:
            _cut(conn)
        with self._connections_changed:
            return self._connections_changed.wait_for(lambda: not self._connections, timeout=wait_s)

    def reopen(self) -> None:
        """Accept connections again after ``cut_connections`` (the listening socket never closed)."""
        with self._connections_changed:
            self._closing = False

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.debug("connection_error", client=str(client_address), exc_info=True)


def version_info(git_version: str) -> dict[str, str]:
    """``GET /version`` as the API server answers it (k8s.io/apimachinery/pkg/version.Info; the python
    client's VersionInfo requires every one of these fields)."""
    major, minor = git_version.lstrip("v").split(".")[:2]
    return {"major": major, "minor": minor, "gitVersion": git_version,
            "gitCommit": "0000000000000000000000000000000000000000", "gitTreeState": "clean",
            "buildDate": "2026-01-01T00:00:00Z", "goVersion": "go1.24.4", "compiler": "gc",
            "platform": "linux/amd64"}


def _cut(conn: socket.socket) -> None:
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already closed by the peer


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body go out as separate writes: no 40 ms delayed-ACK stalls
    server: ApiHttpServer
    _lost_answer: ApiError | None = None
    _answered = False  # the status line went out: a late failure can only hang up

    # -- connection lifecycle ----------------------------------------------------------------------
    def setup(self) -> None:
        super().setup()
        self.server.track(self.connection)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self.server.untrack(self.connection)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the stdlib's signature
        pass  # every request is logged once, structured, in _serve

    def send_response(self, code: int, message: str | None = None) -> None:
        # logged before the answer leaves, so a client that got its answer always finds its request counted
        self._answered = True
        url = urlsplit(self.path)
        self.server.request_log.add(RequestRecord(self.command, url.path, url.query, code))
        log.debug("request", verb=self.command, path=url.path, query=url.query, status=code)
        super().send_response(code, message)

    # -- verbs -------------------------------------------------------------------------------------
    def do_GET(self) -> None:
        self._serve("GET")

    def do_POST(self) -> None:
        self._serve("POST")

    def do_PUT(self) -> None:
        self._serve("PUT")

    def do_PATCH(self) -> None:
        self._serve("PATCH")

    def do_DELETE(self) -> None:
        self._serve("DELETE")

    def _serve(self, verb: str) -> None:
        url = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(url.query, keep_blank_values=True).items()}
        body_bytes = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self._answered = False
        try:
            fault = self.server.faults.take(verb, url.path)
            if fault is not None and not fault.after_commit:
                raise fault.error()
            self._lost_answer = fault.error() if fault is not None else None
            if url.path in ("/version", "/version/") and verb == "GET":
                return self._send_json(200, self.server.version_info)
            if proxy.PATH.match(urllib.parse.unquote(url.path)):
                return self._send_raw(*proxy.forward(self.server.store, verb, url.path, url.query, body_bytes,
                                                     dict(self.headers.items())))
            self._dispatch(verb, route(url.path), query, body_bytes)
        except ApiError as error:
            self._send_json(error.code, error.status_body())
        except (ConnectionError, OSError):
            self.close_connection = True  # the client went away mid-answer (a stopped watch, usually)
        except Exception as error:  # noqa: BLE001 - a double's bug must reach the client as a 500, not a hang-up
            log.error("request_failed", verb=verb, path=url.path, exc_info=True)
            if not self._answered:
                self._send_json(500, ApiError(500, "InternalError", f"apiserver double: {error!r}").status_body())
            self.close_connection = True

    def _dispatch(self, verb: str, where: Route, query: dict[str, str], body_bytes: bytes) -> None:
        store, rtype = self.server.store, where.rtype
        dry_run = query.get("dryRun") == "All"
        if rtype.namespaced and where.name is not None and where.namespace is None:
            raise ApiError(404, "NotFound", f"{rtype.plural} need a namespace in the path")
        if rtype is SELFSUBJECTACCESSREVIEWS:
            if verb != "POST" or where.name is not None:
                raise errors.method_not_allowed(verb, self.path)
            return self._send_json(201, self.server.access.review(_json(body_bytes)))
        if rtype is BINDINGS:
            if verb != "POST" or where.name is not None or where.namespace is None:
                raise errors.method_not_allowed(verb, self.path)
            return self._bind(where.namespace, None, _json(body_bytes))
        if verb == "GET" and where.name is None:
            if query.get("watch") in ("true", "1"):
                return self._watch(where, query)
            return self._list(where, query)
        if verb == "GET" and where.name is not None and where.subresource in (None, "status"):
            return self._send_json(200, store.get(rtype, where.namespace, where.name))
        if verb == "DELETE" and where.name is None:
            return self._delete_collection(where, query, dry_run)
        if verb == "POST" and where.name is None:
            if rtype.namespaced and where.namespace is None:
                raise errors.method_not_allowed(verb, self.path)
            created = store.create(rtype, where.namespace, _json(body_bytes), dry_run=dry_run,
                                   manager=self._manager(query))
            return self._send_json(201, created)
        if verb == "POST" and where.subresource == "binding" and rtype is PODS:
            assert where.namespace is not None
            return self._bind(where.namespace, where.name, _json(body_bytes))
        if verb == "POST" and where.subresource == "eviction" and rtype is PODS:
            return self._evict(where, _json(body_bytes), dry_run)
        if where.name is None or where.subresource in ("binding", "eviction"):
            raise errors.method_not_allowed(verb, self.path)
        if verb == "PUT":
            updated = store.update(rtype, where.namespace, where.name, _json(body_bytes), where.subresource,
                                   dry_run=dry_run, manager=self._manager(query))
            return self._send_json(200, updated)
        if verb == "PATCH":
            content_type = self.headers.get("Content-Type", "")
            if is_apply(content_type):
                applied, created = store.apply(rtype, where.namespace, where.name, _yaml(body_bytes),
                                               query.get("fieldManager"), where.subresource, dry_run=dry_run,
                                               force=query.get("force") in ("true", "1"))
                return self._send_json(201 if created else 200, applied)
            patched = store.patch(rtype, where.namespace, where.name, content_type, _json(body_bytes),
                                  where.subresource, dry_run=dry_run, manager=self._manager(query))
            return self._send_json(200, patched)
        if verb == "DELETE" and where.subresource is None:
            return self._delete(where, query, body_bytes, dry_run)
        raise errors.method_not_allowed(verb, self.path)

    def _manager(self, query: dict[str, str]) -> str:
        """handlers.managerOrUserAgent: who this write is recorded under in managedFields."""
        return managedfields.manager_of(query.get("fieldManager"), self.headers.get("User-Agent"))

    # -- collection reads --------------------------------------------------------------------------
    def _list(self, where: Route, query: dict[str, str]) -> None:
        selector = parse_selector(where.rtype.plural, query.get("fieldSelector"), query.get("labelSelector"))
        items, rv = self.server.store.list_objects(where.rtype, where.namespace, selector)
        meta: dict[str, Any] = {"resourceVersion": str(rv)}
        if query.get("continue"):
            after = _decode_continue(query["continue"])
            items = [o for o in items if _sort_key(o) > after]
        limit = _int(query, "limit") or 0
        if 0 < limit < len(items):
            meta["continue"] = _encode_continue(_sort_key(items[limit - 1]))
            meta["remainingItemCount"] = len(items) - limit
            items = items[:limit]
        self._send_json(200, {"kind": where.rtype.list_kind, "apiVersion": where.rtype.api_version,
                              "metadata": meta, "items": items})

    def _watch(self, where: Route, query: dict[str, str]) -> None:
        selector = parse_selector(where.rtype.plural, query.get("fieldSelector"), query.get("labelSelector"))
        rv_text = query.get("resourceVersion") or "0"
        if not rv_text.isdigit():
            raise errors.bad_request(f"invalid resourceVersion {rv_text!r}")
        timeout = _int(query, "timeoutSeconds")
        request = WatchRequest(where.rtype, where.namespace, selector, int(rv_text) or None,
                               None if timeout is None else float(timeout),
                               query.get("allowWatchBookmarks") in ("true", "1"))
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self.close_connection = True  # one watch per connection keeps stream teardown simple
        self.server.watch_started()
        try:
            for event in self.server.hub.events(request):
                if event is DISCONNECT:
                    _cut(self.connection)  # an abrupt disconnect: no terminating chunk
                    return
                line = json.dumps(event, separators=(",", ":")).encode() + b"\n"
                self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        finally:
            self.server.watch_ended()

    # -- writes ------------------------------------------------------------------------------------
    def _bind(self, namespace: str, pod: str | None, body: Any) -> None:
        """Both Binding endpoints; the answer is a Status, not the Binding (so clients must not preload)."""
        name = pod or ((body.get("metadata") or {}).get("name") if isinstance(body, dict) else None)
        if not name:
            raise errors.invalid("bindings", "", "metadata.name: Required value")
        if pod and isinstance(body, dict) and (body.get("metadata") or {}).get("name") not in (None, "", pod):
            raise errors.bad_request(f"the name of the binding does not match the pod {pod!r} on the URL")
        self.server.store.bind(namespace, name, body)
        self._send_json(201, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201})

    def _evict(self, where: Route, body: Any, dry_run: bool) -> None:
        """POST pods/{name}/eviction (policy/v1 Eviction). Upstream ``EvictionREST.Create``
        (pkg/registry/core/pod/storage/eviction.go) checks PodDisruptionBudgets, then deletes the pod
        with the eviction's deleteOptions and answers a 201 Status. This double has no PDBs."""
        assert where.name is not None
        meta = (body.get("metadata") or {}) if isinstance(body, dict) else {}
        if meta.get("name") not in (None, "", where.name):
            raise errors.bad_request("name in URL does not match name in Eviction object")
        options = (body.get("deleteOptions") or {}) if isinstance(body, dict) else {}
        pre = options.get("preconditions") or {}
        self.server.store.delete(PODS, where.namespace, where.name, grace_seconds=options.get("gracePeriodSeconds"),
                                 precondition_uid=pre.get("uid"), precondition_rv=pre.get("resourceVersion"),
                                 graceful=self.server.graceful_pod_deletion, dry_run=dry_run)
        self._send_json(201, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201})

    def _delete_collection(self, where: Route, query: dict[str, str], dry_run: bool) -> None:
        """DELETE on a collection (``DeleteCollection``): every object the selectors match goes; the
        answer is the list of what was deleted, as the generic registry's ``DeleteCollection`` returns."""
        if where.rtype is PODS and self.server.graceful_pod_deletion:
            raise errors.method_not_allowed("DELETE", self.path)  # not modelled: graceful pod deletion
        selector = parse_selector(where.rtype.plural, query.get("fieldSelector"), query.get("labelSelector"))
        items, _ = self.server.store.list_objects(where.rtype, where.namespace, selector)
        gone = []
        for obj in items:
            meta = obj["metadata"]
            try:
                gone.append(self.server.store.delete(where.rtype, meta.get("namespace"), meta["name"],
                                                     dry_run=dry_run))
            except ApiError as exc:
                if exc.code != 404:  # deleted meanwhile: fine
                    raise
        self._send_json(200, {"kind": where.rtype.list_kind, "apiVersion": where.rtype.api_version,
                              "metadata": {"resourceVersion": str(self.server.store.resource_version)},
                              "items": gone})

    def _delete(self, where: Route, query: dict[str, str], body_bytes: bytes, dry_run: bool) -> None:
        options = _json(body_bytes) if body_bytes.strip() else {}
        grace = _int(query, "gracePeriodSeconds")
        if grace is None and isinstance(options.get("gracePeriodSeconds"), int):
            grace = options["gracePeriodSeconds"]
        pre = options.get("preconditions") or {}
        assert where.name is not None
        gone = self.server.store.delete(where.rtype, where.namespace, where.name, grace_seconds=grace,
                                        precondition_uid=pre.get("uid"), precondition_rv=pre.get("resourceVersion"),
                                        graceful=self.server.graceful_pod_deletion, dry_run=dry_run)
        if where.rtype is PODS:
            return self._send_json(200, gone)  # pods answer with the object, like the real server
        self._send_json(200, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                              "details": {"name": where.name, "kind": where.rtype.plural,
                                          "uid": gone["metadata"]["uid"]}})

    def _send_raw(self, code: int, headers: dict[str, str], data: bytes) -> None:
        self.send_response(code)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _send_json(self, code: int, body: Any) -> None:
        if self._lost_answer is not None and code < 400:  # an after-commit fault: the work is done, the answer lost
            code, body, self._lost_answer = self._lost_answer.code, self._lost_answer.status_body(), None
        data = json.dumps(body, separators=(",", ":")).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def _json(data: bytes) -> Any:
    try:
        return json.loads(data or b"null")
    except ValueError as error:
        raise errors.bad_request(f"the request body is not JSON: {error}") from None


def _yaml(data: bytes) -> Any:
    """An apply body: YAML (JSON is YAML too), as the server decodes application/apply-patch+yaml."""
    try:
        return yaml.safe_load(data or b"null")
    except yaml.YAMLError as error:
        raise errors.bad_request(f"the request body is not YAML: {error}") from None


def _int(query: dict[str, str], name: str) -> int | None:
    text = query.get(name)
    if text in (None, ""):
        return None
    try:
        return int(text)  # type: ignore[arg-type]
    except ValueError:
        raise errors.bad_request(f"{name} must be an integer, not {text!r}") from None


def _sort_key(obj: dict[str, Any]) -> tuple[str, str]:
    meta = obj["metadata"]
    return (meta.get("namespace") or "", meta["name"])


def _encode_continue(after: tuple[str, str]) -> str:
    return base64.urlsafe_b64encode(json.dumps(list(after)).encode()).decode()


def _decode_continue(token: str) -> tuple[str, str]:
    try:
        ns, name = json.loads(base64.urlsafe_b64decode(token.encode()))
        return (str(ns), str(name))
    except (ValueError, TypeError):
        raise errors.bad_request("invalid continue token") from None
