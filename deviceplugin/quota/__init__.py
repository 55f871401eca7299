"""The quota feedback loop: per-GPU memory quotas for co-tenant containers, rebalanced from telemetry.

Pure core: ``model`` (dataclasses) and ``policy`` (``rebalance``: tenants of one GPU in, limits and
reasons out, never granting memory a tenant still holds), ``attribution`` (samples to tenants),
``warmth`` (hot / warm / waking) and ``overlimit`` (breaches past a grace period). Adapters:
``telemetry`` (reader Protocols, NVML per-process reader), ``fence`` (driver mode: per-cgroup use
and limits through NVML), ``scrape`` (dcgm-exporter and vLLM /metrics), ``writer`` (atomic
quota.json, shared with Allocate), ``kube`` (tenants from the reconciler's view and the pod cache,
quota-mib annotation, over-limit events and evictions). ``loop`` runs one tick (``run_once``); ``service`` builds it from the v1
config and exports metrics.
"""
