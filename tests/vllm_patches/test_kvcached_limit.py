"""Our kvcached segment writer/reader against kvcached's own reader (a verbatim copy, see
``kvcached_upstream.py``), and the release mode each engine states (pure, no vLLM, no CUDA)."""
from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.vllm_patches import kvcached_upstream as upstream
from vllm_patches import kvcached_limit, release

MIB = 1 << 20
sizes = st.integers(0, 2**62)


@pytest.fixture
def shm(tmp_path, monkeypatch) -> str:
    monkeypatch.setattr(upstream, "SHM_DIR", str(tmp_path))  # their get_ipc_path reads it
    return str(tmp_path)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(total=sizes, used=sizes, prealloc=sizes, new_total=sizes)
def test_kvcached_reads_the_limit_we_write_and_we_read_its_usage(
        shm: str, total: int, used: int, prealloc: int, new_total: int) -> None:
    name = "eng"
    # kvcached's engine creates the segment and publishes its usage (MemInfoTracker init + update)
    with upstream.RwLockedShm(name, upstream.MemInfoStruct.SHM_SIZE, upstream.RwLockedShm.WLOCK) as mm:
        upstream.MemInfoStruct(total, used, prealloc).write_to_buffer(mm)
    assert kvcached_limit.read(name, shm) == kvcached_limit.KvcachedMemInfo(total, used, prealloc)
    # we set the quota's limit: kvcached sees it, and its usage fields are untouched
    kvcached_limit.write_limit(name, new_total, shm)
    got = upstream.get_kv_cache_limit(name)
    assert (got.total_size, got.used_size, got.prealloc_size) == (new_total, used, prealloc)
    # `kvctl limit` (their update) and our reader agree too
    upstream.update_kv_cache_limit(name, total)
    assert kvcached_limit.read(name, shm).total_size == total


def test_we_create_the_segment_kvcached_would_open(shm: str) -> None:
    assert kvcached_limit.read("new", shm) is None
    assert upstream.get_kv_cache_limit("new") is None
    kvcached_limit.write_limit("new", 300 * MIB, shm)
    assert os.path.getsize(os.path.join(shm, "new")) == upstream.MemInfoStruct.SHM_SIZE
    got = upstream.get_kv_cache_limit("new")
    assert (got.total_size, got.used_size, got.prealloc_size) == (300 * MIB, 0, 0)


def test_bad_names_and_sizes_are_refused(shm: str) -> None:
    with pytest.raises(ValueError, match="IPC name"):
        kvcached_limit.write_limit("a/b", 1, shm)
    with pytest.raises(ValueError, match=">= 0"):
        kvcached_limit.write_limit("x", -1, shm)


def test_kvcached_release_writes_the_cap_and_reports_mapped_bytes(shm: str) -> None:
    rel = release.KvcachedRelease("eng", shm)
    rel.on_cap(100, 40, 100, 2 * MIB)
    assert upstream.get_kv_cache_limit("eng").total_size == 80 * MIB
    with upstream.RwLockedShm("eng", 24, upstream.RwLockedShm.WLOCK) as mm:
        upstream.MemInfoStruct(80 * MIB, 6 * MIB, 2 * MIB).write_to_buffer(mm)
    assert rel.held_bytes(100, 2 * MIB) == 8 * MIB
    upstream.update_kv_cache_limit("eng", 1 << 40)  # someone else (kvctl, kvcached's init)
    rel.reassert()
    assert upstream.get_kv_cache_limit("eng").total_size == 80 * MIB


def test_without_kvcached_a_shrink_throttles_and_says_so() -> None:
    assert release.choose({}).mode == release.MODE_THROTTLE
    # switched on but not installed here (it builds from source with CUDA)
    chosen = release.choose({"ENABLE_KVCACHED": "true", "KVCACHED_IPC_NAME": "x"})
    assert chosen.mode == release.MODE_THROTTLE
    keep = release.KeepMapped()
    keep.on_cap(100, 40, 100, MIB)
    assert keep.held_bytes(100, MIB) == 100 * MIB and keep.unreleased_bytes == 60 * MIB


def test_ipc_name_is_fixed_in_process_zero_for_the_children() -> None:
    assert release.ensure_ipc_name({}) is None
    env = {"ENABLE_KVCACHED": "1"}
    name = release.ensure_ipc_name(env)
    assert name and env["KVCACHED_IPC_NAME"] == name
    assert release.ensure_ipc_name({"ENABLE_KVCACHED": "1", "KVCACHED_IPC_NAME": "mine"}) == "mine"
