"""Deploy-level truth (issue 17 item 7): what each node daemon needs from the host, derived from the
code's own constants, against what the manifests grant, per enforcement mode, as kustomize renders them.

Needs: the kubelet's device-plugin directory and PodResources socket directory, the quota root (device
plugin); the kubelet's plugin registry and plugin directory, the CDI and state directories (DRA plugin);
the CDI spec roots when the config's deviceListStrategy is cdi-cri; the host PID namespace only with
quota.processAttribution; GPUs through the NVIDIA runtime (never a hostPath under /dev); and in driver
mode the host's cgroup tree and the capability nvmlDeviceSetMemoryLimits_v1 needs
(deviceplugin/enforcement.py). Grants: every hostPath volume a container mounts (path, read-only or
not), added capabilities, privileged mode, host namespaces. The two sets must be equal: a missing grant
is a mode that is advertised and fails (driver mode on main: unprivileged, no cgroup mount); an extra
one is a privilege nothing uses.

The installs: ``deploy/daemonset`` alone (every GPU node unprivileged, driver never advertised there,
since the plugin's probe finds neither the capability nor the host cgroups), and
``deploy/overlays/driver-enforcement`` (that plus ``components/driver-enforcement``: a DaemonSet
variant on nodes labelled ``vramshare.io/enforcement=driver``); the DRA path ``deploy/daemonset/dra``
alone and ``deploy/overlays/dra-driver-enforcement`` (that plus ``components/dra-driver-enforcement``,
the DRA plugin's variant on the same nodes, granted the same as the device plugin's) or
``deploy/overlays/dra-mps-enforcement`` (the MPS daemon's directories, read-only, in the DRA plugin).
"""
from __future__ import annotations

import copy
import dataclasses
import os
import pathlib
import shutil
import subprocess
from dataclasses import dataclass, field
from typing import Any

import pytest
import yaml

from deviceplugin import enforcement
from deviceplugin.kubelet import cdi_names
from deviceplugin.kubelet.mig_cdi import MigCdi
from tests.fixtures.fake_nvml import H100_80GB, FakeNvml
from vramshare import config, contract
from vramshare_cli import kustomize
from vramshare.inventory import EnforcementMode

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
BASE, DRA = DEPLOY / "daemonset", DEPLOY / "daemonset" / "dra"
OVERLAYS = DEPLOY / "overlays"
INSTALLS = {"default": BASE, "driver-enforcement": OVERLAYS / "driver-enforcement",
            "mps-enforcement": OVERLAYS / "mps-enforcement", "cdi-cri": OVERLAYS / "cdi-cri", "dra": DRA,
            "dra-driver-enforcement": OVERLAYS / "dra-driver-enforcement",
            "dra-mps-enforcement": OVERLAYS / "dra-mps-enforcement",
            "driver-enforcement-with-dra": OVERLAYS / "driver-enforcement-with-dra"}
RW, RO = False, True  # hostPath mounts: readOnly


@dataclass(frozen=True)
class HostAccess:
    paths: dict[str, bool] = field(default_factory=dict)  # host path -> read-only
    capabilities: frozenset[str] = frozenset()
    privileged: bool = False
    host_pid: bool = False
    host_network: bool = False
    host_ipc: bool = False


def _config_text(objs: list[dict[str, Any]]) -> str:
    [cm] = [o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "vramshare-config"]
    return cm["data"]["config.yaml"]


def _env(ds: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for c in ds["spec"]["template"]["spec"]["containers"] for e in c.get("env", [])
            if "value" in e}


def _config(objs: list[dict[str, Any]], ds: dict[str, Any] | None = None) -> config.Config:
    """The config the plugin of ``ds`` runs with: the ConfigMap's, with its VRAMSHARE_* env applied."""
    return config.parse_config(_config_text(objs), _env(ds) if ds else None)


def device_plugin_needs(cfg: config.Config, mode: EnforcementMode) -> HostAccess:
    """From the code: what ``vramshare device-plugin`` touches on the host in ``mode``."""
    paths = {contract.DEVICE_PLUGIN_DIR: RW,  # its sockets, the kubelet's socket (lifecycle.py)
             os.path.dirname(contract.POD_RESOURCES_SOCKET): RO,  # the directory: the socket is re-created
             cfg.quota_host_dir: RW}  # quota files and links (quota_files.py, reconcile.py)
    if cfg.device_list_strategy is config.DeviceListStrategy.CDI_CRI:
        paths |= {root: RO for root in cdi_names.DEFAULT_ROOTS}  # main.py _check_cdi_names
        # mig_cdi.py: made MIG instances' specs go into the dynamic root. dynamicMig.gpus is a ConfigMap
        # key (restart-only) the DaemonSet does not follow: under cdi-cri a restart may start writing
        # there, so the root is granted writable with the strategy (components/cdi-cri), not per MIG key
        paths[MigCdi(cdi_names.DEFAULT_ROOTS).root] = RW
    caps: set[str] = set()
    if mode is EnforcementMode.DRIVER:
        paths[enforcement.HOST_CGROUP_ROOT] = RO  # CgroupFinder searches it; the driver moves the limits
        caps.add(enforcement.DRIVER_CAPABILITY)  # nvmlDeviceSetMemoryLimits_v1
    if mode is EnforcementMode.MPS:  # _mps_problem looks for the control pipe and the shared memory
        paths[_mps_root(cfg)] = RO
    return HostAccess(paths, frozenset(caps), host_pid=cfg.quota.process_attribution)


def _mps_root(cfg: config.Config) -> str:
    """The one directory holding the MPS daemon's pipe and shared-memory directories."""
    return os.path.commonpath([cfg.enforcement.mps_pipe_directory, cfg.enforcement.mps_shm_directory])


def dra_plugin_needs(cfg: config.Config, mode: EnforcementMode) -> HostAccess:
    """From the code: ``vramshare dra-plugin`` in ``mode``; in driver mode the same fence as the device
    plugin's (its quota loop moves the claims' cgroup limits: the host's cgroup tree and the capability)."""
    paths = {contract.KUBELET_REGISTRY_DIR: RW, os.path.join(contract.KUBELET_PLUGINS_DIR, cfg.names.dra_driver): RW,
             cfg.dra.cdi_root: RW, cfg.dra.state_dir: RW, cfg.quota_host_dir: RW}
    caps: set[str] = set()
    if mode is EnforcementMode.DRIVER:
        paths[enforcement.HOST_CGROUP_ROOT] = RO
        caps.add(enforcement.DRIVER_CAPABILITY)
    if mode is EnforcementMode.MPS:
        paths[_mps_root(cfg)] = RO
    return HostAccess(paths, frozenset(caps), host_pid=cfg.quota.process_attribution)


def granted(ds: dict[str, Any]) -> HostAccess:
    pod = ds["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    paths: dict[str, bool] = {}
    caps: set[str] = set()
    privileged = False
    for c in pod.get("initContainers", []) + pod["containers"]:
        for m in c.get("volumeMounts", []):
            host = volumes[m["name"]].get("hostPath")
            if host is not None:
                assert m["mountPath"] == host["path"], "the code reads host paths where the host has them"
                assert "subPath" not in m
                paths[host["path"]] = paths.get(host["path"], True) and bool(m.get("readOnly", False))
        sc = c.get("securityContext", {})
        caps |= set(sc.get("capabilities", {}).get("add", []))
        privileged |= bool(sc.get("privileged"))
        assert sc.get("allowPrivilegeEscalation") is False and sc.get("readOnlyRootFilesystem") is True
        assert sc.get("capabilities", {}).get("drop") == ["ALL"]
    return HostAccess(paths, frozenset(caps), privileged, bool(pod.get("hostPID")), bool(pod.get("hostNetwork")),
                      bool(pod.get("hostIPC")))


def _render(install: str) -> list[dict[str, Any]]:
    objs = kustomize.build(str(INSTALLS[install]))
    if install.startswith("dra"):  # the DRA path is applied after the base's namespace and ConfigMap
        objs += [o for o in kustomize.build(str(BASE)) if o["kind"] == "ConfigMap"]
    return objs


def _daemonsets(objs: list[dict[str, Any]], name_prefix: str) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] == "DaemonSet" and o["metadata"]["name"].startswith(name_prefix)]


def _schedules_on(ds: dict[str, Any], labels: dict[str, str]) -> bool:
    """The DaemonSet's nodeSelector and required node affinity (In / NotIn / Exists) on a node."""
    pod = ds["spec"]["template"]["spec"]
    if any(labels.get(k) != v for k, v in pod.get("nodeSelector", {}).items()):
        return False
    required = pod.get("affinity", {}).get("nodeAffinity", {}).get("requiredDuringSchedulingIgnoredDuringExecution")
    if not required:
        return True
    ops = {"In": lambda k, vs: labels.get(k) in vs, "NotIn": lambda k, vs: labels.get(k) not in vs,
           "Exists": lambda k, vs: k in labels}
    return any(all(ops[e["operator"]](e["key"], e.get("values", [])) for e in term["matchExpressions"])
               for term in required["nodeSelectorTerms"])


GPU_NODE = {"nvidia.com/gpu.present": "true"}
DRIVER_NODE = GPU_NODE | {enforcement.DRIVER_NODE_LABEL[0]: enforcement.DRIVER_NODE_LABEL[1]}


def _advertised_mode(ds: dict[str, Any], cfg: config.Config, tmp_path: pathlib.Path) -> EnforcementMode:
    """The mode this DaemonSet's plugin advertises on a node where every mode is possible (R615, cgroup
    v2, one shared H100, an MPS control daemon running), found by the plugin's own probe run inside what
    the pod is granted: the capabilities it adds (none: CapEff 0); /sys/fs/cgroup as the host's tree if
    it mounts it, else the container's own cgroup namespace; the MPS daemon's directories if it mounts
    them. ``cfg`` carries the pod's VRAMSHARE_* env."""
    got = granted(ds)
    root = tmp_path / ds["metadata"]["name"]
    (root / "cgroup").mkdir(parents=True)
    (root / "cgroup" / "cgroup.controllers").write_text("cpu memory dmem\n")
    if contract.HOST_CGROUP_ROOT in got.paths:
        (root / "cgroup" / "kubepods.slice").mkdir()
    seen = root / "container-view"  # what the container sees of the host's MPS directories
    pipe, shm = (seen / d.lstrip("/") for d in (cfg.enforcement.mps_pipe_directory, cfg.enforcement.mps_shm_directory))
    if any(_mps_root(cfg) == p or _mps_root(cfg).startswith(p.rstrip("/") + "/") for p in got.paths):
        pipe.mkdir(parents=True)
        os.mkfifo(pipe / enforcement.MPS_CONTROL_PIPE)
        shm.mkdir(parents=True)
    cap_eff = sum(1 << enforcement.CAP_BITS[c] for c in got.capabilities if c in enforcement.CAP_BITS)
    (root / "status").write_text(f"CapEff:\t{cap_eff:016x}\n")
    nvml = FakeNvml([H100_80GB])
    nvml.driver_version = "615.20.01"
    # Both DaemonSets run as UID 0: where the driver's check is the UID, NVML's own probe (a no-op Set on
    # the root cgroup) succeeds in the unprivileged pod too, so the plugin must check its grants itself.
    nvml.privileged = True
    nvml.nvmlInit()
    seen_cfg = dataclasses.replace(cfg.enforcement, mps_pipe_directory=str(pipe), mps_shm_directory=str(shm))
    facts = enforcement.probe(nvml, seen_cfg, cgroup_root=str(root / "cgroup"), shared_uuids=[H100_80GB.uuid],
                              proc_status=str(root / "status"))
    return enforcement.choose(cfg.enforcement.requested(), facts).mode


# -- the renderer renders what kustomize renders -----------------------------------------------------
@pytest.mark.parametrize("install", sorted(INSTALLS))
def test_the_python_render_is_kustomizes(install: str) -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not installed: the Python render alone is checked")
    done = subprocess.run([kubectl, "kustomize", str(INSTALLS[install])], capture_output=True, text=True, timeout=60,
                          check=True)
    theirs = {kustomize.key(o): _squeezed(o) for o in yaml.safe_load_all(done.stdout) if o}
    ours = {kustomize.key(o): _squeezed(o) for o in kustomize.build(str(INSTALLS[install]))}
    assert ours == theirs


def _squeezed(node: Any) -> Any:
    """Whitespace runs as one space: go-yaml and PyYAML fold the more-indented lines of a ``>-`` scalar
    differently (a CEL expression), which changes nothing the API server evaluates."""
    if isinstance(node, dict):
        return {k: _squeezed(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_squeezed(v) for v in node]
    return " ".join(node.split()) if isinstance(node, str) else node


# -- what each node's plugin is granted is what its mode needs ----------------------------------------
def _one_plugin_per_node(install: str, node: str, plugin: str, tmp_path: pathlib.Path) -> tuple[dict, Any, EnforcementMode]:
    """The one DaemonSet named ``plugin*`` of ``install`` that runs on a plain GPU node or a driver-labelled
    one, its config, and the mode it advertises there (its own probe inside its grants), which must be
    driver only where a driver variant is installed and the node labelled, mps wherever the MPS variant
    is (the label alone grants nothing)."""
    objs = _render(install)
    labels = DRIVER_NODE if node == "driver" else GPU_NODE
    [ds] = [ds for ds in _daemonsets(objs, plugin) if _schedules_on(ds, labels)]  # one per node
    cfg = _config(objs, ds)
    mode = _advertised_mode(ds, cfg, tmp_path)
    variant = install.removeprefix("dra-")
    expected = {("driver-enforcement", "driver"): EnforcementMode.DRIVER, ("mps-enforcement", "gpu"): EnforcementMode.MPS,
                ("mps-enforcement", "driver"): EnforcementMode.MPS}
    assert mode is expected.get((variant, node), EnforcementMode.COOPERATIVE)
    return ds, cfg, mode


@pytest.mark.parametrize("install", ["default", "driver-enforcement", "mps-enforcement", "cdi-cri"])
@pytest.mark.parametrize("node", ["gpu", "driver"])
def test_each_gpu_node_runs_one_device_plugin_granted_exactly_what_its_mode_needs(
        install: str, node: str, tmp_path: pathlib.Path) -> None:
    """On main the default plugin advertised driver on an R615 node (auto) with neither grant."""
    ds, cfg, mode = _one_plugin_per_node(install, node, "vramshare-device-plugin", tmp_path)
    assert granted(ds) == device_plugin_needs(cfg, mode)
    pod = ds["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    # NVML and the /dev/nvidia* nodes come from the NVIDIA runtime, NVML only; no device is a hostPath
    assert pod["runtimeClassName"] == "nvidia" and env["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert env["NVIDIA_DRIVER_CAPABILITIES"] == "utility"
    assert not any(p.startswith("/dev") for p in granted(ds).paths)


def test_the_default_install_grants_no_privilege_anywhere() -> None:
    for ds in _daemonsets(_render("default"), "vramshare-"):
        got = granted(ds)
        assert not got.capabilities and not got.privileged and enforcement.HOST_CGROUP_ROOT not in got.paths


def test_the_cdi_cri_install_mounts_the_root_made_mig_instances_specs_are_written_to() -> None:
    """Issue 24 leftover: on main no install mounted any CDI root, so with cdi-cri and dynamicMig the
    plugin wrote its made instances' specs into its own read-only root filesystem (or nowhere the
    runtime reads) and their containers failed at creation. The cdi-cri install mounts the directory
    MigCdi writes, read-write, from the host at the same path, created when missing; /etc/cdi read-only."""
    objs = _render("cdi-cri")
    [ds] = _daemonsets(objs, "vramshare-device-plugin")
    cfg = _config(objs, ds)
    assert cfg.device_list_strategy is config.DeviceListStrategy.CDI_CRI  # the strategy comes with its mounts
    pod = ds["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    [plugin] = pod["containers"]
    mounts = {m["mountPath"]: m for m in plugin["volumeMounts"]}
    written = MigCdi(cdi_names.DEFAULT_ROOTS).root  # what DevicePluginDaemon gives MigCdi: its default roots
    assert written == "/var/run/cdi"
    assert volumes[mounts[written]["name"]]["hostPath"] == {"path": written, "type": "DirectoryOrCreate"}
    assert not mounts[written].get("readOnly", False)
    for root in cdi_names.DEFAULT_ROOTS[:-1]:  # read at start (_check_cdi_names), never written
        assert volumes[mounts[root]["name"]]["hostPath"]["path"] == root and mounts[root]["readOnly"] is True
    base = _config(_render("default"))
    assert base.device_list_strategy is not config.DeviceListStrategy.CDI_CRI  # the default grants no CDI root


def test_cdi_cri_reaches_every_device_plugin_daemonset(tmp_path: pathlib.Path) -> None:
    """With driver-enforcement too, both DaemonSets run cdi-cri and each is granted exactly what its mode
    needs (a node labelled for driver must not fall back to envvar, nor miss the CDI roots)."""
    root = tmp_path / "install"
    root.mkdir()
    rel = lambda p: os.path.relpath(p, root)  # noqa: E731
    (root / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "resources": [rel(BASE)],
        "components": [rel(DEPLOY / "components" / "driver-enforcement"), rel(DEPLOY / "components" / "cdi-cri")]}))
    objs = kustomize.build(str(root))
    for labels, mode in ((GPU_NODE, EnforcementMode.COOPERATIVE), (DRIVER_NODE, EnforcementMode.DRIVER)):
        [ds] = [ds for ds in _daemonsets(objs, "vramshare-device-plugin") if _schedules_on(ds, labels)]
        cfg = _config(objs, ds)
        assert cfg.device_list_strategy is config.DeviceListStrategy.CDI_CRI
        assert _advertised_mode(ds, cfg, tmp_path) is mode
        assert granted(ds) == device_plugin_needs(cfg, mode)


@pytest.mark.parametrize("install", ["dra", "dra-driver-enforcement", "dra-mps-enforcement"])
@pytest.mark.parametrize("node", ["gpu", "driver"])
def test_each_gpu_node_runs_one_dra_plugin_granted_exactly_what_its_mode_needs(
        install: str, node: str, tmp_path: pathlib.Path) -> None:
    """On 4b86459 the DRA plugin had no driver variant: no install could grant what driver mode needs."""
    ds, cfg, mode = _one_plugin_per_node(install, node, "vramshare-dra-plugin", tmp_path)
    assert granted(ds) == dra_plugin_needs(cfg, mode)
    # the DRA plugin's driver grants are the device plugin's, from the same constants
    extra = lambda need: (set(need.paths.items()) - set(dra_plugin_needs(cfg, EnforcementMode.COOPERATIVE).paths.items()),  # noqa: E731
                          need.capabilities)
    if mode is EnforcementMode.DRIVER:
        assert extra(granted(ds)) == ({(contract.HOST_CGROUP_ROOT, RO)}, {enforcement.DRIVER_CAPABILITY})


def test_the_needs_follow_the_config() -> None:
    """The derivation itself: cdi-cri needs the CDI roots, per-process attribution the host PIDs."""
    cfg = config.parse_config("deviceListStrategy: cdi-cri\nquota: {processAttribution: true}")
    needs = device_plugin_needs(cfg, EnforcementMode.COOPERATIVE)
    assert set(cdi_names.DEFAULT_ROOTS) <= set(needs.paths) and needs.host_pid
    assert needs.paths[cdi_names.DEFAULT_ROOTS[-1]] == RW and needs.paths[cdi_names.DEFAULT_ROOTS[0]] == RO
    assert not set(cdi_names.DEFAULT_ROOTS) & set(device_plugin_needs(config.Config(), EnforcementMode.COOPERATIVE).paths)
    driver = device_plugin_needs(config.Config(), EnforcementMode.DRIVER)
    assert driver.paths[contract.HOST_CGROUP_ROOT] is RO and driver.capabilities == {"SYS_ADMIN"}
    mps = device_plugin_needs(config.Config(), EnforcementMode.MPS)
    assert mps.paths["/run/nvidia/mps"] is RO and not mps.capabilities


# -- the variant is the default DaemonSet plus exactly the driver grants -------------------------------
def driver_variant(base: dict[str, Any]) -> dict[str, Any]:
    """The default DaemonSet with exactly the differences driver mode needs, from the code's constants."""
    ds = copy.deepcopy(base)
    label_key, label_value = enforcement.DRIVER_NODE_LABEL
    ds["metadata"]["name"] += "-driver"
    for labels in (ds["metadata"]["labels"], ds["spec"]["selector"]["matchLabels"],
                   ds["spec"]["template"]["metadata"]["labels"]):
        labels[label_key] = label_value
    pod = ds["spec"]["template"]["spec"]
    pod["nodeSelector"][label_key] = label_value
    [c] = pod["containers"]
    c["env"].append({"name": "VRAMSHARE_ENFORCEMENT_MODE", "value": EnforcementMode.DRIVER.value})
    c["securityContext"]["capabilities"]["add"] = [enforcement.DRIVER_CAPABILITY]
    c["volumeMounts"].append({"name": "host-cgroup", "mountPath": contract.HOST_CGROUP_ROOT, "readOnly": True})
    pod["volumes"].append({"name": "host-cgroup", "hostPath": {"path": contract.HOST_CGROUP_ROOT, "type": "Directory"}})
    return ds


@pytest.mark.parametrize("base_file, variant_file", [
    (BASE / "device-plugin.yaml", DEPLOY / "components" / "driver-enforcement" / "device-plugin-driver.yaml"),
    (DRA / "dra-plugin.yaml", DEPLOY / "components" / "dra-driver-enforcement" / "dra-plugin-driver.yaml")])
def test_the_driver_variant_differs_from_the_default_only_by_the_driver_grants(base_file, variant_file) -> None:
    """The variant is a copy (kustomize cannot clone a resource under a new name); this keeps it one."""
    [base] = [d for d in yaml.safe_load_all(base_file.read_text()) if d]
    [variant] = [d for d in yaml.safe_load_all(variant_file.read_text()) if d]
    assert variant == driver_variant(base)


@pytest.mark.parametrize("install, variant", [("driver-enforcement", "vramshare-device-plugin-driver"),
                                               ("dra-driver-enforcement", "vramshare-dra-plugin-driver")])
def test_the_variant_s_mode_is_explicit_so_a_node_that_cannot_honour_it_says_why(install, variant) -> None:
    """With VRAMSHARE_ENFORCEMENT_MODE=driver the plugin is refused with the reason (not a silent
    fallback that would keep a capability for nothing) on a node without R615, cgroup v2 or the grants."""
    objs = _render(install)
    [ds] = _daemonsets(objs, variant)
    assert _config(objs, ds).enforcement.requested() is EnforcementMode.DRIVER
    assert _config(objs).enforcement.requested() is None  # the default DaemonSet: auto


@pytest.mark.parametrize("install", ["driver-enforcement", "mps-enforcement", "dra-driver-enforcement",
                                     "dra-mps-enforcement"])
@pytest.mark.parametrize("version", ["1.31", "1.35"])
def test_the_components_render_valid_daemonsets(install: str, version: str) -> None:
    import kubernetes_validate
    for ds in _daemonsets(_render(install), "vramshare-"):
        kubernetes_validate.validate(ds, version, strict=True)


# -- one install for a node running both plugins in driver mode (round 9) -------------------------------
def _both_driver(objs: list[dict[str, Any]], tmp_path: pathlib.Path) -> None:
    """On a plain GPU node and on a driver-labelled one, exactly one device plugin and one DRA plugin run;
    on the labelled node both advertise driver and each is granted exactly what driver mode needs (the
    capability and the host cgroup tree, read-only: nothing more), on the plain node both cooperative."""
    for labels, mode in ((GPU_NODE, EnforcementMode.COOPERATIVE), (DRIVER_NODE, EnforcementMode.DRIVER)):
        for plugin, needs in (("vramshare-device-plugin", device_plugin_needs), ("vramshare-dra-plugin", dra_plugin_needs)):
            [ds] = [ds for ds in _daemonsets(objs, plugin) if _schedules_on(ds, labels)]
            cfg = _config(objs, ds)
            assert ds["metadata"]["name"] == plugin + ("-driver" if mode is EnforcementMode.DRIVER else "")
            assert _advertised_mode(ds, cfg, tmp_path / str(mode.value)) is mode
            assert granted(ds) == needs(cfg, mode)
            assert cfg.enforcement.requested() is (EnforcementMode.DRIVER if mode is EnforcementMode.DRIVER else None)
    assert sorted(ds["metadata"]["name"] for ds in _daemonsets(objs, "vramshare-")) == [
        "vramshare-device-plugin", "vramshare-device-plugin-driver", "vramshare-dra-plugin",
        "vramshare-dra-plugin-driver"]  # no other DaemonSet, so no other grant
    for o in objs:  # and no other workload gains a capability
        if o["kind"] == "Deployment":
            assert not any(c.get("securityContext", {}).get("capabilities", {}).get("add")
                           for c in o["spec"]["template"]["spec"]["containers"])


def test_one_overlay_runs_both_plugins_in_driver_mode_on_the_labelled_nodes(tmp_path: pathlib.Path) -> None:
    """On 0732846 a node running both plugins needed two installs (overlays/driver-enforcement and
    overlays/dra-driver-enforcement, each with its own copy of the base); overlays/driver-enforcement-with-dra
    is one."""
    objs = _render("driver-enforcement-with-dra")
    _both_driver(objs, tmp_path)
    schedulers = {c["image"] for o in objs for c in kustomize._containers([o]) if "kube-scheduler" in c["image"]}
    assert schedulers == {"registry.k8s.io/kube-scheduler:v1.36.0"}  # both schedulers follow a 1.36+ control plane


def test_install_enforcement_driver_with_dra_composes_both_components(tmp_path: pathlib.Path) -> None:
    """``vramshare install --dra --enforcement driver`` renders what the overlay renders, its DaemonSets
    granted as above; on 0732846 there was no --enforcement, and ``--dra --component dra-driver-enforcement``
    failed (the component was applied before the DRA objects were added: "matches no object")."""
    from vramshare_cli import install
    opts = install.Options(kubernetes_version="1.36.0", dra=True, enforcement="driver", tls="keep")
    objs = install.render(opts)
    _both_driver(objs, tmp_path)
    overlay = {kustomize.key(o): o for o in _render("driver-enforcement-with-dra")}
    rendered = {kustomize.key(o): o for o in objs}
    assert rendered.keys() == overlay.keys()
    for key, obj in overlay.items():
        if obj["kind"] == "DaemonSet":  # the image is install's --image; all else is the overlay's
            ours = copy.deepcopy(rendered[key])
            for c in kustomize._containers([ours]):
                c["image"] = next(x["image"] for x in kustomize._containers([obj]) if x["name"] == c["name"])
            assert ours == obj
    by_hand = install.render(install.Options(kubernetes_version="1.36.0", dra=True, tls="keep",
                                             components=("driver-enforcement", "dra-driver-enforcement")))
    assert {kustomize.key(o) for o in by_hand} == set(rendered)
    alone = install.render(install.Options(kubernetes_version="1.36.0", enforcement="driver", tls="keep"))
    assert [o["metadata"]["name"] for o in _daemonsets(alone, "vramshare-")] == [
        "vramshare-device-plugin", "vramshare-device-plugin-driver"]  # without --dra: the device plugin's alone
