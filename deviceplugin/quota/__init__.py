"""The quota feedback loop: per-GPU memory quotas for co-tenant containers, rebalanced from telemetry.

``policy`` is the pure core (tenants in, limits and reasons out); ``telemetry``/``scrape`` read NVML,
dcgm-exporter and vLLM metrics; ``writer`` writes quota.json atomically; ``loop`` wires them together.
"""
