"""The warm tier on GPUs the DRA driver serves (issue 23): until now only the kubelet device plugin's node
agent built the broker and its sockets, so an idle engine on a DRA-served GPU was never asked to sleep
and lent nothing (README said so). Through the whole DRA plugin (:class:`DraPluginDaemon` on the
simulated backend with replayed use, its preparer, pod cache and quota loop ticking on its own thread),
the API server double, the stand-in DRA scheduler and kubelet (real gRPC Prepare), and on the engine's
side the plugin's :class:`~vllm_patches.warm.WarmTier` over its :class:`~vllm_patches.warm.SocketChannel`:

* the claim's quota dir (the one its CDI spec mounts into the container) gets the warm socket, though
  its path on the host is longer than a unix socket's address may be;
* the engine, idle by its ``/metrics`` (a loopback page in vLLM's names), is asked to sleep, and its
  claim's limit falls to what a sleeping engine holds: the rest is lent;
* a request during sleep is served: the engine asks to wake, the loop restores the claim's quota to its
  request before it grants (without waiting for a tick), and the engine wakes.

The DRA plugin keeps no sleep credit: its ResourceSlice counters are never overcommitted.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import threading
import time

import pytest

from deviceplugin.dra.main import DraPluginDaemon
from deviceplugin.quota.warm import Sleep
from deviceplugin.quota.writer import read_quota
from deviceplugin.simulated_backend import SimulatedBackend
from deviceplugin.simulated_usage import UsageReplay
from standins.apiserver import ApiServerDouble
from standins.dra_kubelet import DraKubelet
from standins.dra_scheduler import DraScheduler
from tests.dra.conftest import NODE, dra_config
from tests.dra.test_daemon import DRIVER, _apply_deploy, devices_of
from tests.dra.test_quota_tick_view import _cached, _ip
from tests.test_warm_e2e import Metrics, page
from vllm_patches.warm import AWAKE, SocketChannel, WarmTier
from vramshare import contract
from vramshare.config import WarmTierConfig
from vramshare.kube import api_client_for

REQUEST_MIB = 22 * 1024  # the claim template vllm-22gi
USED_MIB = 2000  # what the replayed GPU says the claim's processes hold


class FakeEngine:
    """The plugin's engine boundary (as in tests/coldstart/test_warm_tier.py): can sleep, idle."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def can_sleep(self) -> tuple[bool, str]:
        return True, ""

    def weights_bytes(self) -> int:
        return 15 << 30

    def idle(self) -> bool:
        return True

    def sleep(self) -> int:
        self.calls.append("sleep")
        return 18 << 30

    def wake_up(self) -> None:
        self.calls.append("wake_up")


def wait(cond, timeout: float = 20.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


@pytest.fixture
def node(tmp_path):
    """A running DRA plugin with the warm tier on, its quota loop ticking every 0.2 s on its own thread,
    an engine idle after 1 s, and a registered kubelet and scheduler."""
    sockets = tempfile.mkdtemp(prefix="draw", dir="/tmp")
    metrics = Metrics()
    with ApiServerDouble() as api, api_client_for(api.url) as http:
        api.create_node({"metadata": {"name": NODE}})
        _apply_deploy(http)
        config = dra_config(tmp_path)
        config = dataclasses.replace(
            config, warm_tier=WarmTierConfig(enabled=True),
            quota=dataclasses.replace(config.quota, interval_seconds=0.2, idle_seconds=1.0, startup_ticks=0))
        backend = SimulatedBackend.demo()
        backend.usage_replay = UsageReplay([[USED_MIB]])
        daemon = DraPluginDaemon(backend, config, http, NODE, plugin_dir=f"{sockets}/plugins/{DRIVER}",
                                 registry_dir=f"{sockets}/registry", retry_seconds=0.05, resync_seconds=0.2)
        with daemon:
            assert daemon.warm is not None, "warmTier.enabled builds the broker on the DRA plugin too"
            assert api.wait_for(lambda a: len(devices_of(a)) == 7, timeout=20)
            kubelet = DraKubelet(http, NODE, f"{sockets}/registry")
            assert kubelet.sync_plugins() == [DRIVER] and daemon.plugin.registration.registered.wait(5)
            yield api, daemon, DraScheduler(http, [NODE], seed=1), kubelet, metrics
    metrics.close()
    shutil.rmtree(sockets, ignore_errors=True)


def _serving_pod(api: ApiServerDouble, scheduler: DraScheduler, metrics: Metrics) -> dict:
    """A vLLM pod with a 22 GiB shared claim, scheduled here, its ``/metrics`` on the loopback page."""
    metrics.pages["metrics"] = page(lambda: 0, 0, 0.0)  # no request running or waiting: idle
    api.create_pod({"metadata": {"name": "chat", "namespace": "default",
                                 "annotations": {"prometheus.io/port": str(metrics.port)}},
                    "spec": {"resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "vllm-22gi"}],
                             "containers": [{"name": "vllm", "image": "vllm",
                                             "resources": {"claims": [{"name": "gpu"}]}}]}})
    placement = scheduler.schedule(scheduler.create_claims(api.get_pod("default", "chat")))
    assert placement is not None and placement.node == NODE
    _ip(api, "chat", "127.0.0.1")
    return api.get_pod("default", "chat")


def test_an_idle_engine_on_a_dra_claim_sleeps_lends_and_wakes_for_a_request(node):
    api, daemon, scheduler, kubelet, metrics = node
    kubelet.prepare_pod(_serving_pod(api, scheduler, metrics))
    _cached(daemon, api, "chat")
    loop, broker = daemon._quota_loop, daemon.warm
    assert wait(lambda: len(loop.tenants_now) == 1)
    [tenant] = loop.tenants_now
    assert tenant.key.container.startswith("claim-")
    quota_dir = loop.quota_dir(tenant)
    sock = os.path.join(quota_dir, contract.WARM_SOCKET_NAME)
    assert wait(lambda: os.path.exists(sock)), "no warm socket in the claim's quota dir"

    mount = tempfile.mkdtemp(prefix="vs", dir="/tmp")  # the container's short view of the dir
    os.symlink(quota_dir, f"{mount}/run")
    engine = FakeEngine()
    holder: list[WarmTier] = []
    channel = SocketChannel(f"{mount}/run/{contract.WARM_SOCKET_NAME}", on_connect=lambda: holder[0].hello() if holder else None)
    tier = WarmTier(engine, channel, "0", grant_timeout_s=20.0)
    holder.append(tier)
    stop = threading.Event()

    def reader() -> None:  # the plugin's reader thread: deliver messages, run sleep jobs
        while not stop.is_set():
            msg = channel.recv(0.05)
            if msg is not None and (job := tier.deliver(msg)) is not None:
                job()
    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    try:
        tier.hello()
        assert wait(lambda: tenant.key in broker.views() and broker.views()[tenant.key].can_sleep)

        def limit() -> int:
            quota = read_quota(quota_dir)
            return quota.gpus[0].limit_mib if quota is not None else -1
        assert wait(lambda: broker.views()[tenant.key].state is Sleep.SLEEPING), "the idle engine was never slept"
        assert engine.calls == ["sleep"]
        assert wait(lambda: 0 < limit() < REQUEST_MIB // 2), f"nothing lent: limit {limit()} MiB"
        lent = REQUEST_MIB - limit()

        tier.before_request()  # a request arrives: served, never refused
        assert engine.calls == ["sleep", "wake_up"] and tier.state == AWAKE
        assert limit() >= REQUEST_MIB, "the engine woke before its claim's quota was restored"
        assert wait(lambda: broker.views()[tenant.key].state is Sleep.AWAKE)
        assert lent > REQUEST_MIB // 2
        assert broker.sleep_credits() == {}, "the DRA plugin overcommits no counters"
    finally:
        stop.set()
        thread.join(5)
        channel.close()
        shutil.rmtree(mount, ignore_errors=True)
