"""vramshare.watch.ListWatch against the API server double through the real ``kubernetes`` client:
list then watch, bookmarks honoured, 410 relists, a relist reports what was deleted during the gap,
and over random orders of writes, gaps, cuts, compactions and restarts the view settles on the server's."""
from __future__ import annotations

import threading
import urllib.parse
from typing import Any, Iterator, Mapping

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from kubernetes import client

from standins.apiserver import ApiServerDouble
from standins.apiserver.resources import NODES
from tests.standins.tcp_proxy import TcpProxy
from vramshare.kube import api_client_for
from vramshare.retry import Backoff
from vramshare.watch import ListWatch, key_of, replace

Obj = Mapping[str, Any]


def node(name: str, uid: str | None = None, label: str = "a") -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "labels": {"v": label}}
    if uid:
        meta["uid"] = uid
    return {"apiVersion": "v1", "kind": "Node", "metadata": meta}


class Follower:
    """A consumer that keeps its own table only from what the adapter reports: each list's ``deleted``
    and each event (never by replacing its table), so a missed deletion shows."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.table: dict[str, Obj] = {}
        self.deleted: list[str] = []

    def on_replace(self, items: list[Obj], deleted: list[Obj]) -> None:
        with self.lock:
            for old in deleted:
                if self.table.get(key_of(old)) is old:
                    del self.table[key_of(old)]
                self.deleted.append(key_of(old))
            self.table.update({key_of(o): o for o in items})

    def on_event(self, kind: str, obj: Obj) -> None:
        with self.lock:
            if kind == "DELETED":
                self.table.pop(key_of(obj), None)
            else:
                self.table[key_of(obj)] = obj

    def versions(self) -> dict[str, str]:
        with self.lock:
            return {k: o["metadata"]["resourceVersion"] for k, o in self.table.items()}


def server_versions(api: ApiServerDouble) -> dict[str, str]:
    return {n["metadata"]["name"]: n["metadata"]["resourceVersion"] for n in api.nodes()}


class Running:
    def __init__(self, url: str, **options: Any) -> None:
        self.http = api_client_for(url)
        v1 = client.CoreV1Api(self.http)
        self.follower = Follower()
        options.setdefault("backoff", Backoff(0.01, 0.1, jitter=1.0))
        options.setdefault("request_timeout_s", 5.0)
        self.watch = ListWatch("node watch", lambda **kw: v1.list_node(**kw), on_replace=self.follower.on_replace,
                               on_event=self.follower.on_event, **options)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.watch.run, args=(self.stop,), daemon=True)

    def __enter__(self) -> "Running":
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.watch.stop()
        self.thread.join(timeout=10)
        self.http.close()
        assert not self.thread.is_alive()


@pytest.fixture
def api() -> Iterator[ApiServerDouble]:
    with ApiServerDouble() as double:
        yield double


def _watch_queries(api: ApiServerDouble) -> list[dict[str, str]]:
    return [dict(urllib.parse.parse_qsl(r.query)) for r in api.requests("GET", r"^/api/v1/nodes$")
            if "watch=true" in r.query]


def eventually(check: Any, timeout: float = 20.0) -> bool:
    done = threading.Event()
    deadline = 0.0
    while deadline < timeout:
        if check():
            return True
        done.wait(0.02)
        deadline += 0.02
    return bool(check())


def settled(api: ApiServerDouble, running: Running, timeout: float = 20.0) -> bool:
    return eventually(lambda: running.follower.versions() == server_versions(api), timeout)


# -- the pure Replace ----------------------------------------------------------------------------------------
names = st.sampled_from(["a", "b", "c", "d"])
objs = st.lists(st.tuples(names, st.sampled_from(["u1", "u2"])), unique_by=lambda t: t[0])


@given(objs, objs)
def test_replace_reports_exactly_what_went_or_came_back_as_another_object(old, new):
    view = {n: node(n, uid) for n, uid in old}
    items = [node(n, uid) for n, uid in new]
    fresh, deleted = replace(view, items)
    assert fresh == {key_of(o): o for o in items}
    now = dict(new)
    assert sorted((key_of(o), o["metadata"]["uid"]) for o in deleted) == \
        sorted((n, uid) for n, uid in old if now.get(n) != uid)


def test_key_is_namespace_and_name():
    assert key_of({"metadata": {"name": "p", "namespace": "ns"}}) == "ns/p"
    assert key_of({"metadata": {"name": "n"}}) == "n"


# -- the wire ------------------------------------------------------------------------------------------------
def test_it_lists_then_watches_from_the_lists_version_with_bookmarks_and_a_random_timeout(api):
    api.create_node(node("n1"))
    with Running(api.url, min_watch_timeout_s=100) as r:
        assert r.watch.synced.wait(10) and api.wait_for_watches(1, timeout=10)
        [query] = _watch_queries(api)
        assert query["resourceVersion"] == r.watch.resource_version
        assert query["allowWatchBookmarks"] == "true"
        assert 100 <= int(query["timeoutSeconds"]) <= 200  # reflector.go: [minWatchTimeout, 2*minWatchTimeout]
        timeouts = {r.watch.watch_timeout_s() for _ in range(50)}
        assert len(timeouts) > 1 and min(timeouts) >= 100 and max(timeouts) <= 200
        assert r.follower.versions() == server_versions(api)


def test_a_bookmark_moves_the_resume_point_so_a_compaction_costs_no_list(api):
    api.create_node(node("n1"))
    with Running(api.url, min_watch_timeout_s=100) as r:
        assert r.watch.synced.wait(10) and api.wait_for_watches(1, timeout=10)
        listed_at = r.watch.resource_version
        api.create_pod({"metadata": {"name": "elsewhere", "namespace": "default"},
                        "spec": {"containers": [{"name": "c", "image": "x"}]}})  # moves the version, not nodes
        api.send_bookmarks()
        assert eventually(lambda: r.watch.resource_version == str(api.resource_version) != listed_at)
        api.compact()  # the list's version is gone now; the bookmark's is not
        api.drop_watches()
        assert api.wait_for(lambda a: len(_watch_queries(a)) >= 2 and a.open_watches >= 1, timeout=10)
        assert _watch_queries(api)[1]["resourceVersion"] == str(api.resource_version)
        assert r.watch.lists == 1


def test_410_relists_and_the_relist_reports_what_was_deleted_during_the_gap(api):
    api.create_node(node("stays"))
    api.create_node(node("goes"))
    with Running(api.url, min_watch_timeout_s=100) as r:
        assert r.watch.synced.wait(10) and api.wait_for_watches(1, timeout=10)
        api.stop()  # the gap: a deletion nobody watches, and the history with it
        api.delete(NODES, None, "goes")
        api.compact()
        api.start()  # the watch resumes from its version: an ERROR event with code 410, then a list
        assert settled(api, r)
        assert r.follower.deleted == ["goes"] and r.watch.lists >= 2


def test_an_http_410_on_the_watch_request_relists(api):
    api.create_node(node("n1"))
    with Running(api.url, min_watch_timeout_s=100) as r:
        assert r.watch.synced.wait(10) and api.wait_for_watches(1, timeout=10)
        api.fail_next("GET", r"^/api/v1/nodes$", 410, reason="Expired", message="too old resource version")
        api.drop_watches()
        api.create_node(node("n2"))
        assert settled(api, r)
        assert r.watch.lists >= 2


def test_a_name_that_came_back_under_another_uid_is_reported_deleted(api):
    api.create_node(node("n1"))
    with Running(api.url, min_watch_timeout_s=100) as r:
        assert r.watch.synced.wait(10) and api.wait_for_watches(1, timeout=10)
        old_uid = r.watch.view["n1"]["metadata"]["uid"]
        api.stop()
        api.delete(NODES, None, "n1")
        api.create_node(node("n1"))
        api.compact()
        api.start()
        assert settled(api, r)
        assert r.follower.deleted == ["n1"] and r.watch.view["n1"]["metadata"]["uid"] != old_uid


def test_a_silent_connection_is_given_up_after_its_read_timeout(api):
    api.create_node(node("n1"))
    with TcpProxy(int(api.url.rsplit(":", 1)[1])) as proxy, \
            Running(proxy.url, min_watch_timeout_s=1, request_timeout_s=1.0) as r:
        assert r.watch.synced.wait(10) and api.wait_for_watches(1, timeout=10)
        proxy.freeze()
        api.create_node(node("n2"))
        assert settled(api, r)
        assert proxy.accepted >= 2


def test_a_failure_the_caller_calls_final_ends_the_thread(api):
    api.fail_next("GET", r"^/api/v1/nodes$", 403, times=100)
    failures: list[BaseException] = []
    with Running(api.url, on_failure=lambda exc: failures.append(exc) and False) as r:
        r.thread.join(timeout=10)
        assert not r.thread.is_alive() and len(failures) == 1 and not r.watch.synced.is_set()


# -- the property --------------------------------------------------------------------------------------------
OPS = st.lists(st.one_of(
    st.tuples(st.just("create"), names), st.tuples(st.just("modify"), names), st.tuples(st.just("delete"), names),
    st.tuples(st.sampled_from(["drop", "cut", "compact", "bookmark", "outage", "outage+compact"]), st.just(""))),
    min_size=1, max_size=12)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(OPS)
def test_the_view_always_settles_on_the_servers_state(ops):
    """Any order of writes, clean ends, cuts, compactions and outages (writes while the server is down,
    with or without the history): once the server is quiet, the consumer's table (kept only from the
    reported deletions and events) equals the server's objects, version for version."""
    with ApiServerDouble() as api, Running(api.url, min_watch_timeout_s=1) as r:
        assert r.watch.synced.wait(10)
        for op, name in ops:
            exists = api.get_node(name) is not None if name else False
            if op == "create" and not exists:
                api.create_node(node(name))
            elif op == "modify" and exists:
                api.update(NODES, None, name, lambda n: n["metadata"]["labels"].update(v=str(api.resource_version)))
            elif op == "delete" and exists:
                api.delete(NODES, None, name)
            elif op in ("drop", "cut"):
                api.drop_watches(abrupt=op == "cut")
            elif op == "compact":
                api.compact()
            elif op == "bookmark":
                api.send_bookmarks()
            elif op.startswith("outage"):
                assert settled(api, r)  # the client knew the world; now it changes behind its back
                api.stop()
                for n in ("a", "b", "c", "d"):  # everything changes while nobody watches
                    if api.get_node(n) is None:
                        api.create_node(node(n))
                    else:
                        api.delete(NODES, None, n)
                if op.endswith("compact"):
                    api.compact()
                api.start()
        assert settled(api, r), (r.follower.versions(), server_versions(api))
        assert {k: o["metadata"]["resourceVersion"] for k, o in r.watch.view.items()} == server_versions(api)


def test_a_server_restored_to_an_older_version_is_relisted_and_its_absences_reported():
    """An etcd restored from a backup (here: another server behind the same address, at a lower
    resourceVersion): the watch resumes from a version the server has not reached, which answers 504
    ResourceVersionTooLarge after 3 s (reflector.go isTooLargeResourceVersionError); the adapter relists
    and reports what the restored server lacks as deleted."""
    with ApiServerDouble() as first, ApiServerDouble() as restored, \
            TcpProxy(int(first.url.rsplit(":", 1)[1])) as proxy:
        for i in range(5):
            first.create_node(node(f"n{i}"))
        restored.create_node(node("n0"))
        with Running(proxy.url, min_watch_timeout_s=100) as r:
            assert r.watch.synced.wait(10) and first.wait_for_watches(1, timeout=10)
            threading.Event().wait(1.2)  # past reflector.go's "very short watch": the next one resumes
            proxy.retarget(int(restored.url.rsplit(":", 1)[1]))
            first.drop_watches()  # a clean end: the watch resumes, now at the restored server
            assert settled(restored, r)
            assert sorted(r.follower.deleted) == ["n0", "n1", "n2", "n3", "n4"]  # n0 is another object now
            [resumed, *_] = [q for q in _watch_queries(restored)]
            assert int(resumed["resourceVersion"]) > restored.resource_version
