"""Wake ahead, engine side (issue 23): the plugin's :class:`WarmTier` handles ``prewake`` (asleep and
idle: wake and answer ``awake`` with its seq; busy, waking or awake: ignore, which the agent counts as
declined), and the reader drops an op it does not know and logs it (what an engine older than
``prewake`` does with it), then reads on. Fake engine at the plugin's engine boundary."""
from __future__ import annotations

import logging
import socket

import pytest

from vllm_patches.warm import AWAKE, SLEEPING, WAKING, SocketChannel, WarmTier
from vramshare import contract


class Engine:
    def __init__(self, fail: bool = False):
        self.calls: list[str] = []
        self.in_flight = 0
        self.fail = fail

    def can_sleep(self):
        return True, ""

    def weights_bytes(self):
        return 1 << 30

    def idle(self):
        return self.in_flight == 0

    def sleep(self):
        self.calls.append("sleep")
        return 1 << 30

    def wake_up(self):
        self.calls.append("wake_up")
        if self.fail:
            raise RuntimeError("CUDA out of memory")


class Channel:
    def __init__(self):
        self.sent: list[contract.WarmMessage] = []

    def send(self, msg):
        self.sent.append(msg)
        return True

    def recv(self, timeout):
        return None


def asleep(engine: Engine) -> tuple[WarmTier, Channel]:
    ch = Channel()
    tier = WarmTier(engine, ch, "0", grant_timeout_s=0.0)
    tier.on_sleep(contract.WarmMessage.of(contract.WARM_SLEEP, seq=1))
    assert tier.state == SLEEPING
    ch.sent.clear()
    return tier, ch


def prewake(seq: int = 7) -> contract.WarmMessage:
    return contract.WarmMessage.of(contract.WARM_PREWAKE, seq=seq, bytes=20 << 30)


def test_an_idle_sleeping_engine_wakes_ahead_and_answers_awake_with_the_prewakes_seq():
    engine = Engine()
    tier, ch = asleep(engine)
    job = tier.deliver(prewake(7))
    assert job is not None  # onto the engine's thread, as a sleep
    job()
    assert tier.state == AWAKE and engine.calls == ["sleep", "wake_up"]
    assert [(m.op, m.get("seq")) for m in ch.sent] == [(contract.WARM_AWAKE, 7)]
    tier.before_request()  # its request finds it up: no wake in its path
    assert engine.calls == ["sleep", "wake_up"] and len(ch.sent) == 1


@pytest.mark.parametrize("why", ["busy", "waking", "awake"])
def test_a_busy_waking_or_awake_engine_ignores_prewake(why):
    engine = Engine()
    tier, ch = asleep(engine)
    if why == "busy":
        engine.in_flight = 1
    elif why == "waking":
        tier.state = WAKING
    else:
        tier.state = AWAKE
    before = tier.state
    tier.deliver(prewake())()
    assert engine.calls == ["sleep"] and ch.sent == [] and tier.state == before


def test_a_failed_prewake_leaves_it_asleep_and_unanswered():
    engine = Engine(fail=True)
    tier, ch = asleep(engine)
    tier.deliver(prewake())()
    assert tier.state == SLEEPING and ch.sent == []


def test_the_reader_drops_an_op_it_does_not_know_logs_it_and_reads_on(tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    path = str(tmp_path / contract.WARM_SOCKET_NAME)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)
    ch = SocketChannel(path)
    try:
        assert ch.send(contract.WarmMessage.of(contract.WARM_HELLO, engine="0", canSleep=True))
        conn, _ = srv.accept()
        # an op newer than this engine (as prewake is to an engine built before it), then a sleep
        conn.sendall(b'{"v":1,"op":"hibernate","seq":3,"bytes":1}\n' + contract.encode_warm(
            contract.WarmMessage.of(contract.WARM_SLEEP, seq=4, level=1)))
        assert ch.recv(1.0) is None
        assert any("message dropped" in r.getMessage() and "hibernate" in str(getattr(r, "fields", r.args))
                   for r in caplog.records)
        msg = ch.recv(1.0)
        assert msg is not None and msg.op == contract.WARM_SLEEP and msg.get("seq") == 4
        conn.close()
    finally:
        ch.close()
        srv.close()


def test_a_valid_message_not_for_an_engine_is_dropped_and_logged(caplog):
    caplog.set_level(logging.WARNING)
    tier, _ = asleep(Engine())
    assert tier.deliver(contract.WarmMessage.of(contract.WARM_HELLO, engine="x")) is None
    assert any("not for an engine" in r.getMessage() for r in caplog.records)
