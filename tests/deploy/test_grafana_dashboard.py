"""The Grafana dashboard (issue 14) queries only metrics the daemons export. The names are collected
from the real registries (device plugin, quota loop, extender, vLLM plugin), instantiated here, not
grepped from the source, so a renamed or removed metric breaks this test."""
from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

from prometheus_client import CollectorRegistry

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "vramshare-dashboard.json"
_SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
             "summary": ("_sum", "_count", "_created"), "gauge": ("",), "info": ("_info",), "unknown": ("",)}


def _names(registry: CollectorRegistry) -> set[str]:
    """Every series name a scrape of ``registry`` can carry, from its metric families and types."""
    return {m.name + s for m in registry.collect() for s in _SUFFIXES.get(m.type, ("",))}


def exported(tmp_path) -> set[str]:
    from deviceplugin.metrics import PluginMetrics
    from deviceplugin.quota.loop import QuotaLoop
    from deviceplugin.quota.model import PolicyParams
    from deviceplugin.quota.service import register_metrics
    from extender.accounting import Accounting
    from extender.metrics import ExtenderMetrics
    from vllm_patches.metrics import StateCollector
    from vramshare.config import Config
    from vramshare.inventory import EnforcementMode, NodeInventory

    names: set[str] = set()
    snap = SimpleNamespace(devices={}, inventory=NodeInventory(1024, enforcement=EnforcementMode.DRIVER))
    names |= _names(PluginMetrics(snapshot=lambda: snap).registry)
    reg = CollectorRegistry()
    register_metrics(QuotaLoop(None, dict, [], PolicyParams(), str(tmp_path)), reg)
    names |= _names(reg)
    names |= _names(ExtenderMetrics(Accounting(Config())).registry)
    reg = CollectorRegistry()
    reg.register(StateCollector(str(tmp_path)))
    names |= _names(reg)
    return names


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
                   "vramshare_extender_requests_total", "by (instance, gpu)", "by (instance)"):
        assert needle in text, needle
    assert {v["name"] for v in doc["templating"]["list"]} == {"datasource", "node", "class"}
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids))
