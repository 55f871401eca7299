# SPDX-License-Identifier: Apache-2.0
"""kvcached 0.1.6's pure-Python scheduler-side modules, for tests only (Apache-2.0, the kvcached
project, github.com/ovg-project/kvcached; files copied verbatim from the ``kvcached-0.1.6`` sdist
on PyPI: ``errors.py kv_geometry.py locks.py utils.py kv_cache_manager.py control.py
pool_registry.py``, and ``integration/{__init__,patch_base,version_utils}.py``,
``integration/vllm/{__init__,patches}.py`` for its vLLM patches, e.g. the ``EngineCorePatch`` that
refuses vLLM 0.32).

Replaced at the CUDA boundary (ours, not kvcached's): ``vmm_ops.py`` (its C++ ``PageAllocator`` /
``InternalPage`` ported to Python line by line from ``csrc/page_allocator.cpp``, with page mapping
and ``cudaMemGetInfo`` as a fake device) and ``tp_ipc_util.py`` (the worker IPC; one process here).
kvcached's own ``__init__`` (version lookup, autopatch warning) is replaced by this docstring.
"""
__version__ = "0.1.6"
