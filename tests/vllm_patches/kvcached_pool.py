"""kvcached's own Python (0.1.6, ``tests/vllm_patches/kvcached_py``) behind a vLLM-shaped scheduler,
for the tests of the unmap release path. Test doubles at the edges only: kvcached's CUDA allocator
(``kvcached_py/kvcached/vmm_ops.py``) and vLLM's scheduler/config objects (plain namespaces).

:class:`ElasticPool` is kvcached's ``ElasticBlockPool`` accounting with prefix caching off, copied
from ``kvcached/integration/vllm/patches.py`` (0.1.6): ``get_num_free_blocks`` is the manager's
``available_size()``, ``get_usage`` ``1 - free / num_gpu_blocks``, ``get_new_blocks`` refuses more
than the free count and allocates from the manager, ``free_blocks`` frees the ids. The manager is
built as kvcached's ``get_kv_cache_manager`` builds it (``reserve_null_block=True``) and registered
in its pool registry, where ``kvcached.control.set_instance_memory_limit`` finds it.
"""
from __future__ import annotations

import importlib
import os
import sys
from types import SimpleNamespace
from typing import Any

HERE = os.path.join(os.path.dirname(__file__), "kvcached_py")
IPC_NAME = f"vramshare_test_{os.getpid()}"


def load_kvcached() -> SimpleNamespace:
    """Import the vendored kvcached (once per process) with prealloc off and a test segment name."""
    os.environ.setdefault("KVCACHED_PAGE_PREALLOC_ENABLED", "false")
    os.environ.setdefault("KVCACHED_IPC_NAME", IPC_NAME)
    if HERE not in sys.path:
        sys.path.insert(0, HERE)
    mods = {n: importlib.import_module(f"kvcached.{n}")
            for n in ("kv_cache_manager", "control", "pool_registry", "vmm_ops", "utils")}
    assert mods["kv_cache_manager"].__file__.startswith(HERE), "a real kvcached shadows the copy"
    return SimpleNamespace(**mods)


class ElasticPool:
    """kvcached's ElasticBlockPool accounting (prefix caching off), see the module docstring."""

    def __init__(self, manager: Any, num_gpu_blocks: int) -> None:
        self.kv_cache_manager = manager
        self.num_gpu_blocks = num_gpu_blocks

    def get_num_free_blocks(self) -> int:
        return self.kv_cache_manager.available_size()

    def get_usage(self) -> float:
        return 1.0 - (self.get_num_free_blocks() / self.num_gpu_blocks)

    def get_new_blocks(self, num_blocks: int) -> list[int]:
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool")
        ids = self.kv_cache_manager.alloc(num_blocks)
        if ids is None:
            raise ValueError("Unable to allocate KV cache blocks from physical pool")
        return ids

    def free_blocks(self, ids: list[int]) -> None:
        if ids:
            self.kv_cache_manager.free(list(ids))

    def reset_prefix_cache(self) -> bool:
        return True


def make_engine(kvc: SimpleNamespace, *, num_blocks: int, num_layers: int = 2,
                cell_size: int = 2 * 8 * 64, block_size: int = 16, max_model_len: int = 64,
                kv_plan_bytes: int | None = None, dp_rank: int = 0, tp: int = 1
                ) -> tuple[SimpleNamespace, SimpleNamespace, SimpleNamespace]:
    """``(scheduler, vllm_config, kv_cache_config)`` shaped like vLLM 0.32's, over a kvcached pool.

    ``cell_size`` is kvcached's bytes per token per layer for K (or V): ``kv_heads x head x dtype``.
    """
    kvc.pool_registry.clear_registered_kv_cache_pools()
    manager = kvc.kv_cache_manager.KVCacheManager(num_blocks, block_size, cell_size, num_layers,
                                                  reserve_null_block=True)
    manager._wait_post_init()
    kvc.pool_registry.register_kv_cache_pool(manager, integration="vllm")
    pool = ElasticPool(manager, num_blocks)
    block_bytes = block_size * cell_size * num_layers * 2  # K and V of every layer
    scheduler = SimpleNamespace(kv_cache_manager=SimpleNamespace(block_pool=pool),
                                max_model_len=max_model_len, block_size=block_size,
                                running=[], waiting=[])
    vllm_config = SimpleNamespace(
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1,
                                        data_parallel_rank=dp_rank, data_parallel_rank_local=dp_rank,
                                        data_parallel_size=dp_rank + 1),
        kv_transfer_config=None,
        cache_config=SimpleNamespace(kv_cache_memory_bytes=kv_plan_bytes))
    kv_cache_config = SimpleNamespace(num_blocks=num_blocks, kv_cache_tensors=[
        SimpleNamespace(size=num_blocks * block_bytes)])
    return scheduler, vllm_config, kv_cache_config


def vllm_block_pool_class(kvc: SimpleNamespace, *, block_size: int, cell_size: int,
                          num_layers: int) -> type:
    """vLLM 0.32's ``BlockPool`` with kvcached managing its blocks, as kvcached's
    ``ElasticBlockPool`` does with prefix caching off: block ids come from kvcached's
    ``KVCacheManager.alloc`` and go back with ``free``; the free count is kvcached's
    ``available_size()``; ``get_usage`` is ``1 - free / num_gpu_blocks``. vLLM's own KV tensors
    stay (the CPU engine allocates them); kvcached's ids index them (block 0 is the null block in
    both). kvcached installs its pool by patching vLLM's coordinator; the test swaps the class the
    coordinator builds, which is the same edge."""
    from vllm.v1.core.block_pool import BlockPool

    class KvcachedBlockPool(BlockPool):  # type: ignore[misc, valid-type]
        def __init__(self, num_gpu_blocks: int, enable_caching: bool, hash_block_size: int,
                     **kwargs: Any) -> None:
            super().__init__(num_gpu_blocks, False, hash_block_size, **kwargs)
            kvc.pool_registry.clear_registered_kv_cache_pools()
            self.kv_cache_manager = kvc.kv_cache_manager.KVCacheManager(
                num_gpu_blocks, block_size, cell_size, num_layers, reserve_null_block=True)
            self.kv_cache_manager._wait_post_init()
            kvc.pool_registry.register_kv_cache_pool(self.kv_cache_manager, integration="vllm")

        def get_num_free_blocks(self) -> int:
            return self.kv_cache_manager.available_size()

        def get_usage(self) -> float:
            return 1.0 - (self.get_num_free_blocks() / self.num_gpu_blocks)

        def get_new_blocks(self, num_blocks: int) -> list[Any]:
            if num_blocks > self.get_num_free_blocks():
                raise ValueError(f"Cannot get {num_blocks} free blocks from the pool")
            ids = self.kv_cache_manager.alloc(num_blocks)
            if ids is None:
                raise ValueError("Unable to allocate KV cache blocks from physical pool")
            blocks = [self.blocks[i] for i in ids]
            for block in blocks:
                assert block.ref_cnt == 0
                block.ref_cnt += 1
            return blocks

        def free_blocks(self, ordered_blocks: Any) -> None:
            ids = []
            for block in ordered_blocks:
                if block is None or block.is_null:
                    continue
                block.ref_cnt -= 1
                if block.ref_cnt == 0:
                    ids.append(block.block_id)
            if ids:
                self.kv_cache_manager.free(ids)

        def reset_prefix_cache(self) -> bool:
            return True  # no prefix cache here (kvcached's pool with caching off)

    return KvcachedBlockPool
