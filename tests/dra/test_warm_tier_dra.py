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
* a request during sleep is served: the engine asks to wake (which pokes the loop), the loop restores
  the claim's quota to its request before it grants, and the engine wakes.

Overcommit (item 5): two sleeping claims of a class that books sleepers at a quarter of their request lend
their GPU a credit, which the plugin publishes in the device's ``capacity.memory`` (the allocator books
against it, as the extender books a device-plugin GPU); a wake withdraws it.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import threading
import time

import pytest

from deviceplugin.quota.warm import Sleep
from deviceplugin.quota.writer import read_quota
from standins.apiserver import ApiServerDouble
from standins.dra_scheduler import DraScheduler
from tests.dra.conftest import NODE, dra_config
from tests.dra.test_quota_tick_view import _cached, _ip, running_plugin
from tests.test_warm_e2e import Metrics, page
from vllm_patches.warm import AWAKE, SocketChannel, WarmTier
from vramshare import contract
from tests.dra.test_daemon import devices_of
from vramshare.config import ClassMatch, QuotaClass, WarmTierConfig
from vramshare.inventory import GpuMode

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


def _plugin_node(config):
    """The DRA plugin on ``config`` with the warm tier on, its quota loop ticking every 0.2 s on its own
    thread and an engine idle after 1 s; the engines' ``/metrics`` on a loopback page."""
    config = dataclasses.replace(
        config, warm_tier=WarmTierConfig(enabled=True),
        quota=dataclasses.replace(config.quota, interval_seconds=0.2, idle_seconds=1.0, startup_ticks=0))
    metrics = Metrics()
    try:
        with running_plugin(config, USED_MIB) as (api, daemon, scheduler, kubelet):
            assert daemon.warm is not None, "warmTier.enabled builds the broker on the DRA plugin too"
            yield api, daemon, scheduler, kubelet, metrics
    finally:
        metrics.close()


@pytest.fixture
def node(tmp_path):
    yield from _plugin_node(dra_config(tmp_path))


@pytest.fixture
def overcommit_node(tmp_path):
    """Only GPU 0 shared (79 GiB), and the pods of namespace default in a class whose sleepers are booked
    at a quarter of their request, with room kept for one wake (``wakeReserve: 1``)."""
    config = dra_config(tmp_path)
    tail = QuotaClass("tail", sleep_booked_fraction=0.25, match=(ClassMatch(namespaces=("default",)),))
    yield from _plugin_node(dataclasses.replace(config, gpu_modes={"1": GpuMode.EXCLUSIVE, "2": GpuMode.EXCLUSIVE},
                                                quota=dataclasses.replace(config.quota, classes=(tail,))))


def _serving_pod(api: ApiServerDouble, scheduler: DraScheduler, metrics: Metrics, name: str = "chat") -> dict:
    """A vLLM pod with a 22 GiB shared claim, scheduled here, its ``/metrics`` on the loopback page."""
    metrics.pages["metrics"] = page(lambda: 0, 0, 0.0)  # no request running or waiting: idle
    api.create_pod({"metadata": {"name": name, "namespace": "default",
                                 "annotations": {"prometheus.io/port": str(metrics.port)}},
                    "spec": {"resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "vllm-22gi"}],
                             "containers": [{"name": "vllm", "image": "vllm",
                                             "resources": {"claims": [{"name": "gpu"}]}}]}})
    placement = scheduler.schedule(scheduler.create_claims(api.get_pod("default", name)))
    assert placement is not None and placement.node == NODE
    _ip(api, name, "127.0.0.1")
    return api.get_pod("default", name)


class Plugin:
    """The engine's side: the vLLM plugin's warm tier over its socket, with its reader thread, connected
    through a short path to the claim's quota dir (as the container's mount of it is)."""

    def __init__(self, quota_dir: str) -> None:
        self.mount = tempfile.mkdtemp(prefix="vs", dir="/tmp")
        os.symlink(quota_dir, f"{self.mount}/run")
        self.engine = FakeEngine()
        holder: list[WarmTier] = []
        self.channel = SocketChannel(f"{self.mount}/run/{contract.WARM_SOCKET_NAME}",
                                     on_connect=lambda: holder[0].hello() if holder else None)
        self.tier = WarmTier(self.engine, self.channel, "0", grant_timeout_s=20.0)
        holder.append(self.tier)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        self.tier.hello()

    def _read(self) -> None:  # the plugin's reader thread: deliver messages, run sleep jobs
        while not self._stop.is_set():
            msg = self.channel.recv(0.05)
            if msg is not None and (job := self.tier.deliver(msg)) is not None:
                job()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.channel.close()
        shutil.rmtree(self.mount, ignore_errors=True)


def _asleep(node, name: str = "chat") -> tuple:
    """The pod's claim prepared, its engine connected, idle, and asleep."""
    api, daemon, scheduler, kubelet, metrics = node
    pod = _serving_pod(api, scheduler, metrics, name)
    kubelet.prepare_pod(pod)
    _cached(daemon, api, name)
    loop, broker = daemon._quota_loop, daemon.warm
    assert wait(lambda: any(t.key.pod == name for t in loop.tenants_now))
    [tenant] = [t for t in loop.tenants_now if t.key.pod == name]
    assert tenant.key.container.startswith("claim-")
    quota_dir = loop.quota_dir(tenant)
    sock = os.path.join(quota_dir, contract.WARM_SOCKET_NAME)
    assert wait(lambda: os.path.exists(sock)), "no warm socket in the claim's quota dir"
    plugin = Plugin(quota_dir)
    assert wait(lambda: tenant.key in broker.views() and broker.views()[tenant.key].can_sleep)
    assert wait(lambda: broker.views()[tenant.key].state is Sleep.SLEEPING), "the idle engine was never slept"
    assert plugin.engine.calls == ["sleep"]
    return pod, tenant, quota_dir, plugin


def _limit(quota_dir: str) -> int:
    quota = read_quota(quota_dir)
    return quota.gpus[0].limit_mib if quota is not None else -1


def test_an_idle_engine_on_a_dra_claim_sleeps_lends_and_wakes_for_a_request(node):
    api, daemon, scheduler, kubelet, metrics = node
    pod, tenant, quota_dir, plugin = _asleep(node)
    broker = daemon.warm
    try:
        assert wait(lambda: 0 < _limit(quota_dir) < REQUEST_MIB // 2), f"nothing lent: limit {_limit(quota_dir)} MiB"
        lent = REQUEST_MIB - _limit(quota_dir)
        plugin.tier.before_request()  # a request arrives: served, never refused
        assert plugin.engine.calls == ["sleep", "wake_up"] and plugin.tier.state == AWAKE
        assert _limit(quota_dir) >= REQUEST_MIB, "the engine woke before its claim's quota was restored"
        assert wait(lambda: broker.views()[tenant.key].state is Sleep.AWAKE)
        assert lent > REQUEST_MIB // 2
        assert broker.sleep_credits() == {}, "no class here overcommits"
    finally:
        plugin.close()


def test_a_claim_unprepared_while_its_engine_sleeps_leaves_no_socket_and_no_state(node):
    """The pod is deleted while its engine sleeps and the kubelet unprepares the claim: the socket goes,
    the broker and the loop forget the tenant, and the engine's end is left with nothing to talk to."""
    api, daemon, scheduler, kubelet, metrics = node
    pod, tenant, quota_dir, plugin = _asleep(node)
    loop, broker = daemon._quota_loop, daemon.warm
    try:
        api.delete_pod("default", "chat")
        kubelet.unprepare_pod(pod)
        assert wait(lambda: not daemon.preparer.prepared())
        sock = os.path.join(quota_dir, contract.WARM_SOCKET_NAME)
        assert wait(lambda: not os.path.exists(sock)), "the socket of an unprepared claim stayed"
        assert wait(lambda: loop.tenants_now == [] and tenant.key not in broker.views())
        assert wait(lambda: loop.tracked() == set())
    finally:
        plugin.close()


def _gpu0_capacity(api: ApiServerDouble) -> str:
    return devices_of(api)["gpu-0"]["capacity"]["memory"]["value"]


def test_sleeping_claims_of_an_overcommit_class_lend_their_gpu_a_published_credit(overcommit_node):
    """Two 22 GiB claims sleep on GPU 0, each booked at max(a quarter of 22,528, the 2,000 MiB it holds) =
    5,632 MiB; the reserve keeps room for one wake (16,896 MiB), so the credit is the other gap, 16 whole
    units: the device's published capacity grows from 80,896 to 97,280 MiB. On the commit before this
    one the DRA plugin passed no ``on_credits`` and the capacity never moved. A request wakes one engine:
    the credit is withdrawn and the slice says 80,896 MiB again."""
    api = overcommit_node[0]
    assert _gpu0_capacity(api) == "80896Mi"
    asleep = [_asleep(overcommit_node, name) for name in ("chat", "code")]
    try:
        assert wait(lambda: _gpu0_capacity(api) == "97280Mi"), _gpu0_capacity(api)
        asleep[0][3].tier.before_request()  # a request for chat: served, the engine wakes
        assert wait(lambda: _gpu0_capacity(api) == "80896Mi"), _gpu0_capacity(api)
    finally:
        for *_, plugin in asleep:
            plugin.close()
