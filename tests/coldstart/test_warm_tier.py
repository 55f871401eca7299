"""The warm tier end to end (issue 23 item 2): the real quota loop, policy, quota files, warm sockets
and broker on the agent side; the plugin's :class:`WarmTier` on the other end of a real unix socket,
driving a fake engine at the plugin's engine boundary. The "GPU" is a table of measured use per tenant
(the usage reader's edge): a sleeping engine keeps 1 GiB, an awake one its weights and KV, a co-tenant
grows into what is lent and gives it back one tick after its quota shrinks (as a releasing engine does).
"""
from __future__ import annotations

import threading
import time

import pytest

from deviceplugin.quota.warm_channel import WarmChannels
from deviceplugin.quota.loop import LoopSettings, QuotaLoop
from deviceplugin.quota.model import Phase, PolicyParams, Tenant, TenantKey
from deviceplugin.quota.telemetry import UsageSample, VllmSample
from deviceplugin.quota.warm import Sleep, WarmBroker
from deviceplugin.quota.writer import container_dir, read_quota
from vllm_patches.warm import AWAKE, SLEEPING, SocketChannel, WarmTier
from vramshare import contract

CAP = 40000
P = PolicyParams(floor_fraction=0.5, ceiling_fraction=1.75, step_mib=512, margin_mib=1024)
SLEEPY = TenantKey("llm", "sleepy", "vllm", pod_uid="uid-sleepy")
BUSY = TenantKey("llm", "busy", "vllm", pod_uid="uid-busy")


class Gpu:
    """Measured use per tenant, and the vLLM signals each reports."""

    def __init__(self):
        self.used = {SLEEPY: 17000, BUSY: 18000}
        self.running = {SLEEPY: 0, BUSY: 3}
        self.busy_wants = 34000  # the co-tenant's KV would grow to this if allowed

    def free(self):
        return CAP - sum(self.used.values())


class Usage:
    name = "fake-nvml"

    def __init__(self, gpu):
        self.gpu = gpu

    def read_usage(self):
        return [UsageSample("GPU-0", u, pod_uid=k.pod_uid) for k, u in self.gpu.used.items()]


class Signals:
    def __init__(self, gpu):
        self.gpu = gpu

    def read_signals(self, url):
        key = SLEEPY if "sleepy" in url else BUSY
        # both engines give memory back when their cap drops (kvcached/sleep): only such engines may
        # borrow beyond their request (quota.loans: releasing, issue 19)
        return VllmSample(kv_usage=0.99 if key is BUSY else 0.0, waiting=2 if key is BUSY else 0,
                          running=self.gpu.running[key], release_mode="unmap")


class Tenants:
    def list_tenants(self):
        return [Tenant(SLEEPY, (("GPU-0", 20000),), metrics_url="http://sleepy/metrics"),
                Tenant(BUSY, (("GPU-0", 20000),), metrics_url="http://busy/metrics")]


class FakeEngine:
    """The plugin's engine boundary. ``wake_up`` fails (as CUDA would) when the GPU lacks the memory."""

    def __init__(self, gpu, can=True):
        self.gpu, self.can = gpu, can
        self.calls: list[str] = []
        self.in_flight = 0

    def can_sleep(self):
        return (True, "") if self.can else (False, "sleep mode unavailable on this platform (cpu)")

    def weights_bytes(self):
        return 15000 << 20

    def idle(self):
        return self.in_flight == 0

    def sleep(self):
        self.calls.append("sleep")
        freed = self.gpu.used[SLEEPY] - 1000
        self.gpu.used[SLEEPY] = 1000
        return freed << 20

    def wake_up(self):
        self.calls.append("wake_up")
        need = 17000 - self.gpu.used[SLEEPY]
        if self.gpu.free() < need:
            raise RuntimeError(f"CUDA out of memory: need {need} MiB, {self.gpu.free()} free")
        self.gpu.used[SLEEPY] = 17000


class Mirror:
    """The quota-mib annotation mirror (the API edge): keeps the last details per pod."""

    def __init__(self):
        self.details = {}

    def mirror(self, key, quotas, states=None, details=None):
        self.details[key.pod] = details


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def _rig(tmp_path, gpu, classes=(), shared_clock=False):
    """The real loop, broker and channels over one GPU; ``shared_clock``: the channel reads the loop's
    clock too, as in the agent."""
    clock = Clock()
    holder = []
    broker = WarmBroker(send=lambda k, m: holder[0].send(k, m), params=P)
    channels = WarmChannels(broker, clock=clock) if shared_clock else WarmChannels(broker)
    holder.append(channels)
    loop = QuotaLoop(Tenants(), lambda: {"GPU-0": CAP}, [Usage(gpu)], P, str(tmp_path), signals=Signals(gpu),
                     settings=LoopSettings(params=P, idle_seconds=30.0, startup_ticks=0, classes=tuple(classes)),
                     clock=clock, warm=broker, mirror=Mirror())
    broker.poke = loop.poke
    loop.run_once()  # writes the quota dirs
    dirs = {k: container_dir(str(tmp_path), k.pod_uid, k.container) for k in (SLEEPY, BUSY)}
    channels.sync(dirs)
    yield gpu, clock, broker, channels, loop, dirs, tmp_path
    channels.close()
    while OPEN:
        OPEN.pop().close()


@pytest.fixture
def rig(tmp_path):
    yield from _rig(tmp_path, Gpu())


OPEN: list = []  # plugin channels to close after each test


def settle(channels, rounds=5):
    for _ in range(rounds):  # accept, then read
        channels.poll(0.02)


def limit(tmp_path, key):
    return read_quota(container_dir(str(tmp_path), key.pod_uid, key.container)).gpus[0].limit_mib


def tick(loop, gpu, tmp_path, channels):
    loop.run_once()
    settle(channels, 2)
    held = sum(max(limit(tmp_path, k), gpu.used[k]) for k in (SLEEPY, BUSY))
    assert held <= CAP, f"limits and measured use exceed the GPU: {held} > {CAP}"  # the loop's invariant


def follow(gpu, tmp_path):
    """The co-tenant's use follows its quota: it grows into lent memory, and releases when cut."""
    gpu.used[BUSY] = min(gpu.busy_wants, limit(tmp_path, BUSY))


def plugin(dirs, engine, **kw):
    path = f"{dirs[SLEEPY]}/{contract.WARM_SOCKET_NAME}"
    holder = []
    ch = SocketChannel(path, on_connect=lambda: holder[0].hello() if holder else None)
    tier = WarmTier(engine, ch, "0", **kw)
    holder.append(tier)
    OPEN.append(ch)
    tier.hello()
    return tier, ch


def pump(tier, ch, channels, until, timeout=5.0):
    """The plugin's reader thread, inline: deliver messages, run sleep jobs as the engine thread would."""
    end = time.monotonic() + timeout
    while time.monotonic() < end and not until():
        channels.poll(0.01)
        msg = ch.recv(0.01)
        if msg is not None:
            job = tier.deliver(msg)
            if job is not None:
                job()
        channels.poll(0.01)
    assert until()


def put_to_sleep(rig_, engine):
    gpu, clock, broker, channels, loop, dirs, tmp_path = rig_
    tier, ch = plugin(dirs, engine)
    settle(channels)
    assert broker.views()[SLEEPY].can_sleep
    for _ in range(3):  # idle for idleSeconds by the loop's clock
        clock.t += 20
        tick(loop, gpu, tmp_path, channels)
    pump(tier, ch, channels, lambda: broker.views()[SLEEPY].state is Sleep.SLEEPING)
    return tier, ch


def test_idle_engine_sleeps_and_its_memory_is_lent(rig):
    gpu, clock, broker, channels, loop, dirs, tmp_path = rig
    engine = FakeEngine(gpu)
    tier, _ = put_to_sleep(rig, engine)
    assert engine.calls == ["sleep"] and tier.state == SLEEPING
    for _ in range(6):
        clock.t += 10
        tick(loop, gpu, tmp_path, channels)
        follow(gpu, tmp_path)
    assert limit(tmp_path, SLEEPY) <= 1000 + P.margin_mib + P.step_mib  # residual + margin, not the class floor
    assert gpu.used[BUSY] > 20000  # the co-tenant is using what was lent
    assert broker.views()[SLEEPY].lent_mib >= 20000 - 2600
    seen = loop._mirror.details["sleepy"]["vllm"]["GPU-0"]  # what vramshare inspect shows
    assert seen["sleep"] == "sleeping" and seen["lent"] >= 17000
    from prometheus_client import CollectorRegistry, generate_latest
    from deviceplugin.quota.warm_channel import WarmCollector
    reg = CollectorRegistry()
    reg.register(WarmCollector(broker))
    text = generate_latest(reg).decode()
    tenant = 'tenant_container="vllm",tenant_namespace="llm",tenant_pod="sleepy"'
    assert f'vramshare_warm_engine_state{{state="sleeping",{tenant}}} 1.0' in text
    assert 'vramshare_warm_lent_bytes{tenant_container="vllm",tenant_namespace="llm",tenant_pod="sleepy"}' in text


def test_request_during_sleep_waits_for_co_tenants_to_release_then_is_served(rig):
    gpu, clock, broker, channels, loop, dirs, tmp_path = rig
    engine = FakeEngine(gpu)
    tier, ch = put_to_sleep(rig, engine)
    for _ in range(6):
        clock.t += 10
        tick(loop, gpu, tmp_path, channels)
        follow(gpu, tmp_path)
    lent_use = gpu.used[BUSY]
    assert lent_use > 20000
    served = threading.Event()

    def request():  # the engine thread: a request arrives while asleep
        tier.before_request()
        served.set()

    t = threading.Thread(target=request)
    t.start()
    pump(tier, ch, channels, lambda: broker.views()[SLEEPY].state is Sleep.WAKING)
    gpu.running[SLEEPY] = 1
    tick(loop, gpu, tmp_path, channels)  # co-tenant cut back; its measured use has not dropped yet
    assert limit(tmp_path, BUSY) < lent_use and gpu.used[BUSY] == lent_use
    assert not served.is_set() and "wake_up" not in engine.calls  # nothing granted out of unreleased memory
    follow(gpu, tmp_path)  # the co-tenant releases
    for _ in range(3):
        if served.is_set():
            break
        tick(loop, gpu, tmp_path, channels)
        follow(gpu, tmp_path)
        msg = ch.recv(0.5)  # the reader thread hands the grant to the waiting request
        if msg is not None:
            tier.deliver(msg)
        served.wait(1.0)
    t.join(5)
    assert served.is_set() and tier.state == AWAKE
    assert engine.calls == ["sleep", "wake_up"]  # the wake never failed for memory
    assert limit(tmp_path, SLEEPY) >= 20000
    pump(tier, ch, channels, lambda: broker.views()[SLEEPY].state is Sleep.AWAKE)
    assert broker.views()[SLEEPY].wakes == 1 and tier.last_wake_s is not None


def test_request_is_served_when_the_agent_never_answers(rig):
    gpu, clock, broker, channels, loop, dirs, tmp_path = rig
    engine = FakeEngine(gpu)
    tier, ch = put_to_sleep(rig, engine)
    channels.close()  # the agent is gone
    tier.grant_timeout_s = 0.2
    tier.before_request()
    assert tier.state == AWAKE and engine.calls == ["sleep", "wake_up"]


def test_a_failed_wake_is_retried_not_refused():
    gpu = Gpu()
    engine = FakeEngine(gpu)

    class NoAgent:
        def send(self, msg):
            return False

        def recv(self, timeout):
            return None

    tier = WarmTier(engine, NoAgent(), sleep_fn=lambda s: gpu.used.__setitem__(BUSY, 10000))
    tier.on_sleep(contract.WarmMessage.of(contract.WARM_SLEEP, seq=1))
    gpu.used[BUSY] = 39000  # a co-tenant took everything
    tier.before_request()
    assert engine.calls == ["sleep", "wake_up", "wake_up"] and tier.state == AWAKE


def test_busy_engine_refuses_to_sleep(rig):
    gpu, clock, broker, channels, loop, dirs, tmp_path = rig
    engine = FakeEngine(gpu)
    engine.in_flight = 1
    tier, ch = plugin(dirs, engine)
    settle(channels)
    for _ in range(3):
        clock.t += 20
        tick(loop, gpu, tmp_path, channels)
    pump(tier, ch, channels, lambda: broker.views()[SLEEPY].refusals >= 1)
    assert engine.calls == [] and broker.views()[SLEEPY].state is Sleep.AWAKE


def test_engine_that_cannot_sleep_keeps_todays_behaviour(rig):
    gpu, clock, broker, channels, loop, dirs, tmp_path = rig
    engine = FakeEngine(gpu, can=False)
    tier, ch = plugin(dirs, engine)
    settle(channels)
    view = broker.views()[SLEEPY]
    assert not view.can_sleep and "unavailable" in view.reason
    for _ in range(4):
        clock.t += 20
        tick(loop, gpu, tmp_path, channels)
        assert ch.recv(0.01) is None  # never asked to sleep
    assert engine.calls == []
    assert limit(tmp_path, SLEEPY) >= P.floor_of(20000)  # the idle tenant keeps its class floor, as today


def test_bad_lines_on_the_socket_are_dropped(rig):
    import socket as s
    gpu, clock, broker, channels, loop, dirs, tmp_path = rig
    c = s.socket(s.AF_UNIX, s.SOCK_STREAM)
    c.connect(f"{dirs[SLEEPY]}/{contract.WARM_SOCKET_NAME}")
    c.sendall(b'not json\n{"v":2,"op":"hello"}\n{"v":1,"op":"wake","seq":"x"}\n'
              b'{"v":1,"op":"hello","canSleep":true,"state":"awake"}\n')
    settle(channels)
    assert broker.views()[SLEEPY].can_sleep
    c.sendall(b"x" * (contract.WARM_MAX_LINE + 10))
    settle(channels)
    c.settimeout(1)
    assert c.recv(10) == b""  # closed
    c.close()


@pytest.fixture
def ahead_rig(tmp_path):
    """The rig with the sleeper in a ``wakeAhead`` class (its namespace)."""
    from vramshare.config import ClassMatch, QuotaClass

    gpu = Gpu()
    gpu.busy_wants = 18000  # the co-tenant stays within its request: free memory is measured free
    cls = QuotaClass("ahead", match=(ClassMatch(namespaces=("llm",)),), wake_ahead=True)
    yield from _rig(tmp_path, gpu, classes=(cls,), shared_clock=True)


def test_the_loop_restores_the_quota_then_wakes_a_regular_client_ahead(ahead_rig):
    """Through the real loop, quota files and sockets: after three regular quiet gaps the broker wakes the
    engine before its forecast request, with its quota file restored first; the request finds it up."""
    gpu, clock, broker, channels, loop, dirs, tmp_path = ahead_rig
    engine = FakeEngine(gpu)
    tier, ch = put_to_sleep(ahead_rig, engine)

    def step(dt):
        clock.t += dt
        tick(loop, gpu, tmp_path, channels)
        msg = ch.recv(0.05)
        if msg is not None:
            job = tier.deliver(msg)
            if msg.op == contract.WARM_PREWAKE:
                assert limit(tmp_path, SLEEPY) >= 20000  # the quota carries the early wake
            if job is not None:
                job()
        return msg.op if msg is not None else None

    for _ in range(3):  # a request every ~100 s: woken by it, asleep again 30 s after it
        for _ in range(5):
            step(10)
        done = threading.Event()
        threading.Thread(target=lambda: (tier.before_request(), done.set()), daemon=True).start()
        for _ in range(20):
            if done.is_set():
                break
            if step(0.5) == contract.WARM_GRANT:  # the request thread wakes the engine before the next
                done.wait(5)  # tick, however loaded the machine: the loop dates its use from that tick
        assert done.wait(5) and tier.state == AWAKE
        for _ in range(5):
            step(10)
        pump(tier, ch, channels, lambda: broker.views()[SLEEPY].state is Sleep.SLEEPING)
    assert len(broker.views()[SLEEPY].gaps) == 3 and broker.views()[SLEEPY].due is not None
    calls = len(engine.calls)
    for _ in range(30):  # until the forecast's hold has passed, at the latest
        if tier.state == AWAKE:
            break
        step(5)
    v = broker.views()[SLEEPY]
    assert tier.state == AWAKE and engine.calls[calls:] == ["wake_up"], (  # up before its request
        f"{tier.state} at t={clock.t}: gaps {v.gaps} due {v.due} quiet_from {v.quiet_from} ahead {v.ahead!r}")
    pump(tier, ch, channels, lambda: broker.views()[SLEEPY].state is Sleep.AWAKE)  # the engine's awake, read
    wakes = tier.wakes
    tier.before_request()  # the request: no wake in its path
    assert tier.wakes == wakes
    gpu.running[SLEEPY] = 1  # the loop sees it serving: the early wake was used
    step(0.5)
    v = broker.views()[SLEEPY]
    assert (v.prewakes_used, v.prewakes_wasted, v.prewakes_declined) == (1, 0, 0)


def test_a_quota_dir_past_a_unix_sockets_path_limit_still_gets_its_socket(tmp_path):
    """``<quotaHostDir>/<pod uid>/<container or claim-name>/warm.sock`` is ~140 bytes with 63-character
    names, past sun_path's 107: the agent listened nowhere (``AF_UNIX path too long``, logged) and the
    engine never slept. The socket is bound in that directory all the same, and an engine reaches it
    through the container's short mount of it."""
    broker = WarmBroker(send=lambda k, m: False, params=P)
    channels = WarmChannels(broker)
    deep = tmp_path / ("p" * 36) / ("claim-" + "c" * 57)
    deep.mkdir(parents=True)
    assert len(str(deep / contract.WARM_SOCKET_NAME)) > 107
    try:
        channels.sync({SLEEPY: str(deep)})
        assert (deep / contract.WARM_SOCKET_NAME).is_socket()
        mount = tmp_path / "m"
        mount.symlink_to(deep)
        tier, ch = plugin({SLEEPY: str(mount)}, FakeEngine(Gpu()))
        settle(channels)
        assert broker.views()[SLEEPY].can_sleep  # the engine's hello arrived
        channels.sync({})
        assert not (deep / contract.WARM_SOCKET_NAME).exists()  # unlinked when the tenant is gone
    finally:
        channels.close()
        while OPEN:
            OPEN.pop().close()


def test_a_reload_reaches_the_brokers_bounds(rig):
    """The broker bounds sleeping and waking tenants by the quota's fractions; a reload changed the loop's
    and left the broker on the ones it was built with."""
    from vramshare.config import QuotaConfig

    gpu, clock, broker, channels, loop, dirs, tmp_path = rig
    loop.reconfigure(QuotaConfig(floor_fraction=0.25, ceiling_fraction=1.25, step_mib=256, margin_mib=512))
    assert broker.params == loop.settings.params
    assert broker.params.bounds_of(20000) == loop.settings.params.bounds_of(20000)
