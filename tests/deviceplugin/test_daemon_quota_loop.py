"""The composition root starts the quota feedback loop only where it can work: an API server to find
the pods and NVML to read per-process memory. With the simulated backend it stays off and says so."""
from __future__ import annotations

import tempfile
from typing import Iterator

import pytest

from deviceplugin.kubelet.main import DevicePluginDaemon
from deviceplugin.nvml_backend import NvmlBackend
from deviceplugin.simulated_backend import SimulatedBackend
from standins.apiserver import ApiServerDouble
from tests.fixtures.fake_nvml import H100_80GB, FakeNvml
from vramshare import kube
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


def test_warm_tier_and_residency_start_with_the_loop(api_url: str, tmp_path) -> None:
    """Issue 23: ``warmTier.enabled`` runs the warm channel beside the quota loop; a model cache dir puts
    the node's resident models into its inventory annotation (additive: older readers ignore it)."""
    import dataclasses
    import json
    import time

    from vramshare.config import WarmTierConfig

    cache = tmp_path / "hf"
    snap = cache / "models--org--m" / "snapshots" / "r1"
    snap.mkdir(parents=True)
    (snap / "model.safetensors").write_bytes(b"x" * 100)
    backend = NvmlBackend(nvml=FakeNvml([H100_80GB]))
    with kube.api_client_for(api_url) as api:
        config = dataclasses.replace(Config().with_overrides(quota_host_dir=str(tmp_path / "quota")),
                                     warm_tier=WarmTierConfig(enabled=True, model_cache_dir=str(cache)))
        daemon = DevicePluginDaemon(backend, config, str(tmp_path), node_name="gpu-1", api=api)
        try:
            daemon.start()
            assert _running(daemon, "warm-channel") and _running(daemon, "model-residency")
            deadline = time.monotonic() + 10
            models = None
            while time.monotonic() < deadline:
                from kubernetes import client
                node = client.CoreV1Api(api).read_node("gpu-1")
                ann = node.metadata.annotations or {}
                text = ann.get(config.names.inventory)
                if text and "models" in json.loads(text):
                    models = json.loads(text)["models"]
                    break
                time.sleep(0.1)
            assert models == [{"name": "org/m", "revision": "r1", "bytes": 100, "engines": []}]
            # issue 23 item 5: the broker's sleep credit reaches the node annotation and the kubelet's units
            gpu = daemon.state.snapshot.inventory.gpus[0]
            units = len(daemon.state.snapshot.devices[config.names.gpu_memory])
            daemon.warm.on_credits({gpu.uuid: 20 * 1024})
            assert len(daemon.state.snapshot.devices[config.names.gpu_memory]) == units + 20
            credit = None
            while time.monotonic() < deadline + 10 and credit != 20 * 1024:
                text = (client.CoreV1Api(api).read_node("gpu-1").metadata.annotations or {})[config.names.inventory]
                credit = json.loads(text)["gpus"][0].get("sleepCreditMiB")
                time.sleep(0.1)
            assert credit == 20 * 1024 and "models" in json.loads(text)
        finally:
            daemon.close()
    assert [t.name for t in daemon._threads if t.is_alive()] == []
