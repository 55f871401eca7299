"""Who reaches what under the NetworkPolicies of deploy/daemonset/ and deploy/daemonset/dra/.

The policies are evaluated the way networking.k8s.io/v1 defines them (a pod selected by any
Ingress policy admits only what one of those policies' rules admits; a peer with only a podSelector
means the policy's namespace; ports by number or by the destination container's port name), over
the pods the manifests' workloads create. Every kube-scheduler whose configuration names the
extender must reach the port its urlPrefix resolves to (through the Service), and nothing else in
or outside the namespace may; Prometheus reaches each workload's metrics port and nothing more.
"""
from __future__ import annotations

import pathlib
import urllib.parse
from dataclasses import dataclass
from typing import Any

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "daemonset"
NAMESPACE = "vramshare-system"
Obj = dict[str, Any]


def _docs() -> list[Obj]:
    files = sorted(DEPLOY.glob("*.yaml")) + sorted((DEPLOY / "dra").glob("*.yaml"))
    return [d for f in files for d in yaml.safe_load_all(f.read_text()) if d]


DOCS = _docs()
POLICIES = [d for d in DOCS if d["kind"] == "NetworkPolicy"]


@dataclass(frozen=True)
class Pod:
    name: str  # the workload's
    namespace: str
    labels: dict[str, str]
    ports: dict[str, int]  # container port name -> number (unnamed ports under their number)


WORKLOADS = {d["metadata"]["name"]: Pod(
    d["metadata"]["name"], d["metadata"]["namespace"], d["spec"]["template"]["metadata"]["labels"],
    {p.get("name", str(p["containerPort"])): p["containerPort"]
     for c in d["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])})
    for d in DOCS if d["kind"] in ("Deployment", "DaemonSet")}
PROMETHEUS = Pod("prometheus", "monitoring", {"app.kubernetes.io/name": "prometheus"}, {})
STRANGER = Pod("stranger", "default", {"app": "web"}, {})
NEIGHBOUR = Pod("neighbour", NAMESPACE, {"app": "debug"}, {})  # any other pod of our namespace


def _selects(selector: Obj, labels: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, "extend the evaluator for matchExpressions"
    return all(labels.get(k) == v for k, v in (selector.get("matchLabels") or {}).items())


def _peer_admits(peer: Obj, policy_ns: str, src: Pod) -> bool:
    assert "ipBlock" not in peer
    if "namespaceSelector" in peer:
        if peer["namespaceSelector"] != {}:
            raise AssertionError("extend the evaluator for namespace labels")
    elif src.namespace != policy_ns:
        return False
    return _selects(peer.get("podSelector", {}), src.labels)


def _port_admits(ports: list[Obj] | None, dst: Pod, port: int) -> bool:
    if not ports:
        return True
    for p in ports:
        number = dst.ports.get(p["port"]) if isinstance(p["port"], str) else p["port"]
        if number == port and p.get("protocol", "TCP") == "TCP":
            return True
    return False


def admitted(src: Pod, dst: Pod, port: int) -> bool:
    """May ``src`` open a TCP connection to ``dst``'s ``port``?"""
    selecting = [p for p in POLICIES if p["metadata"]["namespace"] == dst.namespace
                 and "Ingress" in p["spec"].get("policyTypes", ["Ingress"]) and _selects(p["spec"]["podSelector"], dst.labels)]
    if not selecting:
        return True
    return any(any(_peer_admits(peer, p["metadata"]["namespace"], src) for peer in rule.get("from", [{}]))
               and _port_admits(rule.get("ports"), dst, port)
               for p in selecting for rule in p["spec"].get("ingress", []))


def _service_port(url: str) -> tuple[Pod, int]:
    """The pod and container port behind an in-cluster https://<svc>.<ns>.svc:<port> URL."""
    parts = urllib.parse.urlsplit(url)
    svc_name, ns = parts.hostname.split(".")[:2]
    [svc] = [d for d in DOCS if d["kind"] == "Service" and d["metadata"]["name"] == svc_name
             and d["metadata"]["namespace"] == ns]
    [sp] = [p for p in svc["spec"]["ports"] if p["port"] == parts.port]
    [dst] = [w for w in WORKLOADS.values() if w.namespace == ns and _selects({"matchLabels": svc["spec"]["selector"]},
                                                                              w.labels)]
    target = sp.get("targetPort", sp["port"])
    return dst, dst.ports[target] if isinstance(target, str) else target


def _schedulers() -> list[tuple[Pod, str]]:
    """(scheduler pods, extender urlPrefix) for every Deployment whose mounted KubeSchedulerConfiguration
    names an extender."""
    out = []
    for cm in (d for d in DOCS if d["kind"] == "ConfigMap"):
        for text in (cm.get("data") or {}).values():
            cfg = yaml.safe_load(text)
            if not isinstance(cfg, dict) or cfg.get("kind") != "KubeSchedulerConfiguration":
                continue
            users = [d for d in DOCS if d["kind"] == "Deployment" and any(
                v.get("configMap", {}).get("name") == cm["metadata"]["name"] for v in d["spec"]["template"]["spec"]["volumes"])]
            assert users, f"no Deployment mounts {cm['metadata']['name']}"
            out += [(WORKLOADS[u["metadata"]["name"]], e["urlPrefix"]) for u in users for e in cfg.get("extenders", [])]
    return out


SCHEDULERS = _schedulers()


def test_both_schedulers_are_found() -> None:
    assert {s.name for s, _ in SCHEDULERS} == {"vramshare-scheduler", "vramshare-dra-scheduler"}


@pytest.mark.parametrize("sched, url", SCHEDULERS, ids=[s.name for s, _ in SCHEDULERS])
def test_every_scheduler_reaches_the_extender_it_calls(sched: Pod, url: str) -> None:
    dst, port = _service_port(url)
    assert dst.name == "vramshare-extender"
    assert admitted(sched, dst, port), f"{sched.name} may not reach {dst.name}:{port}: admit it in a NetworkPolicy"


def test_nothing_else_reaches_the_extenders_verbs() -> None:
    dst, port = _service_port(SCHEDULERS[0][1])
    callers = {s.name for s, _ in SCHEDULERS} | {"vramshare-extender"}  # the standby hands verbs to the leader
    for src in [*WORKLOADS.values(), PROMETHEUS, STRANGER, NEIGHBOUR]:
        assert admitted(src, dst, port) == (src.name in callers), src.name


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_prometheus_reaches_metrics_ports_only(name: str) -> None:
    dst = WORKLOADS[name]
    for port_name, port in dst.ports.items():
        assert admitted(PROMETHEUS, dst, port) == (port_name == "metrics"), f"{name}:{port_name}"
        assert not admitted(STRANGER, dst, port) and not admitted(NEIGHBOUR, dst, port)


def test_the_dra_plugins_metrics_are_scrapable() -> None:
    """The DRA plugin's metrics port exists and is admitted (the default deny would hide it)."""
    dra = WORKLOADS["vramshare-dra-plugin"]
    assert admitted(PROMETHEUS, dra, dra.ports["metrics"])
