"""Fixtures: the API server double and a real extender on loopback talking to it over HTTP.

Only the edges are doubles: the API server (real REST + watch wire format) and, for the scheduler's
side, a plain HTTP client that posts what kube-scheduler posts.
"""
from __future__ import annotations

from typing import Any, Iterator

import orjson
import pytest
import urllib3

from extender import main
from standins.apiserver import ApiServerDouble
from vramshare.config import Config, ExtenderConfig, Policy


@pytest.fixture
def double() -> Iterator[ApiServerDouble]:
    with ApiServerDouble() as api:
        yield api


class Scheduler:
    """Posts extender verbs as kube-scheduler does: JSON bodies, one keep-alive connection pool."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.http = urllib3.PoolManager(maxsize=32, retries=False)

    def post(self, verb: str, body: Any) -> Any:
        raw = body if isinstance(body, bytes) else orjson.dumps(body)
        resp = self.http.request("POST", f"{self.url}/{verb}", body=raw,
                                 headers={"Content-Type": "application/json"})
        assert resp.status == 200, resp.data
        return orjson.loads(resp.data)

    def get(self, path: str) -> urllib3.BaseHTTPResponse:
        return self.http.request("GET", f"{self.url}{path}")

    def filter(self, pod: dict, names: list[str]) -> Any:
        return self.post("filter", {"Pod": pod, "Nodes": None, "NodeNames": names})

    def prioritize(self, pod: dict, names: list[str]) -> Any:
        return self.post("prioritize", {"Pod": pod, "Nodes": None, "NodeNames": names})

    def bind(self, pod: dict, node: str) -> Any:
        meta = pod["metadata"]
        return self.post("bind", {"PodName": meta["name"], "PodNamespace": meta.get("namespace", "default"),
                                  "PodUID": meta.get("uid", ""), "Node": node})

    def close(self) -> None:
        self.http.clear()


@pytest.fixture
def extender_config() -> Config:
    return Config(extender=ExtenderConfig(policy=Policy.BINPACK, assume_timeout_seconds=120))


@pytest.fixture
def extender(double: ApiServerDouble, extender_config: Config) -> Iterator[main.RunningExtender]:
    """An extender against the double; nodes/pods created *before* requesting it are in its first list."""
    with main.start_for_url(double.url, extender_config, expiry_interval_s=0.05) as running:
        assert running.wait_ready(10)
        assert double.wait_for_watches(2)  # nodes and pods: later writes reach the extender as events
        yield running


@pytest.fixture
def scheduler(extender: main.RunningExtender) -> Iterator[Scheduler]:
    client = Scheduler(extender.url)
    yield client
    client.close()


def eventually(predicate: Any, timeout: float = 10.0, interval: float = 0.01) -> bool:
    """Poll ``predicate`` until it holds: the extender applies watch events asynchronously."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())
