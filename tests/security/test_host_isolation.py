"""No host PID namespace by default (issue 11): root in it could signal the kubelet and containerd.

The quota loop's per-process attribution is the only user of host PIDs; it is an opt-in config key,
and off it the loop reads no NVML per-process figures (they would resolve to no pod and count as
foreign memory, shrinking every quota).
"""
from __future__ import annotations

import pathlib

import pytest
import yaml
from kubernetes import client

from deviceplugin.quota.kube import NodeTenantSource
from deviceplugin.quota.service import build_loop
from deviceplugin.quota.telemetry import NvmlProcessReader
from vramshare import contract
from vramshare.config import parse_config

NAMES = contract.Names()

DEPLOY = pathlib.Path(__file__).resolve().parents[2] / "deploy" / "daemonset"


def _workload(file: str) -> dict:
    return next(d for d in yaml.safe_load_all((DEPLOY / file).read_text())
                if d and d["kind"] in ("DaemonSet", "Deployment"))["spec"]["template"]["spec"]


@pytest.mark.parametrize("file", ["device-plugin.yaml", "dra/dra-plugin.yaml"])
def test_the_node_plugins_run_without_host_pid_and_without_capabilities(file: str) -> None:
    pod = _workload(file)
    assert not pod.get("hostPID") and not pod.get("hostNetwork") and not pod.get("hostIPC")
    [c] = pod["containers"]
    sc = c["securityContext"]
    assert sc["capabilities"]["drop"] == ["ALL"] and "add" not in sc["capabilities"]
    assert sc["readOnlyRootFilesystem"] and not sc["allowPrivilegeEscalation"] and not sc["privileged"]
    assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"


def test_extender_and_scheduler_run_as_non_root() -> None:
    for file in ("extender.yaml", "scheduler.yaml", "dra/scheduler.yaml"):
        pod = _workload(file)
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
        assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
        for c in pod["containers"]:
            assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
            assert c["securityContext"]["readOnlyRootFilesystem"] is True


def _readers(text: str) -> list[type]:
    with client.ApiClient(client.Configuration()) as api:
        loop = build_loop(parse_config(text), api, "gpu-node-1", lambda: {}, NodeTenantSource(list, list, NAMES))
    return [type(r) for r in loop._usage]  # noqa: SLF001 - which readers were wired is the point


def test_per_process_attribution_is_opt_in() -> None:
    assert parse_config("").quota.process_attribution is False
    assert NvmlProcessReader not in _readers("")
    assert NvmlProcessReader in _readers("quota: {processAttribution: true}")
