"""A vLLM KV connector that keeps preempted requests' KV as compressed host snapshots.

vLLM-facing glue (tested with vLLM 0.32.0, CPU worker); the compression and the block copies are
:mod:`vllm_patches.snapshot`. When the quota cap (or anything else) makes the scheduler preempt a
request, vLLM frees its blocks and later recomputes its whole prompt and output so far. With this
connector the worker compresses those blocks into host memory *before* the step's forward can
overwrite them, and when the request is scheduled again the connector reports the snapshot as an
external cache hit; the worker restores it into the new blocks and only the tail is recomputed.

Enable it with::

    LLM(..., kv_transfer_config=KVTransferConfig(kv_connector="SnapshotConnector",
        kv_connector_module_path="vllm_patches.snapshot_connector", kv_role="kv_both"))

and pick the codec with ``VRAMSHARE_KV_SNAPSHOT_CODEC`` (``none`` default, bit-exact; ``kivi8``,
``kivi4``, ``int8``, ``fp8``, ``int4``). Lossy codecs change the resumed request's KV slightly, so
its continuation can differ from a recompute. An fp8/int8 KV cache is always stored raw.

Protocol per step, scheduler side -> worker side through the connector metadata:
``saves`` (preempted this step: the blocks it held after the previous step) and ``loads`` (resumed
this step: snapshot -> new blocks, skipping blocks the local prefix cache already supplied).
Sync execution only: a save relies on the previous step's forward having finished, and the
token counts on the scheduler's view after that step. vLLM 0.32 turns async scheduling on by
default on CUDA (the CPU platform forces it off), so the connector checks
``scheduler_config.async_scheduling`` and refuses to start with it, naming the flag.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1,
                                                               KVConnectorMetadata, KVConnectorRole)

from vramshare import logs

from .codecs import codec_bits
from .engine_cap import block_bytes_of
from .snapshot import (DEFAULT_SNAPSHOT_CODEC, ENV_SNAPSHOT_CODEC, KvSnapshot, effective_codec,
                       restore_from, snapshot_block_bytes, take)
from .snapshot_policy import worth_snapshot
from .vllm_glue import cache_elem_bytes

log = logs.get(__name__)

ENV_MAX_MIB = "VRAMSHARE_SNAPSHOT_MAX_MIB"
DEFAULT_MAX_MIB = 2048


@dataclass
class SnapshotMeta(KVConnectorMetadata):
    """What the worker must do this step, before the forward pass."""

    saves: list[tuple[str, list[int], int]] = field(default_factory=list)  # id, blocks, tokens
    loads: list[tuple[str, list[int], int]] = field(default_factory=list)  # id, blocks, first block
    drops: list[str] = field(default_factory=list)


class SnapshotConnector(KVConnectorBase_V1):
    """Both roles in one class, as vLLM expects; each instance uses the half for its role."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        if getattr(vllm_config.scheduler_config, "async_scheduling", False):
            raise ValueError(
                "SnapshotConnector needs synchronous scheduling (a snapshot must see the previous "
                "step's forward finished), but async scheduling is on (vLLM 0.32's default on "
                "CUDA); pass --no-async-scheduling / async_scheduling=False")
        super().__init__(vllm_config, role, kv_cache_config)
        self.block_size = vllm_config.cache_config.block_size
        requested = os.environ.get(ENV_SNAPSHOT_CODEC, DEFAULT_SNAPSHOT_CODEC)
        codec_bits(requested)  # fail at start-up on a typo, not at the first preemption
        elem = cache_elem_bytes(vllm_config)
        self.codec = effective_codec(requested, elem)
        if self.codec != requested:
            log.info("kv snapshots stored raw: the KV cache is already 8-bit", requested=requested,
                     cache_dtype=vllm_config.cache_config.cache_dtype)
        # scheduler side
        self._last: dict[str, tuple[list[int], int]] = {}  # blocks + tokens after the last step
        self._snap_tokens: dict[str, int] = {}
        self._pending_local: dict[str, int] = {}
        self._requests: dict[str, Any] = {}
        self._meta = SnapshotMeta()
        self.tokens_restored = 0
        self.snapshots_taken = 0
        self.snapshots_skipped = 0
        # Host memory is not free either: snapshots beyond the budget are skipped (recomputed).
        self._budget_bytes = int(float(os.environ.get(ENV_MAX_MIB, "") or DEFAULT_MAX_MIB) * (1 << 20))
        raw_block = block_bytes_of(kv_cache_config) if kv_cache_config is not None else 0
        self._host_block_bytes = snapshot_block_bytes(raw_block, self.codec, elem)
        # bits per element a snapshot stores (the metric vramshare_vllm_kv_compression_bits)
        self.snapshot_bits = 8 * elem if self.codec == "none" else codec_bits(self.codec)
        self._held: dict[str, int] = {}  # request -> host bytes of its snapshot
        self._prefix_caching = bool(vllm_config.cache_config.enable_prefix_caching)
        self.snapshots_not_needed = 0  # preemptions whose blocks stay in the prefix cache
        self.snapshots_dropped = 0  # snapshots released without a restore (resumed from cache)
        # worker side
        self.head_size = vllm_config.model_config.get_head_size()
        self._caches: list[torch.Tensor] = []
        self._block_dim = 0
        self._store: dict[str, KvSnapshot] = {}

    # ---------------------------------------------------------------- scheduler side
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        tokens = self._snap_tokens.get(request.request_id, 0)
        tokens = min(tokens, request.num_tokens - 1)  # the last token must be computed for logits
        if tokens <= num_computed_tokens:
            if request.request_id in self._snap_tokens:  # resumed without it: release it now
                self._drop(request.request_id)
            return 0, False
        self._pending_local[request.request_id] = num_computed_tokens
        return tokens - num_computed_tokens, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        local = self._pending_local.pop(request.request_id, 0)
        if num_external_tokens <= 0:
            return
        block_ids = list(blocks.get_block_ids()[0])
        self._meta.loads.append((request.request_id, block_ids, local // self.block_size))
        self._snap_tokens.pop(request.request_id, None)
        self._held.pop(request.request_id, None)
        self.tokens_restored += num_external_tokens
        log.info("kv snapshot restore scheduled", request=request.request_id,
                 tokens=num_external_tokens, local_tokens=local, total_restored=self.tokens_restored)

    def _drop(self, req_id: str) -> None:
        """Forget a snapshot on both sides (the worker drops it with this step's metadata)."""
        self._snap_tokens.pop(req_id, None)
        self._held.pop(req_id, None)
        self._meta.drops.append(req_id)
        self.snapshots_dropped += 1

    def _raw_free_blocks(self) -> int:
        pool = getattr(self._kv_cache_manager, "block_pool", None)
        raw = getattr(pool, "vramshare_raw_free", None) or getattr(pool, "get_num_free_blocks", None)
        return int(raw()) if raw is not None else 0

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        meta, self._meta = self._meta, SnapshotMeta()
        for req_id in scheduler_output.preempted_req_ids or ():
            last = self._last.pop(req_id, None)
            if last is None or not last[0] or last[1] <= 0:
                continue
            if not worth_snapshot(self._prefix_caching, self._raw_free_blocks(), len(last[0])):
                self.snapshots_not_needed += 1
                log.debug("kv snapshot not needed: blocks stay in the prefix cache", request=req_id)
                continue
            size = len(last[0]) * self._host_block_bytes
            if sum(self._held.values()) + size > self._budget_bytes:
                self.snapshots_skipped += 1
                log.warning("kv snapshot skipped: host budget full", request=req_id,
                            budget_mib=self._budget_bytes >> 20)
                continue
            self._held[req_id] = size
            meta.saves.append((req_id, last[0], last[1]))
            self._snap_tokens[req_id] = last[1]
            self.snapshots_taken += 1
            log.info("kv snapshot of preempted request", request=req_id, tokens=last[1],
                     blocks=len(last[0]), codec=self.codec)
        manager = self._kv_cache_manager
        if manager is not None:
            for req_id, n in scheduler_output.num_scheduled_tokens.items():
                request = self._requests.get(req_id)
                if request is None:
                    continue
                # build_connector_meta runs before the scheduler advances num_computed_tokens:
                # after this step's forward the KV covers computed + scheduled tokens.
                blocks = list(manager.get_block_ids(req_id)[0])
                self._last[req_id] = (blocks, request.num_computed_tokens + n)
        if meta.loads and scheduler_output.new_block_ids_to_zero:
            # We overwrite whole blocks synchronously before the forward: no need to zero them.
            restored = {b for _, ids, first in meta.loads for b in ids[first:]}
            scheduler_output.new_block_ids_to_zero = [
                b for b in scheduler_output.new_block_ids_to_zero if b not in restored]
        return meta

    def on_new_request(self, request: Any) -> None:
        self._requests[request.request_id] = request

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, None]:
        req_id = request.request_id
        self._requests.pop(req_id, None)
        self._last.pop(req_id, None)
        self._pending_local.pop(req_id, None)
        if req_id in self._snap_tokens:
            self._drop(req_id)
        return False, None

    # ---------------------------------------------------------------- worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._caches = list(kv_caches.values())
        first = self._caches[0]
        # GPU backends stack K and V first ([2, blocks, ...]); the CPU layout leads with blocks.
        self._block_dim = 1 if first.dim() == 5 and first.shape[0] == 2 else 0

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        assert isinstance(kv_connector_metadata, SnapshotMeta)
        for req_id, blocks, tokens in kv_connector_metadata.saves:
            self._store[req_id] = take(self._caches, blocks, codec=self.codec,
                                       head_size=self.head_size, num_tokens=tokens,
                                       block_dim=self._block_dim)
            log.debug("kv snapshot taken", request=req_id, blocks=len(blocks), tokens=tokens,
                      kib=self._store[req_id].nbytes // 1024, codec=self.codec)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, SnapshotMeta)
        for req_id, block_ids, first in meta.loads:
            snap = self._store.pop(req_id, None)
            if snap is None:
                raise RuntimeError(f"no KV snapshot for resumed request {req_id}")
            targets = block_ids[first:snap.num_blocks]
            restore_from(snap, self._caches, targets, first_block=first, block_dim=self._block_dim)
        for req_id in meta.drops:
            self._store.pop(req_id, None)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Worker side, every step: a finished request's snapshot goes with it."""
        for req_id in finished_req_ids:
            self._store.pop(req_id, None)
        return None, None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        return
