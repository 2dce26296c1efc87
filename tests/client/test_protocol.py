"""Wire protocol: round trips, packed token ids, and errors that name the problem."""
from __future__ import annotations

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from nanovllm_client import protocol as p


@given(st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=300))
def test_packed_token_ids_round_trip(ids):
    packed = p.pack_token_ids(ids)
    assert isinstance(packed, bytes) and len(packed) == 4 * len(ids)
    assert p.unpack_token_ids(packed) == ids


def test_every_message_type_round_trips():
    messages = [
        p.GenerateReq("r", prompt="hi", sampling={"max_tokens": 3}, stop=["x"], skip_special_tokens=False),
        p.GenerateReq("r", messages=[{"role": "user", "content": "hi"}]),
        p.AbortReq("r"), p.Ping(), p.StatsReq(),
        p.TokenizedReq("c:r", p.pack_token_ids([1, 2]), {"temperature": 0}, {"rid": "r"}),
        p.StepOutput([{"request_id": "a"}], [["b", {}, "no"]], [["a", p.pack_token_ids([5]), True, "stop", 1, 1, 0]]),
        p.EngineStatus(True, "abc", "", {"num_running": 1}),
        p.StreamOutput([p.error_delta("r", "boom")]), p.ErrorOutput("bad", "r"), p.Pong("detokenizer", "i", True),
        p.StatsOutput({"a": 1}),
    ]
    for msg in messages:
        assert p.decode(msg.encode()) == msg


def test_generate_token_ids_may_travel_packed_or_as_a_list():
    packed = p.decode(p.GenerateReq("r", prompt_token_ids=p.pack_token_ids([3, 4])).encode())
    listed = p.decode(p.GenerateReq("r", prompt_token_ids=[3, 4]).encode())
    assert packed.prompt_token_ids == listed.prompt_token_ids == [3, 4]


@pytest.mark.parametrize("frame, expected", [
    (b"\xc1", "not valid msgpack"),
    (msgpack.packb("hello"), "msgpack array [protocol_version, type, body]"),
    (msgpack.packb([p.PROTOCOL_VERSION + 1, "ping", {}]), f"protocol version {p.PROTOCOL_VERSION + 1} is not supported"),
    (msgpack.packb([p.PROTOCOL_VERSION, "pickle", {}]), "unknown message type 'pickle'"),
    (msgpack.packb([p.PROTOCOL_VERSION, "abort", []]), "body of a 'abort' message must be a map"),
    (msgpack.packb([p.PROTOCOL_VERSION, "abort", {}]), "missing field(s) ['request_id']"),
    (msgpack.packb([p.PROTOCOL_VERSION, "abort", {"request_id": "", "x": 1}]), "unknown field(s) ['x']"),
    (msgpack.packb([p.PROTOCOL_VERSION, "abort", {"request_id": ""}]), "request_id must be a non-empty string"),
    (msgpack.packb([p.PROTOCOL_VERSION, "generate", {"request_id": "r", "prompt": "a", "messages": []}]),
     "exactly one of prompt, messages, prompt_token_ids"),
    (msgpack.packb([p.PROTOCOL_VERSION, "generate", {"request_id": "r", "prompt_token_ids": [-1]}]),
     "non-negative integers"),
    (msgpack.packb([p.PROTOCOL_VERSION, "generate", {"request_id": "r", "prompt": "a", "stop": [""]}]),
     "stop must be a list of non-empty strings"),
])
def test_bad_frames_raise_protocol_errors_naming_the_problem(frame, expected):
    with pytest.raises(p.ProtocolError) as info:
        p.decode(frame)
    assert expected in str(info.value)


def test_no_pickle_anywhere_on_the_wire():
    import pathlib

    import nanovllm_client

    for path in pathlib.Path(nanovllm_client.__file__).parent.glob("*.py"):
        assert "pickle" not in path.read_text().replace("no pickle", "").replace("No pickle", ""), path


def test_peek_request_id_finds_the_stream_of_a_bad_request():
    frame = msgpack.packb([99, "generate", {"request_id": "abc"}])
    assert p.peek_request_id(frame) == "abc"
    assert p.peek_request_id(b"\xc1") is None
