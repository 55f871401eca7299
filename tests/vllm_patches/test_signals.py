"""The signals the quota loop reads (SIGNALS.md): KV demand from the engine's own scheduler state,
and the quota generation the engine has applied (issue 20 item 5)."""
from __future__ import annotations

from collections import deque
from types import SimpleNamespace

from vllm_patches.engine_cap import demand_blocks, scheduler_queues


class Req:
    """vLLM 0.32 ``Request``: ``num_tokens`` (prompt + output so far), ``num_tokens_with_spec``;
    hashable by identity (vLLM keeps requests in sets)."""

    def __init__(self, rid: str, tokens: int, spec: int = 0) -> None:
        self.request_id, self.num_tokens, self.num_tokens_with_spec = rid, tokens, tokens + spec


req = Req


def test_demand_counts_running_waiting_and_preempted_requests_once() -> None:
    running = [req("a", 33), req("b", 16, spec=1)]  # 3 + 2 blocks of 16
    waiting = deque([req("c", 100)])  # a new prompt: 7 blocks
    kv_holding = deque([req("d", 48)])  # preempted, waiting again with its tokens: 3 blocks
    deferred = {running[0]}  # vLLM keeps some requests in two collections: counted once
    sched = SimpleNamespace(running=running, waiting=waiting, kv_holding_waiting=kv_holding,
                            deferred_waiting=deferred)
    assert demand_blocks(scheduler_queues(sched), 16) == 3 + 2 + 7 + 3
    assert demand_blocks(scheduler_queues(SimpleNamespace(running=[], waiting=deque())), 16) == 0


def test_a_queue_changing_under_the_reader_is_retried_not_fatal() -> None:
    class Flaky(list):
        calls = 0

        def __iter__(self):
            Flaky.calls += 1
            if Flaky.calls == 1:
                raise RuntimeError("deque mutated during iteration")
            return super().__iter__()

    assert demand_blocks([Flaky([req("a", 17)])], 16) == 2
