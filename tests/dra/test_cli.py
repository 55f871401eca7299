"""``vramshare dra-plugin`` as an admin runs it: a subprocess against the API server double publishes
its slices before any kubelet, registers with the kubelet stand-in, prepares over its socket, exits 0
on SIGTERM and removes its sockets; without an API server it refuses to start with one clear line."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile

import pytest

from standins.apiserver import RESOURCESLICES, ApiServerDouble
from standins.dra_kubelet import DraKubelet
from vramshare.kube import api_client_for

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DRIVER = "gpu.vramshare.io"


@pytest.fixture
def short_dir():
    d = tempfile.mkdtemp(prefix="dracli", dir="/tmp")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST", "NODE_NAME")}


def test_the_subprocess_publishes_registers_and_exits_cleanly(short_dir):
    config = os.path.join(short_dir, "config.yaml")
    with open(config, "w", encoding="utf-8") as fh:
        fh.write(f"version: v1\nquotaHostDir: {short_dir}/quota\n"
                 f"dra: {{gpus: all, cdiRoot: {short_dir}/cdi, stateDir: {short_dir}/state}}\n")
    with ApiServerDouble() as api, api_client_for(api.url) as http:
        api.create_node({"metadata": {"name": "gpu-1"}})
        kubeconfig = os.path.join(short_dir, "kubeconfig")
        with open(kubeconfig, "w", encoding="utf-8") as fh:
            fh.write(f"apiVersion: v1\nkind: Config\ncurrent-context: double\n"
                     f"clusters: [{{name: double, cluster: {{server: '{api.url}'}}}}]\n"
                     f"users: [{{name: nobody, user: {{}}}}]\n"
                     f"contexts: [{{name: double, context: {{cluster: double, user: nobody}}}}]\n")
        proc = subprocess.Popen(
            [sys.executable, "-m", "vramshare_cli.main", "dra-plugin", "--backend", "simulated", "--config", config,
             "--kubeconfig", kubeconfig, "--node-name", "gpu-1", "--plugin-dir", f"{short_dir}/plugins/{DRIVER}",
             "--registry-dir", f"{short_dir}/registry", "--metrics-port", "0"],
            cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert api.wait_for(lambda a: len(a.objects(RESOURCESLICES)) == 1, timeout=30)
            [s] = api.objects(RESOURCESLICES)
            assert s["spec"]["nodeName"] == "gpu-1" and len(s["spec"]["devices"]) == 7
            kubelet = DraKubelet(http, "gpu-1", f"{short_dir}/registry")
            assert api.wait_for(lambda a: kubelet.sync_plugins() == [DRIVER] or DRIVER in kubelet.plugins,
                                timeout=15)
        finally:
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=20)
        assert proc.returncode == 0, err
        assert not os.path.exists(f"{short_dir}/registry/{DRIVER}-reg.sock")
        assert not os.path.exists(f"{short_dir}/plugins/{DRIVER}/dra.sock")


def test_without_an_api_server_it_refuses_with_one_line(short_dir):
    proc = subprocess.run([sys.executable, "-m", "vramshare_cli.main", "dra-plugin", "--backend", "simulated",
                           "--node-name", "n", "--metrics-port", "0"],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "vramshare dra-plugin: needs the API server" in proc.stderr
