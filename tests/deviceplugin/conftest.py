"""Shared set-up for the device plugin tests: the simulated node, a fake kubelet, a running plugin.

Doubles sit only at the edges: the simulated GPU backend, the fake kubelet (real gRPC on real unix
sockets) and, where pods matter, the API server double. Unix socket paths must stay under 108
bytes, so the sockets live in a short directory under /tmp rather than pytest's tmp_path.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any, Callable, Iterator

import pytest

from deviceplugin.kubelet.main import DevicePluginDaemon
from deviceplugin.metrics import PluginMetrics
from deviceplugin.simulated_backend import SimulatedBackend
from standins.apiserver import ApiServerDouble
from standins.kubelet import FakeKubelet
from vramshare.config import Config
from vramshare.kube import api_client_for

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures", "inventories")
MIXED = os.path.join(FIXTURES, "mixed.yaml")  # H100 81559 MiB numa 0; A100 MIG [3g.40gb, 2g.20gb, 1g.10gb] numa 1

MEM = "vramshare.io/gpu-memory"
GPU = "vramshare.io/gpu"
MIG_RESOURCES = ["vramshare.io/mig-1g.10gb", "vramshare.io/mig-2g.20gb", "vramshare.io/mig-3g.40gb"]
NODE = "gpu-1"  # the node of the tests that need the API server double
TWO_GPUS = {"gpus": [
    {"model": "NVIDIA H100 80GB HBM3", "memoryMiB": 81559, "numaNode": 0, "uuid": "GPU-aaaa"},
    {"model": "NVIDIA H100 80GB HBM3", "memoryMiB": 81559, "numaNode": 1, "uuid": "GPU-bbbb"}]}


@pytest.fixture
def api() -> Iterator[ApiServerDouble]:
    with ApiServerDouble() as double:
        double.create_node({"metadata": {"name": NODE}})
        yield double


@pytest.fixture
def http(api):
    with api_client_for(api.url) as client:
        yield client


@pytest.fixture
def short_dir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="vs-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def backend() -> SimulatedBackend:
    return SimulatedBackend.from_file(MIXED)


@pytest.fixture
def config(short_dir: str) -> Config:
    return Config(quota_host_dir=os.path.join(short_dir, "quota"))


@pytest.fixture
def kubelet(short_dir: str) -> Iterator[FakeKubelet]:
    k = FakeKubelet(os.path.join(short_dir, "dp"), os.path.join(short_dir, "pr", "kubelet.sock"))
    k.start()
    yield k
    k.stop()


@pytest.fixture
def start_plugin(backend: SimulatedBackend, config: Config, kubelet: FakeKubelet) -> Iterator[Callable[..., DevicePluginDaemon]]:
    """Start a plugin against the fake kubelet and wait until every resource is registered."""
    started: list[DevicePluginDaemon] = []

    def start(cfg: Config | None = None, api: Any = None, node: str = "gpu-1", gpus: Any = None,
              **kw: Any) -> DevicePluginDaemon:
        kw.setdefault("metrics", None)
        kw.setdefault("pod_resources_socket", kubelet.pod_resources_socket)
        daemon = DevicePluginDaemon(gpus or backend, cfg or config, kubelet.plugin_dir, node_name=node, api=api,
                                    poll_seconds=0.02, reconcile_seconds=kw.pop("reconcile_seconds", 60.0),
                                    stream_grace_seconds=kw.pop("stream_grace_seconds", 0.3), **kw)
        daemon.start()
        started.append(daemon)
        kubelet.wait_registered(list(daemon.state.snapshot.devices))
        assert daemon.lifecycle.wait_registered(1, timeout=5)  # the plugin saw every Register answered
        return daemon

    yield start
    for daemon in started:
        daemon.close()


def fresh_metrics(daemon_state: Callable[[], object]) -> PluginMetrics:
    return PluginMetrics(snapshot=daemon_state)
