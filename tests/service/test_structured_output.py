"""response_format through the three-stage service on the real default model: sync and async
clients, a refused bad format (the service serves on), schemas past what the grammar expresses
(unknown formats, `not`, `uniqueItems`, past 64 KiB), a stream continued across an engine kill
and across a detokenizer restart, a prompt prefilled in chunks and then found in the prefix
cache, and what wins where a constraint conflicts with the grammar."""
from __future__ import annotations

import asyncio
import json
import uuid
from typing import Callable

import jsonschema
import pytest
import zmq

from nanovllm_client import AsyncClient, Client
from nanovllm_client.errors import RequestError
from nanovllm_client import protocol as p
from nanovllm_client.endpoints import service_endpoints
from tests.service.conftest import start_service
from tests.service.harness import fresh_engine_stats, short_tmpdir, wait_for
from tests.service.test_hardening import raw_socket, reply

PEOPLE = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 16},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "role": {"enum": ["admin", "user", "guest"]}},
    "required": ["name", "age", "role"], "additionalProperties": False}
NUMBERS = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 40, "maxItems": 40}
CHUNK_TOKENS = 64
"""The engine's step budget here: a prompt longer than this is prefilled in several chunks."""
INVENTORY = " ".join(f"Shelf {i} holds {3 * i % 17} boxes of item {i * 7 % 31}." for i in range(40))
"""A long context (about 450 tokens): several chunks of CHUNK_TOKENS, many full KV blocks."""


def fmt(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "t", "schema": schema, "strict": True}}


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


@pytest.fixture(scope="module")
def procs():
    procs = start_service("default", f"ipc://{short_tmpdir()}/so",
                          engine_args=["--num-threads", "2", "--max-num-batched-tokens", str(CHUNK_TOKENS)])
    yield procs
    procs.stop()


def test_sync_and_async_clients_get_valid_json(procs):
    prompts = [f"Describe user number {i} as JSON." for i in range(6)]
    with Client(procs.url, timeout=120) as client:
        streams = [client.stream(chat(p), max_tokens=48, temperature=0 if i % 2 else 0.9, seed=i,
                                 response_format=fmt(PEOPLE)) for i, p in enumerate(prompts)]
        results = [("".join(d.text for d in s), s) for s in streams]
    for text, _ in results:
        jsonschema.validate(json.loads(text), PEOPLE)

    async def run() -> list:
        async with AsyncClient(procs.url, timeout=120) as client:
            return await asyncio.gather(
                client.generate(chat("Pick a color."), max_tokens=8, response_format={
                    "type": "choice", "choices": ["red", "green", "blue"]}),
                client.generate(chat("A date?"), max_tokens=16, response_format={
                    "type": "regex", "regex": "[0-9]{4}-[0-9]{2}-[0-9]{2}"}),  # \d would take any Unicode digit
                client.generate(chat("Any JSON."), max_tokens=48, temperature=0, response_format=fmt(PEOPLE)))

    color, date, person = asyncio.run(run())
    assert color.text in ("red", "green", "blue") and color.finish_reason == "stop"
    assert len(date.text) == 10 and date.text[4] == "-" and date.finish_reason == "stop"
    jsonschema.validate(json.loads(person.text), PEOPLE)


@pytest.mark.parametrize("bad, message", [
    ({"type": "regex", "regex": "(unclosed"}, "does not compile"),
    ({"type": "grammar", "grammar": "start: nothing_here"}, "does not compile"),
    ({"type": "json_schema", "json_schema": {"name": "r", "schema": {"$ref": "#/$defs/x"}}}, "does not compile"),
    ({"type": "choice", "choices": []}, "choices"),
    ({"type": "regex", "regex": "a" * 70_000}, "response_format"),
])
def test_a_bad_format_is_refused_and_the_service_serves_on(procs, bad, message):
    with Client(procs.url, timeout=120) as client:
        with pytest.raises(Exception, match=message):
            client.generate("hi", max_tokens=4, response_format=bad)
        deep: dict = {"type": "string"}
        for _ in range(12):  # 25 levels of containers: past the frame's nesting limit, within ours
            deep = {"type": "object", "properties": {"a": deep}}
        ok = client.generate("hi", max_tokens=4, response_format=fmt(deep))
        assert ok.text.startswith("{")
    procs.assert_running()


def test_schemas_past_what_the_grammar_expresses_are_accepted_and_never_end_invalid(procs):
    blob = {"type": "object", "properties": {"blob": {"type": "string", "format": "byte", "maxLength": 12},
                                             "home": {"type": "string", "format": "uri-reference", "maxLength": 12}},
            "required": ["blob", "home"], "additionalProperties": False}
    no_b = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999}}, "required": ["a"],
            "additionalProperties": False, "not": {"required": ["b"]}}
    ones = {"type": "array", "items": {"const": 1}, "minItems": 2, "maxItems": 2, "uniqueItems": True}
    wide = {"type": "object", "properties": {f"field_{i}": {"type": "string", "maxLength": 8, "description": "x" * 4000}
                                             for i in range(20)}, "required": [f"field_{i}" for i in range(20)]}
    assert len(json.dumps(wide)) > 64 * 1024  # documented schemas are mostly descriptions
    with Client(procs.url, timeout=120) as client:
        for schema in (blob, no_b):  # an unknown format ignored; `not` checked on the output
            out = client.generate(chat("Reply in JSON."), max_tokens=48, temperature=0, response_format=fmt(schema))
            assert out.finish_reason == "stop", out
            jsonschema.validate(json.loads(out.text), schema)
        # The grammar (uniqueItems left out) allows only [1,1], which the schema does not: the
        # request fails naming why instead of finishing with an invalid output.
        with pytest.raises(RequestError, match=r"does not satisfy the schema at \$: \[1, 1\] has non-unique.*uniqueItems"):
            client.generate(chat("Two ones."), max_tokens=16, response_format=fmt(ones))
        big = client.generate(chat("Reply in JSON."), max_tokens=8, temperature=0, response_format=fmt(wide))
        assert big.text.startswith("{") and big.finish_reason in ("stop", "length"), big
    procs.assert_running()


def stream_numbers_across(procs, prompt: str, restart: Callable[[Client], None]) -> None:
    """Stream forty numbers under a schema, call `restart(client)` once the first delta is in, and
    check that the rest of the stream completes the schema: valid JSON, finished with `stop`."""
    with Client(procs.url, timeout=180) as client:
        stream = client.stream(chat(prompt), max_tokens=200, temperature=0, response_format=fmt(NUMBERS))
        first = next(stream)
        assert first.finish_reason is None
        restart(client)
        rest = list(stream)
    assert rest and rest[-1].finish_reason == "stop", rest[-1:]
    jsonschema.validate(json.loads(first.text + "".join(d.text for d in rest)), NUMBERS)


def test_a_stream_continued_across_an_engine_kill_still_follows_the_schema(procs):
    def restart_engine(client: Client) -> None:
        procs.kill("engine_proc")
        wait_for(lambda: client.engine_alive is False, timeout=60, what="engine reported dead")
        procs.restart("engine_proc")

    stream_numbers_across(procs, "Forty numbers.", restart_engine)


def test_a_prompt_prefilled_in_chunks_then_found_in_the_prefix_cache_follows_the_schema(procs):
    """The same long prompt twice: the first is prefilled in several chunks (its prompt is many
    times the step budget), the second finds its full blocks in the prefix cache; both follow
    the schema, greedy and sampled. Greedy text is not compared: chunked and cached prefills sum
    attention in another order, so the two may part at a near-tie (more so in bfloat16), and the
    service does not return the logprobs that would tell one. tests/structured/test_default_model.py
    compares the token ids up to such a tie offline, where it can."""
    messages = chat(INVENTORY + " Describe the shelf keeper as JSON.")
    with Client(procs.url, timeout=180) as client:
        first = client.generate(messages, max_tokens=48, temperature=0, response_format=fmt(PEOPLE))
        second = client.generate(messages, max_tokens=48, temperature=0, response_format=fmt(PEOPLE))
        sampled = client.generate(messages, max_tokens=48, temperature=0.9, seed=7, response_format=fmt(PEOPLE))
    assert first.usage["prompt_tokens"] > 5 * CHUNK_TOKENS, first.usage
    assert first.usage["cached_tokens"] <= 32, first.usage  # the chat template's preamble, shared by every chat
    for result in (second, sampled):
        assert result.usage["cached_tokens"] >= first.usage["prompt_tokens"] - 2 * 16, result.usage  # all but the last block(s)
    for result in (first, second, sampled):
        assert result.finish_reason == "stop", result
        jsonschema.validate(json.loads(result.text), PEOPLE)


def test_a_stream_continued_across_a_detokenizer_restart_still_follows_the_schema(procs):
    tokenizer, engine = procs.pid("tokenizer_proc"), procs.pid("engine_proc")

    def restart_detokenizer(client: Client) -> None:
        procs.kill("detok_proc")
        procs.start("detok_proc")

    stream_numbers_across(procs, "Forty numbers, please.", restart_detokenizer)
    assert (procs.pid("tokenizer_proc"), procs.pid("engine_proc")) == (tokenizer, engine)


def test_banned_words_give_way_to_the_grammar_only_where_they_leave_it_nothing(procs):
    """Banned words hold wherever the grammar leaves another token; where together they would
    allow none, the grammar wins (the output stays parseable) and the banned word appears."""
    with Client(procs.url, timeout=120) as client:
        free = client.generate(chat("Return a JSON record for Alice."), max_tokens=48, temperature=0,
                               response_format=fmt(PEOPLE))
        name = json.loads(free.text)["name"]
        assert name, free.text
        banned = client.generate(chat("Return a JSON record for Alice."), max_tokens=48, temperature=0,
                                 banned_words=[name], response_format=fmt(PEOPLE))
        forced = client.generate(chat("Yes or no?"), max_tokens=8, temperature=0, banned_words=["yes", "no"],
                                 response_format={"type": "choice", "choices": ["yes", "no"]})
    jsonschema.validate(json.loads(banned.text), PEOPLE)
    assert name not in banned.text and banned.finish_reason == "stop", (name, banned.text)
    assert forced.text in ("yes", "no") and forced.finish_reason == "stop", forced
    procs.assert_running()


def test_min_tokens_with_a_response_format_is_refused_naming_the_conflict(procs):
    with Client(procs.url, timeout=120) as client:
        with pytest.raises(Exception, match="min_tokens cannot be combined with response_format"):
            client.generate("hi", max_tokens=8, min_tokens=4, response_format={"type": "json_object"})
        assert client.generate("hi", max_tokens=4, min_tokens=2).usage["completion_tokens"] >= 2
    procs.assert_running()


def test_a_bad_format_sent_straight_to_the_engine_is_refused_there_and_the_steps_go_on(procs):
    """Frames that skip the tokenizer's compile: the engine's input thread compiles each format
    itself (cached by text), refuses the bad ones with the compiler's reason before they are
    queued (counted as refused at intake, not when added on the step loop), and a stream decoding meanwhile runs to its end; good formats sent the same way work."""
    eps = service_endpoints(procs.url)
    ctx = zmq.Context()
    try:
        identity = uuid.uuid4().bytes
        out = raw_socket(ctx, zmq.DEALER, eps.stream, identity)
        out.send(p.Ping().encode())
        assert isinstance(reply(out), p.Pong)
        engine = raw_socket(ctx, zmq.PUSH, eps.engine)

        def send(name: str, fmt: dict) -> None:
            sampling = {"max_tokens": 32, "temperature": 0, "response_format": json.dumps(fmt)}
            engine.send(p.TokenizedReq(f"{identity.hex()}:{name}", p.pack_token_ids([1, 2, 3]), sampling,
                                       p.RequestMeta(client=identity, client_request_id=name)).encode())

        bad = [{"type": "regex", "regex": "(unclosed"}, {"type": "grammar", "grammar": "start: nothing_here"},
               {"type": "json_schema", "json_schema": {"name": "r", "schema": {"$ref": "#/$defs/x"}}}]
        with Client(procs.url, timeout=180) as client:
            before = fresh_engine_stats(client)  # not a heartbeat from before the last test's requests
            stream = client.stream(chat("Forty numbers."), max_tokens=200, temperature=0, response_format=fmt(NUMBERS))
            first = next(stream)
            for i in range(30):  # each bad one ten times: compiled once, then refused from the cache
                send(f"bad{i}", bad[i % 3])
            send("good", {"type": "choice", "choices": ["alpha", "beta"]})
            ends: dict = {}
            while len(ends) < 31:
                msg = reply(out)
                for d in getattr(msg, "deltas", []):
                    if d.finish_reason is not None:
                        ends[d.request_id] = d
            rest = list(stream)
            after = wait_for(lambda: (e := client.server_stats()["engine"])["formats_refused_at_intake"]
                             >= before["formats_refused_at_intake"] + 30 and e, timeout=60, what="the refusals counted")
        for i in range(30):
            d = ends[f"bad{i}"]
            assert d.finish_reason == "error" and "does not compile" in d.error, d
        assert ends["good"].finish_reason == "stop"
        jsonschema.validate(json.loads(first.text + "".join(d.text for d in rest)), NUMBERS)
        assert after["formats_compiled"] - before["formats_compiled"] <= 5  # the stream's, three bad ones, the choice
    finally:
        ctx.destroy(linger=0)
    procs.assert_running()
