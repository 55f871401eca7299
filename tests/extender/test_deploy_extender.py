"""The extender's manifests agree with its code: scheduler config, routes, ports, probes and RBAC.

tests/deploy/test_manifests.py validates every document against the Kubernetes schemas; these are the
invariants a schema cannot see.
"""
from __future__ import annotations

import pathlib
import re
import urllib.parse
from typing import Any

import pytest
import yaml

from extender import accounting, app, metrics
from vramshare import contract
from vramshare_cli import main as cli
from vramshare.config import Config, Policy

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "daemonset"
NAMES = contract.Names()


def docs(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((DEPLOY / name).read_text()) if d]


def one(name: str, kind: str, obj: str | None = None) -> dict[str, Any]:
    [found] = [d for d in docs(name) if d["kind"] == kind and (obj is None or d["metadata"]["name"] == obj)]
    return found


@pytest.fixture(scope="module")
def sched_config() -> dict[str, Any]:
    cm = one("scheduler-config.yaml", "ConfigMap")
    return yaml.safe_load(cm["data"]["scheduler-config.yaml"])


@pytest.fixture(scope="module")
def ext(sched_config: dict[str, Any]) -> dict[str, Any]:
    [entry] = sched_config["extenders"]
    return entry


@pytest.fixture(scope="module")
def service_app() -> app.Extender:
    acct = accounting.Accounting(Config())
    return app.Extender(acct, None, None, metrics.ExtenderMetrics(acct), Policy.FGD)  # type: ignore[arg-type]


def test_profile_and_extender_settings(sched_config: dict[str, Any], ext: dict[str, Any]) -> None:
    assert sched_config["apiVersion"] == "kubescheduler.config.k8s.io/v1"
    assert [p["schedulerName"] for p in sched_config["profiles"]] == ["vramshare-scheduler"]
    assert sched_config["percentageOfNodesToScore"] == 100
    assert ext["nodeCacheCapable"] is True and ext["ignorable"] is False and ext["enableHTTPS"] is True
    assert ext["weight"] >= 3 and re.fullmatch(r"\d+s", ext["httpTimeout"])
    assert all(m["ignoredByScheduler"] is False for m in ext["managedResources"])
    managed = [m["name"] for m in ext["managedResources"]]
    assert len(managed) == len(set(managed))
    assert {NAMES.gpu_memory, NAMES.gpu, NAMES.mig("1g.10gb"), NAMES.mig("1g.10gb+me"), NAMES.mig("3g.40gb")} <= set(managed)
    assert all(NAMES.is_ours(m) for m in managed)


#: kube-scheduler's default score plugins and weights, 1.28 to 1.34 (pkg/scheduler/apis/config/v1/
#: default_plugins.go, getDefaultPlugins: MultiPoint). MaxNodeScore 100, MaxExtenderPriority 10.
DEFAULT_SCORE_WEIGHTS = {"TaintToleration": 3, "NodeAffinity": 2, "NodeResourcesFit": 1, "PodTopologySpread": 2,
                         "InterPodAffinity": 2, "NodeResourcesBalancedAllocation": 1, "ImageLocality": 1}
MAX_NODE_SCORE, MAX_EXTENDER_PRIORITY = 100, contract.MAX_EXTENDER_PRIORITY


def test_one_step_of_the_extenders_score_outweighs_every_default_score_plugin(
        sched_config: dict[str, Any], ext: dict[str, Any]) -> None:
    """schedule_one.go prioritizeNodes: extender score x weight x (MaxNodeScore / MaxExtenderPriority)."""
    [profile] = sched_config["profiles"]
    score = (profile.get("plugins") or {}).get("score") or {}
    disabled = {p["name"] for p in score.get("disabled") or []}
    assert disabled <= set(DEFAULT_SCORE_WEIGHTS) and not score.get("enabled")
    others = sum(w for name, w in DEFAULT_SCORE_WEIGHTS.items() if name not in disabled) * MAX_NODE_SCORE
    step = 1 * ext["weight"] * (MAX_NODE_SCORE // MAX_EXTENDER_PRIORITY)
    assert step > others, f"one extender step {step} <= default plugins' {others}"
    assert (others, step) == (900, 1000)  # the arithmetic the YAML comment shows
    assert {"TaintToleration", "NodeAffinity", "PodTopologySpread", "InterPodAffinity"}.isdisjoint(disabled)


def test_every_verb_is_a_route_of_the_extender(ext: dict[str, Any], service_app: app.Extender) -> None:
    for key in ("filterVerb", "prioritizeVerb", "preemptVerb"):
        resp = service_app.handle("POST", f"/{ext[key]}", b"{}")
        assert resp.status == 200 and resp.content_type == "application/json"
    assert service_app.handle("POST", "/nope", b"{}").status == 404
    assert ext["bindVerb"] == "bind"


def test_url_reaches_the_service_and_the_container(ext: dict[str, Any]) -> None:
    url = urllib.parse.urlsplit(ext["urlPrefix"])
    service = one("extender.yaml", "Service")
    assert url.hostname == f"{service['metadata']['name']}.{service['metadata']['namespace']}.svc"
    port = next(p for p in service["spec"]["ports"] if p["name"] == "https")
    assert url.scheme == "https" and url.port == port["port"]
    pod = one("extender.yaml", "Deployment")["spec"]["template"]["spec"]
    [c] = pod["containers"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    args = cli.build_parser().parse_args(c["command"][1:] + c["args"])
    assert args.command == "extender" and int(args.listen.rsplit(":", 1)[1]) == ports[port["targetPort"]]
    assert args.tls_cert and args.tls_key and args.client_ca  # the verbs need the scheduler's certificate
    metrics_port = next(p for p in service["spec"]["ports"] if p["name"] == "metrics")
    assert int(args.metrics_listen.rsplit(":", 1)[1]) == ports[metrics_port["targetPort"]]
    labels = one("extender.yaml", "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    volumes = {v["name"]: v for v in pod["volumes"]}
    mount = next(m for m in c["volumeMounts"] if args.config.startswith(m["mountPath"] + "/"))
    assert volumes[mount["name"]]["configMap"]["name"] == "vramshare-config"


def test_probes_are_served(service_app: app.Extender) -> None:
    c = one("extender.yaml", "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert service_app.handle("GET", c["livenessProbe"]["httpGet"]["path"], b"").status == 200
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"


def test_scheduler_runs_the_config_with_its_identity(sched_config: dict[str, Any]) -> None:
    pod = one("scheduler.yaml", "Deployment")["spec"]["template"]["spec"]
    [c] = pod["containers"]
    config_path = next(a.split("=", 1)[1] for a in c["command"] if a.startswith("--config="))
    mount = next(m for m in c["volumeMounts"] if config_path.startswith(m["mountPath"] + "/"))
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    cm = one("scheduler-config.yaml", "ConfigMap")
    assert volume["configMap"]["name"] == cm["metadata"]["name"]
    assert config_path.rsplit("/", 1)[1] in cm["data"]
    sa = pod["serviceAccountName"]
    roles = {d["roleRef"]["name"] for d in docs("rbac-extender.yaml")
             if d["kind"] in ("ClusterRoleBinding", "RoleBinding") and d["subjects"][0]["name"] == sa}
    assert {"system:kube-scheduler", "system:volume-scheduler", "vramshare-scheduler-leader-election",
            "extension-apiserver-authentication-reader"} <= roles
    lease = one("rbac-extender.yaml", "Role", "vramshare-scheduler-leader-election")
    le = sched_config["leaderElection"]
    assert lease["metadata"]["namespace"] == le["resourceNamespace"]
    assert any(le["resourceName"] in r.get("resourceNames", []) for r in lease["rules"])


_CALL = re.compile(r"self\.core\.(read|list|patch|create)_(?:namespaced_)?([a-z_]+?)(?:_for_all_namespaces)?\(")
_VERB = {"read": "get", "list": "list", "patch": "patch", "create": "create"}


def test_extender_rbac_is_exactly_what_its_code_calls() -> None:
    source = (ROOT / "extender" / "apicalls.py").read_text()
    used = set()
    for verb, res in _CALL.findall(source):
        plural = "pods/binding" if res == "pod_binding" else f"{res}s"
        used.add((plural, _VERB[verb]))
        if verb == "list" and ("watch=True" in source or "ListWatch(" in source):  # vramshare.watch.ListWatch
            used.add((plural, "watch"))
    assert ("pods/binding", "create") in used and ("nodes", "watch") in used
    assert "apicalls.Kube" in (ROOT / "extender" / "dra_scoring.py").read_text()  # the DRA watch goes through it
    # DRA scoring (extender/dra_scoring.py DraWatch) lists and watches these through apicalls
    for res in re.findall(r"self\.resource\.list_([a-z_]+?)(?:_for_all_namespaces)?\(", source):
        used |= {(res.replace("_", "") + "s", "list"), (res.replace("_", "") + "s", "watch")}
    role = one("rbac-extender.yaml", "ClusterRole", "vramshare-extender")
    granted = {(r, v) for rule in role["rules"] for r in rule["resources"] for v in rule["verbs"]}
    assert granted == used
    binding = one("rbac-extender.yaml", "ClusterRoleBinding", "vramshare-extender")
    pod = one("extender.yaml", "Deployment")["spec"]["template"]["spec"]
    assert binding["subjects"][0]["name"] == pod["serviceAccountName"]
