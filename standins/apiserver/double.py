"""``ApiServerDouble``: start/stop the HTTP server and reach its state from Python.

Tests and ``vramshare demo`` talk to the double through the real ``kubernetes`` client; the Python
helpers here are for set-up and for playing the parts no one else plays (the kubelet setting a pod
phase, etcd compaction, a network cut), never a back door around behaviour under test.
"""
from __future__ import annotations

import copy
import threading
from types import TracebackType
from typing import Callable

from vramshare import logs

from .access import AccessRules
from .resources import BY_KIND, EVENTS, NODES, PODS, ResourceType
from .server import ApiHttpServer, version_info
from .store import Obj, Store
from .traffic import Fault, FaultPlan, RequestLog, RequestRecord
from .watch import BOOKMARK_FREQUENCY_S, MIN_REQUEST_TIMEOUT_S, WatchHub

log = logs.get("standins.apiserver")


class ApiServerDouble:
    """A local stand-in for the Kubernetes API server on 127.0.0.1 and an ephemeral port.

    ``stop()`` keeps the objects; a later ``start()`` serves them again on the same port; ``restart()``
    does both without ever refusing a connection.
    """

    def __init__(self, *, history_limit: int = 10_000, graceful_pod_deletion: bool = False,
                 host: str = "127.0.0.1", port: int = 0, kubernetes_version: str = "v1.33.2",
                 min_request_timeout_s: float = MIN_REQUEST_TIMEOUT_S,
                 bookmark_frequency_s: float = BOOKMARK_FREQUENCY_S, partitionable_devices: bool = True) -> None:
        self.kubernetes_version = kubernetes_version  # what GET /version answers
        self._store = Store(history_limit)
        self._store.partitionable_devices = partitionable_devices  # DRAPartitionableDevices gate
        # a watch without timeoutSeconds ends after min_request_timeout_s * (1 + rand), as the real one
        self._hub = WatchHub(self._store, min_request_timeout_s=min_request_timeout_s,
                             bookmark_frequency_s=bookmark_frequency_s)
        self._log = RequestLog()
        self._faults = FaultPlan()
        self.access = AccessRules()  # SelfSubjectAccessReview answers: AlwaysAllow unless a test denies a right
        self._graceful = graceful_pod_deletion
        self._address = (host, port)
        self._server: ApiHttpServer | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> "ApiServerDouble":
        if self._server is not None:
            return self
        self._hub.resume()
        self._server = ApiHttpServer(self._store, self._hub, self._log, self._faults, self._graceful,
                                     *self._address, access=self.access)
        self._server.version_info = version_info(self.kubernetes_version)
        self._address = (self._address[0], self._server.server_address[1])  # a later start keeps the URL
        self._serve()
        log.info("apiserver_double_started", url=self.url)
        return self

    def _serve(self) -> None:
        assert self._server is not None
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="apiserver-double", daemon=True)
        self._thread.start()

    def _pause(self, server: ApiHttpServer) -> None:
        """Stop accepting, end every watch (cleanly: its final chunk is written first) and cut every
        connection; the listening socket stays open. Accepting stops first, so a client that re-watches
        as soon as its watch ends waits in the backlog for the restarted server instead of reaching a
        connection about to be cut."""
        server.shutdown()
        self._hub.stop()
        server.wait_watches_ended(wait_s=5.0)
        server.cut_connections(wait_s=5.0)
        if self._thread is not None:
            self._thread.join()

    def stop(self) -> None:
        """End every watch and connection, then wait for the handler threads: nothing is left running."""
        server, self._server = self._server, None
        if server is None:
            return
        self._pause(server)
        server.server_close()  # joins the handler threads
        log.info("apiserver_double_stopped")

    def restart(self) -> None:
        """What clients see of an API server restart: watches end and connections break, while the objects
        and their resourceVersions stay. The listening socket stays open, so a client that reconnects during
        the restart waits in the backlog instead of being refused (deterministic tests)."""
        server = self._server
        if server is None:
            self.start()
            return
        self._pause(server)
        server.reopen()
        self._hub.resume()
        self._serve()
        log.info("apiserver_double_restarted", url=self.url)

    def __enter__(self) -> "ApiServerDouble":
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    @property
    def url(self) -> str:
        """``http://127.0.0.1:<port>``, for ``vramshare.kube.api_client_for``."""
        if self._server is None:
            raise RuntimeError("the API server double is not started")
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    # -- objects -----------------------------------------------------------------------------------
    def create_node(self, node: Obj) -> Obj:
        return copy.deepcopy(self._store.create(NODES, None, node, keep_status=True))

    def create(self, obj: Obj) -> Obj:
        """Any object of a served kind as given, status included (an installed cluster's Deployments,
        Services, Endpoints, Secrets, ...)."""
        rtype = BY_KIND[(obj["apiVersion"], obj["kind"])]
        namespace = (obj.get("metadata") or {}).get("namespace") if rtype.namespaced else None
        return copy.deepcopy(self._store.create(rtype, namespace, obj, keep_status=True))

    def create_pod(self, pod: Obj, manager: str | None = None) -> Obj:
        """Create a pod; unlike a POST, a given ``status`` is kept (set-up may start pods Running).
        With ``manager`` the fields are recorded as that field manager's (e.g. the extender's plan)."""
        namespace = (pod.get("metadata") or {}).get("namespace") or "default"
        return copy.deepcopy(self._store.create(PODS, namespace, pod, keep_status=True, manager=manager))

    def get_node(self, name: str) -> Obj | None:
        return _copy_or_none(self._store.find(NODES, None, name))

    def get_pod(self, namespace: str, name: str) -> Obj | None:
        return _copy_or_none(self._store.find(PODS, namespace, name))

    def nodes(self) -> list[Obj]:
        return copy.deepcopy(self._store.list_objects(NODES, None)[0])

    def pods(self, namespace: str | None = None) -> list[Obj]:
        return copy.deepcopy(self._store.list_objects(PODS, namespace)[0])

    def objects(self, rtype: ResourceType, namespace: str | None = None) -> list[Obj]:
        """Any served resource (e.g. ``RESOURCESLICES``, ``RESOURCECLAIMS``), read Python-side."""
        return copy.deepcopy(self._store.list_objects(rtype, namespace)[0])

    def events(self, namespace: str | None = None) -> list[Obj]:
        """Core v1 Events clients posted (e.g. the extender's FailedScheduling reasons)."""
        return copy.deepcopy(self._store.list_objects(EVENTS, namespace)[0])

    def delete_pod(self, namespace: str, name: str) -> Obj:
        """Remove a pod now, with whatever status it has: ``kubectl delete --force --grace-period=0``, or a
        pod no kubelet runs. What a kubelet does at the end of a graceful deletion is
        :meth:`finish_pod_deletion`."""
        return copy.deepcopy(self._store.delete(PODS, namespace, name))

    def finish_pod_deletion(self, namespace: str, name: str) -> Obj:
        """A graceful deletion to its end: the DELETE marks a bound pod (``deletionTimestamp``, the same as
        the HTTP verb), then its kubelet's status manager reports every container terminated
        (``status_manager.go TerminatePod``: a container that never ran as ``ContainerStatusUnknown``,
        exit code 137) and removes the object, which it may only do once they are (``canBeDeleted``).
        The watch sees MODIFIED (marked), MODIFIED (terminated), then DELETED; an unbound pod, which no
        kubelet runs, is removed by the DELETE itself, as the API server does."""
        marked = self._store.delete(PODS, namespace, name, graceful=True)
        if self._store.find(PODS, namespace, name) is None:
            return copy.deepcopy(marked)
        def terminated(pod: Obj) -> None:
            spec, status = pod.get("spec") or {}, pod.setdefault("status", {})
            for field, kind in (("initContainerStatuses", "initContainers"), ("containerStatuses", "containers")):
                had = {c.get("name"): c for c in status.get(field) or []}
                status[field] = [{"name": c["name"], "image": c.get("image", ""), "imageID": "", "restartCount": 0,
                                  **had.get(c["name"], {}), "ready": False, "started": False,
                                  "state": _terminated((had.get(c["name"]) or {}).get("state"))}
                                 for c in spec.get(kind) or []]
        self._store.mutate(PODS, namespace, name, terminated)
        return copy.deepcopy(self._store.delete(PODS, namespace, name))

    def delete_node(self, name: str) -> Obj:
        return copy.deepcopy(self._store.delete(NODES, None, name))

    def delete(self, rtype: ResourceType, namespace: str | None, name: str) -> Obj:
        """Remove any object now (e.g. while the server is stopped: what a client misses in an outage)."""
        return copy.deepcopy(self._store.delete(rtype, namespace, name))

    def set_pod_phase(self, namespace: str, name: str, phase: str) -> Obj:
        """Play the kubelet: move a pod to Running, Succeeded, Failed..."""
        def set_phase(pod: Obj) -> None:
            pod.setdefault("status", {})["phase"] = phase
        return copy.deepcopy(self._store.mutate(PODS, namespace, name, set_phase))

    def bind_pod(self, namespace: str, name: str, node: str) -> Obj:
        """Play a scheduler without an extender: the same Binding semantics as the HTTP endpoint."""
        self._store.bind(namespace, name, {"target": {"kind": "Node", "name": node}})
        return copy.deepcopy(self._store.get(PODS, namespace, name))

    def update(self, rtype: ResourceType, namespace: str | None, name: str, change: Callable[[Obj], None],
               manager: str | None = None) -> Obj:
        """Any Python-side edit: ``change`` edits a copy which is then committed (one MODIFIED event).
        With ``manager`` it is recorded in managedFields as that field manager's Update (playing a
        writer, e.g. a user's ``kubectl annotate``); without, managedFields stay as they were."""
        return copy.deepcopy(self._store.mutate(rtype, namespace, name, change, manager))

    @property
    def resource_version(self) -> int:
        return self._store.resource_version

    def deleted_after(self, rtype: ResourceType, rv: int) -> tuple[list[Obj], int]:
        """The objects of ``rtype`` deleted after ``rv``, each as its DELETED watch event carries it (the
        object as it was when it went), read Python-side; and the resourceVersion they are current at.
        Raises the 410 Expired a watch from ``rv`` would get once the history no longer reaches back."""
        with self._store.lock:
            changes, now = self._store.changes_after(rv), self._store.resource_version
        return [copy.deepcopy(c.obj) for c in changes if c.type == "DELETED" and c.rtype == rtype], now

    # -- watches -----------------------------------------------------------------------------------
    def compact(self) -> None:
        """Forget the change history: a watch from any older resourceVersion now gets 410 Expired."""
        self._store.compact()

    def drop_watches(self, abrupt: bool = False) -> None:
        """End every open watch stream: cleanly by default, or ``abrupt`` (socket cut mid-stream)."""
        self._hub.drop_all(abrupt)

    def send_bookmarks(self) -> None:
        """Send a BOOKMARK now on every watch that allowed bookmarks."""
        self._hub.bookmark_all()

    @property
    def open_watches(self) -> int:
        return self._hub.open

    def wait_for(self, predicate: Callable[["ApiServerDouble"], bool], timeout: float = 5.0) -> bool:
        """Block until ``predicate(self)`` holds, re-checked on every write and watch start/end."""
        with self._store.changed:
            return self._store.changed.wait_for(lambda: predicate(self), timeout)

    def wait_for_watches(self, count: int = 1, timeout: float = 5.0) -> bool:
        """Block until at least ``count`` watches are open: write only after a watcher is listening."""
        return self.wait_for(lambda d: d.open_watches >= count, timeout)

    # -- traffic -----------------------------------------------------------------------------------
    def requests(self, verb: str | None = None, path: str | None = None) -> list[RequestRecord]:
        """Requests seen so far, filtered by verb and a regex searched in the path."""
        return self._log.records(verb, path)

    def count(self, verb: str | None = None, path: str | None = None) -> int:
        """How many requests matched, e.g. ``count("POST", r"/binding$")``."""
        return self._log.count(verb, path)

    def clear_requests(self) -> None:
        self._log.clear()

    def fail_next(self, verb: str, path: str, code: int = 500, times: int = 1, reason: str | None = None,
                  message: str | None = None, after_commit: bool = False) -> Fault:
        """Answer the next ``times`` requests matching ``verb`` ("*" for any) and regex ``path`` with ``code``.

        With ``after_commit`` the request still takes effect and only its answer is replaced (a lost reply).
        """
        return self._faults.add(verb, path, code, times, reason, message, after_commit)

    def clear_faults(self) -> None:
        self._faults.clear()


def _copy_or_none(obj: Obj | None) -> Obj | None:
    return None if obj is None else copy.deepcopy(obj)


def _terminated(state: Obj | None) -> Obj:
    """A container's state once its pod ended: as it was if it had terminated, else what the kubelet's
    ``TerminatePod`` writes for a container it cannot account for."""
    if isinstance(state, dict) and "terminated" in state:
        return state
    return {"terminated": {"exitCode": 137, "reason": "ContainerStatusUnknown"}}
