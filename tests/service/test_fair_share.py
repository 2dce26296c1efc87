"""Fair share by default: with no per-client flag set, one client that floods the service does not
delay another client's request beyond a few engine steps; the flooder's excess is what is refused."""
from __future__ import annotations

import pytest

from nanovllm.service.fair_queue import FairQueue
from nanovllm_client import Client, RequestError
from tests.service.conftest import TINY_ENGINE_ARGS, start_service
from tests.service.harness import fresh_engine_stats, num_steps, short_tmpdir, wait_for

SLOW = ["--post-step-hook", "tests.helpers.hooks:slow_step"]
HEARTBEAT = ["--heartbeat-s", "0.02"]
"""Step counts read from heartbeats are then at most a few steps (>= 10 ms each) old."""


def test_clients_take_turns_and_priorities_order_a_clients_own_line():
    queue: FairQueue[str] = FairQueue()
    for i in range(4):
        queue.push("a", f"a{i}", f"a{i}")
    queue.push("b", "b0", "b0")
    queue.push("b", "b1", "b1", rank=5)  # b's own priority: before its older b0
    order = []
    while queue:
        key, _ = queue.peek()
        order.append(queue.take(key))
    assert order == ["a0", "b1", "a1", "b0", "a2", "a3"]
    assert queue.num_clients == 0 and len(queue) == 0  # nothing stays behind


def test_a_client_passed_over_keeps_its_place_and_aborts_leave_nothing():
    queue: FairQueue[int] = FairQueue()
    for i in range(3):
        queue.push("a", ("a", i), i)
        queue.push("b", ("b", i), i)
    assert queue.peek(lambda client: client != "a") == (("b", 0), 0)  # a's share is full: b goes
    queue.take(("b", 0))
    assert queue.peek() == (("a", 0), 0)  # a's turn is still first
    assert queue.largest() == ("a", 3) and queue.newest("a") == ("a", 2)
    for i in range(3):
        assert queue.remove(("a", i)) == i
    assert queue.remove(("a", 0)) is None and queue.count("a") == 0 and queue.num_clients == 1
    with pytest.raises(KeyError, match="already queued"):
        queue.push("b", ("b", 1), 9)


@pytest.fixture(scope="module")
def default_service(tiny_model_dir):
    """No per-client flag: only the model's size (64 sequences a step) and steps of >= 10 ms."""
    procs = start_service(tiny_model_dir, f"ipc://{short_tmpdir()}/svc", engine_args=TINY_ENGINE_ARGS + SLOW + HEARTBEAT)
    yield procs
    procs.stop()


FLOOD = 3000
"""More than the engine holds for one client by default (half the batch live, 1,024 waiting) and
the tokenizer's 256: the rest must be refused, naming the limit."""
MINE_TOKENS = 8
BOUND_STEPS = MINE_TOKENS + 30
"""The other client's request, from its send to its last token: its own 8 steps, a step or two to
pass the tokenizer and the engine's pipe, one to be admitted (the clients take turns, and the
flooder holds only half the batch, so a row is free), and the staleness of the two step counts
read from heartbeats (every 20 ms, steps >= 10 ms: a few steps each, more on a loaded host).
First come first served, it would wait behind the flooder's thousand 900-token requests, 64 at a
time: over 10,000 steps."""


def test_a_flooding_client_does_not_delay_another_by_default(default_service):
    with Client(default_service.url, timeout=300) as flood, Client(default_service.url, timeout=120) as other:
        flood.wait_engine(timeout=120)
        # 900 tokens at >= 10 ms a step: none of the flood's ends while the test runs, so what the
        # engine holds of it stays put.
        streams = [flood.stream(f"def f{i}():", max_tokens=900, ignore_eos=True) for i in range(FLOOD)]
        wait_for(lambda: (e := fresh_engine_stats(other)).get("num_live") == 32 and e.get("num_queued") >= 500,
                 timeout=120, what="the flood holding its live share (half of 64) and hundreds waiting")
        since = num_steps(other)
        mine = list(other.stream("def mine():", max_tokens=MINE_TOKENS, ignore_eos=True))
        took = num_steps(other) - since
        print(f"the other client's request: {took} steps from its send to its end (its own: {MINE_TOKENS})")
        assert mine[-1].finish_reason == "length"
        assert took <= BOUND_STEPS, f"the other client's request took {took} steps, its own are {MINE_TOKENS}"
        for s in streams[-100:]:  # sent in order: its last ones came over its shares and are refused
            with pytest.raises(RequestError, match=r"limit \(--max-(queued|pending)-per-client (1024|256)\)"):
                list(s)
        for s in streams:
            s.cancel()
        stats = wait_for(lambda: (e := fresh_engine_stats(other)).get("num_live") == 0 and e, timeout=120,
                         what="every request gone")
        assert stats["num_queued"] == 0 and stats["num_clients"] == 0


@pytest.fixture(scope="module")
def held_tokenizer(tiny_model_dir):
    """An engine that takes one request and queues one, and a tokenizer with no per-client bound
    of its own (`--max-pending-per-client 0`): one client can reach the stage's global bound."""
    args = TINY_ENGINE_ARGS + SLOW + ["--max-live", "1", "--max-queued", "1"]
    procs = start_service(tiny_model_dir, f"ipc://{short_tmpdir()}/svc", engine_args=args,
                          env={"tokenizer_proc": {"NANOVLLM_MAX_PENDING_PER_CLIENT": "0"}})
    yield procs
    procs.stop()


def test_a_full_tokenizer_refuses_the_flooders_newest_not_the_newcomer(held_tokenizer):
    from tokenizer_proc.server import PENDING_MAX_FRAMES

    with Client(held_tokenizer.url, timeout=300) as flood, Client(held_tokenizer.url, timeout=300) as other:
        flood.wait_engine(timeout=120)
        # More than the pipes and the tokenizer's own bound hold (3.6 KB frames).
        streams = [flood.stream(list(range(100, 1000)), max_tokens=100, ignore_eos=True)
                   for _ in range(PENDING_MAX_FRAMES + 300)]
        with pytest.raises(RequestError, match="the tokenizer already holds 1024 requests"):
            list(streams[-1])  # its own request over the bound: refused at once
        mine = other.stream("def mine():", max_tokens=3, ignore_eos=True)
        displaced = wait_for(lambda: next(filter(None, map(held_error, streams)), None), timeout=60,
                             what="the flood's newest held request refused")
        assert "its newest was refused to make room for another client's request" in displaced
        for s in streams:
            s.cancel()
        assert list(mine)[-1].finish_reason == "length"  # held in the flood's place, and served


def held_error(stream) -> str | None:
    """The error a stream was refused with for another client's request, if it has come (read
    without waiting: the other streams run for minutes)."""
    first = stream._deltas.queue[0] if stream._deltas.queue else None
    return first.error if first is not None and first.error and "to make room" in first.error else None
