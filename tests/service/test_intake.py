"""The one way every stage takes frames in (`nanovllm.service.intake`), without sockets."""
from __future__ import annotations

import logging

import msgpack
import zmq

from nanovllm.service.intake import accept, drain
from nanovllm.service.stage import RejectLog
from nanovllm_client import protocol as p

log = logging.getLogger("test_intake")
ACCEPTED = (p.GenerateReq, p.Ping)


def test_accept_returns_the_message_or_the_error_that_answers_it():
    rejects = RejectLog(log)
    ping = accept([p.Ping().encode()], ACCEPTED, rejects, "from c", "the tokenizer")
    assert isinstance(ping, p.Ping) and rejects.counts == {}

    two = accept([p.Ping().encode(), b"x"], ACCEPTED, rejects, "from c", "the tokenizer")
    assert isinstance(two, p.ErrorOutput) and "exactly one frame" in two.message and "got 2" in two.message

    bad = msgpack.packb([p.PROTOCOL_VERSION, "generate", {"request_id": "r7", "prompt": 5}])
    error = accept([bad], ACCEPTED, rejects, "from c", "the tokenizer")
    assert isinstance(error, p.ErrorOutput) and error.request_id == "r7" and "prompt" in error.message

    wrong = accept([p.StatsReq().encode()], ACCEPTED, rejects, "from c", "the tokenizer", "; try elsewhere")
    assert isinstance(wrong, p.ErrorOutput)
    assert wrong.message == "the tokenizer accepts only 'generate', 'ping' messages, got 'stats'; try elsewhere"
    assert rejects.counts == {"multipart": 1, "bad_frame": 1, "wrong_type": 1}


def test_drain_stops_when_the_socket_is_empty_or_the_budget_is_spent_and_a_bug_costs_one_message():
    rejects = RejectLog(log)
    queue = list(range(10))
    handled = []

    def recv():
        if not queue:
            raise zmq.Again()
        return queue.pop(0)

    def handle(n):
        if n == 3:
            raise KeyError(n)
        handled.append(n)

    drain(recv, handle, rejects, budget=6)
    assert handled == [0, 1, 2, 4, 5] and queue == [6, 7, 8, 9] and rejects.counts == {"internal": 1}
    drain(recv, handle, rejects)
    assert handled == [0, 1, 2, 4, 5, 6, 7, 8, 9] and queue == []
    queue.append(10)
    drain(recv, handle, rejects, max_s=-1.0)  # no time left: nothing is read
    assert queue == [10] and handled[-1] == 9
