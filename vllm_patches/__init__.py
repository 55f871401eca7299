"""vramshare's vLLM plugin: start inside the GPU memory quota, follow it at runtime, compress KV.

Entry point ``vllm_patches.plugin:register`` (group ``vllm.general_plugins``); see README.md. The pure
core (``quota``, ``budget``, ``cap``, ``codecs``, ``snapshot``, ``metrics``, ``watcher``) imports no
vLLM; ``vllm_glue``, ``engine_cap`` and ``snapshot_connector`` are the only modules that touch it.
"""
