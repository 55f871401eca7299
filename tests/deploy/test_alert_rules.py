"""The alerts shipped for prometheus-operator (deploy/monitoring/prometheusrules.yaml, installed by
``vramshare install --monitoring``): every expression parses as PromQL; it reads only series a daemon
exports (names and declared labels from the daemons' own registries, :mod:`tests.deploy.test_grafana_dashboard`,
plus the PodMonitor's ``up``); every label it matches, groups by or names in its text is one its result
carries (an aggregation keeps only its grouping labels); each alert says how bad it is and where its
first step is, in README's "Alerts", which lists exactly these alerts."""
from __future__ import annotations

import re
from pathlib import Path

import promql_parser
import pytest
import yaml

from tests.deploy.test_grafana_dashboard import TARGET_LABELS, declared_labels, exported

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "monitoring" / "prometheusrules.yaml"
README = ROOT / "README.md"
SERIES = re.compile(r"\b(vramshare_[a-z0-9_]+|up)\b(?:\{([^}]*)\})?(?=\s*[{\[)=]|\s*$|\s*==)")


def _rules() -> list[dict]:
    doc = yaml.safe_load(RULES.read_text())
    assert doc["kind"] == "PrometheusRule" and doc["apiVersion"] == "monitoring.coreos.com/v1"
    return [r for g in doc["spec"]["groups"] for r in g["rules"]]


def test_every_alert_parses_and_reads_only_exported_series_and_labels(tmp_path):
    have = exported(tmp_path) | {"up"}
    labels = declared_labels(tmp_path)
    rules = _rules()
    assert len(rules) >= 10 and all(r["alert"].startswith("Vramshare") for r in rules)
    for rule in rules:
        expr = rule["expr"]
        promql_parser.parse(expr)  # ValueError names the fault
        used = SERIES.findall(expr)
        assert used, rule["alert"]
        carried = []
        for name, matchers in used:
            assert name in have, f"{rule['alert']} reads {name}, which no daemon exports"
            own = labels.get(name, set()) | TARGET_LABELS
            for label in re.findall(r"([a-z_]+)\s*=~?", matchers):
                assert label in own, f"{rule['alert']}: {name} has no label {label}"
            carried.append(own)
        groupings = re.findall(r"\bby \(([^)]*)\)", expr)
        keeps = ({x.strip() for x in groupings[-1].split(",")} if groupings else set.intersection(*carried))
        for grouping in groupings:
            for label in (x.strip() for x in grouping.split(",")):
                assert any(label in c for c in carried) or label == "le", (rule["alert"], label)
        named = set(re.findall(r"\$labels\.([a-z_]+)", " ".join(rule["annotations"].values())))
        assert named <= keeps, f"{rule['alert']} names {sorted(named - keeps)}, which its result does not carry"


def test_a_broken_expression_or_a_dropped_label_is_caught():
    """The checks above can fail: the parser refuses a typo, and an aggregation drops ``node``."""
    with pytest.raises(ValueError):
        promql_parser.parse('sum by (verb (rate(vramshare_extender_requests_total[5m]))')
    groupings = re.findall(r"\bby \(([^)]*)\)", "sum by (verb) (rate(vramshare_extender_requests_total[5m])) > 0")
    assert "node" not in {x.strip() for x in groupings[-1].split(",")}


def test_every_alert_has_a_severity_a_summary_and_a_runbook_in_readme():
    section = README.read_text().split("### Alerts", 1)[1].split("\n### ", 1)[0]
    listed = set(re.findall(r"^\| `(Vramshare[A-Za-z]+)`", section, re.M))
    rules = _rules()
    assert {r["alert"] for r in rules} == listed
    for rule in rules:
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}, rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]
        assert rule["annotations"]["runbook_url"].endswith("README.md#alerts"), rule["alert"]


def test_install_monitoring_ships_the_rules():
    from vramshare_cli import certs, install
    assert "prometheusrules.yaml" in (ROOT / "deploy" / "monitoring" / "kustomization.yaml").read_text()
    objects = install.render(install.Options(kubernetes_version="1.33.2", monitoring=True, namespace="gpu-share"),
                             lambda ns, days: certs.secrets(certs.generate(ns, days), ns))
    [rule] = [o for o in objects if o["kind"] == "PrometheusRule"]
    assert rule["metadata"]["namespace"] == "gpu-share"
