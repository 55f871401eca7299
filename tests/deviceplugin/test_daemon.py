"""The daemon as an admin runs it: ``vramshare device-plugin`` in a subprocess (standalone, and with a
kubeconfig pointing at the API server double), a clean exit on SIGTERM, one clear line and a non-zero
exit without a GPU driver, and a config reload that changes which resources are served."""
from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys

import pytest

from standins.apiserver import ApiServerDouble
from tests.fixtures.kubeconfig import write_kubeconfig
from vramshare import contract
from vramshare.config import Config
from vramshare.inventory import GpuMode, NodeInventory

from .conftest import GPU, MEM, MIG_RESOURCES, MIXED

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def plugin_process(kubelet, *extra: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST", "NODE_NAME")}
    return subprocess.Popen(
        [sys.executable, "-m", "vramshare_cli.main", "device-plugin", "--backend", "simulated", "--inventory", MIXED,
         "--device-plugin-dir", kubelet.plugin_dir, "--pod-resources-socket", kubelet.pod_resources_socket,
         "--metrics-port", "0", *extra],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def stop(proc: subprocess.Popen) -> tuple[int, str]:
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=15)
    return proc.returncode, err


def test_standalone_subprocess_serves_reloads_on_sighup_and_exits_cleanly(kubelet, short_dir):
    config = os.path.join(short_dir, "config.yaml")
    with open(config, "w", encoding="utf-8") as fh:
        fh.write("version: v1\n")
    proc = plugin_process(kubelet, "--quota-dir", os.path.join(short_dir, "quota"), "--config", config)
    try:
        kubelet.wait_registered([MEM] + MIG_RESOURCES, timeout=20)
        resp = kubelet.allocate(MEM, kubelet.preferred(MEM, kubelet.healthy_ids(MEM), 2))
        assert resp.envs["VRAMSHARE_MEMORY_LIMIT_MIB"] == "2048"
        with open(config, "w", encoding="utf-8") as fh:
            fh.write("version: v1\ndefaultGpuMode: exclusive\n")
        proc.send_signal(signal.SIGHUP)
        kubelet.wait_registered([GPU], timeout=10)
        assert len(kubelet.devices(GPU)) == 1
    finally:
        rc, err = stop(proc)
    assert rc == 0, err
    assert "standalone" in err and "config changed" in err
    assert not [p for p in os.listdir(kubelet.plugin_dir) if p.startswith("vramshare-")]  # sockets removed


def test_with_a_kubeconfig_it_publishes_the_node_inventory(kubelet, short_dir):
    with ApiServerDouble() as api:
        api.create_node({"metadata": {"name": "gpu-1"}})
        kubeconfig = str(write_kubeconfig(pathlib.Path(short_dir) / "kubeconfig", api.url))
        proc = plugin_process(kubelet, "--kubeconfig", kubeconfig, "--node-name", "gpu-1",
                              "--quota-dir", os.path.join(short_dir, "quota"))
        try:
            key = contract.Names().inventory
            assert api.wait_for(lambda d: key in (d.get_node("gpu-1")["metadata"].get("annotations") or {}),
                                timeout=20)
            inventory = NodeInventory.from_json(api.get_node("gpu-1")["metadata"]["annotations"][key])
            assert [g.units for g in inventory.gpus] == [79, 0]
        finally:
            rc, err = stop(proc)
        assert rc == 0, err


def test_the_inventory_says_which_config_text_the_plugin_runs(kubelet, short_dir):
    """Through the real main and the API double: the inventory carries the digest of the config file's
    text in force (``vramshare check`` compares it with the ConfigMap); after an edit it carries the new
    one, with the keys that wait for a restart (memoryUnitMiB is read at start)."""
    from vramshare.config import text_digest
    with ApiServerDouble() as api:
        api.create_node({"metadata": {"name": "gpu-1"}})
        kubeconfig = str(write_kubeconfig(pathlib.Path(short_dir) / "kubeconfig", api.url))
        config = os.path.join(short_dir, "config.yaml")
        first, edited = "version: v1\n", "version: v1\nmemoryUnitMiB: 2048\nquota: {stepMiB: 256}\n"
        with open(config, "w", encoding="utf-8") as fh:
            fh.write(first)
        proc = plugin_process(kubelet, "--kubeconfig", kubeconfig, "--node-name", "gpu-1", "--config", config,
                              "--quota-dir", os.path.join(short_dir, "quota"))
        key = contract.Names().inventory

        def published():
            text = (api.get_node("gpu-1")["metadata"].get("annotations") or {}).get(key)
            return NodeInventory.from_json(text).config if text else None
        try:
            assert api.wait_for(lambda d: published() is not None, timeout=20)
            assert published().digest == text_digest(first) and published().restart_pending == ()
            with open(config, "w", encoding="utf-8") as fh:
                fh.write(edited)
            proc.send_signal(signal.SIGHUP)
            assert api.wait_for(lambda d: published().digest == text_digest(edited), timeout=10)
            assert published().restart_pending == ("memoryUnitMiB",)
        finally:
            rc, err = stop(proc)
        assert rc == 0, err


def test_without_a_driver_the_nvml_backend_fails_with_one_line(short_dir):
    pytest.importorskip("pynvml")
    from deviceplugin.nvml_backend import NvmlBackend
    from deviceplugin.backend import BackendError
    try:
        NvmlBackend().discover()
        pytest.skip("an NVIDIA driver answers on this machine")
    except BackendError:
        pass
    env = {k: v for k, v in os.environ.items() if k not in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST")}
    proc = subprocess.run([sys.executable, "-m", "vramshare_cli.main", "device-plugin", "--backend", "nvml",
                           "--device-plugin-dir", short_dir, "--metrics-port", "0"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 1
    lines = [line for line in proc.stderr.splitlines() if line.startswith("vramshare device-plugin:")]
    assert len(lines) == 1 and ("NVML" in lines[0] or "driver" in lines[0])
    assert "Traceback" not in proc.stderr


def test_a_config_reload_can_change_the_served_resources(kubelet, start_plugin, config):
    daemon = start_plugin()
    h100 = daemon.state.snapshot.inventory.gpus[0].uuid
    daemon.reload(Config(quota_host_dir=config.quota_host_dir, gpu_modes={h100: GpuMode.EXCLUSIVE}))
    kubelet.wait_registered([GPU])
    assert [d.ID for d in kubelet.devices(GPU)] == [h100]
    assert daemon.lifecycle.sockets and not os.path.exists(os.path.join(kubelet.plugin_dir, "vramshare-gpu-memory.sock"))


def test_a_reload_keeps_what_the_plugin_built_at_start_and_says_so(kubelet, start_plugin, config, caplog):
    """The health watch, the warm tier and the quota loop are built at start from the config: a reload
    that turned them off or on was taken into the config in force while nothing followed it (no warm
    tier ran, the old Xid list still filtered), so the config an admin read back lied. Now the reload
    keeps the running values, names each key, and applies the rest."""
    import dataclasses
    import logging
    daemon = start_plugin()
    running = daemon.state.snapshot.config
    asked = dataclasses.replace(
        running, health=dataclasses.replace(running.health, ignored_xids=(13,)),
        warm_tier=dataclasses.replace(running.warm_tier, enabled=True),
        quota=dataclasses.replace(running.quota, process_attribution=True, step_mib=256))
    with caplog.at_level(logging.WARNING):
        daemon.reload(asked)
    now = daemon.state.snapshot.config
    assert now.health == running.health and now.warm_tier == running.warm_tier
    assert now.quota.process_attribution is False and now.quota.step_mib == 256
    reasons = [getattr(r, "fields", {}).get("reason", "") for r in caplog.records]
    for key in ("health.ignoredXids", "warmTier.enabled", "quota.processAttribution"):
        assert any(r.startswith(f"{key}: ") and "restart the plugin" in r for r in reasons), (key, reasons)
    pending = {s.labels["key"] for m in daemon.metrics.registry.collect() for s in m.samples
               if s.name == "vramshare_deviceplugin_config_restart_pending" and s.value == 1}
    assert pending == {"health.ignoredXids", "warmTier.enabled", "quota.processAttribution"}
    daemon.reload(running)  # the file reverted: nothing waits any more
    assert not [s for m in daemon.metrics.registry.collect() for s in m.samples
                if s.name == "vramshare_deviceplugin_config_restart_pending"]
