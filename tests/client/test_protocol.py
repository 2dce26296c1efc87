"""Wire protocol: round trips, packed token ids, and errors that name the problem."""
from __future__ import annotations

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from nanovllm_client import protocol as p
from nanovllm_client.sampling import SamplingParams


@given(st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=300))
def test_packed_token_ids_round_trip(ids):
    packed = p.pack_token_ids(ids)
    assert isinstance(packed, bytes) and len(packed) == 4 * len(ids)
    assert p.unpack_token_ids(packed) == ids


META = p.RequestMeta(client=b"\x01\x02", client_request_id="r",
                     sampling=SamplingParams(stop=["x"], skip_special_tokens=False),
                     prompt_tail=p.pack_token_ids([1]), arrival=1.5)
OUT = p.OutputRow(request_id="a", token_ids=p.pack_token_ids([5]), finished=True, finish_reason=p.FinishReason.STOP,
                  num_prompt_tokens=1, num_output_tokens=1, num_cached_tokens=0, error=None)
STEP = p.StepOutput(instance_id="e1", started=[p.StartedRow(request_id="a", meta=META)],
                    rejected=[p.RejectedRow(request_id="b", meta=META, error="no")], outputs=[OUT])
LIVE = OUT._replace(token_ids=p.pack_token_ids([5, 6]), finished=False, finish_reason=None, num_output_tokens=2)
RESYNC = p.Resync(instance_id="e1", detok_instance="d1", entries=[p.ResyncEntry(meta=META, output=LIVE)], last=True)


def test_typed_rows_travel_as_plain_arrays_and_come_back_named():
    """Rows are named in code and positional on the wire: the same bytes as plain lists (the
    sampling struct as the map of its non-default fields, a finish reason as its string)."""
    meta = [b"\x01\x02", "r", {"stop": ["x"], "skip_special_tokens": False}, p.pack_token_ids([1]), 1.5, 0, 0, False]
    as_lists = p.StepOutput(instance_id="e1", started=[["a", meta]], rejected=[["b", meta, "no"]],
                            outputs=[["a", p.pack_token_ids([5]), True, "stop", 1, 1, 0, None, None, None]])
    assert STEP.encode() == as_lists.encode()
    assert p.decode(as_lists.encode()) == STEP
    step = p.decode(as_lists.encode())
    assert step.outputs[0].finish_reason is p.FinishReason.STOP and step.outputs[0].finish_reason == "stop"
    assert step.rejected[0].error == "no" and step.started[0].meta == META
    assert step.started[0].meta.sampling.stop == ["x"] and not step.started[0].meta.sampling.skip_special_tokens
    entry = p.decode(RESYNC.encode()).entries[0]
    assert entry.output == LIVE and entry.request_id == "a" and entry.meta == META
    logprobs = [[5, -0.25, 1, [5, 9], [-0.25, -2.0]]]
    with_logprobs = p.decode(p.StepOutput(instance_id="e1", outputs=[
        ["a", p.pack_token_ids([5]), False, None, 1, 1, 0, None, logprobs, logprobs]]).encode()).outputs[0]
    assert with_logprobs.logprobs == [p.TokenLogprobs(5, -0.25, 1, [5, 9], [-0.25, -2.0])]
    assert with_logprobs.prompt_logprobs[0].top_token_ids == [5, 9]
    five = p.pack_token_ids([5])
    for bad, why in (([["a", meta]], "each outputs row must have 10 items"),
                     ([["a", b"123", True, "stop", 1, 1, 0, None, None, None]], "multiple of 4 bytes"),
                     ([["a", b"", True, "done", 1, 1, 0, None, None, None]], "finish_reason must be null or one of"),
                     ([["a", five, True, "stop", 1, 1, 0, None, [[5, -1.0, 1, [5], []]], None]],
                      "top_logprobs must be a list as long as top_token_ids"),
                     ([["a", five, True, "stop", 1, 1, 0, None, [[5, float("nan"), 1, [], []]], None]],
                      "logprob must be a number <= 0"),
                     ([["a", five, True, "stop", 1, 1, 0, None, logprobs * 2, None]], "at most one entry per token")):
        with pytest.raises(p.ProtocolError, match=why):
            p.decode(p.StepOutput(instance_id="e1", outputs=bad).encode())


def test_finish_reasons_are_one_enum_whose_values_are_the_wire_strings():
    assert p.FINISH_REASONS == ("stop", "length", "abort", "error")
    for reason in p.FinishReason:
        assert reason == reason.value and str(reason) == reason.value and f"{reason}" == reason.value
        assert msgpack.unpackb(msgpack.packb(reason)) == reason.value
    import json
    assert json.dumps({"finish_reason": p.FinishReason.LENGTH}) == '{"finish_reason": "length"}'
    (delta,) = p.decode(p.StreamOutput(deltas=[p.error_delta("r", "boom")]).encode()).deltas
    assert delta.finish_reason is p.FinishReason.ERROR


def test_every_message_type_round_trips():
    messages = [
        p.GenerateReq(request_id="r", prompt="hi", sampling=SamplingParams(max_tokens=3, stop=["x"],
                                                                            skip_special_tokens=False)),
        p.GenerateReq(request_id="r", messages=[{"role": "user", "content": "hi"}]),
        p.AbortReq(request_id="r"), p.Ping(), p.StatsReq(),
        p.TokenizedReq(request_id="c:r", prompt_token_ids=p.pack_token_ids([1, 2]),
                       sampling=SamplingParams(temperature=0, logit_bias={7: 1.5}, allowed_token_ids=[1, 2]),
                       meta=META, priority=3, resend=True),
        STEP, RESYNC,
        p.DetokHello(instance_id="d1"), p.Resume(requests=[p.ResumeRow(request_id="r#1", num_tokens=3, num_chars=9)]),
        p.EngineStatus(alive=True, instance_id="abc", stats={"num_running": 1}),
        p.StreamOutput(deltas=[p.error_delta("r", "boom")]), p.ErrorOutput(message="bad", request_id="r"),
        p.Pong(role="detokenizer", instance_id="i", engine_alive=True), p.StatsOutput(stats={"a": 1}),
    ]
    for msg in messages:
        assert p.decode(msg.encode()) == msg


def test_a_client_of_the_previous_release_keeps_working():
    """Clients before the sampling struct put stop strings and skip_special_tokens beside
    `sampling`, and stop strings in it too: the message is still version 2, and both are read
    into the one struct, under its one limit."""
    old = msgpack.packb([2, "generate", {"request_id": "r", "prompt": "hi", "stop": ["a"], "skip_special_tokens": False,
                                         "sampling": {"max_tokens": 5, "stop": "b"}}])
    req = p.decode(old)
    assert req.sampling == SamplingParams(max_tokens=5, stop=["a", "b"], skip_special_tokens=False)
    over = msgpack.packb([2, "generate", {"request_id": "r", "prompt": "hi", "stop": ["s"] * 40,
                                          "sampling": {"stop": ["t"] * 40}}])
    with pytest.raises(p.ProtocolError, match="stop may have at most 64 strings, got 80"):
        p.decode(over)
    assert p.GenerateReq.VERSION == p.PROTOCOL_VERSION == 2  # what a client speaks did not change


def test_each_message_type_has_one_version_and_a_frame_of_another_is_refused_naming_both():
    """The messages between stages changed shape (version 4); a stage of the previous release
    sending one to a stage of this release, or the other way round, is refused by name."""
    assert {m.VERSION for m in (p.TokenizedReq, p.StepOutput, p.Resync, p.DetokHello)} == {p.STAGE_PROTOCOL_VERSION}
    assert {m.VERSION for m in (p.GenerateReq, p.StreamOutput, p.Pong, p.AbortReq)} == {p.PROTOCOL_VERSION}
    old_step = msgpack.packb([2, "step", {"instance_id": "e1"}])
    with pytest.raises(p.ProtocolError, match="protocol version 2 is not supported for 'step' messages; this service "
                                              "speaks version 4 for them"):
        p.decode(old_step)
    with pytest.raises(p.ProtocolError, match="protocol version 3 is not supported; this service speaks version 2 "):
        p.decode(msgpack.packb([3, "step", {"instance_id": "e1"}]))  # the previous release's stages
    with pytest.raises(p.ProtocolError, match="protocol version 4 is not supported for 'ping' messages"):
        p.decode(msgpack.packb([4, "ping", {}]))
    with pytest.raises(p.ProtocolError, match="protocol version 9 is not supported; this service speaks version 2 "
                                              r"\(clients\) and 4 \(between its stages\)"):
        p.decode(msgpack.packb([9, "ping", {}]))


def test_generate_token_ids_may_travel_packed_or_as_a_list():
    packed = p.decode(p.GenerateReq("r", prompt_token_ids=p.pack_token_ids([3, 4])).encode())
    listed = p.decode(p.GenerateReq("r", prompt_token_ids=[3, 4]).encode())
    assert packed.prompt_token_ids == listed.prompt_token_ids == [3, 4]


@pytest.mark.parametrize("frame, expected", [
    (b"\xc1", "not valid msgpack"),
    (msgpack.packb("hello"), "msgpack array [protocol_version, type, body]"),
    (msgpack.packb([p.STAGE_PROTOCOL_VERSION + 1, "ping", {}]),
     f"protocol version {p.STAGE_PROTOCOL_VERSION + 1} is not supported"),
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
     "non-empty strings"),
    (msgpack.packb([p.PROTOCOL_VERSION, "generate", {"request_id": "r", "prompt": "a", "sampling": {"top_p": 7.0}}]),
     "top_p must be in (0, 1], got 7.0"),
    (msgpack.packb([p.PROTOCOL_VERSION, "generate", {"request_id": "r", "prompt": "a", "sampling": {"tmp": 1}}]),
     "unknown sampling parameter(s) ['tmp']"),
    (msgpack.packb([p.PROTOCOL_VERSION, "generate", {"request_id": "r", "prompt": "a", "output_token_ids": [1, 2]}]),
     "output_token_ids must be packed uint32 bytes"),
    (msgpack.packb([p.PROTOCOL_VERSION, "generate", {"request_id": "r", "prompt": "a", "output_token_ids": b"abc"}]),
     "multiple of 4 bytes"),
    (msgpack.packb([p.PROTOCOL_VERSION, "generate", {"request_id": "r", "prompt": "a", "output_chars": -1}]),
     "output_chars"),
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


def test_a_bad_frame_names_its_request_when_that_much_can_be_read():
    with pytest.raises(p.ProtocolError) as info:
        p.decode(msgpack.packb([p.PROTOCOL_VERSION, "generate", {"request_id": "abc", "prompt": 5}]))
    assert info.value.request_id == "abc"
    with pytest.raises(p.ProtocolError) as info:
        p.decode(b"\xc1")
    assert info.value.request_id is None


def nested(levels: int) -> bytes:
    """msgpack for [[[...[1]...]]], `levels` deep, without recursing in the packer."""
    return b"\x91" * levels + b"\x01"


def raw_message(version: bytes, type_name: bytes, body: bytes) -> bytes:
    return b"\x93" + version + type_name + body


V, GENERATE = msgpack.packb(p.PROTOCOL_VERSION), msgpack.packb("generate")
TEXT = SamplingParams()


def tokenized(meta, sampling=TEXT) -> bytes:
    return p.TokenizedReq(request_id="c:r", prompt_token_ids=p.pack_token_ids([1]), sampling=sampling, meta=meta).encode()


def meta_row(**fields) -> list:
    """A meta row as a hostile stage might send it: `fields` over a valid one."""
    row = dict(client=b"x", client_request_id="r", sampling={}, prompt_tail=b"", arrival=0.0, have_tokens=0,
               have_chars=0, reasoning_open=False)
    row.update(fields)
    return list(row.values())
HOSTILE = {
    "deep type": raw_message(V, nested(1000), msgpack.packb({})),
    "deep version": raw_message(nested(1000), GENERATE, msgpack.packb({})),
    "deep temperature": raw_message(V, GENERATE, b"\x83" + msgpack.packb("request_id") + msgpack.packb("r")
                                    + msgpack.packb("prompt") + msgpack.packb("hi") + msgpack.packb("sampling")
                                    + b"\x81" + msgpack.packb("temperature") + nested(1000)),
    "deeper than msgpack allows": raw_message(V, GENERATE, nested(5000)),
    "mixed key types": msgpack.packb([p.PROTOCOL_VERSION, "generate", {"request_id": "r", "prompt": "x",
                                                                     "sampling": {b"a": 1, "b": 2}}]),
    "bytes keys in body": msgpack.packb([p.PROTOCOL_VERSION, "abort", {b"request_id": "r", "request_id": "r"}]),
    "ext type": msgpack.packb([p.PROTOCOL_VERSION, "ping", msgpack.ExtType(5, b"x")]),
    "timestamp": msgpack.packb([p.PROTOCOL_VERSION, "ping", {}, ]) [:-1] + b"\xd6\xff\x00\x00\x00\x01",
    "int map keys": msgpack.packb([p.PROTOCOL_VERSION, "ping", {1: 2}]),
    "truncated": msgpack.packb([p.PROTOCOL_VERSION, "generate", {"request_id": "r", "prompt": "x" * 100}])[:-7],
    "trailing bytes": msgpack.packb([p.PROTOCOL_VERSION, "ping", {}]) + b"\x00",
    "too large": b"\xc4" + b"x" * 10,
    "meta is empty": tokenized({}),
    "meta not a row": msgpack.packb([p.STAGE_PROTOCOL_VERSION, "tokenized", {"request_id": "c:r",
                                     "prompt_token_ids": b"\0" * 4, "sampling": {}, "meta": [1]}]),
    "meta client is str": tokenized(meta_row(client="x")),
    "meta stop is int": tokenized(meta_row(sampling={"stop": 5})),
    "meta sampling not a map": tokenized(meta_row(sampling=[1])),
    "meta sampling unknown field": tokenized(meta_row(sampling={"stops": ["a"]})),
    "meta tail of 3 bytes": tokenized(meta_row(prompt_tail=b"abc")),
    "sampling out of range": msgpack.packb([p.STAGE_PROTOCOL_VERSION, "tokenized", {
        "request_id": "c:r", "prompt_token_ids": b"\0" * 4, "sampling": {"temperature": -1}, "meta": meta_row()}]),
    "step row too short": p.StepOutput(instance_id="e", outputs=[["a", b"", True]]).encode(),
    "step reason unknown": p.StepOutput(instance_id="e", outputs=[["a", b"", True, "exploded", 1, 1, 0, None, None, None]]).encode(),
    "step reason not a string": p.StepOutput(instance_id="e", outputs=[["a", b"", True, ["stop"], 1, 1, 0, None, None, None]]).encode(),
    "step started without meta": p.StepOutput(instance_id="e", started=[["a", {}]]).encode(),
    "resync entry of the old shape": p.Resync(instance_id="e", detok_instance="d", last=True, entries=[
        ["a", meta_row(), b"", False, None, 1, 0, 0, None]]).encode(),
    "delta without id": p.StreamOutput(deltas=[{"text": "x"}]).encode(),
    "negative count": p.Resume(requests=[["r", -1, 0]]).encode(),
    "huge string in error": msgpack.packb([p.PROTOCOL_VERSION, "error", {"message": "x" * 100_000}]),
}


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_frames_raise_a_short_protocol_error(name):
    frame = HOSTILE[name]
    if name == "too large":
        frame = b"\xc6" + (p.MAX_FRAME_BYTES + 1).to_bytes(4, "big") + b"x" * (p.MAX_FRAME_BYTES + 1)
    with pytest.raises(p.ProtocolError) as info:
        p.decode(frame)
    assert 0 < len(str(info.value)) < 600, str(info.value)


def test_nesting_a_real_message_needs_is_allowed_and_one_level_more_is_not():
    sampling = SamplingParams(banned_words=[[1, 2]], logit_bias={3: 1.0})
    assert p.decode(p.GenerateReq(request_id="r", prompt="x", sampling=sampling).encode()).sampling == sampling
    long_stops = [p.ResyncEntry(meta=META._replace(sampling=SamplingParams(stop=["s"] * 64)), output=LIVE)]
    assert p.decode(p.Resync(instance_id="e", detok_instance="d", entries=long_stops, last=True).encode()) \
        .entries == long_stops  # the deepest real message: a resync entry's stop strings
    too_deep = msgpack.packb([p.PROTOCOL_VERSION, "generate", {"request_id": "r", "prompt": "x",
                                                               "sampling": {"banned_words": [[[[[[1]]]]]]}}])
    with pytest.raises(p.ProtocolError, match="deeper than"):
        p.decode(too_deep)


def test_frames_within_splits_only_what_does_not_fit_and_keeps_the_order():
    rows = [[f"c:r{i}", p.pack_token_ids([i] * (100 + i))] for i in range(40)]
    make = lambda part: p.StepOutput(instance_id="e1", outputs=[[rid, ids, False, None, 1, 1, 0, None, None, None]
                                                                for rid, ids in part])
    (whole,) = p.frames_within(make, rows)  # fits: one frame, encoded once
    assert whole == (rows, make(rows).encode())
    limit = len(whole[1]) // 5
    parts = p.frames_within(make, rows, limit)
    assert len(parts) > 4 and all(len(frame) <= limit for _, frame in parts)
    assert [row for part, _ in parts for row in part] == rows  # every row once, in order
    for part, frame in parts:  # each frame decodes to its own rows
        assert [r[0] for r in p.decode(frame).outputs] == [r[0] for r in part]
    (single,) = p.frames_within(make, rows[:1], 10)  # one row over the limit stays one frame
    assert single[0] == rows[:1]


def test_what_the_service_sends_a_client_may_carry_fields_the_client_does_not_know():
    # A client is often older than the service it talks to: when the pong gained a field, every
    # older client dropped every pong ("unknown field(s)") and never became ready. What a stage
    # receives is still checked strictly.
    def frame(type_name: str, body: dict) -> bytes:
        return msgpack.packb([p.PROTOCOL_VERSION, type_name, body], use_bin_type=True)

    pong = p.decode(frame("pong", {"role": "detokenizer", "instance_id": "d1", "engine_alive": True, "later": [1]}))
    assert (pong.instance_id, pong.engine_alive) == ("d1", True)
    delta = [*p.DeltaRow(request_id="r", text="hi"), [[1, -0.5]]]  # a field a newer service appended to the row
    (got,) = p.decode(frame("stream", {"deltas": [delta], "later": 1})).deltas
    assert got == p.DeltaRow(request_id="r", text="hi") and got.text == "hi"
    assert p.decode(frame("engine_status", {"alive": True, "later": 1})).alive is True
    with pytest.raises(p.ProtocolError, match="unknown field"):
        p.decode(frame("generate", {"request_id": "r", "prompt": "x", "later": 1}))
    with pytest.raises(p.ProtocolError, match="unknown field"):
        p.decode(msgpack.packb([p.STAGE_PROTOCOL_VERSION, "tokenized", {
            "request_id": "c:r", "prompt_token_ids": b"", "sampling": {}, "meta": meta_row(), "later": 1}]))
    with pytest.raises(p.ProtocolError, match="missing field"):  # dropping fields never makes a required one optional
        p.decode(frame("pong", {"instance_id": "d1", "later": 1}))


class _CountedRepr:
    """Counts how often its text is built."""
    shown = 0

    def __repr__(self) -> str:
        type(self).shown += 1
        return "<counted>"


def test_a_check_that_passes_never_builds_its_message(monkeypatch):
    """Checks formatted the value of every check that passed (a `show` per delta cost the client
    ~5 us a delta); the values are now shown only when the check fails."""
    from nanovllm_client.checks import ProtocolError, check
    from nanovllm_client.sampling import SamplingError, _check

    value = _CountedRepr()
    check(True, "must be a map, got {}", value)
    _check(True, "logit_bias", "must be a map, got {}", value)
    assert _CountedRepr.shown == 0
    with pytest.raises(ProtocolError, match="^must be a map, got <counted>$"):
        check(False, "must be a map, got {}", value)
    with pytest.raises(SamplingError, match="^must be a map, got <counted>$") as info:
        _check(False, "logit_bias", "must be a map, got {}", value)
    assert info.value.field == "logit_bias"
    with pytest.raises(ProtocolError, match="^braces {} stay when no value is given$"):
        check(False, "braces {} stay when no value is given")
    # Decoding a frame of valid deltas shows none of them.
    import nanovllm_client.checks as checks

    shown: list = []
    for module in (checks, p):
        monkeypatch.setattr(module, "show", lambda v, real=checks.show: shown.append(v) or real(v))
    frame = p.StreamOutput(deltas=[p.DeltaRow(request_id=f"c:{i}", text="x", token_ids=p.pack_token_ids([i]))
                                   for i in range(16)]).encode()
    assert len(p.decode(frame).deltas) == 16 and shown == []
    width = len(p.DeltaRow._fields)  # a row one version older may lack the newest fields
    with pytest.raises(ProtocolError, match=rf"each deltas row must have {width - len(p._NEWEST_FIELDS[p.DeltaRow])} to {width} items \(request_id, "):
        p.decode(p.StreamOutput(deltas=[7]).encode())


def test_logprobs_of_pieces_join_only_while_they_line_up_with_the_tokens():
    a, b = [p.TokenLogprobs(1, -0.1, 1, [], [])], [p.TokenLogprobs(2, -0.2, 1, [], [])]
    assert p.join_logprobs(a, 1, b, 1) == a + b
    assert p.join_logprobs(None, 0, b, 1) == b and p.join_logprobs(a, 1, None, 0) == a  # a piece without tokens
    assert p.join_logprobs(None, 3, b, 1) is None and p.join_logprobs(a, 1, None, 2) is None  # a resync's tokens
    assert p.join_logprobs(None, 1, None, 1) is None
