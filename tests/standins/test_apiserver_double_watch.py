"""Watch behaviour of the double, read through ``kubernetes.watch.Watch`` as production code does."""
from __future__ import annotations

import json
import threading
from typing import Any

import pytest
from kubernetes import client, watch
from kubernetes.client.exceptions import ApiException

from standins.apiserver import ApiServerDouble
from tests.standins.bodies import pod_body
from vramshare.kube import api_client_for


def _collect(v1: client.CoreV1Api, count: int, **kwargs: Any) -> list[tuple[str, str]]:
    """(type, name) of the first ``count`` events of a pod watch in ``default``."""
    w = watch.Watch()
    seen: list[tuple[str, str]] = []
    for event in w.stream(v1.list_namespaced_pod, "default", **kwargs):
        seen.append((event["type"], event["raw_object"]["metadata"].get("name", "")))
        if len(seen) == count:
            w.stop()
    return seen


def test_replay_from_resource_version_in_order(double: ApiServerDouble, v1: client.CoreV1Api) -> None:
    start = v1.list_namespaced_pod("default").metadata.resource_version
    v1.create_namespaced_pod("default", pod_body("p"))
    double.set_pod_phase("default", "p", "Running")
    v1.delete_namespaced_pod("p", "default")

    seen = _collect(v1, 3, resource_version=start, timeout_seconds=2)

    assert seen == [("ADDED", "p"), ("MODIFIED", "p"), ("DELETED", "p")]


def test_a_kubelet_ended_pod_is_deleted_after_its_containers_show_terminated(double: ApiServerDouble,
                                                                             v1: client.CoreV1Api) -> None:
    """``finish_pod_deletion`` is a graceful deletion to its end: the DELETE marks the bound pod, then the
    kubelet's status manager (``TerminatePod``, then ``canBeDeleted``) reports every container terminated
    and removes it; the DELETED object carries them. ``delete_pod`` alone (a forced deletion) carries
    whatever status the pod had."""
    start = v1.list_namespaced_pod("default").metadata.resource_version
    body = pod_body("p")
    body["spec"]["containers"].append({**body["spec"]["containers"][0], "name": "sidecar"})
    double.create_pod(body)
    double.bind_pod("default", "p", "gpu-1")
    double.set_pod_phase("default", "p", "Running")
    double.finish_pod_deletion("default", "p")
    w = watch.Watch()
    events = []
    for event in w.stream(v1.list_namespaced_pod, "default", resource_version=start, timeout_seconds=2):
        events.append((event["type"], event["raw_object"]))
        if event["type"] == "DELETED":
            w.stop()
    assert [t for t, _ in events] == ["ADDED", "MODIFIED", "MODIFIED", "MODIFIED", "MODIFIED", "DELETED"]
    marked = events[3][1]
    assert marked["metadata"]["deletionTimestamp"] and marked["metadata"]["deletionGracePeriodSeconds"] == 30
    assert "containerStatuses" not in marked["status"]
    for _, obj in events[-2:]:
        statuses = obj["status"]["containerStatuses"]
        assert [c["name"] for c in statuses] == [c["name"] for c in body["spec"]["containers"]]
        assert all(c["state"]["terminated"]["reason"] == "ContainerStatusUnknown" for c in statuses)
    double.create_pod(pod_body("q"))
    assert "containerStatuses" not in (double.delete_pod("default", "q").get("status") or {})


def test_live_events_reach_an_open_watch(double: ApiServerDouble, v1: client.CoreV1Api) -> None:
    start = v1.list_namespaced_pod("default").metadata.resource_version
    seen: list[tuple[str, str]] = []
    watcher = threading.Thread(target=lambda: seen.extend(_collect(v1, 2, resource_version=start,
                                                                   timeout_seconds=2)))
    watcher.start()
    assert double.wait_for_watches(1)
    v1.create_namespaced_pod("default", pod_body("live"))
    v1.patch_namespaced_pod("live", "default", {"metadata": {"labels": {"a": "b"}}})
    watcher.join()
    assert seen == [("ADDED", "live"), ("MODIFIED", "live")]


def test_watch_without_version_starts_with_current_state(double: ApiServerDouble, v1: client.CoreV1Api) -> None:
    double.create_pod(pod_body("existing"))
    assert _collect(v1, 1, timeout_seconds=2) == [("ADDED", "existing")]


def test_filtered_watch_sees_binding_as_deleted(double: ApiServerDouble, v1: client.CoreV1Api) -> None:
    start = v1.list_namespaced_pod("default").metadata.resource_version
    double.create_pod(pod_body("p"))
    double.bind_pod("default", "p", "gpu-1")

    seen = _collect(v1, 2, resource_version=start, field_selector="spec.nodeName=", timeout_seconds=2)

    assert seen == [("ADDED", "p"), ("DELETED", "p")]


def test_watch_from_compacted_version_raises_410(double: ApiServerDouble, v1: client.CoreV1Api) -> None:
    start = v1.list_namespaced_pod("default").metadata.resource_version
    double.create_pod(pod_body("p"))
    double.compact()

    with pytest.raises(ApiException) as expired:
        _collect(v1, 1, resource_version=start, timeout_seconds=2)

    assert expired.value.status == 410


def test_history_limit_expires_old_versions() -> None:
    with ApiServerDouble(history_limit=1) as double, api_client_for(double.url) as http:
        v1 = client.CoreV1Api(http)
        versions = [double.create_pod(pod_body(name))["metadata"]["resourceVersion"] for name in ("a", "b", "c")]
        with pytest.raises(ApiException) as expired:  # only the change to c is still remembered
            _collect(v1, 1, resource_version=versions[0], timeout_seconds=2)
        assert expired.value.status == 410
        assert _collect(v1, 1, resource_version=versions[1], timeout_seconds=2) == [("ADDED", "c")]


def test_a_timeout_ends_the_stream_cleanly_and_a_short_watch_gets_no_bookmark(double: ApiServerDouble,
                                                                              v1: client.CoreV1Api) -> None:
    """cache_watcher.go nextBookmarkTime: the bookmark is due 2 s before the deadline and none is sent once
    that moment has passed: a 1 s watch gets none, and the end of a stream carries none (the double
    used to end every timed-out watch with one, kinder than the real server)."""
    rv = str(double.resource_version)
    events = list(watch.Watch().stream(v1.list_namespaced_pod, "default", resource_version=rv, timeout_seconds=1,
                                       allow_watch_bookmarks=True))
    assert events == []


def test_the_bookmark_comes_before_the_deadline_and_events_follow_it(double: ApiServerDouble,
                                                                     v1: client.CoreV1Api) -> None:
    """A 4 s watch: the BOOKMARK comes 2 s before its end, and the stream goes on carrying events after it."""
    seen: list[str] = []
    for event in watch.Watch().stream(v1.list_namespaced_pod, "default", resource_version=str(double.resource_version),
                                      timeout_seconds=4, allow_watch_bookmarks=True):
        seen.append(event["type"])
        if event["type"] == "BOOKMARK":
            v1.create_namespaced_pod("default", pod_body("after"))
    assert seen == ["BOOKMARK", "ADDED"]


def test_bookmarks_come_every_bookmark_frequency_and_only_when_allowed() -> None:
    """cacher.go defaultBookmarkFrequency (a minute; 0.3 s here): one per period until 2 s before the end."""
    with ApiServerDouble(bookmark_frequency_s=0.3) as double, api_client_for(double.url) as http:
        v1 = client.CoreV1Api(http)
        rv = str(double.resource_version)
        allowed = [e["type"] for e in watch.Watch().stream(v1.list_namespaced_pod, "default", resource_version=rv,
                                                             timeout_seconds=3, allow_watch_bookmarks=True)]
        assert len(allowed) >= 2 and set(allowed) == {"BOOKMARK"}
        assert list(watch.Watch().stream(v1.list_namespaced_pod, "default", resource_version=rv,
                                         timeout_seconds=3)) == []


def test_a_watch_without_timeout_seconds_still_ends() -> None:
    """get.go handleWatch: no timeoutSeconds (or 0) means minRequestTimeout * (1 + rand), never for ever;
    the stream ends with the final chunk and no event."""
    with ApiServerDouble(min_request_timeout_s=1) as double, api_client_for(double.url) as http:
        v1 = client.CoreV1Api(http)
        rv = str(double.resource_version)
        for timeout in ({}, {"timeout_seconds": 0}):
            resp = v1.list_namespaced_pod("default", watch=True, resource_version=rv, _preload_content=False,
                                          _request_timeout=(5, 10), **timeout)
            try:
                assert resp.read() == b""  # ended by the server within 2 s; a read timeout raises instead
            finally:
                resp.release_conn()


def test_a_too_old_resource_version_is_one_expired_error_event(double: ApiServerDouble, v1: client.CoreV1Api) -> None:
    """cacher.go newErrWatcher over watch_cache_history.go: HTTP 200, then one ERROR event carrying the
    Status (410, reason Expired, "too old resource version: <rv> (<oldest-1>)"), then the end."""
    start = v1.list_namespaced_pod("default").metadata.resource_version
    double.create_pod(pod_body("p"))
    double.compact()
    resp = v1.list_namespaced_pod("default", watch=True, resource_version=start, timeout_seconds=5,
                                  allow_watch_bookmarks=True, _preload_content=False)
    try:
        assert resp.status == 200
        lines = [json.loads(line) for line in resp.read().splitlines() if line]
    finally:
        resp.release_conn()
    [event] = lines
    assert event["type"] == "ERROR"
    status = event["object"]
    assert (status["kind"], status["apiVersion"], status["status"], status["code"], status["reason"]) == \
        ("Status", "v1", "Failure", 410, "Expired")
    assert status["message"] == f"too old resource version: {start} ({double.resource_version})"


def test_drop_watches_ends_open_streams(double: ApiServerDouble, v1: client.CoreV1Api) -> None:
    ended = threading.Event()

    def watch_until_dropped() -> None:
        for _ in watch.Watch().stream(v1.list_namespaced_pod, "default", resource_version="0",
                                      timeout_seconds=30):
            pass
        ended.set()

    watcher = threading.Thread(target=watch_until_dropped)
    watcher.start()
    assert double.wait_for_watches(1)
    double.drop_watches()
    watcher.join(timeout=5)
    assert ended.is_set()
    assert double.wait_for(lambda d: d.open_watches == 0)


def test_stop_ends_open_watches() -> None:
    double = ApiServerDouble().start()
    outcome: list[str] = []
    with api_client_for(double.url) as http:
        v1 = client.CoreV1Api(http)

        def watch_until_stopped() -> None:
            try:
                for _ in watch.Watch().stream(v1.list_namespaced_pod, "default", timeout_seconds=30):
                    pass
                outcome.append("ended")
            except Exception as error:  # noqa: BLE001 - any clean client-side end is fine here
                outcome.append(type(error).__name__)

        watcher = threading.Thread(target=watch_until_stopped)
        watcher.start()
        assert double.wait_for_watches(1)
        double.stop()
        watcher.join(timeout=5)
    assert outcome == ["ended"]


def test_filtered_watch_sees_an_object_enter_as_added(double: ApiServerDouble, v1: client.CoreV1Api) -> None:
    start = v1.list_namespaced_pod("default").metadata.resource_version
    double.create_pod(pod_body("p"))
    double.bind_pod("default", "p", "gpu-1")
    double.set_pod_phase("default", "p", "Running")

    seen = _collect(v1, 2, resource_version=start, field_selector="spec.nodeName=gpu-1", timeout_seconds=2)

    assert seen == [("ADDED", "p"), ("MODIFIED", "p")]


def test_watch_one_pod_by_name(double: ApiServerDouble, v1: client.CoreV1Api) -> None:
    start = v1.list_namespaced_pod("default").metadata.resource_version
    for name in ("other", "mine"):
        double.create_pod(pod_body(name))
    double.set_pod_phase("default", "other", "Running")
    double.set_pod_phase("default", "mine", "Running")

    seen = _collect(v1, 2, resource_version=start, field_selector="metadata.name=mine", timeout_seconds=2)

    assert seen == [("ADDED", "mine"), ("MODIFIED", "mine")]


def test_send_bookmarks_reaches_watches_that_allow_them(double: ApiServerDouble, v1: client.CoreV1Api) -> None:
    w = watch.Watch()
    got: list[str] = []

    def watch_for_a_bookmark() -> None:
        for event in w.stream(v1.list_namespaced_pod, "default", resource_version=str(double.resource_version),
                              allow_watch_bookmarks=True, timeout_seconds=5):
            got.append(event["type"])
            w.stop()

    watcher = threading.Thread(target=watch_for_a_bookmark)
    watcher.start()
    assert double.wait_for_watches(1)
    double.send_bookmarks()
    watcher.join()
    assert got == ["BOOKMARK"] and w.resource_version == str(double.resource_version)


def test_abrupt_drop_looks_like_a_network_failure(double: ApiServerDouble, v1: client.CoreV1Api) -> None:
    failures: list[BaseException] = []

    def watch_until_cut() -> None:
        try:
            for _ in watch.Watch().stream(v1.list_namespaced_pod, "default", timeout_seconds=30):
                pass
        except Exception as error:  # noqa: BLE001 - the test asserts which one below
            failures.append(error)

    watcher = threading.Thread(target=watch_until_cut)
    watcher.start()
    assert double.wait_for_watches(1)
    double.drop_watches(abrupt=True)
    watcher.join(timeout=5)
    assert len(failures) == 1 and "ProtocolError" in type(failures[0]).__name__


def test_watch_one_node(double: ApiServerDouble, v1: client.CoreV1Api) -> None:
    start = v1.list_node().metadata.resource_version
    double.create_node({"metadata": {"name": "gpu-1"}})
    double.create_node({"metadata": {"name": "gpu-2"}})
    v1.patch_node("gpu-1", {"metadata": {"annotations": {"vramshare.io/gpu-inventory": "{}"}}})

    w = watch.Watch()
    seen = []
    for event in w.stream(v1.list_node, field_selector="metadata.name=gpu-1", resource_version=start,
                          timeout_seconds=2):
        seen.append((event["type"], event["object"].metadata.annotations))
        if len(seen) == 2:
            w.stop()

    assert seen == [("ADDED", None), ("MODIFIED", {"vramshare.io/gpu-inventory": "{}"})]


def test_restart_keeps_url_and_objects_and_watches_resume(double: ApiServerDouble, v1: client.CoreV1Api) -> None:
    url = double.url
    double.create_pod(pod_body("before"))
    seen: list[tuple[str, str]] = []
    first_seen = threading.Event()
    w = watch.Watch()

    def watch_across_restart() -> None:  # no timeout: the client reconnects from its last resourceVersion
        for event in w.stream(v1.list_namespaced_pod, "default"):
            seen.append((event["type"], event["raw_object"]["metadata"]["name"]))
            first_seen.set()
            if len(seen) == 2:
                w.stop()

    watcher = threading.Thread(target=watch_across_restart)
    watcher.start()
    assert first_seen.wait(timeout=5)
    double.restart()
    assert double.wait_for_watches(1)  # the client came back on its own
    double.create_pod(pod_body("after"))
    watcher.join(timeout=5)

    assert double.url == url
    assert seen == [("ADDED", "before"), ("ADDED", "after")]
    assert [p.metadata.name for p in v1.list_namespaced_pod("default").items] == ["after", "before"]


def test_a_resource_version_the_server_has_not_reached_is_a_504_after_blocking(double: ApiServerDouble,
                                                                                v1: client.CoreV1Api) -> None:
    """watch_cache.go waitUntilFreshAndBlock (3 s) then storage.NewTooLargeResourceVersionError, sent by
    cacher.go as an ERROR event; the double used to wait for it for ever."""
    ahead = double.resource_version + 100
    resp = v1.list_namespaced_pod("default", watch=True, resource_version=str(ahead), timeout_seconds=30,
                                  _preload_content=False, _request_timeout=(5, 10))
    try:
        [event] = [json.loads(line) for line in resp.read().splitlines() if line]
    finally:
        resp.release_conn()
    assert event["type"] == "ERROR"
    status = event["object"]
    assert (status["code"], status["reason"], status["details"]["retryAfterSeconds"]) == (504, "Timeout", 1)
    assert status["details"]["causes"] == [{"reason": "ResourceVersionTooLarge", "message": "Too large resource version"}]
    assert status["message"] == f"Timeout: Too large resource version: {ahead}, current: {double.resource_version}"
