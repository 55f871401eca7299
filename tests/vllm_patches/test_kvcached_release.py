"""The unmap release path against kvcached's own Python (0.1.6; only its CUDA allocator replaced):
the cap counts once, offered blocks equal the cap, a shrink under load completes and gives the
memory back, and the generation it carried is acknowledged only then (issue 20, items 1, 2, 5)."""
from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.vllm_patches.kvcached_pool import load_kvcached, make_engine
from vllm_patches import engine_cap, metrics, release
from vllm_patches import settings as qsettings
from vllm_patches.testing import write_quota

MIB = 1 << 20
NUM_BLOCKS = 2048  # 32 MiB per layer and K/V: 2 layers x 2 x 16 pages of 2 MiB
BLOCK_BYTES = 16 * 1024 * 2 * 2  # block_size x cell_size (8 heads x 64 x bf16) x layers x K/V
PER_PAGE = 2 * MIB // (16 * 1024)  # kvcached's blocks per 2 MiB page
START_MIB = 300


@pytest.fixture(scope="module")
def kvc():
    kvc = load_kvcached()
    yield kvc
    path = os.path.join("/dev/shm", os.environ.get("KVCACHED_IPC_NAME", ""))
    if os.path.basename(path).startswith("vramshare_test_") and os.path.exists(path):
        os.unlink(path)


@pytest.fixture
def env(tmp_path, monkeypatch):
    quota = str(tmp_path / "quota.json")
    write_quota(quota, START_MIB, 1)
    monkeypatch.setenv("VRAMSHARE_QUOTA_FILE", quota)
    monkeypatch.setenv("VRAMSHARE_QUOTA_POLL_S", "3600")  # the test polls by hand
    monkeypatch.setenv("VRAMSHARE_VLLM_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("ENABLE_KVCACHED", "true")
    monkeypatch.delenv("VRAMSHARE_KVCACHED_FALLBACK", raising=False)
    return quota


def attach(kvc, quota: str) -> engine_cap.EngineCap:
    write_quota(quota, START_MIB, 1)
    sched, cfg, kvcfg = make_engine(kvc, num_blocks=NUM_BLOCKS, kv_plan_bytes=NUM_BLOCKS * BLOCK_BYTES)
    found = qsettings.from_env()
    assert found is not None
    ec = engine_cap.attach(sched, cfg, kvcfg, found)
    assert ec is not None
    ec.watcher.stop()
    return ec


def set_quota(ec: engine_cap.EngineCap, quota: str, mib: int, generation: int) -> None:
    write_quota(quota, mib, generation)
    ec.watcher.poll_once()
    ec.tick()


def take(pool, n: int, chunk: int = 7) -> list[int]:
    """Allocate like the scheduler: ask the (capped) free count first, a few blocks at a time."""
    held: list[int] = []
    while len(held) < n:
        want = min(chunk, n - len(held), pool.get_num_free_blocks())
        if want <= 0:
            break
        held += pool.get_new_blocks(want)
    return held


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(limit=st.integers(60, START_MIB), frac=st.floats(0.0, 1.0))
def test_the_cap_counts_once_against_kvcached_accounting(kvc, env, limit: int, frac: float) -> None:
    """Regression (issue 20 item 2): kvcached's pool already offers only what its limit allows;
    the plugin's view must be exactly that, not that minus the withheld blocks again."""
    ec = attach(kvc, env)
    pool, manager = ec.pool, ec.pool.kv_cache_manager
    set_quota(ec, env, limit, 2)
    cap = ec.cap.cap
    # within the quota, and less than it by at most one page bundle (kvcached's granularity)
    fits = (limit * MIB - ec.cap.non_kv_bytes) // BLOCK_BYTES
    floor = min(ec.cap.min_blocks, NUM_BLOCKS - 1)
    if fits >= floor + PER_PAGE:
        assert fits - PER_PAGE < cap <= fits  # rounded down to kvcached's pages, within the quota
    else:  # rounding down would go below one full-length request: the fewest pages above it
        assert floor <= cap < max(fits, floor) + PER_PAGE
    assert pool.get_num_free_blocks() == cap  # idle: offered == cap
    assert pool.get_usage() == 0.0
    held = take(pool, int(frac * cap))
    offered = pool.get_num_free_blocks()
    assert offered == manager.available_size()  # counted once
    assert offered == cap - len(held)  # every block of the cap is offered, no more
    assert pool.get_usage() == pytest.approx(len(held) / cap)
    assert len(take(pool, cap)) == offered  # and they really can be taken


def test_shrink_under_load_completes_gives_memory_back_and_acknowledges_the_generation(kvc, env):
    ec = attach(kvc, env)
    pool, device = ec.pool, kvc.vmm_ops.DEVICE
    assert ec.releaser.mode == release.MODE_UNMAP and ec.generation_applied == 1
    requests = [take(pool, 40) for _ in range(40)]  # 1,600 of 2,047 blocks held
    running = [r for r in requests if r]
    mapped_full = device.mapped_bytes
    set_quota(ec, env, 120, 2)  # shrink far below what is held
    assert ec.releaser.pending() and ec.generation_applied == 1  # not given back yet
    # kvcached's deferred shrink: no new pages, only the free blocks of pages already mapped are
    # offered (counted once: exactly kvcached's figure); taking them maps nothing new
    offered = pool.get_num_free_blocks()
    assert offered == pool.kv_cache_manager.available_size() < PER_PAGE
    running.append(take(pool, offered))
    assert device.mapped_bytes <= mapped_full and pool.get_usage() == 1.0
    finished = 0
    while running:  # vLLM preempts / finishes requests until the running set fits
        pool.free_blocks(running.pop())
        finished += 1
        ec.tick()
    assert finished == len([r for r in requests if r]) + 1  # every request completed
    assert not ec.releaser.pending() and ec.generation_applied == 2
    assert pool.get_usage() == 0.0  # an idle shrunk engine reads 0
    assert pool.get_num_free_blocks() == ec.cap.cap > 0  # offered == cap after the shrink
    held = ec.releaser.held_bytes(ec.cap.usable_blocks, BLOCK_BYTES)
    assert held <= (ec.cap.cap + 1) * BLOCK_BYTES + 10 * 8 * MIB  # + <= 10 pages kept ready
    assert device.mapped_bytes < mapped_full  # the pages went back to the device
    doc = metrics.read_states(os.environ["VRAMSHARE_VLLM_STATE_DIR"])["0"]
    assert doc["generation_applied"] == 2 and doc["release_mode"] == "unmap"
    assert doc["kv_held_bytes"] == held and doc["cap_blocks"] == ec.cap.cap
    # grow back: the cap follows at once
    set_quota(ec, env, START_MIB, 3)
    assert ec.generation_applied == 3 and pool.get_num_free_blocks() == ec.cap.cap > 1000


def test_a_throttling_engine_acknowledges_a_generation_at_once(tmp_path, monkeypatch):
    """Throttle mode: the cap is all a shrink does, so it is applied when the scheduler has it."""
    from vllm_patches.cap import KvCap
    from vllm_patches.watcher import QuotaTracker, QuotaWatcher

    quota = str(tmp_path / "q.json")
    write_quota(quota, 100, 4)
    tracker = QuotaTracker(100, None)
    pool = type("Pool", (), {"get_num_free_blocks": lambda self: 90})()
    ec = engine_cap.EngineCap(pool, KvCap(start_limit_mib=100, usable_blocks=100, block_bytes=MIB,
                                          min_blocks=1),
                              QuotaWatcher(quota, tracker, lambda mib: None), str(tmp_path), "0",
                              release.KeepMapped(), 16)
    ec.watcher.poll_once()
    ec.apply_cap()
    assert ec.generation_applied == 4
