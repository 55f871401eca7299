"""The quota feedback loop: per-GPU memory quotas for co-tenant containers, rebalanced from telemetry.

Pure core: ``model`` (dataclasses) and ``policy`` (``rebalance``: tenants of one GPU in, limits and
reasons out) and ``attribution`` (samples to tenants). Adapters: ``telemetry`` (reader Protocols,
NVML per-process reader), ``scrape`` (dcgm-exporter and vLLM /metrics), ``writer`` (atomic
quota.json, shared with Allocate), ``kube`` (tenants from pods, quota-mib annotation). ``loop``
runs one tick (``run_once``); ``service`` builds it from the v1 config and exports metrics.
"""
