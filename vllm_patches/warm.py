"""The warm tier, engine side (issue 23 item 2): sleep when the node agent says the pod is idle, wake on
the first request once the agent has taken the memory back from co-tenants.

:class:`WarmTier` is the protocol; it drives an engine only through :class:`Engine` (the engine boundary:
:mod:`vllm_patches.warm_glue` implements it on vLLM's ``EngineCore``, the tests with a fake) and talks
to the agent only through :class:`Channel` (:class:`SocketChannel`: the unix socket of
:data:`vramshare.contract.WARM_SOCKET_NAME` in the quota dir). Rules:

* ``sleep`` from the agent is obeyed only when the engine can sleep and has no request (else
  ``refused`` with the reason); then ``Engine.sleep()`` (vLLM: level 1, weights to host RAM, KV freed)
  and ``slept`` with the bytes freed;
* a request that arrives while asleep is never refused: :meth:`WarmTier.before_request` sends
  ``wake``, waits for ``grant`` (the agent restored the quota out of memory that is measured free), wakes
  the engine and lets the request through. If the agent does not answer within ``grant_timeout_s``
  (agent restarting, channel gone) the engine wakes anyway, logged: the memory is its request, which the
  books kept. A wake that fails (out of memory) is retried until it succeeds; the request waits;
* an engine that cannot sleep (no ``enable_sleep_mode``, the CPU build: vLLM's
  ``is_sleep_mode_available`` is true on CUDA, ROCm and XPU only) says so in ``hello`` and keeps
  today's behaviour: the agent never asks it to sleep.

Metrics (published through :func:`vllm_patches.metrics.publish_warm`): ``vramshare_vllm_sleep_state
{engine,state}``, ``vramshare_vllm_wake_seconds`` (last), ``vramshare_vllm_sleep_freed_bytes`` (last).
"""
from __future__ import annotations

import queue
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

from vramshare import contract, logs

log = logs.get(__name__)

AWAKE, SLEEPING, WAKING = "awake", "sleeping", "waking"
STATES = (AWAKE, SLEEPING, WAKING)


class Engine(Protocol):
    """What the warm tier needs of an engine. Called on the engine's own thread."""

    def can_sleep(self) -> tuple[bool, str]:
        """Whether it can sleep, and why not."""

    def weights_bytes(self) -> int:
        """What a wake brings back to the GPU (the agent's estimate of the memory to take back)."""

    def idle(self) -> bool:
        """No running, waiting or queued request."""

    def sleep(self) -> int:
        """Sleep (level 1); returns the GPU bytes freed (0 when it cannot tell)."""

    def wake_up(self) -> None:
        """Back to serving; raises when it cannot (then it is retried)."""


class Channel(Protocol):
    def send(self, msg: contract.WarmMessage) -> bool: ...

    def recv(self, timeout: float) -> contract.WarmMessage | None: ...


@dataclass
class WarmTier:
    engine: Engine
    channel: Channel
    name: str = "0"
    grant_timeout_s: float = 30.0
    retry_s: float = 1.0
    publish: Callable[[dict], None] = lambda state: None
    clock: Callable[[], float] = time.monotonic
    sleep_fn: Callable[[float], None] = time.sleep
    state: str = AWAKE
    wake_seq: int = 0
    last_wake_s: float | None = None
    freed_bytes: int = 0
    wakes: int = 0
    sleeps: int = 0
    _grants: "queue.Queue[contract.WarmMessage]" = field(default_factory=queue.Queue)
    _lock: threading.RLock = field(default_factory=threading.RLock)

    def hello(self) -> None:
        ok, why = self.engine.can_sleep()
        if not ok:
            log.info("warm tier: engine cannot sleep, kept awake (today's behaviour)", engine=self.name, reason=why)
        self.channel.send(contract.WarmMessage.of(contract.WARM_HELLO, engine=self.name, canSleep=ok,
                                                  weightsBytes=int(self.engine.weights_bytes()),
                                                  reason=why or None, state=self.state, model=self._model()))
        self._publish()

    def _model(self) -> str | None:
        """The model it serves, when the engine can say and it parses (``<name>[@<revision>]``)."""
        name = getattr(self.engine, "model_name", lambda: None)()
        try:
            return str(contract.parse_model_ref(name)) if name else None
        except contract.ModelRefError:
            return None

    # -- from the agent ------------------------------------------------------------------------------
    def deliver(self, msg: contract.WarmMessage) -> Callable[[], None] | None:
        """A message read off the channel (reader thread). Grants are queued for the waiting request;
        a sleep is returned as a job for the engine's thread (the engine is not thread-safe)."""
        if msg.op == contract.WARM_GRANT:
            self._grants.put(msg)
            return None
        if msg.op == contract.WARM_SLEEP:
            return lambda: self.on_sleep(msg)
        if msg.op == contract.WARM_PREWAKE:
            return lambda: self.on_prewake(msg)
        log.warning("warm channel: message dropped, not for an engine", engine=self.name, op=msg.op)
        return None

    def on_prewake(self, msg: contract.WarmMessage) -> None:
        """On the engine thread: wake ahead of a forecast request (the agent restored the quota out of
        free memory) if asleep and idle, and answer ``awake`` with the prewake's seq; busy or waking, it
        is ignored (the agent counts no answer as declined). A failed wake leaves it asleep, unanswered."""
        seq = msg.get("seq")
        with self._lock:
            if self.state != SLEEPING or not self.engine.idle():
                log.info("warm tier: prewake ignored", engine=self.name, state=self.state, seq=seq)
                return
            t0 = self.clock()
            try:
                self.engine.wake_up()
            except Exception as exc:  # no memory after all: it stays asleep; a request wakes it as usual
                log.warning("warm tier: prewake failed, staying asleep", engine=self.name, error=str(exc))
                return
            self.state = AWAKE
            self.last_wake_s = self.clock() - t0
            self.channel.send(contract.WarmMessage.of(contract.WARM_AWAKE, engine=self.name, seq=seq,
                                                      seconds=round(self.last_wake_s, 6)))
            log.info("warm tier: woken ahead", engine=self.name, wake_s=round(self.last_wake_s, 3))
            self._publish()

    def on_sleep(self, msg: contract.WarmMessage) -> None:
        """On the engine thread: sleep if it can and nothing is in flight."""
        seq = msg.get("seq")
        with self._lock:
            ok, why = self.engine.can_sleep()
            reason = None if ok else (why or "cannot sleep")
            if ok and self.state != AWAKE:
                reason = f"already {self.state}"
            elif ok and not self.engine.idle():
                reason = "busy"
            if reason is not None:
                self.channel.send(contract.WarmMessage.of(contract.WARM_REFUSED, engine=self.name, seq=seq,
                                                          reason=reason))
                return
            try:
                freed = int(self.engine.sleep())
            except Exception as exc:  # a failed sleep leaves it serving
                log.warning("warm tier: sleep failed, staying awake", engine=self.name, error=str(exc))
                self.channel.send(contract.WarmMessage.of(contract.WARM_REFUSED, engine=self.name, seq=seq,
                                                          reason=f"sleep failed: {exc}"[:200]))
                return
            self.state, self.freed_bytes = SLEEPING, max(0, freed)
            self.sleeps += 1
            self.channel.send(contract.WarmMessage.of(contract.WARM_SLEPT, engine=self.name, seq=seq,
                                                      freedBytes=self.freed_bytes))
            log.info("warm tier: asleep", engine=self.name, freed_mib=self.freed_bytes >> 20)
            self._publish()

    # -- a request arrives (engine thread) -------------------------------------------------------------
    def before_request(self) -> None:
        """Make sure the engine is awake before a request goes in. Never refuses; may wait."""
        with self._lock:
            if self.state != SLEEPING:
                return
            t0 = self.clock()
            self.state = WAKING
            self.wake_seq += 1
            seq = self.wake_seq
            self._publish()
            sent = self.channel.send(contract.WarmMessage.of(contract.WARM_WAKE, engine=self.name, seq=seq,
                                                             needBytes=int(self.engine.weights_bytes())))
            if not self._await_grant(seq, sent):
                log.warning("warm tier: no grant from the node agent, waking anyway", engine=self.name,
                            waited_s=round(self.clock() - t0, 3), channel=sent)
            while True:
                try:
                    self.engine.wake_up()
                    break
                except Exception as exc:  # out of memory: a co-tenant has not released yet; the request waits
                    log.warning("warm tier: wake failed, retrying", engine=self.name, error=str(exc))
                    self.sleep_fn(self.retry_s)
            self.state = AWAKE
            self.last_wake_s = self.clock() - t0
            self.wakes += 1
            self.channel.send(contract.WarmMessage.of(contract.WARM_AWAKE, engine=self.name, seq=seq,
                                                      seconds=round(self.last_wake_s, 6)))
            log.info("warm tier: awake", engine=self.name, wake_s=round(self.last_wake_s, 3))
            self._publish()

    def _await_grant(self, seq: int, sent: bool) -> bool:
        if not sent:
            return False
        deadline = self.clock() + self.grant_timeout_s
        while True:
            left = deadline - self.clock()
            if left <= 0:
                return False
            try:
                msg = self._grants.get(timeout=min(left, 0.5))
            except queue.Empty:
                continue
            if msg.get("seq") == seq:
                return True  # grants of earlier wakes (late answers) are dropped

    def metrics_state(self) -> dict:
        return {"sleep_state": self.state, "wake_seconds": self.last_wake_s, "sleep_freed_bytes": self.freed_bytes,
                "wakes": self.wakes, "sleeps": self.sleeps}

    def _publish(self) -> None:
        try:
            self.publish(self.metrics_state())
        except OSError as exc:
            log.debug("warm tier: metrics not published", error=str(exc))


class SocketChannel:
    """The engine's end of the warm socket: connects lazily, reconnects after the agent restarts (then
    says ``hello`` again through ``on_connect``). ``recv`` is for the reader thread only."""

    def __init__(self, path: str, on_connect: Callable[[], None] = lambda: None) -> None:
        self.path, self._on_connect = path, on_connect
        self._sock: socket.socket | None = None
        self._buf = b""
        self._lock = threading.Lock()

    def _connect(self) -> tuple[socket.socket | None, bool]:
        if self._sock is not None:
            return self._sock, False
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(self.path)
        except OSError:
            s.close()
            return None, False
        self._sock, self._buf = s, b""
        return s, True

    def send(self, msg: contract.WarmMessage) -> bool:
        data = contract.encode_warm(msg)
        with self._lock:
            s, fresh = self._connect()
            if s is None:
                return False
            try:
                s.sendall(data)
            except OSError:
                self._close()
                return False
        if fresh and msg.op != contract.WARM_HELLO:
            self._on_connect()  # a new agent (or the first connection) hears who we are
        return True

    def recv(self, timeout: float) -> contract.WarmMessage | None:
        with self._lock:
            s, fresh = self._connect()
        if s is None:
            time.sleep(timeout)
            return None
        if fresh:
            self._on_connect()
        while b"\n" not in self._buf:
            s.settimeout(timeout)
            try:
                data = s.recv(4096)
            except socket.timeout:
                return None
            except OSError:
                data = b""
            if not data:
                with self._lock:
                    self._close()
                return None
            self._buf += data
            if len(self._buf) > 16 * contract.WARM_MAX_LINE:
                self._buf = b""
                return None
        line, self._buf = self._buf.split(b"\n", 1)
        try:
            return contract.decode_warm(line)
        except contract.WarmMessageError as exc:
            log.warning("warm channel: message dropped", error=str(exc))
            return None

    def _close(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            finally:
                self._sock = None

    def close(self) -> None:
        with self._lock:
            self._close()


def start_reader(tier: WarmTier, channel: SocketChannel, run_on_engine: Callable[[Callable[[], None]], None],
                 stop: threading.Event) -> threading.Thread:
    """The reader thread: grants to the waiting request, sleeps onto the engine's thread."""

    def body() -> None:
        while not stop.is_set():
            msg = channel.recv(0.5)
            if msg is None:
                continue
            job = tier.deliver(msg)
            if job is not None:
                run_on_engine(job)

    t = threading.Thread(target=body, name="vramshare-warm", daemon=True)
    t.start()
    return t
