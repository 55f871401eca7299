"""The engine's warm-tier gauges (issue 23), served by the plugin's collector next to vLLM's /metrics:
``vramshare_vllm_sleep_state{engine,state}`` (the cross-team name), last wake seconds, bytes freed."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from vllm_patches import metrics
from vllm_patches.warm import WarmTier


class Engine:
    def can_sleep(self):
        return True, ""

    def weights_bytes(self):
        return 1 << 30

    def idle(self):
        return True

    def sleep(self):
        return 5 << 30

    def wake_up(self):
        pass


class Channel:
    def send(self, msg):
        return False

    def recv(self, timeout):
        return None


def test_sleep_state_gauges(tmp_path):
    reg = CollectorRegistry()
    reg.register(metrics.StateCollector(str(tmp_path)))
    assert b"vramshare_vllm_sleep_state" not in generate_latest(reg)  # no warm tier: nothing new
    tier = WarmTier(Engine(), Channel(), "0", grant_timeout_s=0.0,
                    publish=lambda st: metrics.publish_warm(str(tmp_path), "0", st))
    tier.hello()
    from vramshare import contract
    tier.on_sleep(contract.WarmMessage.of(contract.WARM_SLEEP, seq=1))
    text = generate_latest(reg).decode()
    assert 'vramshare_vllm_sleep_state{engine="0",state="sleeping"} 1.0' in text
    assert 'vramshare_vllm_sleep_state{engine="0",state="awake"} 0.0' in text
    assert 'vramshare_vllm_sleep_freed_bytes{engine="0"} 5.36870912e+09' in text
    tier.before_request()  # no agent: wakes anyway, the request is served
    text = generate_latest(reg).decode()
    assert 'vramshare_vllm_sleep_state{engine="0",state="awake"} 1.0' in text
    assert 'vramshare_vllm_wake_seconds{engine="0"}' in text
    # the engine-cap gauges still read their own files only
    assert metrics.read_states(str(tmp_path)) == {}


def test_vllm_adapter_reads_the_restored_quota_before_waking():
    """``VllmEngine`` on an object shaped like vLLM 0.32's ``EngineCore`` (the boundary): the quota file
    is polled before ``wake_up`` so the KV cap is back before the first request."""
    from types import SimpleNamespace

    from vllm_patches.warm_glue import VllmEngine

    calls = []
    watcher = SimpleNamespace(poll_once=lambda: calls.append("poll"))
    core = SimpleNamespace(scheduler=SimpleNamespace(_vramshare=SimpleNamespace(watcher=watcher),
                                                     has_requests=lambda: False),
                           wake_up=lambda tags: calls.append(("wake_up", tags)))
    eng = VllmEngine(core)
    eng.wake_up()
    assert calls == ["poll", ("wake_up", None)] and eng.idle()
