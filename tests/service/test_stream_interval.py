"""`--stream-interval N`: past a request's first output, the engine stage sends its tokens N at a
time; its first and last outputs go at once, and nothing is held past the next heartbeat."""
from __future__ import annotations

import time

import pytest
import zmq

from engine_proc.output import StepMessages
from engine_proc.output import StreamHold
from nanovllm.engine.llm_engine import RequestOutput
from nanovllm_client import Client
from nanovllm_client import protocol as p
from nanovllm_client.endpoints import service_endpoints
from tests.service.conftest import TINY_ENGINE_ARGS, start_service
from tests.service.harness import short_tmpdir


def out(request_id: str, token: int, n: int, finished: bool = False) -> RequestOutput:
    """The output of a request's step that made its `n`th token, `token`."""
    return RequestOutput(request_id, [token], finished, "length" if finished else None, 5, n, 0)


def test_the_first_output_goes_at_once_then_interval_tokens_at_a_time():
    hold = StreamHold(3)
    sent = [hold.take([out("a", 100, 1), out("b", 200, 1)])]
    for n in range(2, 8):
        sent.append(hold.take([out("a", 100 + n, n), out("b", 200 + n, n, finished=n == 5)] if n <= 5
                              else [out("a", 100 + n, n)]))
    rows = [[(o.request_id, o.new_token_ids, o.num_output_tokens, o.finished) for o in step] for step in sent]
    assert rows == [
        [("a", [100], 1, False), ("b", [200], 1, False)],  # first outputs: at once
        [], [],
        [("a", [102, 103, 104], 4, False), ("b", [202, 203, 204], 4, False)],  # three held, then sent
        [("b", [205], 5, True)],  # a last output goes at once, with whatever was held
        [],
        [("a", [105, 106, 107], 7, False)],
    ]


def test_a_flush_sends_what_is_held_and_forgets_it():
    hold = StreamHold(4)
    hold.take([out("a", 1, 1), out("b", 2, 1)])
    assert hold.take([out("a", 3, 2), out("b", 4, 2)]) == []
    flushed = hold.flush()
    assert [(o.request_id, o.new_token_ids, o.num_output_tokens) for o in flushed] == [("a", [3], 2), ("b", [4], 2)]
    assert hold.flush() == []
    # Held tokens counted afresh after a flush: three more before the next row.
    assert hold.take([out("a", 5, 3)]) == [] and hold.take([out("a", 6, 4)]) == [] and hold.take([out("a", 7, 5)]) == []
    assert [o.new_token_ids for o in hold.take([out("a", 8, 6)])] == [[5, 6, 7, 8]]


def test_interval_one_holds_nothing_and_bad_intervals_are_refused():
    hold = StreamHold(1)
    step = [out("a", 1, 1)]
    assert hold.take(step) is step and hold.take([out("a", 2, 2)])[0].new_token_ids == [2]
    for bad in (0, -1, 2.0, True, "4"):
        with pytest.raises(ValueError, match="stream interval"):
            StreamHold(bad)


def read_messages(sock: zmq.Socket, count: int, timeout_s: float = 10.0) -> list:
    messages = []
    deadline = time.monotonic() + timeout_s
    while len(messages) < count and sock.poll(max(0, int(1000 * (deadline - time.monotonic())))):
        messages.append(p.decode(sock.recv()))
    return messages


def read_until(sock: zmq.Socket, last, timeout_s: float = 60.0) -> list:
    """Messages up to and including the first for which `last` holds (the limit catches a hang)."""
    messages: list = []
    deadline = time.monotonic() + timeout_s
    while not (messages and last(messages[-1])):
        assert sock.poll(max(0, int(1000 * (deadline - time.monotonic())))), f"hung: got only {messages}"
        messages.append(p.decode(sock.recv()))
    return messages


def test_the_output_thread_sends_what_it_holds_before_its_heartbeat():
    """A real output thread and socket: held tokens go out before the next heartbeat (so none
    waits longer than `heartbeat_s`, and the order of everything on the wire is kept)."""
    from engine_proc.output import STOP
    from engine_proc.server import EngineStage
    from nanovllm.sampling_params import SamplingParams

    ctx = zmq.Context()
    eps = service_endpoints(f"ipc://{short_tmpdir()}")
    detok_in = ctx.socket(zmq.PULL)
    detok_in.bind(eps.detok)
    stage = EngineStage(None, eps.engine, eps.detok, eps.control, ctx=ctx, heartbeat_s=0.5,
                        stream_interval=100)
    output_thread = stage._threads[1]
    try:
        # Queued before the thread starts: a heartbeat cannot come first, however late it runs.
        stage.outbox.put(StepMessages(outputs=[out("a", 1, 1)]))
        stage.outbox.put(StepMessages(outputs=[out("a", 2, 2)]))
        stage.outbox.put(StepMessages(outputs=[out("a", 3, 3)]))
        output_thread.start()
        first, held, heartbeat = read_messages(detok_in, 3)
        assert isinstance(first, p.StepOutput) and [r.token_ids for r in first.outputs] == [p.pack_token_ids([1])]
        assert isinstance(held, p.StepOutput), "held tokens must go before the heartbeat"
        assert [(r.request_id, p.unpack_token_ids(r.token_ids), r.num_output_tokens) for r in held.outputs] == [("a", [2, 3], 3)]
        assert isinstance(heartbeat, p.EngineStatus)
        # A status queued behind held tokens (a resync, a drain) also goes after them.
        stage.outbox.put(StepMessages(outputs=[out("a", 4, 4)]))
        stage.outbox.put(stage._status(True, "draining"))
        stage.outbox.put(STOP)
        held, *heartbeats, status = read_until(detok_in, lambda m: isinstance(m, p.EngineStatus) and m.reason)
        assert isinstance(held, p.StepOutput) and p.unpack_token_ids(held.outputs[0].token_ids) == [4]
        assert all(isinstance(m, p.EngineStatus) for m in heartbeats)  # a stalled test thread lets some in
        assert status.reason == "draining"
        output_thread.join(timeout=5)
        assert not output_thread.is_alive()
    finally:
        ctx.destroy(linger=0)


def test_a_service_with_a_stream_interval_streams_the_same_answer_in_fewer_deltas(tiny_model_dir, client):
    """`--stream-interval 4` through the real stages: the same greedy tokens and text as the
    shared service (interval 1) sends, in about a quarter of the deltas (heartbeats aside)."""
    prompt, n = "def main():", 25
    reference = list(client.stream(prompt, max_tokens=n, temperature=0, ignore_eos=True))
    hook = ["--post-step-hook", "tests.helpers.hooks:slow_step"]  # steps of >= 10 ms: heartbeats every 25+
    # Not EXACT_ARGS: the reference's engine resolves dtype "auto" (bf16 on some CPUs), and so
    # must this one, or the two compute in different precisions and part at a near-tie.
    procs = start_service(tiny_model_dir, f"ipc://{short_tmpdir()}/svc",
                          engine_args=TINY_ENGINE_ARGS + hook + ["--stream-interval", "4"])
    try:
        with Client(procs.url) as c:
            started = time.monotonic()
            deltas = list(c.stream(prompt, max_tokens=n, temperature=0, ignore_eos=True))
            elapsed = time.monotonic() - started
    finally:
        procs.stop()
    assert [t for d in deltas for t in d.token_ids] == [t for d in reference for t in d.token_ids]
    assert "".join(d.text for d in deltas) == "".join(d.text for d in reference)
    # The detokenizer may merge rows it reads in one pass (it does at interval 1 too, when it
    # falls behind): so at least, not exactly, four tokens in some delta.
    sizes = [len(d.token_ids) for d in deltas if d.token_ids]
    assert max(sizes) >= 4, sizes
    heartbeats = int(elapsed / 0.25) + 1  # each may send what is held early
    assert len(sizes) <= 1 + (n - 1) // 4 + 1 + heartbeats, sizes
