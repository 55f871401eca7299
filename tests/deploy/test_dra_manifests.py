"""deploy/daemonset/dra/ and every object the DRA plugin writes, against the 1.36 and 1.37 schemas
(``kubernetes-validate --strict``), plus what a schema cannot see: the DaemonSet's args parse and its
mounts are the kubelet's directories, both workloads are hardened like the device plugin's and the
extender's, the DRA scheduler scores only. RBAC against the code: test_manifests.py."""
from __future__ import annotations

import os
import pathlib
from typing import Any

import kubernetes_validate
import pytest
import yaml

from deviceplugin import devices
from deviceplugin.dra import slices
from deviceplugin.simulated_backend import SimulatedBackend
from vramshare import config, contract
from vramshare_cli import main as cli

ROOT = pathlib.Path(__file__).resolve().parents[2]
DRA = ROOT / "deploy" / "daemonset" / "dra"
K8S_VERSIONS = ["1.36", "1.37"]  # consumable capacity is beta (on by default) from 1.36
NAMESPACE = "vramshare-system"


def _docs() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for path in sorted(DRA.rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                out.append((str(path.relative_to(DRA)), doc))
    return out


DOCS = _docs()
API_DOCS = [(n, d) for n, d in DOCS if d["kind"] != "Kustomization"]


def _one(kind: str, name: str) -> dict[str, Any]:
    [found] = [d for _, d in DOCS if d["kind"] == kind and d["metadata"]["name"] == name]
    return found


def _written_objects() -> list[dict[str, Any]]:
    """What the plugin applies: the demo node's slices, healthy and with a tainted GPU."""
    cfg = config.Config(dra=config.DraConfig(gpus=("all",)), gpu_modes={"1": config.GpuMode.EXCLUSIVE})
    discovered = SimulatedBackend.demo().discover()
    out = []
    for unhealthy, taints in ((frozenset(), False), (frozenset({discovered[0].uuid}), True)):
        inv = devices.build_inventory(discovered, cfg, unhealthy, dra=True)
        devs = slices.desired_devices(inv, cfg.names, "gpu-node-1", taints=taints)
        out += slices.resource_slices("gpu-node-1", "6f1c0a52-6d3a-4a43-9f5f-0f3e2b1c9d77", devs, 2, cfg.names)
    return out


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("doc", API_DOCS + [("written", o) for o in _written_objects()],
                         ids=lambda d: f"{d[0]}:{d[1]['kind']}/{d[1]['metadata']['name']}")
def test_every_object_validates_strictly(doc, version):
    kubernetes_validate.validate(doc[1], version, strict=True)


def test_the_three_device_classes_and_example_templates_exist():
    names = contract.Names()
    for what in ("gpu-memory", "gpu", "mig"):
        _one("DeviceClass", names.device_class(what))
    assert {d["metadata"]["name"] for _, d in DOCS if d["kind"] == "ResourceClaimTemplate"} == {
        "vllm-22gi", "vllm-22gi-driver", "vllm-tp2-48gi", "mig-1g-10gb"}
    tp2 = _one("ResourceClaimTemplate", "vllm-tp2-48gi")["spec"]["spec"]["devices"]
    assert {"matchAttribute", "distinctAttribute"} <= {k for c in tp2["constraints"] for k in c}


def test_kustomization_lists_every_file_but_the_examples():
    kust = yaml.safe_load((DRA / "kustomization.yaml").read_text())
    files = {n for n, _ in API_DOCS if not n.startswith("examples/")}
    assert set(kust["resources"]) == files


def test_namespaced_objects_live_in_our_namespace_and_examples_in_none():
    for name, d in API_DOCS:
        ns = d["metadata"].get("namespace")
        if name.startswith("examples/"):
            assert ns is None, "examples are applied into the user's namespace"
        elif d["kind"] in ("DaemonSet", "ServiceAccount"):
            assert ns == NAMESPACE


def test_daemonset_args_parse_and_mount_the_kubelet_directories():
    ds = _one("DaemonSet", "vramshare-dra-plugin")
    pod = ds["spec"]["template"]["spec"]
    [c] = pod["containers"]
    args = cli.build_parser().parse_args(c["command"][1:] + c["args"])
    assert args.command == "dra-plugin" and args.backend == "nvml"
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: volumes[m["name"]] for m in c["volumeMounts"]}
    cfg = config.Config()
    assert mounts[args.registry_dir]["hostPath"] == {"path": contract.KUBELET_REGISTRY_DIR, "type": "Directory"}
    plugin_dir = os.path.join(contract.KUBELET_PLUGINS_DIR, cfg.names.dra_driver)
    assert mounts[plugin_dir]["hostPath"]["path"] == plugin_dir
    for path in (cfg.dra.cdi_root, cfg.dra.state_dir, cfg.quota_host_dir):
        assert mounts[path]["hostPath"]["path"] == path
    assert mounts[os.path.dirname(args.config)]["configMap"]["name"] == "vramshare-config"
    assert pod["serviceAccountName"] == "vramshare-dra-plugin"
    port = {p["name"]: p["containerPort"] for p in c["ports"]}["metrics"]
    assert port == args.metrics_port
    sc = c["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
    assert not pod.get("hostPID") and not pod.get("hostNetwork")


def test_configmap_documents_the_dra_keys():
    from tests.deploy.test_manifests import _config_text
    raw = yaml.safe_load(_config_text())
    assert set(raw["dra"]) == set(config._DRA_KEYS)


def test_the_dra_scheduler_calls_the_extender_to_score_only():
    cm = _one("ConfigMap", "vramshare-dra-scheduler-config")
    cfg = yaml.safe_load(cm["data"]["scheduler-config.yaml"])
    assert cfg["kind"] == "KubeSchedulerConfiguration"
    assert [p["schedulerName"] for p in cfg["profiles"]] == ["vramshare-dra-scheduler"]
    [ext] = cfg["extenders"]
    assert ext["prioritizeVerb"] == "prioritize" and ext["ignorable"] is True
    assert not {"filterVerb", "bindVerb", "preemptVerb", "managedResources"} & set(ext)  # DRA pods ask none
    assert cfg["leaderElection"]["resourceName"] == "vramshare-dra-scheduler"
    role = _one("Role", "vramshare-dra-scheduler-leader-election")
    assert ["vramshare-dra-scheduler"] in [r.get("resourceNames") for r in role["rules"]]
    dep = _one("Deployment", "vramshare-dra-scheduler")["spec"]["template"]["spec"]
    [c] = dep["containers"]
    minor = int(c["image"].rsplit(":v", 1)[1].split(".")[1])
    assert minor >= 36, "consumable capacity needs kube-scheduler 1.36+"
    assert dep["volumes"][0]["configMap"]["name"] == cm["metadata"]["name"]
    assert any(a.endswith("/scheduler-config.yaml") and a.startswith("--config=" + c["volumeMounts"][0]["mountPath"])
               for a in c["command"])


def test_the_dra_workloads_are_hardened_like_the_others():
    """The same patterns as device-plugin.yaml and scheduler.yaml (checkov: deploy/checkov-accepted.yaml
    lists what is accepted and why): the device plugin's image, no host namespaces, RuntimeDefault
    seccomp, no capability, read-only root, no privilege escalation, requests and a memory limit,
    probes; the scheduler non-root with profiling off."""
    from tests.deploy.test_manifests import _one as base_one
    [dp] = base_one("DaemonSet", "vramshare-device-plugin")["spec"]["template"]["spec"]["containers"]
    [main_sched] = base_one("Deployment", "vramshare-scheduler")["spec"]["template"]["spec"]["containers"]
    for kind, name in (("DaemonSet", "vramshare-dra-plugin"), ("Deployment", "vramshare-dra-scheduler")):
        pod = _one(kind, name)["spec"]["template"]["spec"]
        assert not pod.get("hostPID") and not pod.get("hostNetwork") and not pod.get("hostIPC"), name
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, name
        [c] = pod["containers"]
        sc = c["securityContext"]
        assert sc["capabilities"] == {"drop": ["ALL"]} and sc["privileged"] is False, name
        assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True, name
        assert c["resources"]["requests"]["cpu"] and c["resources"]["limits"]["memory"], name
        assert c["livenessProbe"] and c["readinessProbe"], name
        assert c["imagePullPolicy"] == "IfNotPresent", name
    [plugin] = _one("DaemonSet", "vramshare-dra-plugin")["spec"]["template"]["spec"]["containers"]
    assert plugin["image"] == dp["image"], "the image the build produces (deploy/build-image.sh)"
    sched = _one("Deployment", "vramshare-dra-scheduler")["spec"]["template"]["spec"]
    assert sched["securityContext"]["runAsNonRoot"] is True and sched["securityContext"]["runAsUser"] != 0
    [c] = sched["containers"]
    assert "--profiling=false" in c["command"]
    assert c["image"].rsplit(":", 1)[0] == main_sched["image"].rsplit(":", 1)[0]
    kust = yaml.safe_load((DRA / "kustomization.yaml").read_text())
    [img] = kust["images"]
    assert img["name"] == "registry.k8s.io/kube-scheduler" and c["image"].endswith(":" + img["newTag"])
