"""Prometheus metrics of the extender: what kube-scheduler asked, how fast we answered, what we hold.

Request counters and latency histograms are per verb, because the filter and prioritize latency adds to
every managed pod's scheduling cycle (extender-anchors section 6) and is what an operator alerts on.
The cache figures are a pull collector that reads the accounting when scraped, so they are never stale
and cost nothing between scrapes. Each extender owns its registry, so tests can run several at once.
"""
from __future__ import annotations

import time
from typing import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from extender import accounting, tls

__all__ = ["ExtenderMetrics", "CONTENT_TYPE_LATEST"]

# Sub-millisecond resolution where the budget is (p99 < 5 ms at 500 nodes), up to the 5 s httpTimeout.
LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class _CacheCollector:
    """Nodes, GPUs, pods and MiB the extender accounts for, read at scrape time."""

    def __init__(self, acct: accounting.Accounting) -> None:
        self.acct = acct

    def collect(self) -> Iterator[Metric]:
        with self.acct.lock:
            nodes = len(self.acct.slots)
            gpus = sum(len(s) for s in self.acct.slots.values())
            capacity = sum(slot.capacity for s in self.acct.slots.values() for slot in s)
            used = int(self.acct.state.used.sum())
            pods = len(self.acct.pods)
            unaccounted = len(self.acct.unaccounted)
            untrusted = len(self.acct.untrusted)
            ignored = dict(self.acct.untrusted_events)
        for name, doc, value in (
            ("vramshare_extender_cache_nodes", "Nodes with a GPU inventory in the extender's cache", nodes),
            ("vramshare_extender_cache_gpus", "Schedulable GPU slots (GPUs and MIG instances) in the cache", gpus),
            ("vramshare_extender_cache_pods", "Live pods asking for vramshare resources in the cache", pods),
            ("vramshare_extender_cache_capacity_mib", "Schedulable GPU memory in the cache, MiB", capacity),
            ("vramshare_extender_cache_used_mib", "GPU memory held by assigned pods, MiB", used),
            ("vramshare_extender_cache_unaccounted_pods",
             "Pods whose assignment could not be recorded (see the extender log)", unaccounted),
            ("vramshare_extender_cache_untrusted_pods",
             "Pods whose vramshare annotations were written by someone other than vramshare", untrusted),
        ):
            yield GaugeMetricFamily(name, doc, value=value)
        events = CounterMetricFamily("vramshare_extender_untrusted_annotations",
                                     "Pod events whose assignment annotations were ignored or bounded because "
                                     "vramshare's field managers did not write them", labels=["state"])
        for state, count in sorted(ignored.items()):
            events.add_metric([state], count)
        yield events


class _PresentedCollector:
    """What kube-scheduler presents, not what its Secret holds (it reads the Secret once): read at scrape."""

    def __init__(self, presented: tls.PresentedCertificates) -> None:
        self.presented = presented

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "vramshare_extender_client_certificate_expiry_timestamp_seconds",
            "When the earliest-expiring client certificate that callers of this subject presented in the last "
            "hour expires (seconds since the epoch); kube-scheduler keeps the one it read at start",
            labels=["subject"])
        for subject, cert in sorted(self.presented.earliest(time.monotonic()).items()):
            family.add_metric([subject], cert.not_after)
        yield family


class ExtenderMetrics:
    def __init__(self, acct: accounting.Accounting, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.requests = Counter("vramshare_extender_requests", "Extender HTTP requests by verb and outcome",
                                ["verb", "outcome"], registry=self.registry)
        self.latency = Histogram("vramshare_extender_request_seconds", "Time to answer one request, by verb",
                                 ["verb"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.binds = Counter("vramshare_extender_binds", "Bind requests by result", ["result"],
                             registry=self.registry)
        self.resyncs = Counter("vramshare_extender_cache_resyncs",
                               "Full relists of a resource after 410 Gone or a broken watch", ["resource"],
                               registry=self.registry)
        self.tls_reloads = Counter("vramshare_extender_tls_reloads", "Changed TLS files: reloaded, or refused "
                                   "(they do not load; the previous certificates stay in force)", ["result"],
                                   registry=self.registry)
        self.registry.register(_CacheCollector(acct))

    def watch_client_certificates(self, presented: tls.PresentedCertificates) -> None:
        """Export the earliest expiry per subject of the client certificates callers present now."""
        self.registry.register(_PresentedCollector(presented))

    def observe(self, verb: str, outcome: str, seconds: float) -> None:
        self.requests.labels(verb, outcome).inc()
        self.latency.labels(verb).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
