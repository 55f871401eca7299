"""Every YAML document under deploy/daemonset/ against the Kubernetes schemas, plus the invariants
that a schema cannot see: the config parses, the kubelet directories are mounted as directories, the
RBAC grants exactly what each daemon's code calls (the device plugin and, under dra/, the DRA plugin),
the kube-schedulers get the upstream roles and their own Lease only, and the kustomization lists
every resource. The DRA path's schemas (1.36+) are checked in test_dra_manifests.py.
"""
from __future__ import annotations

import ast
import os
import pathlib
import re
from typing import Any, Iterable, Iterator

import kubernetes_validate
import pytest
import yaml

from vramshare import config, contract
from vramshare_cli import main as cli

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "daemonset"
K8S_VERSIONS = ["1.31", "1.35"]  # oldest supported (CDI GA) and a recent one
# Documents that are not API objects, hence have no schema; each gets its own checks below.
NON_API_KINDS = {"Kustomization": "kustomize.config.k8s.io/", "KubeSchedulerConfiguration": "kubescheduler.config.k8s.io/"}
NAMESPACE = "vramshare-system"


def _documents() -> Iterator[tuple[str, int, dict[str, Any]]]:
    for path in sorted(list(DEPLOY.rglob("*.yaml")) + list(DEPLOY.rglob("*.yml"))):
        if DEPLOY / "dra" in path.parents:
            continue  # the DRA path (Kubernetes 1.36+) has its own kustomization: test_dra_manifests.py
        with open(path, encoding="utf-8") as fh:
            for i, doc in enumerate(yaml.safe_load_all(fh)):
                if doc is not None:
                    yield str(path.relative_to(DEPLOY)), i, doc


DOCS = list(_documents())


def _dra_documents() -> Iterator[tuple[str, int, dict[str, Any]]]:
    for path in sorted((DEPLOY / "dra").glob("*.yaml")):  # not examples/: users apply those
        for i, doc in enumerate(yaml.safe_load_all(path.read_text(encoding="utf-8"))):
            if doc is not None:
                yield str(path.relative_to(DEPLOY)), i, doc


DRA_DOCS = list(_dra_documents())
ALL_DOCS = DOCS + DRA_DOCS


def _id(doc: tuple[str, int, dict[str, Any]]) -> str:
    name, i, body = doc
    return f"{name}#{i}:{body.get('kind')}/{(body.get('metadata') or {}).get('name')}"


def _one(kind: str, name: str, docs: list[tuple[str, int, dict[str, Any]]] = DOCS) -> dict[str, Any]:
    found = [d for _, _, d in docs if d.get("kind") == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name} under deploy/daemonset, found {len(found)}"
    return found[0]


def test_the_directory_has_the_device_plugin_manifests():
    kinds = {(d["kind"], d["metadata"]["name"]) for _, _, d in DOCS if d.get("kind") != "Kustomization"}
    assert {("Namespace", NAMESPACE), ("DaemonSet", "vramshare-device-plugin"),
            ("ServiceAccount", "vramshare-device-plugin"), ("ClusterRole", "vramshare-device-plugin"),
            ("ClusterRoleBinding", "vramshare-device-plugin"), ("ConfigMap", "vramshare-config")} <= kinds


@pytest.mark.parametrize("doc", DOCS, ids=_id)
@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_document_is_valid(doc, version):
    _name, _i, body = doc
    assert isinstance(body, dict) and body.get("apiVersion") and body.get("kind"), "apiVersion and kind"
    prefix = NON_API_KINDS.get(body["kind"])
    if prefix is not None:
        assert body["apiVersion"].startswith(prefix), f"{body['kind']} wants apiVersion {prefix}..."
        return
    kubernetes_validate.validate(body, version, strict=True)  # raises ValidationError naming the field


@pytest.mark.parametrize("doc", [d for d in ALL_DOCS if d[2].get("kind") not in NON_API_KINDS], ids=_id)
def test_namespaced_objects_live_in_our_namespace(doc):
    body = doc[2]
    if body["kind"] in {"Namespace", "ClusterRole", "ClusterRoleBinding", "PriorityClass",
                        "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding", "DeviceClass"}:
        assert "namespace" not in body["metadata"]
    elif body["kind"] not in {"Role", "RoleBinding"}:  # a Role may have to live in kube-system
        assert body["metadata"].get("namespace") == NAMESPACE


def test_kustomization_lists_every_resource_file():
    kust = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    listed = set(kust["resources"])
    for entry in listed:
        assert (DEPLOY / entry).is_file(), f"kustomization.yaml lists {entry}, which does not exist"
    with_objects = {name for name, _, d in DOCS if d.get("kind") not in NON_API_KINDS}
    missing = with_objects - listed
    assert not missing, f"add {sorted(missing)} to deploy/daemonset/kustomization.yaml resources"


# -- the config -------------------------------------------------------------------------------
def _config_text() -> str:
    return _one("ConfigMap", "vramshare-config")["data"]["config.yaml"]


def test_configmap_config_parses_and_documents_the_defaults():
    assert config.parse_config(_config_text()) == config.Config()


def test_configmap_shows_every_key():
    raw = yaml.safe_load(_config_text())
    sections = {"": (raw, config._TOP_KEYS), "health.": (raw["health"], config._HEALTH_KEYS),
                "extender.": (raw["extender"], config._EXTENDER_KEYS), "quota.": (raw["quota"], config._QUOTA_KEYS),
                "warmTier.": (raw["warmTier"], config._WARM_KEYS)}
    for prefix, (given, known) in sections.items():
        missing = sorted(set(known) - set(given))
        assert not missing, f"document {[prefix + k for k in missing]} in configmap.yaml"


def test_configmap_lists_exactly_the_keys_a_reload_leaves_for_a_restart():
    """The ConfigMap's header names what the node plugins read only at start (config.RESTART_ONLY, and
    quota.enabled turned on): the admin's answer to "did my edit apply?"."""
    header = (DEPLOY / "configmap.yaml").read_text()
    listed = {key.split(" (")[0].strip() for line in header.splitlines() if line.startswith("#   restart: ")
              for key in line.removeprefix("#   restart: ").split(",") if key.strip()}
    assert listed == set(config.RESTART_ONLY) | {"quota.enabled"}
    for key in listed:
        assert config.NODE_RESTART in config.applies(key, False, True), key


# -- the DaemonSet ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pod() -> dict[str, Any]:
    return _one("DaemonSet", "vramshare-device-plugin")["spec"]["template"]["spec"]


@pytest.fixture(scope="module")
def container(pod) -> dict[str, Any]:
    [c] = pod["containers"]
    return c


def _mounts(pod, container) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """Mount path -> (volume, mount)."""
    volumes = {v["name"]: v for v in pod["volumes"]}
    return {m["mountPath"]: (volumes[m["name"]], m) for m in container["volumeMounts"]}


def test_kubelet_directories_are_mounted_as_directories(pod, container):
    mounts = _mounts(pod, container)
    for path in (contract.DEVICE_PLUGIN_DIR, os.path.dirname(contract.POD_RESOURCES_SOCKET)):
        volume, mount = mounts[path]
        assert volume["hostPath"] == {"path": path, "type": "Directory"}
        assert "subPath" not in mount
    for volume, _mount in mounts.values():
        assert not volume.get("hostPath", {}).get("path", "").endswith(".sock"), "mount directories, not sockets"
    assert mounts[contract.HOST_QUOTA_ROOT][0]["hostPath"]["path"] == config.Config().quota_host_dir


def test_config_is_the_configmap_directory_and_the_args_agree(pod, container):
    argv = container["command"][1:] + container["args"]
    args = cli.build_parser().parse_args(argv)
    assert args.command == "device-plugin" and args.backend == "nvml"
    volume, mount = _mounts(pod, container)[os.path.dirname(args.config)]
    assert volume["configMap"]["name"] == "vramshare-config" and "subPath" not in mount
    assert os.path.basename(args.config) in _one("ConfigMap", "vramshare-config")["data"]
    assert container["livenessProbe"]["httpGet"]["path"] == "/metrics"
    port = {p["name"]: p["containerPort"] for p in container["ports"]}[container["livenessProbe"]["httpGet"]["port"]]
    assert port == args.metrics_port


def test_node_name_and_gpu_runtime(pod, container):
    env = {e["name"]: e for e in container["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert pod.get("runtimeClassName") == "nvidia" or "NVIDIA_VISIBLE_DEVICES" in env
    assert pod["priorityClassName"] == "system-node-critical"
    assert any(t.get("key") == "nvidia.com/gpu" for t in pod["tolerations"])
    assert pod["nodeSelector"]


def test_security_context_is_tight(pod, container):
    sc = container["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False and sc.get("privileged") is False
    assert sc["readOnlyRootFilesystem"] is True and sc["capabilities"]["drop"] == ["ALL"]
    assert "add" not in sc["capabilities"]
    assert not pod.get("hostNetwork") and not pod.get("hostIPC")
    assert container["resources"]["requests"] and container["resources"]["limits"]["memory"]


# -- RBAC: exactly what the code calls --------------------------------------------------------
_VERB = {"read": "get", "list": "list", "patch": "patch", "create": "create", "delete": "delete",
         "replace": "update"}
# a call, or the bound method handed to a helper that calls it (``_read(api.read_namespaced_pod, ...)``)
_CALL = re.compile(r"\.(read|list|patch|create|delete|replace)_(?:namespaced_)?([a-z_]+?)"
                   r"(?:_for_all_namespaces)?[(,]")
#: the API client classes whose calls are scanned, and the API group of their resources
API_CLIENTS = {"CoreV1Api": "", "ResourceV1Api": "resource.k8s.io"}


def used_rights(package: pathlib.Path) -> set[tuple[str, str]]:
    """(resource, verb) of every API call in the package (the device plugin: all but dra/)."""
    return rights_in(p for p in package.rglob("*.py") if package / "dra" not in p.parents)


#: Server-side applies that never create: the API server authorizes the create an apply would do
#: (apiserver handlers/patch.go, the create authorizer attributes), and the device plugin applies only
#: to pods that exist (with their resourceVersion); without a pods/create right a pod deleted
#: meanwhile gets 403 and is dropped. Granting create would let a node agent create any pod.
APPLY_NEVER_CREATES = {"pods"}


def rights_in(paths: Iterable[pathlib.Path]) -> set[tuple[str, str]]:
    """(resource, verb) of every CoreV1Api / ResourceV1Api call in the files that build such a client.
    A server-side apply (an ``apply-patch`` content type in the file) also creates: patch implies create,
    except on :data:`APPLY_NEVER_CREATES`."""
    rights: set[tuple[str, str]] = set()
    for path in paths:
        source = path.read_text(encoding="utf-8")
        if not any(api in source for api in API_CLIENTS):
            continue
        # a vramshare.watch.ListWatch watches with the list call it is given
        watches = "watch=True" in source or "Watch()" in source or "ListWatch(" in source
        applies = "application/apply-patch" in source
        for match in _CALL.finditer(source):
            verb, resource = match.groups()
            sub = ""
            if resource == "pod_binding":  # create_namespaced_pod_binding: the pods/binding subresource
                resource, sub = "pod", "/binding"
            if resource.endswith("_status"):
                resource, sub = resource[: -len("_status")], "/status"
            elif resource.endswith("_eviction"):  # create_namespaced_pod_eviction: pods/eviction
                resource, sub = resource[: -len("_eviction")], "/eviction"
            plural = resource.replace("_", "") + "s" + sub
            rights.add((plural, _VERB[verb]))
            if verb == "list" and watches:
                rights.add((plural, "watch"))
            if verb == "patch" and applies and plural not in APPLY_NEVER_CREATES and _is_apply(source, match.end()):
                rights.add((plural, "create"))
    return rights


def _is_apply(source: str, start: int) -> bool:
    """Whether the call opened at ``start`` passes an apply content type (its arguments, to the
    matching parenthesis)."""
    depth, i = 1, start
    while i < len(source) and depth:
        depth += {"(": 1, ")": -1}.get(source[i], 0)
        i += 1
    args = source[start:i]
    return "APPLY" in args or "apply-patch" in args


def granted_rights(role: dict[str, Any]) -> set[tuple[str, str]]:
    return {(r, v) for rule in role["rules"] for r in rule["resources"] for v in rule["verbs"]}


#: rights the node plugins' code calls that only an opt-in component grants (issue 17: the eviction
#: right only where overLimitAction: evict is configured): right -> deploy/components/<name>
OPT_IN = {("pods/eviction", "create"): "over-limit-evict"}
COMPONENTS = ROOT / "deploy" / "components"


def _component_docs(name: str) -> list[tuple[str, int, dict[str, Any]]]:
    return [(str(p.relative_to(COMPONENTS)), i, d) for p in sorted((COMPONENTS / name).glob("*.yaml"))
            if p.name != "kustomization.yaml" for i, d in enumerate(yaml.safe_load_all(p.read_text())) if d]


def test_device_plugin_rbac_is_exactly_what_its_code_calls():
    used = used_rights(ROOT / "deviceplugin")
    assert used, "no Kubernetes API call found in deviceplugin/: the scan is broken"
    granted = granted_rights(_one("ClusterRole", "vramshare-device-plugin"))
    assert granted - used == set(), "granted but never called: remove from rbac-device-plugin.yaml"
    assert used - granted == set(OPT_IN), "called but not granted: add to rbac-device-plugin.yaml"


def test_the_eviction_right_is_only_in_its_opt_in_component():
    """Issue 17 item 15: the default ClusterRoles granted pods/eviction create whatever overLimitAction said."""
    for _, _, doc in ALL_DOCS:
        if doc.get("kind") in {"ClusterRole", "Role"}:
            assert not set(OPT_IN) & granted_rights(doc), f"{doc['metadata']['name']} grants an opt-in right"
    for right, component in OPT_IN.items():
        docs = _component_docs(component)
        [role] = [d for _, _, d in docs if d["kind"] == "ClusterRole"]
        assert granted_rights(role) == {right}
        [binding] = [d for _, _, d in docs if d["kind"] == "ClusterRoleBinding"]
        assert binding["roleRef"]["name"] == role["metadata"]["name"]
        assert {s["name"] for s in binding["subjects"]} == {"vramshare-device-plugin", "vramshare-dra-plugin"}
        for _, _, doc in docs:
            for version in K8S_VERSIONS:
                kubernetes_validate.validate(doc, version, strict=True)
    assert {g for rule in _one("ClusterRole", "vramshare-device-plugin")["rules"] for g in rule["apiGroups"]} == {""}


def test_extender_pod_writes_are_no_wider_than_kube_schedulers():
    """kube-scheduler's system:kube-scheduler role writes pods only through pods/binding, pods/status
    and delete; the extender's extra `patch` on pods is narrowed to vramshare.io/* annotations by the
    vramshare-extender-scope admission policy (tests/security/test_admission_policies.py)."""
    granted = granted_rights(_one("ClusterRole", "vramshare-extender"))
    writes = {(r, v) for r, v in granted if v not in {"get", "list", "watch"}}
    assert writes == {("pods", "patch"), ("pods/binding", "create")}
    _one("ValidatingAdmissionPolicy", "vramshare-extender-scope")


def test_rbac_scan_sees_verbs_and_watches(tmp_path):
    (tmp_path / "a.py").write_text("v1 = client.CoreV1Api(api)\nv1.read_node(n)\nv1.patch_namespaced_pod_status(p)\n"
                                   "w.stream(v1.list_pod_for_all_namespaces(watch=True))\n")
    assert used_rights(tmp_path) == {("nodes", "get"), ("pods/status", "patch"), ("pods", "list"),
                                     ("pods", "watch")}


def test_device_plugin_binding_and_service_account_agree(pod):
    binding = _one("ClusterRoleBinding", "vramshare-device-plugin")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                  "name": "vramshare-device-plugin"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": pod["serviceAccountName"],
                                    "namespace": NAMESPACE}]
    _one("ServiceAccount", pod["serviceAccountName"])


@pytest.mark.parametrize("doc", [d for d in ALL_DOCS if d[2].get("kind") in {"ClusterRole", "Role"}], ids=_id)
def test_no_rbac_wildcards(doc):
    for rule in doc[2]["rules"]:
        for key in ("apiGroups", "resources", "verbs"):
            assert "*" not in rule.get(key, []), f"{key}: no wildcards"


# -- the DRA path (deploy/daemonset/dra/) ---------------------------------------------------------
def _module_path(module: str) -> pathlib.Path | None:
    for p in (ROOT / (module.replace(".", "/") + ".py"), ROOT / module.replace(".", "/") / "__init__.py"):
        if p.is_file():
            return p
    return None


def _imports(path: pathlib.Path) -> set[str]:
    """Our modules ``path`` imports, at any depth of the file (function-level imports too)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return {m for m in out if m.split(".")[0] in {"deviceplugin", "vramshare"} and _module_path(m)}


def dra_plugin_modules() -> set[pathlib.Path]:
    """The files the DRA plugin runs: deviceplugin/dra/ and everything it imports (transitively)."""
    seen: set[str] = set()
    todo = [f"deviceplugin.dra.{p.stem}" for p in (ROOT / "deviceplugin" / "dra").glob("*.py")]
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        todo += _imports(_module_path(module))
    return {_module_path(m) for m in seen}


def test_the_dra_plugin_runs_nothing_of_the_kubelet_plugin():
    """It shares the backend choice (deviceplugin/backend_choice.py) and the rest of deviceplugin/'s shared
    level, so the scan below covers all it runs (tests/test_layering.py keeps the two programs apart)."""
    modules = dra_plugin_modules()
    assert ROOT / "deviceplugin" / "backend_choice.py" in modules
    assert not any("kubelet" in p.relative_to(ROOT).parts for p in modules)


def test_dra_plugin_rbac_is_exactly_what_its_code_calls():
    """Its ResourceSlices (publisher.py: list, server-side apply, delete), the claims Prepare reads,
    the Node it reads, and the quota loop it runs (deviceplugin/quota: this node's pods, the
    quota-mib mirror, over-limit events and evictions)."""
    modules = dra_plugin_modules()
    assert ROOT / "deviceplugin" / "quota" / "kube.py" in modules, "the import scan lost the quota loop"
    used = rights_in(modules)
    role = _one("ClusterRole", "vramshare-dra-plugin", DRA_DOCS)
    granted = granted_rights(role)
    assert granted - used == set(), "granted but never called: remove from dra/rbac-dra-plugin.yaml"
    assert used - granted == set(OPT_IN), "called but not granted: add to dra/rbac-dra-plugin.yaml"
    for rule in role["rules"]:
        want = {"resource.k8s.io" if r.startswith("resource") else "" for r in rule["resources"]}
        assert set(rule["apiGroups"]) == want, rule


def test_dra_plugin_binding_and_service_account_agree():
    pod = _one("DaemonSet", "vramshare-dra-plugin", DRA_DOCS)["spec"]["template"]["spec"]
    binding = _one("ClusterRoleBinding", "vramshare-dra-plugin", DRA_DOCS)
    assert binding["roleRef"]["name"] == "vramshare-dra-plugin"
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": pod["serviceAccountName"], "namespace": NAMESPACE}]
    _one("ServiceAccount", pod["serviceAccountName"], DRA_DOCS)


def _role_refs(sa: str) -> dict[str, dict[str, Any]]:
    """roleRef name -> the binding, for every binding of service account ``sa`` in deploy/daemonset/."""
    subject = {"kind": "ServiceAccount", "name": sa, "namespace": NAMESPACE}
    return {d["roleRef"]["name"]: d for _, _, d in ALL_DOCS
            if d.get("kind") in {"ClusterRoleBinding", "RoleBinding"} and subject in d["subjects"]}


@pytest.mark.parametrize("deployment", ["vramshare-scheduler", "vramshare-dra-scheduler"])
def test_each_kube_scheduler_has_the_upstream_roles_and_only_its_own_lease(deployment):
    """kube-scheduler is not our code: its identity gets the built-in roles, the front-proxy CA
    reader, and a Lease Role naming only the Lease its configuration elects with."""
    dep = _one("Deployment", deployment, ALL_DOCS)
    sa = dep["spec"]["template"]["spec"]["serviceAccountName"]
    refs = _role_refs(sa)
    lease_roles = {n for n, bd in refs.items() if bd["roleRef"]["kind"] == "Role" and bd["metadata"]["namespace"] == NAMESPACE}
    assert set(refs) - lease_roles == {"system:kube-scheduler", "system:volume-scheduler",
                                       "extension-apiserver-authentication-reader"}
    assert refs["extension-apiserver-authentication-reader"]["metadata"]["namespace"] == "kube-system"
    [lease_role] = lease_roles
    [cm_volume] = [v for v in dep["spec"]["template"]["spec"]["volumes"] if "configMap" in v]
    cm = _one("ConfigMap", cm_volume["configMap"]["name"], ALL_DOCS)
    elect = yaml.safe_load(cm["data"]["scheduler-config.yaml"])["leaderElection"]["resourceName"]
    role = _one("Role", lease_role, ALL_DOCS)
    named = {n for r in role["rules"] for n in r.get("resourceNames", [])}
    assert named == {elect}
    assert all(r["resources"] == ["leases"] for r in role["rules"])
    others = {d["spec"]["template"]["spec"]["serviceAccountName"] for _, _, d in ALL_DOCS
              if d.get("kind") in {"Deployment", "DaemonSet"} and d["metadata"]["name"] != deployment}
    assert sa not in others, f"{deployment} shares its service account"
