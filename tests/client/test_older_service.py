"""A client against a service one version older: its detokenizer sends delta rows without the
fields this version added (`logprobs`, `prompt_logprobs`, `stop_reason`), and the client reads
them, those fields at their defaults. Real sockets, a real Client: the rows go through the decode
path every stream takes.
Every other row width is still refused."""
from __future__ import annotations

import multiprocessing

import msgpack
import pytest
import zmq

from nanovllm_client import Client
from nanovllm_client import protocol as p
from nanovllm_client.endpoints import service_endpoints

NEWEST = ("logprobs", "prompt_logprobs", "stop_reason")
OLDER_WIDTH = len(p.DeltaRow._fields) - len(NEWEST)
"""The delta row before the logprobs fields and `stop_reason` were appended."""


def older_row(*fields, **named) -> list:
    return list(p.DeltaRow(*fields, **named))[:OLDER_WIDTH]


def older_service(url: str, stop) -> None:
    """A tokenizer and a detokenizer that answer pings as ready; each request is answered by the
    detokenizer with two deltas in the older row width, "Hel" then "lo" with its end."""
    eps = service_endpoints(url)
    ctx = zmq.Context()
    tok, out = ctx.socket(zmq.ROUTER), ctx.socket(zmq.ROUTER)
    tok.bind(eps.tokenizer)
    out.bind(eps.stream)
    reader = None  # the client's identity on the detokenizer's socket
    poller = zmq.Poller()
    poller.register(tok, zmq.POLLIN)
    poller.register(out, zmq.POLLIN)
    while not stop.poll():
        for sock, _ in poller.poll(50):
            identity, frame = sock.recv_multipart()
            msg = p.decode(frame)
            if isinstance(msg, p.Ping):
                role = "tokenizer" if sock is tok else "detokenizer"
                reader = identity if sock is out else reader
                sock.send_multipart([identity, p.Pong(role, "old1", True, engine_state="ready").encode()])
            elif isinstance(msg, p.GenerateReq) and reader is not None:
                rid = msg.request_id
                rows = [older_row(rid, "Hel", p.pack_token_ids([1, 2])),
                        older_row(rid, "lo", p.pack_token_ids([3]), "stop", None, p.Usage(4, 3, 0))]
                out.send_multipart([reader, msgpack.packb([p.PROTOCOL_VERSION, "stream", {"deltas": rows}],
                                                          use_bin_type=True)])
    tok.close(linger=0)
    out.close(linger=0)
    ctx.term()


def test_a_client_reads_the_delta_rows_of_a_service_one_version_older(tmp_path):
    url = f"ipc://{tmp_path}"
    stop, stop_end = multiprocessing.Pipe()
    fake = multiprocessing.get_context("spawn").Process(target=older_service, args=(url, stop_end), daemon=True)
    fake.start()
    try:
        with Client(url, timeout=60, connect_timeout=60) as client:
            deltas = list(client.stream("hi", max_tokens=3))
            result = client.generate("hi", max_tokens=3)
    finally:
        stop.send("stop")
        fake.join(10)
    assert [(d.text, d.token_ids, d.finish_reason) for d in deltas] == [("Hel", [1, 2], None), ("lo", [3], "stop")]
    assert (result.text, result.token_ids, result.finish_reason) == ("Hello", [1, 2, 3], "stop")
    assert result.usage["completion_tokens"] == 3


def frame(rows: list) -> bytes:
    return msgpack.packb([p.PROTOCOL_VERSION, "stream", {"deltas": rows}], use_bin_type=True)


def test_only_the_newest_fields_may_be_missing_and_they_take_their_defaults():
    assert p.DeltaRow._fields[-len(NEWEST):] == NEWEST
    (got,) = p.decode(frame([older_row("r", "hi", reasoning_open=True)])).deltas
    assert got == p.DeltaRow("r", "hi", reasoning_open=True) and got.logprobs is None and got.prompt_logprobs is None
    assert got.stop_reason is None
    entry = p.TokenLogprob(5, "a", b"a", -0.5, 1, [p.TopLogprob(5, "a", b"a", -0.5)])
    (got,) = p.decode(frame([list(p.DeltaRow("r", "a", p.pack_token_ids([5]), logprobs=[entry]))])).deltas
    assert got.logprobs == [entry]
    (got,) = p.decode(frame([list(p.DeltaRow("r", "hi", stop_reason="\n\n"))])).deltas
    assert got.stop_reason == "\n\n"
    for width in (OLDER_WIDTH - 1, 1):  # older than one version, or cut short: refused
        with pytest.raises(p.ProtocolError, match=f"must have {OLDER_WIDTH} to {OLDER_WIDTH + len(NEWEST)} items"):
            p.decode(frame([list(p.DeltaRow("r", "hi"))[:width]]))
    with pytest.raises(p.ProtocolError, match="logprob"):  # the fields, where sent, are still checked
        p.decode(frame([[*older_row("r", "hi"), [[5, "a", b"a", 0.5, 1, []]]]]))
    with pytest.raises(p.ProtocolError, match="stop_reason"):
        p.decode(frame([[*older_row("r", "hi"), None, None, 7]]))
    # What a stage receives stays exact: a meta without its newest field is refused.
    meta = list(p.RequestMeta._field_defaults.values())
    with pytest.raises(p.ProtocolError, match="meta row must have"):
        p.typed_row("meta", meta[:-1], p.RequestMeta)
