"""Prometheus-text readers: dcgm-exporter's per-pod ``DCGM_FI_DEV_FB_USED`` and vLLM's ``/metrics``.

Both parse with ``prometheus_client.parser`` and turn any malformed page or failed fetch into
:class:`TelemetryError`, so one bad endpoint never costs the other tenants their quotas. The fetch is
injected (a callable) so tests feed text fixtures and production uses :func:`http_get`.
"""
from __future__ import annotations

import urllib.error
import urllib.request
from typing import Callable

from prometheus_client.parser import text_string_to_metric_families

from deviceplugin.quota.model import Release
from deviceplugin.quota.telemetry import TelemetryError, UsageSample, VllmSample

Fetch = Callable[[str], str]
DCGM_FB_USED = "DCGM_FI_DEV_FB_USED"
VLLM_KV = "vllm:kv_cache_usage_perc"
VLLM_WAITING = "vllm:num_requests_waiting"
VLLM_RUNNING = "vllm:num_requests_running"
VLLM_PREEMPTIONS = "vllm:num_preemptions_total"
#: requests finished, per finished_reason (vLLM v1 ``counter_request_success``): a request that starts and
#: ends between two ticks shows in no gauge, only here
VLLM_FINISHED = "vllm:request_success_total"
PLUGIN_PREFIX = "vramshare_vllm_"
PLUGIN_BLOCKS_USED = "vramshare_vllm_kv_blocks_used"  # the plugin's KV use against its quota cap
PLUGIN_BLOCK_CAP = "vramshare_vllm_kv_block_cap"
# SIGNALS.md: the release signals the quota loop uses (issue 19, issue 20 item 5)
PLUGIN_RELEASE_MODE = "vramshare_vllm_release_mode"  # {engine, mode}: 1 for the active mode
PLUGIN_KV_HELD = "vramshare_vllm_kv_memory_held_bytes"
PLUGIN_KV_DEMAND = "vramshare_vllm_kv_demand_bytes"
PLUGIN_GENERATION_APPLIED = "vramshare_vllm_quota_generation_applied"


def http_get(url: str, timeout: float = 2.0) -> str:
    """GET a metrics page; every failure becomes :class:`TelemetryError` naming the URL."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 (http scrape)
            body: bytes = resp.read()
            return body.decode("utf-8", errors="replace")
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise TelemetryError(f"scrape {url}: {exc}") from exc


def _samples(text: str, where: str) -> list[tuple[str, dict[str, str], float]]:
    try:
        return [(s.name, s.labels, float(s.value))
                for fam in text_string_to_metric_families(text) for s in fam.samples]
    except (ValueError, TypeError, IndexError) as exc:
        raise TelemetryError(f"{where}: malformed metrics page: {exc}") from exc


class DcgmExporterReader:
    """Per-pod framebuffer use from dcgm-exporter (``:9400/metrics``).

    Needs ``--kubernetes --kubernetes-virtual-gpus --nvidia-resource-names=<our gpu-memory resource>``:
    only then does each pod on a shared GPU get its own ``DCGM_FI_DEV_FB_USED`` (MiB). Samples
    without a ``pod`` label are whole-GPU figures and are skipped, since they name no tenant.
    """

    name = "dcgm-exporter"

    def __init__(self, url: str = "http://localhost:9400/metrics", fetch: Fetch = http_get) -> None:
        self._url = url
        self._fetch = fetch

    def read_usage(self) -> list[UsageSample]:
        out = []
        for name, labels, value in _samples(self._fetch(self._url), self.name):
            if name != DCGM_FB_USED or not labels.get("pod") or not labels.get("UUID"):
                continue
            out.append(UsageSample(gpu_uuid=labels["UUID"], used_mib=int(value),
                                   pod_uid=labels.get("pod_uid") or None,
                                   namespace=labels.get("namespace") or None, pod=labels["pod"],
                                   container=labels.get("container") or None))
        return out


class VllmMetricsReader:
    """Pressure signals from one vLLM server's ``/metrics`` (all engines of the server combined).

    KV usage is the fullest engine's (the one that will preempt first). Under a quota the plugin's
    ``vramshare_vllm_kv_blocks_used / vramshare_vllm_kv_block_cap`` is the truer figure (vLLM's own
    gauge is relative to every block allocated at start, not to the cap), so the higher of the two
    counts. Waiting requests and preemptions add up over engines; ``vramshare_vllm_*`` gauges are
    passed through in ``extra`` (summed over engines).
    """

    def __init__(self, fetch: Fetch = http_get) -> None:
        self._fetch = fetch

    def read_signals(self, url: str) -> VllmSample:
        kv: float | None = None
        waiting: float | None = None
        running: float | None = None
        preempt: float | None = None
        finished: float | None = None
        extra: dict[str, float] = {}
        used: dict[str, float] = {}
        cap: dict[str, float] = {}
        page = _samples(self._fetch(url), url)
        for name, labels, value in page:
            if name == VLLM_KV:
                kv = value if kv is None else max(kv, value)
            elif name == VLLM_WAITING:
                waiting = (waiting or 0.0) + value
            elif name == VLLM_RUNNING:
                running = (running or 0.0) + value
            elif name == VLLM_PREEMPTIONS:
                preempt = (preempt or 0.0) + value
            elif name == VLLM_FINISHED:
                finished = (finished or 0.0) + value
            elif name.startswith(PLUGIN_PREFIX):
                extra[name] = extra.get(name, 0.0) + value
                engine = labels.get("engine", "")
                if name == PLUGIN_BLOCKS_USED:
                    used[engine] = value
                elif name == PLUGIN_BLOCK_CAP:
                    cap[engine] = value
        for engine, c in cap.items():
            if c > 0 and engine in used:
                kv = max(kv or 0.0, used[engine] / c)
        modes, applied = _release(page)
        return VllmSample(kv_usage=kv, waiting=None if waiting is None else int(waiting),
                          preemptions_total=preempt, running=None if running is None else int(running), extra=extra,
                          finished_total=finished,
                          release_mode=_weakest(modes), kv_held_bytes=extra.get(PLUGIN_KV_HELD),
                          kv_demand_bytes=extra.get(PLUGIN_KV_DEMAND),
                          generation_applied=min(applied.values()) if applied else None)


def _release(samples: list[tuple[str, dict[str, str], float]]) -> tuple[set[str], dict[str, int]]:
    """Active release modes, and the quota generation each engine applied, from one page."""
    modes: set[str] = set()
    applied: dict[str, int] = {}
    for name, labels, value in samples:
        if name == PLUGIN_RELEASE_MODE and value >= 1 and labels.get("mode"):
            modes.add(labels["mode"])
        elif name == PLUGIN_GENERATION_APPLIED:
            applied[labels.get("engine", "")] = int(value)
    return modes, applied


def _weakest(modes: set[str]) -> str | None:
    """One mode for the server: a releasing one only when every engine releases."""
    if not modes:
        return None
    keep = sorted(m for m in modes if Release.of_mode(m) is not Release.RELEASE)
    return keep[0] if keep else sorted(modes)[0]
