"""The alerts shipped for prometheus-operator (deploy/monitoring/prometheusrules.yaml): every expression
parses as PromQL, reads only series the daemons export (names from their real registries, as the
dashboard's test collects them, plus the DRA plugin's and the PodMonitor's ``up``), and every label an
alert's text or matchers name is one those series carry; each alert says how bad it is and where its
first step is (README "Alerts", which lists exactly these alerts)."""
from __future__ import annotations

import re
from pathlib import Path

import promql_parser
import pytest
import yaml

from tests.deploy.test_grafana_dashboard import _names, exported

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "monitoring" / "prometheusrules.yaml"
README = ROOT / "README.md"
#: labels every scraped series carries: Prometheus' own and the PodMonitor's relabelings
TARGET_LABELS = {"job", "instance", "namespace", "pod", "container", "endpoint", "node", "component"}


def _rules() -> list[dict]:
    doc = yaml.safe_load(RULES.read_text())
    assert doc["kind"] == "PrometheusRule" and doc["apiVersion"] == "monitoring.coreos.com/v1"
    return [r for g in doc["spec"]["groups"] for r in g["rules"]]


def _all_exported(tmp_path) -> set[str]:
    from deviceplugin.dra.main import DraMetrics
    return exported(tmp_path) | _names(DraMetrics().registry) | {"up"}


def test_every_alert_parses_and_reads_only_exported_series(tmp_path):
    have = _all_exported(tmp_path)
    rules = _rules()
    assert rules
    for rule in rules:
        promql_parser.parse(rule["expr"])  # ValueError names the fault
        used = set(re.findall(r"\b(vramshare_[a-z0-9_]+|up)\b(?=\s*[{\[)]|\s*==)", rule["expr"]))
        assert used, rule["alert"]
        missing = sorted(used - have)
        assert not missing, f"{rule['alert']} reads series no daemon exports: {missing}"


def test_a_broken_expression_is_caught_by_the_parser():
    """The parser is what fails a typo, not a happy string compare: the check above can fail."""
    with pytest.raises(ValueError):
        promql_parser.parse('sum by (verb (rate(vramshare_extender_requests_total[5m]))')


def _label_names() -> dict[str, set[str]]:
    """Series name -> its label names, from registries that hold a sample of each alerted series."""
    from types import SimpleNamespace

    from deviceplugin.dra.main import DraMetrics
    from deviceplugin.metrics import PluginMetrics
    from extender.accounting import Accounting
    from extender.metrics import ExtenderMetrics
    from vramshare.config import Config
    from vramshare.inventory import Gpu, GpuMode, NodeInventory

    gpu = Gpu(index=0, uuid="GPU-a", model="H100", memory_mib=81559, numa_node=0, mode=GpuMode.SHARED,
              healthy=False, units=79)
    snap = SimpleNamespace(devices={}, inventory=NodeInventory(1024, gpus=(gpu,)))
    plugin, dra, ext = PluginMetrics(snapshot=lambda: snap), DraMetrics(), ExtenderMetrics(Accounting(Config()))
    plugin.backend_error("nvml")
    plugin.config_reloads.labels("refused").inc()
    dra.config_reloads.labels("refused").inc()
    plugin.restart_pending.labels("memoryUnitMiB").set(1)
    dra.restart_pending.labels("memoryUnitMiB").set(1)
    dra.publish_errors.inc()
    ext.observe("filter", "error", 0.01)
    ext.binds.labels("api_error").inc()
    out: dict[str, set[str]] = {}
    for registry in (plugin.registry, dra.registry, ext.registry):
        for family in registry.collect():
            for sample in family.samples:
                out.setdefault(sample.name, set()).update(sample.labels)
    return out


def test_the_labels_an_alert_names_exist_on_its_series():
    """``$labels.x`` in a summary renders empty when the series has no ``x``, or when the aggregation
    dropped it: each one is a label the alert's result keeps."""
    labels = _label_names()
    for rule in _rules():
        expr, text = rule["expr"], " ".join(rule["annotations"].values())
        named = set(re.findall(r"\$labels\.([a-z_]+)", text))
        grouped = [g for g in re.findall(r"by \(([^)]*)\)", expr)]
        if grouped:  # an aggregation keeps only its grouping labels
            kept = {label.strip() for label in grouped[-1].split(",")}
        else:
            carried = [TARGET_LABELS | labels.get(n, set()) for n in re.findall(r"\b(vramshare_[a-z0-9_]+)\b", expr)]
            kept = set.intersection(*carried) if carried else set(TARGET_LABELS)
        assert named <= kept, f"{rule['alert']} names {sorted(named - kept)}, which its result does not carry"
        for label in re.findall(r"\b([a-z_]+)=~?\"", expr):  # matchers
            assert label in TARGET_LABELS or any(label in labels.get(n, set()) for n in
                                                 re.findall(r"\b(vramshare_[a-z0-9_]+)\b", expr)), (rule["alert"], label)


def test_every_alert_has_a_severity_a_summary_and_a_runbook_in_readme():
    text = README.read_text()
    section = text.split("### Alerts", 1)[1].split("\n### ", 1)[0]
    listed = set(re.findall(r"`(Vramshare[A-Za-z]+)`", section))
    rules = _rules()
    assert {r["alert"] for r in rules} == listed
    for rule in rules:
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}, rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]
        assert rule["annotations"]["runbook_url"].endswith("README.md#alerts"), rule["alert"]


def test_install_monitoring_renders_the_rules():
    from vramshare_cli import certs, install
    objects = install.render(install.Options(kubernetes_version="1.33.2", monitoring=True, namespace="gpu-share"),
                             lambda ns, days: certs.secrets(certs.generate(ns, days), ns))
    [rule] = [o for o in objects if o["kind"] == "PrometheusRule"]
    assert rule["metadata"]["namespace"] == "gpu-share"
