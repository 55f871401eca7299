"""The binder against the API double when the extender's cache is behind the API (deterministic races)."""
from __future__ import annotations

import threading
import time
from typing import Iterator

import orjson
import pytest

from extender import accounting, apicalls, binder, wire
from standins.apiserver import PODS, ApiServerDouble
from tests.extender import builders as b
from vramshare import contract
from vramshare.config import Config, Policy
from vramshare.kube import api_client_for

N = b.NAMES


@pytest.fixture
def parts(double: ApiServerDouble) -> Iterator[tuple[accounting.Accounting, binder.Binder]]:
    acct = accounting.Accounting(Config())
    node = double.create_node(b.gpu_node("n1", b.a100(), b.a100()))
    acct.apply_node("ADDED", node)  # fed by hand: the cache is whatever the test says it is
    with api_client_for(double.url) as api:
        yield acct, binder.Binder(acct, apicalls.Kube(api), Policy.BINPACK)


def args_for(pod: dict, node: str) -> wire.BindingArgs:
    return wire.BindingArgs(pod["metadata"]["name"], "default", pod["metadata"]["uid"], node)


def used(acct: accounting.Accounting) -> list[int]:
    return [u.used for u in acct.state.node_usage("n1")]


def test_retry_of_a_bind_that_already_happened_keeps_the_first_assignment(
        double: ApiServerDouble, parts: tuple[accounting.Accounting, binder.Binder]) -> None:
    acct, bind = parts
    stale = double.create_pod(b.pod("p", 20))
    acct.apply_pod("ADDED", stale)  # the cache has not seen the first attempt's patch and binding
    first = b.assigned(stale, "", [("GPU-n1-1", 20480)], time.time_ns())["metadata"]["annotations"]
    double.update(PODS, "default", "p", lambda p: p["metadata"]["annotations"].update(first),
                  manager=contract.FIELD_MANAGER_EXTENDER)  # the first attempt's patch
    double.bind_pod("default", "p", "n1")
    double.clear_requests()
    outcome = bind.bind(args_for(stale, "n1"))
    assert outcome == binder.BindOutcome(result="already_bound")
    assert orjson.loads(double.get_pod("default", "p")["metadata"]["annotations"][N.assignment]) == \
        {"c0": [{"uuid": "GPU-n1-1", "mib": 20480}]}  # untouched
    assert double.count("POST", r"/binding$") == 0
    assert used(acct) == [0, 20480]  # the real assignment, not the pick of this attempt


def test_bound_elsewhere_meanwhile_is_an_error_and_holds_nothing(
        double: ApiServerDouble, parts: tuple[accounting.Accounting, binder.Binder]) -> None:
    acct, bind = parts
    double.create_node(b.gpu_node("n2", b.l4()))
    stale = double.create_pod(b.pod("p", 8))
    acct.apply_pod("ADDED", stale)
    double.bind_pod("default", "p", "n2")
    outcome = bind.bind(args_for(stale, "n1"))
    assert outcome.result == "conflict" and "bound to n2 meanwhile" in outcome.error
    assert used(acct) == [0, 0]


def test_replaced_pod_is_refused(double: ApiServerDouble, parts: tuple[accounting.Accounting, binder.Binder]) -> None:
    _acct, bind = parts
    pod = double.create_pod(b.pod("p", 8))
    outcome = bind.bind(wire.BindingArgs("p", "default", "some-older-uid", "n1"))
    assert outcome.result == "conflict" and "replaced" in outcome.error
    assert not double.get_pod("default", "p")["spec"].get("nodeName")
    assert pod["metadata"]["uid"] != "some-older-uid"


def test_deleted_pod_is_an_api_error(double: ApiServerDouble, parts: tuple[accounting.Accounting, binder.Binder]) -> None:
    acct, bind = parts
    pod = double.create_pod(b.pod("p", 8))
    acct.apply_pod("ADDED", pod)
    double.delete_pod("default", "p")
    outcome = bind.bind(args_for(pod, "n1"))
    assert outcome.result == "api_error" and "404" in outcome.error
    assert used(acct) == [0, 0]


def assignment(double: ApiServerDouble, name: str) -> dict:
    return orjson.loads(double.get_pod("default", name)["metadata"]["annotations"][N.assignment])


@pytest.mark.parametrize("policy, gpu", [(None, "GPU-n1-1"), ("spread", "GPU-n1-0")], ids=["binpack", "spread"])
def test_the_pods_policy_picks_the_gpu(double: ApiServerDouble, parts: tuple[accounting.Accounting, binder.Binder],
                                      policy: str | None, gpu: str) -> None:
    acct, bind = parts
    acct.apply_pod("ADDED", b.assigned(b.pod("old", 40), "n1", [("GPU-n1-1", 40960)], time.time_ns()))
    pod = double.create_pod(b.pod("p", 8, policy=policy))
    assert bind.bind(args_for(pod, "n1")) == binder.BindOutcome()
    assert assignment(double, "p") == {"c0": [{"uuid": gpu, "mib": 8192}]}


def test_every_container_and_every_kind_is_assigned(double: ApiServerDouble,
                                                    parts: tuple[accounting.Accounting, binder.Binder]) -> None:
    acct, bind = parts
    node = double.create_node(b.gpu_node("mixed", b.l4(), b.l4(), b.a100(mode="exclusive"),
                                         b.a100(mig=(("3g.40gb", 40192), ("3g.40gb", 40192)))))
    acct.apply_node("ADDED", node)
    two = double.create_pod(b.pod("two", 8, count=2, containers=2))
    assert bind.bind(args_for(two, "mixed")) == binder.BindOutcome()
    got = assignment(double, "two")
    assert sorted(got) == ["c0", "c1"]
    assert all(sorted(e["uuid"] for e in es) == ["GPU-mixed-0", "GPU-mixed-1"] for es in got.values())
    assert all(e["mib"] == 4096 for es in got.values() for e in es)
    whole = double.create_pod(b.pod("whole", whole=1, mig={"3g.40gb": 1}))
    assert bind.bind(args_for(whole, "mixed")) == binder.BindOutcome()
    entries = sorted((e["uuid"], e["mib"]) for e in assignment(double, "whole")["c0"])
    assert entries[0] == ("GPU-mixed-2", 81920) and entries[1][0].startswith("MIG-mixed-3-")
    assert entries[1][1] == 40192
    assert [u.used for u in acct.state.node_usage("mixed")] == [8192, 8192, 81920, 40192, 0]


class _SlowBindKube(apicalls.Kube):
    """The API edge with the first Binding held open (a slow API server), so a retry overlaps it."""

    def __init__(self, api: object) -> None:
        super().__init__(api)  # type: ignore[arg-type]
        self.first_binding = threading.Event()
        self.release = threading.Event()
        self.patched = threading.Semaphore(0)
        self._calls = 0

    def patch_pod_annotations(self, *args: object, **kwargs: object) -> dict:
        out = super().patch_pod_annotations(*args, **kwargs)  # type: ignore[arg-type]
        self.patched.release()
        return out

    def bind_pod(self, namespace: str, name: str, uid: str, node: str) -> None:
        self._calls += 1
        if self._calls == 1:
            self.first_binding.set()
            assert self.release.wait(10)
        super().bind_pod(namespace, name, uid, node)


def test_a_bind_retried_without_the_uid_waits_for_the_one_in_flight(double: ApiServerDouble) -> None:
    """Issue 18 item 4: in-flight binds were keyed by ``pod_uid or pod_key``, so a retry without the
    UID ran beside the first attempt: a second reservation and a second assignment on the GPUs. The
    UID is now read from the cache (or the API) when the caller omits it."""
    acct = accounting.Accounting(Config())
    acct.apply_node("ADDED", double.create_node(b.gpu_node("n1", b.a100(), b.a100())))
    pod = double.create_pod(b.pod("p", 60))
    acct.apply_pod("ADDED", pod)
    with api_client_for(double.url) as api:
        kube = _SlowBindKube(api)
        bind = binder.Binder(acct, kube, Policy.SPREAD)
        outcomes: list[binder.BindOutcome] = []
        first = threading.Thread(target=lambda: outcomes.append(bind.bind(args_for(pod, "n1"))))
        first.start()
        assert kube.first_binding.wait(10) and kube.patched.acquire(timeout=1)
        retry = threading.Thread(target=lambda: outcomes.append(
            bind.bind(wire.BindingArgs("p", "default", "", "n1"))))
        retry.start()
        overlapped = kube.patched.acquire(timeout=1.0)  # on main the retry patches its own assignment
        kube.release.set()
        first.join(10)
        retry.join(10)
    assert not overlapped
    assert sorted(o.result for o in outcomes) == ["already_bound", "bound"]
    assert sum(used(acct)) == 60 * 1024  # reserved once, on one GPU
    assert double.count("POST", r"/binding$") == 1


def test_a_bind_without_the_uid_of_a_pod_the_cache_has_not_seen_reads_it(
        double: ApiServerDouble, parts: tuple[accounting.Accounting, binder.Binder]) -> None:
    acct, bind = parts
    double.create_pod(b.pod("p", 8))  # not in the cache
    outcome = bind.bind(wire.BindingArgs("p", "default", "", "n1"))
    assert outcome.result == "bound"
    assert double.get_pod("default", "p")["spec"]["nodeName"] == "n1"
