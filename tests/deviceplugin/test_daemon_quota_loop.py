"""The composition root starts the quota feedback loop only where it can work: an API server to find
the pods and NVML to read per-process memory. With the simulated backend it stays off and says so."""
from __future__ import annotations

import tempfile
from typing import Iterator

import pytest

from deviceplugin.main import DevicePluginDaemon
from deviceplugin.nvml_backend import NvmlBackend
from deviceplugin.simulated_backend import SimulatedBackend
from tests.fixtures.fake_nvml import H100_80GB, FakeNvml
from vramshare import kube
from vramshare.standins.apiserver import ApiServerDouble
from vramshare.config import Config


@pytest.fixture
def api_url() -> Iterator[str]:
    with ApiServerDouble() as api:
        api.create_node({"metadata": {"name": "gpu-1"}})
        yield api.url


def _running(daemon: DevicePluginDaemon, thread: str) -> bool:
    return any(t.name == thread and t.is_alive() for t in daemon._threads)


@pytest.mark.parametrize("backend_name", ["nvml", "simulated"])
def test_quota_loop_runs_on_nvml_nodes_only(api_url: str, backend_name: str) -> None:
    backend = NvmlBackend(nvml=FakeNvml([H100_80GB])) if backend_name == "nvml" else SimulatedBackend.from_dict(
        {"gpus": [{"model": "NVIDIA H100 80GB HBM3", "memoryMiB": 81559}]})
    with tempfile.TemporaryDirectory(prefix="vs-q-") as root, kube.api_client_for(api_url) as api:
        config = Config().with_overrides(quota_host_dir=f"{root}/quota")
        daemon = DevicePluginDaemon(backend, config, root, node_name="gpu-1", api=api)
        try:
            daemon.start()
            ticks = daemon.metrics.registry.get_sample_value("vramshare_quota_ticks_total")
            assert _running(daemon, "quota-loop") is (backend_name == "nvml")
            assert (ticks is not None) is (backend_name == "nvml")
            assert daemon._shared_capacities() == {g.uuid: g.units * 1024
                                                    for g in daemon.state.snapshot.inventory.gpus}
        finally:
            daemon.close()
    assert [t.name for t in daemon._threads if t.is_alive()] == []
