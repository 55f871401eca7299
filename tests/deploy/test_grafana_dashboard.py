"""The Grafana dashboard (issue 14) queries only metrics the daemons export. The names are collected
from the real registries (device plugin, quota loop, extender, vLLM plugin), instantiated here, not
grepped from the source, so a renamed or removed metric breaks this test."""
from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import yaml
from prometheus_client import CollectorRegistry

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "vramshare-dashboard.json"
_SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
             "summary": ("_sum", "_count", "_created"), "gauge": ("",), "info": ("_info",), "unknown": ("",)}


def _names(registry: CollectorRegistry) -> set[str]:
    """Every series name a scrape of ``registry`` can carry, from its metric families and types."""
    return {m.name + s for m in registry.collect() for s in _SUFFIXES.get(m.type, ("",))}


def _labels(registry: CollectorRegistry) -> dict[str, set[str]]:
    """Series name -> the label names its samples carry (from a collect with data in it)."""
    out: dict[str, set[str]] = {}
    for m in registry.collect():
        for s in m.samples:
            out.setdefault(s.name, set()).update(s.labels)
    return out


def registries(tmp_path) -> list[CollectorRegistry]:
    """Every daemon's metrics registry (device plugin, quota loop, extender, vLLM plugin, warm tier,
    dynamic MIG, DRA plugin), built as the daemons build them."""
    from deviceplugin.dra.main import DraMetrics
    from deviceplugin.metrics import PluginMetrics
    from deviceplugin.mig_dynamic import MigMetrics
    from deviceplugin.quota.loop import QuotaLoop
    from deviceplugin.quota.model import PolicyParams
    from deviceplugin.quota.service import register_metrics
    from deviceplugin.quota.warm import WarmBroker
    from deviceplugin.quota.warm_channel import WarmCollector
    from extender.accounting import Accounting
    from extender.metrics import ExtenderMetrics
    from extender.tls import PresentedCertificates
    from vllm_patches.metrics import StateCollector, publish_warm
    from vramshare.config import Config
    from vramshare.inventory import EnforcementMode, NodeInventory

    snap = SimpleNamespace(devices={}, inventory=NodeInventory(1024, enforcement=EnforcementMode.DRIVER))
    extender = ExtenderMetrics(Accounting(Config()))
    extender.watch_client_certificates(PresentedCertificates())  # with mutual TLS, as deployed
    out = [PluginMetrics(snapshot=lambda: snap).registry, extender.registry, MigMetrics().registry,
           DraMetrics().registry]
    quota = CollectorRegistry()
    register_metrics(QuotaLoop(None, dict, [], PolicyParams(), str(tmp_path)), quota)
    engine = CollectorRegistry()
    publish_warm(str(tmp_path), "e0", {"sleep_state": "sleeping", "wake_seconds": 1.5, "sleep_freed_bytes": 1})
    engine.register(StateCollector(str(tmp_path)))
    warm = CollectorRegistry()
    warm.register(WarmCollector(WarmBroker(send=lambda key, message: True)))
    return [*out, quota, engine, warm]


def exported(tmp_path) -> set[str]:
    return {name for reg in registries(tmp_path) for name in _names(reg)}


def declared_labels(tmp_path) -> dict[str, set[str]]:
    """Series name -> the label names it is declared with (also for a family with no sample yet):
    prometheus_client keeps them as ``_labelnames`` on a metric and on a custom collector's family."""
    out: dict[str, set[str]] = {}
    for reg in registries(tmp_path):
        for collector, names in list(reg._collector_to_names.items()):  # noqa: SLF001 - the registry's map
            for name in names:
                out.setdefault(name, set()).update(getattr(collector, "_labelnames", ()))
        for m in reg.collect():
            for suffix in _SUFFIXES.get(m.type, ("",)):
                out.setdefault(m.name + suffix, set()).update(getattr(m, "_labelnames", ()))
            for s in m.samples:
                out.setdefault(s.name, set()).update(s.labels)
    return out


def _queries(doc: dict) -> list[str]:
    out = []
    for panel in doc["panels"]:
        out += [t["expr"] for t in panel.get("targets", [])]
    out += [v["definition"] for v in doc["templating"]["list"] if "definition" in v]
    return out


def test_every_metric_the_dashboard_queries_is_exported(tmp_path):
    doc = json.loads(DASHBOARD.read_text())
    have = exported(tmp_path)
    assert "vramshare_quota_limit_mib" in have and "vramshare_extender_request_seconds_bucket" in have
    used = {name for q in _queries(doc) for name in re.findall(r"\bvramshare_[a-z0-9_]+\b", q)}
    assert used, "the dashboard queries nothing"
    missing = sorted(used - have)
    assert not missing, f"the dashboard queries metrics no daemon exports: {missing}"


def test_the_dashboard_covers_what_an_admin_asked_for():
    """Per node and per GPU capacity, reserved, limits, used; over-limit events; limit changes;
    extender latency and failures; and the class variable."""
    doc = json.loads(DASHBOARD.read_text())
    text = "\n".join(_queries(doc))
    for needle in ("vramshare_quota_gpu_capacity_mib", "vramshare_quota_request_mib", "vramshare_quota_limit_mib",
                   "vramshare_quota_used_mib", "vramshare_quota_class_breaches_total",
                   "vramshare_quota_class_changes_total", "vramshare_extender_request_seconds_bucket",
                   "vramshare_extender_requests_total", "by (node, gpu)", "by (node)"):
        assert needle in text, needle
    assert {v["name"] for v in doc["templating"]["list"]} == {"datasource", "node", "class"}
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids))


# Labels Prometheus puts on every sample of a pod target (kubernetes_sd pod role with prometheus-operator's
# PodMonitor) plus the `node` our PodMonitor adds (deploy/monitoring/podmonitors.yaml).
TARGET_LABELS = {"instance", "job", "namespace", "pod", "container", "endpoint", "node", "component"}


def test_tenant_labels_do_not_collide_with_target_labels(tmp_path):
    """A tenant's namespace/pod/container would be renamed exported_* by Prometheus (issue 22)."""
    from deviceplugin.quota.loop import QuotaLoop
    from deviceplugin.quota.model import PolicyParams, Tenant, TenantKey
    from deviceplugin.quota.service import register_metrics
    from deviceplugin.quota.telemetry import UsageSample

    class Node:
        name = "fake"

        def list_tenants(self):
            return [Tenant(TenantKey("llm", "chat", "vllm", pod_uid="u"), (("GPU-0", 20000),))]

        def read_usage(self):
            return [UsageSample("GPU-0", 19800, pod_uid="u")]

    node = Node()
    loop = QuotaLoop(node, lambda: {"GPU-0": 40000}, [node], PolicyParams(), str(tmp_path))
    loop.run_once()
    reg = CollectorRegistry()
    register_metrics(loop, reg)
    labels = _labels(reg)
    assert labels["vramshare_quota_limit_mib"] >= {"tenant_namespace", "tenant_pod", "tenant_container", "gpu"}
    for name, have in labels.items():
        assert not have & TARGET_LABELS, f"{name} exports {sorted(have & TARGET_LABELS)}: collides with target labels"


def test_the_dashboard_groups_by_the_node_label_and_tenant_labels():
    doc = json.loads(DASHBOARD.read_text())
    text = "\n".join(_queries(doc))
    assert "instance" not in text, "per node is the node label (the PodMonitor's), not the scrape target"
    for grouping in re.findall(r"\b(?:by|on) \(([^)]*)\)", text):
        for label in (x.strip() for x in grouping.split(",")):
            assert label in TARGET_LABELS | {"gpu", "class", "state", "le", "verb", "outcome", "result", "mode",
                                             "tenant_namespace", "tenant_pod", "tenant_container"}, label
    legends = [t.get("legendFormat", "") for p in doc["panels"] for t in p.get("targets", [])]
    assert not any(re.search(r"\{\{(namespace|pod|container)\}\}/", lf) for lf in legends if "vllm" not in lf)
    podmonitor = (ROOT / "deploy" / "monitoring" / "podmonitors.yaml").read_text()
    assert "targetLabel: node" in podmonitor and "__meta_kubernetes_pod_node_name" in podmonitor


#: where an admin or ML engineer reads metric names: README, the vLLM plugin's README, the shipped manifests
DOCS = (ROOT / "README.md", ROOT / "vllm_patches" / "README.md", *sorted((ROOT / "deploy").rglob("*.yaml")))


def documented_metrics() -> dict[str, set[str]]:
    """Every ``vramshare_*`` series the docs name -> the files naming it. Expands README's shorthands:
    ``vramshare_mig_instances_{created,adopted,destroyed}_total`` and ``vramshare_quota_limit_mib``,
    ``_used_mib``, ... (a list continued by suffixes); a name ending in ``_`` or ``*`` is a prefix."""
    out: dict[str, set[str]] = {}
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        for m in re.finditer(r"\b(vramshare_[a-z0-9_]*)(?:\{([a-z,]+)\}(_[a-z0-9_]+)?)?", text):
            stem, alts, tail = m.groups()
            if alts and "," in alts and stem.endswith("_"):
                found = [stem + a + (tail or "") for a in alts.split(",")]
            elif stem.endswith("_") or text[m.end():m.end() + 1] == "*":
                continue  # a prefix (vramshare_enforcement_*, vramshare_vllm_), not a series
            else:
                found = [stem]
            for name in found:
                out.setdefault(name, set()).add(str(path.relative_to(ROOT)))
        for short in re.findall(r"`vramshare_quota_[a-z_]+`((?:,\s+`_[a-z_]+`)+)", text):
            for suffix in re.findall(r"`(_[a-z_]+)`", short):
                out.setdefault("vramshare_quota" + suffix, set()).add(str(path.relative_to(ROOT)))
    return out


def test_every_metric_the_docs_name_is_exported(tmp_path):
    """README tells an admin which metric says what (enforcement, warm tier, MIG, config refusals...): a
    renamed metric must take its mention along. A histogram may be named by its family. Not metrics: the
    package ``vramshare_cli`` and the vLLM plugin's entry point ``vramshare_quota``."""
    have = exported(tmp_path)
    have |= {n[:-len("_bucket")] for n in have if n.endswith("_bucket")}
    named = {k: v for k, v in documented_metrics().items() if k not in {"vramshare_cli", "vramshare_quota"}}
    assert {"vramshare_mig_instances_created_total", "vramshare_quota_floor_mib", "vramshare_warm_prewakes_total",
            "vramshare_vllm_sleep_state", "vramshare_enforcement_unavailable"} <= set(named), sorted(named)
    missing = {k: sorted(v) for k, v in named.items() if k not in have}
    assert not missing, f"the docs name metrics no daemon exports: {missing}"
