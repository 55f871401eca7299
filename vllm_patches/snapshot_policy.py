"""When KV snapshots pay, and when the snapshot connector must stay off. Pure core, no vLLM.

Measured (``bench/bench_kv_snapshots.py``, README "Where it pays"): a preempted request's blocks
stay in vLLM's prefix cache while the pool has room for them, and vLLM then recomputes nothing,
so a snapshot is pure cost; it saves the recompute only when those blocks will be reused for other
requests first (the pool is physically full, or prefix caching is off and freed blocks lose
their contents). And enabling any KV connector that does not implement vLLM's ``SupportsHMA``
makes vLLM 0.32 switch its hybrid KV cache manager off (``VllmConfig.__post_init__``:
"Turning off hybrid kv cache manager because `--kv-transfer-config` selects a KV connector that
does not support it"): sliding-window models lose its memory savings, hybrid SSM models fail to
start. Snapshots are not worth that unless the operator says so.
"""
from __future__ import annotations


def worth_snapshot(prefix_caching: bool, raw_free_blocks: int, request_blocks: int) -> bool:
    """Take a snapshot of a preempted request only when its blocks will not survive in the pool.

    With prefix caching on, freed blocks keep their KV until the pool hands them out again, which
    happens only once the truly free blocks are used up; a request whose blocks fit in what is
    free now resumes from the prefix cache (the quota cap's preemptions, under throttle, are of
    this kind: the blocks above the cap stay allocated and cached).
    """
    if not prefix_caching:
        return True
    return raw_free_blocks < request_blocks


def costs_hybrid_manager(user_disabled_hma: bool | None, platform_supports_hma: bool,
                         model_uses_hma: bool) -> bool:
    """Would enabling the (non-HMA) snapshot connector switch the hybrid KV cache manager off
    where it would otherwise run, without the operator having asked for that?

    ``user_disabled_hma``: ``--disable-hybrid-kv-cache-manager`` as given (None = not given).
    """
    if user_disabled_hma is not None:
        return False  # the operator decided: respect it (True: off anyway; False: vLLM errors)
    return platform_supports_hma and model_uses_hma
