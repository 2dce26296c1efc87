"""Bad input gets an error naming the problem, and everyone else keeps streaming."""
from __future__ import annotations

import threading
import uuid

import msgpack
import pytest
import zmq

from nanovllm_client import PROTOCOL_VERSION, RequestError, SamplingError
from nanovllm_client import protocol as p
from nanovllm_client.endpoints import service_endpoints
from tests.service.harness import wait_for


@pytest.fixture
def raw_dealer(service):
    """A hand-rolled client socket on the tokenizer endpoint."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.ROUTING_ID, uuid.uuid4().bytes)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(service_endpoints(service.url).tokenizer)
    yield sock
    sock.close()
    ctx.term()


def ask(sock: zmq.Socket, *frames: bytes) -> p.Message:
    sock.send_multipart(list(frames))
    assert sock.poll(10_000), "no reply from the tokenizer"
    return p.decode(sock.recv())


def error_text(msg: p.Message) -> str:
    if isinstance(msg, p.ErrorOutput):
        return msg.message
    assert isinstance(msg, p.StreamOutput) and msg.deltas[0].finish_reason == "error"
    return msg.deltas[0].error


def generate_frame(version=PROTOCOL_VERSION, type_name="generate", **body) -> bytes:
    body = {"request_id": "r1", "prompt": "hi", **body}
    return msgpack.packb([version, type_name, body])


BAD_FRAMES = {
    "not msgpack": ([b"\xc1\xc1 definitely not msgpack"], "not valid msgpack"),
    "not an array": ([msgpack.packb({"hello": 1})], "[protocol_version, type, body]"),
    "unknown type": ([generate_frame(type_name="summon_demons")], "unknown message type 'summon_demons'"),
    "wrong version": ([generate_frame(version=99)], "protocol version 99 is not supported"),
    "unknown field": ([generate_frame(colour="blue")], "unknown field(s) ['colour']"),
    "two frames": ([generate_frame(), b"extra"], "exactly one frame"),
    "no prompt": ([msgpack.packb([PROTOCOL_VERSION, "generate", {"request_id": "r1"}])],
                  "exactly one of prompt, messages, prompt_token_ids"),
    "bad token ids": ([generate_frame(prompt=None, prompt_token_ids=b"abc")], "multiple of 4 bytes"),
    "invalid temperature": ([generate_frame(sampling={"temperature": -1})], "temperature"),
    "invalid max_tokens": ([generate_frame(sampling={"max_tokens": 0})], "max_tokens"),
    "unknown sampling field": ([generate_frame(sampling={"top_q": 0.5})], "unknown sampling parameter(s) ['top_q']"),
    "bad chat messages": ([generate_frame(prompt=None, messages=[{"role": "user"}])], "'role' and 'content'"),
}


def test_each_bad_frame_gets_a_clear_error_while_another_client_streams(client, raw_dealer):
    stream = client.stream("def main():", max_tokens=200, ignore_eos=True, temperature=0)
    assert next(stream).finish_reason is None
    for name, (frames, expected) in BAD_FRAMES.items():
        reply = ask(raw_dealer, *frames)
        assert expected in error_text(reply), f"{name}: {error_text(reply)!r}"
    # The tokenizer still serves this very socket afterwards, and the long stream was untouched.
    assert isinstance(ask(raw_dealer, p.Ping().encode()), p.Pong)
    rest = list(stream)
    assert rest[-1].finish_reason == "length"
    assert rest[-1].usage["completion_tokens"] == 200


def test_request_errors_come_back_as_request_errors(client):
    with pytest.raises(RequestError, match="max_model_len is 1024"):  # refused by the tokenizer stage
        client.generate(prompt_token_ids=[7] * 5000, max_tokens=4)
    with pytest.raises(SamplingError, match="temperature"):  # refused by the client's copy of the checks
        client.generate("hi", temperature=-0.5)
    with pytest.raises(RequestError, match="outside the vocabulary"):
        client.generate(prompt_token_ids=[10**9], max_tokens=4)
    # ... and the same client keeps working.
    assert client.generate("hi", max_tokens=3, ignore_eos=True).finish_reason == "length"


def test_over_long_prompt_error_does_not_disturb_concurrent_streams(client):
    results = {}

    def run(k):
        results[k] = client.generate(f"x{k}", max_tokens=30, ignore_eos=True, temperature=0)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for _ in range(3):
        with pytest.raises(RequestError, match="max_model_len is"):
            client.generate(prompt_token_ids=[7] * 2000, max_tokens=4)
    for t in threads:
        t.join(timeout=60)
    assert [results[k].usage["completion_tokens"] for k in range(4)] == [30] * 4


def test_detokenizer_endpoint_rejects_requests_with_a_pointer(service):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(service_endpoints(service.url).stream)
    try:
        reply = ask(sock, generate_frame())
        assert "send requests to the tokenizer endpoint" in error_text(reply)
        reply = ask(sock, msgpack.packb([7, "ping", {}]))
        assert "protocol version 7" in error_text(reply)
    finally:
        sock.close()
        ctx.term()


def test_sampler_knobs_travel_through_the_service(client):
    knobs = dict(max_tokens=8, temperature=0.9, top_k=20, top_p=0.9, seed=7, ignore_eos=True)
    first, again = client.generate("hi", **knobs), client.generate("hi", **knobs)
    assert first.token_ids == again.token_ids  # the seed reached the engine's sampler
    with pytest.raises(SamplingError, match="top_p"):
        client.generate("hi", top_p=1.5)


def test_unknown_sampling_fields_are_refused_by_name(client):
    with pytest.raises(SamplingError, match="unknown sampling parameter.*'bogus'"):
        client.generate("hi", bogus=1)
    assert client.generate("hi", max_tokens=2, ignore_eos=True).finish_reason == "length"


def test_a_client_of_the_previous_release_is_served_as_before(service, client):
    """Frames exactly as a client from before the sampling struct builds them: protocol version
    2, every field of `generate`, stop strings and skip_special_tokens beside `sampling` and
    a stop string inside it too. The service streams the answer the current client gets for the
    same request; a stage frame of that release is refused, naming the versions."""
    ctx = zmq.Context()
    identity = uuid.uuid4().bytes
    eps = service_endpoints(service.url)
    try:
        out = ctx.socket(zmq.DEALER)
        tok = ctx.socket(zmq.DEALER)
        for sock, endpoint in ((out, eps.stream), (tok, eps.tokenizer)):
            sock.setsockopt(zmq.ROUTING_ID, identity)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint)
        assert isinstance(ask(out, p.Ping().encode()), p.Pong)  # the detokenizer knows where to stream
        plain = client.generate("def main():", max_tokens=40, temperature=0, ignore_eos=True).text
        stop = plain[10:13]  # surely in the answer: it must end there, by a stop string sent beside `sampling`
        assert len(stop) == 3 and plain.find(stop) >= 0
        old = {"request_id": "old#1", "prompt": "def main():", "messages": None, "prompt_token_ids": None,
               "sampling": {"max_tokens": 40, "temperature": 0, "ignore_eos": True, "stop": "\x00\x01"},
               "stop": [stop], "skip_special_tokens": True, "priority": 0, "resend": False,
               "output_token_ids": None, "output_chars": 0, "tools": None, "chat_template_kwargs": None}
        tok.send(msgpack.packb([2, "generate", old], use_bin_type=True))
        text, last = "", None
        while last is None:
            assert out.poll(60_000), "no answer for the old client's request"
            for d in getattr(p.decode(out.recv()), "deltas", []):
                text += d.text
                last = d if d.finish_reason is not None else None
        want = client.generate("def main():", max_tokens=40, temperature=0, ignore_eos=True, stop=[stop, "\x00\x01"])
        assert (text, last.finish_reason) == (want.text, want.finish_reason) == (plain[:plain.find(stop)], "stop")
        before = client.server_stats()["engine"]["rejected_frames"]
        engine = ctx.socket(zmq.PUSH)
        engine.connect(eps.engine)
        engine.send(msgpack.packb([2, "tokenized", {"request_id": "c:r", "prompt_token_ids": b"\0\0\0\0",
                                                    "sampling": {}, "meta": [b"c", "r", [], True, b"", 0.0, 0,
                                                                             False, 0, 0, False]}]))
        wait_for(lambda: client.server_stats()["engine"]["rejected_frames"] > before, timeout=60,
                 what="the engine to refuse the previous release's frame")
    finally:
        ctx.destroy(linger=0)
    with pytest.raises(p.ProtocolError, match="protocol version 2 is not supported for 'tokenized' messages"):
        p.decode(msgpack.packb([2, "tokenized", {}]))  # the words that frame was refused with
