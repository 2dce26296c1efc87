"""`nanovllm serve --http-port`: the HTTP front as a fourth supervised process, over real sockets,
against the tiny model: output equal to the ZeroMQ client's, SSE through real curl, a closed
connection frees its KV blocks, SIGTERM drains. One service for the module."""
from __future__ import annotations

import contextlib
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys

import jsonschema
import msgpack
import pytest
import zmq

pytest.importorskip("uvicorn")

from nanovllm_client import Client  # noqa: E402
from tests.service.conftest import START_TIMEOUT, TINY_ENGINE_ARGS  # noqa: E402
from tests.service.harness import REPO, engine_idle, short_tmpdir, wait_for  # noqa: E402
from tests.service.test_supervisor import read_pids, stopped  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_with_front(model: str, engine_args: list[str], keys: str | None = None):
    """`nanovllm serve --http-port` on `model` (with `keys` as its API-key file's text, if given),
    ready: yields (supervisor process, runtime dir, port, a ZeroMQ client); every process killed
    after, whatever the test did to them."""
    runtime_dir, port = short_tmpdir(), _free_port()
    key_args = []
    if keys is not None:
        key_file = os.path.join(runtime_dir, "http-keys")
        with open(os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            f.write(keys)
        key_args = ["--http-api-key-file", key_file]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.path.join(REPO, "client")]))
    proc = subprocess.Popen([sys.executable, "-m", "nanovllm.supervisor", "--model", model, "--runtime-dir",
                             runtime_dir, "--log-level", "INFO", "--http-port", str(port), *key_args, *engine_args],
                            cwd=REPO, env=env, start_new_session=True)
    try:
        with Client(f"ipc://{runtime_dir}", timeout=120, connect_timeout=START_TIMEOUT) as client:
            client.wait_engine(timeout=START_TIMEOUT)
            wait_for(lambda: _get(port, "/health")[0] == 200, timeout=START_TIMEOUT, what="the HTTP front's /health")
            yield proc, runtime_dir, port, client
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        for pid in (read_pids(runtime_dir) or {}).values():
            if isinstance(pid, int):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


@pytest.fixture(scope="module")
def front(tiny_model_dir):
    with serve_with_front(tiny_model_dir, TINY_ENGINE_ARGS, f"# the front's keys\nother-key\n{KEY}\n") as served:
        yield (*served, tiny_model_dir)


KEY = "sk-test-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}


def _get(port, path, headers=AUTH):
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("GET", path, headers=headers)
        r = conn.getresponse()
        return r.status, r.read()
    except OSError:
        return 0, b""


def _post(port, path, body, headers=AUTH):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json", **headers})
    r = conn.getresponse()
    return r.status, json.loads(r.read())


def test_models_health_and_greedy_equal_to_the_zmq_client(front):
    _, _, port, client, model = front
    assert _get(port, "/v1/models", headers={})[0] == 401
    assert _get(port, "/v1/models", headers={"Authorization": "Bearer sk-wrong"})[0] == 401
    status, out = _post(port, "/v1/completions", {"model": model, "prompt": "x"}, headers={})
    assert status == 401 and out["error"]["type"] == "authentication_error"
    status, body = _get(port, "/v1/models", headers={"Authorization": "Bearer other-key"})
    assert status == 200
    status, body = _get(port, "/v1/models")
    assert status == 200 and json.loads(body)["data"][0]["id"] == model
    status, body = _get(port, "/health")
    assert status == 200 and set(json.loads(body)["stages"].values()) == {"ready"}
    want = client.generate("def f():", max_tokens=24, temperature=0, ignore_eos=True)
    status, out = _post(port, "/v1/completions", {"model": model, "prompt": "def f():", "max_tokens": 24,
                                                  "temperature": 0, "ignore_eos": True})
    assert status == 200 and out["choices"][0]["text"] == want.text
    assert out["usage"]["completion_tokens"] == 24 and out["choices"][0]["finish_reason"] == "length"
    messages = [{"role": "user", "content": "hi"}]
    want = client.generate(messages, max_tokens=16, temperature=0, ignore_eos=True)
    status, out = _post(port, "/v1/chat/completions", {"model": model, "messages": messages, "max_tokens": 16,
                                                       "temperature": 0, "ignore_eos": True})
    assert status == 200 and out["choices"][0]["message"]["content"] == want.text
    status, out = _post(port, "/v1/completions", {"model": model, "prompt": [10**9]})  # refused by a stage
    assert status == 400 and "request failed" in out["error"]["message"], out
    status, out = _post(port, "/v1/completions", {"model": model, "prompt": "x", "logprobs": 21})
    assert status == 400 and out["error"]["param"] == "logprobs" and "between 0 and 20" in out["error"]["message"]
    status, out = _post(port, "/v1/completions", {"model": model, "prompt": "x", "max_tokens": 0})  # only with echo
    assert status == 400 and out["error"]["param"] == "max_tokens"


def test_the_openai_sdk(front):
    openai = pytest.importorskip("openai")
    _, _, port, client, model = front
    sdk = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0, timeout=120)
    assert [m.id for m in sdk.models.list()] == [model]
    messages = [{"role": "user", "content": "hello"}]
    want = client.generate(messages, max_tokens=10, temperature=0, ignore_eos=True)
    out = sdk.chat.completions.create(model=model, messages=messages, max_completion_tokens=10, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert out.choices[0].message.content == want.text and out.usage.completion_tokens == 10
    chunks = list(sdk.chat.completions.create(model=model, messages=messages, max_tokens=10, temperature=0,
                                              stream=True, stream_options={"include_usage": True},
                                              extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert chunks[-1].usage.total_tokens == out.usage.total_tokens
    text = "".join(c.choices[0].text for c in sdk.completions.create(
        model=model, prompt="def f():", max_tokens=8, temperature=0, stream=True, extra_body={"ignore_eos": True}))
    assert text == client.generate("def f():", max_tokens=8, temperature=0, ignore_eos=True).text
    with pytest.raises(openai.NotFoundError):
        sdk.completions.create(model="nope", prompt="x")
    with pytest.raises(openai.BadRequestError) as e:
        sdk.chat.completions.create(model=model, messages=messages, top_logprobs=2)
    assert e.value.body["param"] == "top_logprobs" and "needs 'logprobs': true" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        sdk.chat.completions.create(model=model, messages=messages, stream=True, extra_body={"prompt_logprobs": 1})
    assert e.value.body["param"] == "prompt_logprobs"


PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "role": {"enum": ["admin", "user", "guest"]}},
    "required": ["name", "age", "role"], "additionalProperties": False}


def _bias_on(model_dir: str, text: str) -> dict[str, float]:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(model_dir).encode(text, add_special_tokens=False)
    assert len(ids) == 1, ids
    return {str(ids[0]): 100.0}


def _sdk(port):
    openai = pytest.importorskip("openai")
    return openai, openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.mark.parametrize("stream", [False, True])
def test_response_format_through_the_openai_sdk(front, stream):
    _, _, port, client, model = front
    openai, sdk = _sdk(port)
    schema_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    # A random-weight model left to itself writes an object without end: the bias on "}" closes
    # json_object's object at once; the schema's bounds end the other on their own.
    cases = [("chat", schema_format, {}, PERSON), ("completions", schema_format, {}, PERSON),
             ("chat", {"type": "json_object"}, {"logit_bias": _bias_on(model, "}")}, {"type": "object"})]
    for route, fmt, extra, want in cases:
        for seed in range(3):
            args = dict(model=model, max_tokens=64, temperature=0.8, seed=seed, response_format=fmt,
                        stream=stream, **extra)
            if route == "chat":
                out = sdk.chat.completions.create(messages=[{"role": "user", "content": "A person?"}], **args)
                pieces = ([c.choices[0].delta.content or "" for c in out if c.choices] if stream
                          else [out.choices[0].message.content])
            else:
                args.pop("response_format")
                out = sdk.completions.create(prompt="A person:", extra_body={"response_format": fmt}, **args)
                pieces = [c.choices[0].text for c in out] if stream else [out.choices[0].text]
            text = "".join(pieces)
            jsonschema.validate(json.loads(text), want)
    with pytest.raises(openai.BadRequestError) as e:  # refused by the service, which compiles it
        sdk.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], stream=stream,
                                    response_format={"type": "json_schema", "json_schema": {
                                        "name": "r", "schema": {"$ref": "#/$defs/missing"}}})
    assert e.value.status_code == 400 and e.value.body["param"] == "response_format"
    assert "response_format" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:  # refused by the front: no type
        sdk.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], stream=stream,
                                    response_format={"json_schema": {}})
    assert e.value.body["param"] == "response_format"
    procs_alive = client.generate("x", max_tokens=2)
    assert procs_alive.finish_reason in ("stop", "length")


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Today's weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]}},
                   "required": ["city"], "additionalProperties": False}}}


def _streamed_call(chunks) -> tuple[str, str, str | None]:
    """(name, arguments, finish_reason) assembled from a stream's tool_call deltas."""
    name, arguments, reason = "", "", None
    for c in chunks:
        for t in c.choices[0].delta.tool_calls or []:
            assert t.index == 0
            name += t.function.name or ""
            arguments += t.function.arguments or ""
        reason = c.choices[0].finish_reason or reason
    return name, arguments, reason


def test_a_tool_call_round_trip_through_the_openai_sdk(front):
    """The call (forced by tool_choice: a random model calls no tool by itself), its result sent
    back, the final answer; the stage renders tools and result into the prompt through the
    model's chat template (ChatML without tools, as the default model's)."""
    from nanovllm_client.http.schema import parse_chat
    from nanovllm.models.tokenizer import load_tokenizer
    from tokenizer_proc.chat import render_chat

    _, _, port, _, model = front
    openai, sdk = _sdk(port)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        out = sdk.chat.completions.create(model=model, messages=messages, tools=[WEATHER], tool_choice=choice,
                                          max_tokens=64, temperature=0)
        assert out.choices[0].finish_reason == "tool_calls", out
        [call] = out.choices[0].message.tool_calls
        assert call.function.name == "get_weather" and call.id.startswith("call_")
        assert json.loads(call.function.arguments)["city"] in ("Paris", "Oslo", "Lima")
        chunks = list(sdk.chat.completions.create(model=model, messages=messages, tools=[WEATHER], tool_choice=choice,
                                                  max_tokens=64, temperature=0, stream=True))
        assert _streamed_call(chunks) == ("get_weather", call.function.arguments, "tool_calls")
    turns = messages + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function",
         "function": {"name": "get_weather", "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    final = sdk.chat.completions.create(model=model, messages=turns, tools=[WEATHER], max_tokens=8, temperature=0,
                                        extra_body={"ignore_eos": True})
    assert final.choices[0].finish_reason == "length" and final.choices[0].message.content
    tokenizer = load_tokenizer(model)
    prompt = render_chat(tokenizer, parse_chat({"model": model, "messages": turns}).prompt, json.dumps([WEATHER]))
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in prompt and "get_weather" in prompt
    assert final.usage.prompt_tokens == len(tokenizer.encode(prompt, add_special_tokens=False))


def test_parallel_tool_calls_false_returns_one_call(front):
    """Two calls written (the output held to that form by a regex: a random-weight model calls no
    tool by itself): every call by default, the first alone with parallel_tool_calls false,
    streamed and not."""
    _, _, port, _, model = front
    _, sdk = _sdk(port)
    two = ('<tool_call>\n\\{"name": "get_weather", "arguments": \\{"city": "Paris"\\}\\}\n</tool_call>\n'
           '<tool_call>\n\\{"name": "get_weather", "arguments": \\{"city": "Oslo"\\}\\}\n</tool_call>')
    args = dict(model=model, messages=[{"role": "user", "content": "Weather in Paris and Oslo?"}], tools=[WEATHER],
                max_tokens=96, temperature=0, response_format={"type": "regex", "regex": two})
    both = sdk.chat.completions.create(**args).choices[0]
    assert [json.loads(c.function.arguments)["city"] for c in both.message.tool_calls] == ["Paris", "Oslo"]
    one = sdk.chat.completions.create(parallel_tool_calls=False, **args).choices[0]
    assert one.finish_reason == "tool_calls" and not one.message.content
    [call] = one.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    chunks = list(sdk.chat.completions.create(parallel_tool_calls=False, stream=True, **args))
    assert _streamed_call(chunks) == ("get_weather", call.function.arguments, "tool_calls")
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_one_call_stops_the_request_in_the_engine(front):
    """parallel_tool_calls false: once the call is complete the front stops the request, so the
    engine frees its blocks instead of generating on to max_tokens, and the usage says how far it
    went. The output is held to one call and then text without end (a regex that never closes,
    ignore_eos): left alone, it runs to max_tokens, as the same request with parallel calls does."""
    _, _, port, client, model = front
    _, sdk = _sdk(port)
    form = '<tool_call>\n\\{"name": "get_weather", "arguments": \\{"city": "Paris"\\}\\}\n</tool_call>[a-z ]*'
    args = dict(model=model, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER],
                max_tokens=300, temperature=0, response_format={"type": "regex", "regex": form},
                extra_body={"ignore_eos": True})
    whole = sdk.chat.completions.create(**args)
    assert whole.usage.completion_tokens == 300 and whole.choices[0].finish_reason == "length"
    one = sdk.chat.completions.create(parallel_tool_calls=False, **args)
    assert one.choices[0].finish_reason == "tool_calls" and len(one.choices[0].message.tool_calls) == 1
    assert one.usage.completion_tokens < 300, one.usage
    wait_for(lambda: engine_idle(client), timeout=60, what="the engine idle, every KV block free")
    chunks = list(sdk.chat.completions.create(parallel_tool_calls=False, stream=True,
                                              stream_options={"include_usage": True}, **args))
    assert _streamed_call([c for c in chunks if c.choices]) == ("get_weather", '{"city": "Paris"}', "tool_calls")
    assert chunks[-1].usage.completion_tokens < 300, chunks[-1].usage
    wait_for(lambda: engine_idle(client), timeout=60, what="the engine idle, every KV block free")


def test_a_forced_call_with_references_in_its_schema(front):
    """A tool whose parameters use $defs and $ref, forced (required, one call, parallel_tool_calls
    false): the arguments follow the referenced schemas; a reference outside the schema is a 400."""
    _, _, port, _, model = front
    openai, sdk = _sdk(port)
    params = {"type": "object", "properties": {"place": {"$ref": "#/$defs/Place"}, "days": {"$ref": "#/$defs/Days"}},
              "required": ["place", "days"], "additionalProperties": False,
              "$defs": {"Place": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}},
                                  "required": ["city"], "additionalProperties": False},
                        "Days": {"type": "integer", "minimum": 1, "maximum": 7}}}
    forecast = {"type": "function", "function": {"name": "forecast", "parameters": params}}
    messages = [{"role": "user", "content": "Forecast for Paris?"}]
    out = sdk.chat.completions.create(model=model, messages=messages, tools=[WEATHER, forecast], max_tokens=64,
                                      tool_choice={"type": "function", "function": {"name": "forecast"}},
                                      parallel_tool_calls=False, temperature=0)
    assert out.choices[0].finish_reason == "tool_calls", out
    [call] = out.choices[0].message.tool_calls
    assert call.function.name == "forecast"
    jsonschema.validate(json.loads(call.function.arguments), params)
    far = {"type": "function", "function": {"name": "far", "parameters": {
        "type": "object", "properties": {"x": {"$ref": "https://example.com/x.json"}}}}}
    with pytest.raises(openai.BadRequestError) as e:
        sdk.chat.completions.create(model=model, messages=messages, tools=[far], tool_choice="required", max_tokens=8)
    assert e.value.body["param"] == "tools" and "$ref" in e.value.body["message"]
    # A reference to nothing: the stage's compiler refuses the grammar, named as the tools' fault.
    dangling = {"type": "function", "function": {"name": "dangling", "parameters": {
        "type": "object", "properties": {"x": {"$ref": "#/$defs/Nope"}}}}}
    with pytest.raises(openai.BadRequestError) as e:
        sdk.chat.completions.create(model=model, messages=messages, tools=[dangling], tool_choice="required",
                                    max_tokens=8, stream=True)
    assert e.value.body["param"] == "tools" and "Nope" in e.value.body["message"]


def test_reasoning_content_apart_from_the_answer(front):
    """A `<think>` that opens the output is reasoning_content, streamed and not (the output is
    held to that form by a regex: a random-weight model does not think by itself)."""
    _, _, port, _, model = front
    _, sdk = _sdk(port)
    args = dict(model=model, messages=[{"role": "user", "content": "Think first."}], max_tokens=48, temperature=0,
                response_format={"type": "regex", "regex": "<think>\n[a-z]{3,12}\n</think>\n\n[a-z]{2,8}"})
    message = sdk.chat.completions.create(**args).choices[0].message
    assert 3 <= len(message.reasoning_content.strip()) <= 12 and message.reasoning_content.strip().isalpha()
    assert 2 <= len(message.content) <= 8 and message.content.isalpha()
    chunks = list(sdk.chat.completions.create(stream=True, **args))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == message.reasoning_content
    assert "".join(d.content or "" for d in deltas) == message.content


def test_model_card_version_and_a_wrong_method(front):
    _, _, port, client, model = front
    _, sdk = _sdk(port)
    card = sdk.models.retrieve(model)
    assert card.id == model and card.max_model_len == client.server_stats()["engine"]["max_model_len"] > 0
    assert [m.max_model_len for m in sdk.models.list()] == [card.max_model_len]
    status, body = _get(port, "/v1/models/not-this-one")
    assert status == 404 and json.loads(body)["error"]["code"] == "model_not_found"
    assert _get(port, "/v1/models/" + model, headers={})[0] == 401  # the key rules of /v1/models
    status, body = _get(port, "/version", headers={})
    assert status == 200 and json.loads(body)["version"]
    status, body = _get(port, "/v1/chat/completions")
    assert status == 405 and json.loads(body)["error"]["type"] == "invalid_request_error"


def test_n_choices_and_prompt_lists_through_the_openai_sdk(front):
    """`n` choices per prompt and a list of prompts in one completions request: each choice what the
    ZeroMQ client gives for its prompt and seed (choice j: seed + j), streamed equal to not."""
    _, _, port, client, model = front
    _, sdk = _sdk(port)
    prompts = ["def f():", "import os"]
    out = sdk.completions.create(model=model, prompt=prompts, n=2, max_tokens=5, temperature=0,
                                 extra_body={"ignore_eos": True})
    want = [client.generate(p, max_tokens=5, temperature=0, ignore_eos=True) for p in prompts]
    assert [(c.index, c.text) for c in out.choices] == [(0, want[0].text), (1, want[0].text), (2, want[1].text),
                                                        (3, want[1].text)]
    assert out.usage.completion_tokens == 20
    assert out.usage.prompt_tokens == sum(w.usage["prompt_tokens"] for w in want)
    texts: dict[int, str] = {}
    for chunk in sdk.completions.create(model=model, prompt=prompts, n=2, max_tokens=5, temperature=0, stream=True,
                                        extra_body={"ignore_eos": True}):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert texts == {c.index: c.text for c in out.choices}
    messages = [{"role": "user", "content": "Say something."}]
    chat = sdk.chat.completions.create(model=model, messages=messages, n=3, max_tokens=6, temperature=0.9, seed=5,
                                       extra_body={"ignore_eos": True})
    assert [c.message.content for c in chat.choices] == [
        client.generate(messages, max_tokens=6, temperature=0.9, seed=5 + j, ignore_eos=True).text for j in range(3)]
    assert len({c.message.content for c in chat.choices}) > 1  # seeds apart, so choices apart


def test_the_responses_api_through_the_openai_sdk(front):
    """OpenAI's Responses API, stateless: input as a string and as items with instructions,
    streamed (responses.stream) equal to not streamed and to the ZeroMQ client's chat, a forced
    function call with its output sent back as items, text.format json_schema, and a clear 400
    for previous_response_id."""
    _, _, port, client, model = front
    openai, sdk = _sdk(port)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}]
    want = client.generate(chat, max_tokens=10, temperature=0, ignore_eos=True)
    args = dict(model=model, instructions="Be brief.", input="hello", max_output_tokens=10, temperature=0,
                extra_body={"ignore_eos": True})
    out = sdk.responses.create(**args)
    assert out.output_text == want.text and out.status == "incomplete"
    assert out.incomplete_details.reason == "max_output_tokens" and out.usage.output_tokens == 10
    assert out.usage.input_tokens == want.usage["prompt_tokens"]
    as_items = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "input_text", "text": "hello"}]}]
    items = sdk.responses.create(**dict(args, instructions=None, input=as_items))
    assert items.output_text == want.text
    with sdk.responses.stream(**args) as s:
        events = list(s)
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    final = events[-1].response  # response.incomplete at max_output_tokens, as OpenAI's (the SDK's
    assert events[-1].type == "response.incomplete"  # get_final_response waits for .completed only)
    assert "".join(deltas) == want.text and final.output_text == want.text and final.usage.output_tokens == 10

    tool = {"type": "function", "name": "get_weather", "description": "Today's weather in a city",
            "parameters": WEATHER["function"]["parameters"], "strict": True}
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    forced = dict(model=model, input=question, tools=[tool], max_output_tokens=64, temperature=0,
                  tool_choice={"type": "function", "name": "get_weather"})
    call = sdk.responses.create(**forced)
    calls = [o for o in call.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert json.loads(calls[0].arguments)["city"] in ("Paris", "Oslo", "Lima")
    with sdk.responses.stream(**forced) as s:
        argument_deltas = "".join(e.delta for e in s if e.type == "response.function_call_arguments.delta")
        streamed = s.get_final_response()
    assert argument_deltas == calls[0].arguments
    assert [(o.name, o.arguments) for o in streamed.output if o.type == "function_call"] == \
        [(calls[0].name, calls[0].arguments)]
    answer = sdk.responses.create(model=model, tools=[tool], max_output_tokens=8, temperature=0, input=question + [
        {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather", "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny, 21 C"}])
    assert answer.output[-1].type == "message"

    person = sdk.responses.create(model=model, input="A person?", max_output_tokens=64, temperature=0.8,
                                  text={"format": {"type": "json_schema", "name": "person", "schema": PERSON,
                                                   "strict": True}})
    jsonschema.validate(json.loads(person.output_text), PERSON)
    with pytest.raises(openai.BadRequestError) as e:
        sdk.responses.create(model=model, input="hi", previous_response_id="resp_123")
    assert e.value.body["param"] == "previous_response_id" and "whole conversation" in e.value.body["message"]


def test_the_anthropic_sdk(front):
    """Anthropic's Messages API through its own SDK: system and messages, streamed equal to not
    streamed and to the ZeroMQ client's chat, a forced tool_use with its tool_result sent back,
    Anthropic's error shapes, and x-api-key taking the place of the bearer key."""
    anthropic = pytest.importorskip("anthropic")
    _, _, port, client, model = front
    sdk = anthropic.Anthropic(base_url=f"http://127.0.0.1:{port}", api_key=KEY, max_retries=0, timeout=120)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}]
    want = client.generate(chat, max_tokens=10, temperature=0, ignore_eos=True)
    # Sampling fields are not in the SDK's signature any more: they go as extra_body, as vLLM's do.
    args = dict(model=model, max_tokens=10, system="Be brief.", messages=[{"role": "user", "content": "hello"}],
                metadata={"user_id": "u"}, extra_body={"ignore_eos": True, "temperature": 0})
    msg = sdk.messages.create(**args)
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text == want.text
    assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 10
    assert msg.usage.input_tokens == want.usage["prompt_tokens"]
    with sdk.messages.stream(**args) as s:
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    assert streamed == want.text and final.content[0].text == want.text and final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 10

    tool = {"name": "get_weather", "description": "Today's weather in a city",
            "input_schema": WEATHER["function"]["parameters"]}
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    greedy = {"temperature": 0}
    call = sdk.messages.create(model=model, max_tokens=64, messages=question, tools=[tool], extra_body=greedy,
                               tool_choice={"type": "tool", "name": "get_weather"})
    uses = [b for b in call.content if b.type == "tool_use"]
    assert call.stop_reason == "tool_use" and len(uses) == 1 and uses[0].name == "get_weather"
    assert uses[0].input["city"] in ("Paris", "Oslo", "Lima")
    with sdk.messages.stream(model=model, max_tokens=64, messages=question, tools=[tool], extra_body=greedy,
                             tool_choice={"type": "tool", "name": "get_weather"}) as s:
        streamed_call = s.get_final_message()
    assert [(b.type, b.name, b.input) for b in streamed_call.content if b.type == "tool_use"] == \
        [("tool_use", "get_weather", uses[0].input)]
    answer = sdk.messages.create(model=model, max_tokens=8, tools=[tool], extra_body=greedy, messages=question + [
        {"role": "assistant", "content": call.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "sunny, 21 C"}]}])
    assert answer.content[0].type == "text" and answer.stop_reason in ("end_turn", "max_tokens")

    with pytest.raises(anthropic.BadRequestError) as e:
        sdk.messages.create(model=model, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError):
        sdk.messages.create(model="nope", max_tokens=4, messages=question)
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=f"http://127.0.0.1:{port}", api_key="wrong", max_retries=0).messages.create(
            model=model, max_tokens=4, messages=question)


def test_the_fronts_metrics_carry_the_engines_state_by_vllms_names(front):
    from prometheus_client.parser import text_string_to_metric_families

    _, _, port, client, _ = front
    client.generate("hi", max_tokens=2)
    # The stats come with the engine's heartbeats: wait until one shows the request done.
    wait_for(lambda: (e := client.server_stats()["engine"]).get("prefix_cache_queries", 0) > 0
             and e.get("num_running") == 0, timeout=30, what="the engine's stats after a request")
    status, body = _get(port, "/metrics", headers={})
    assert status == 200
    samples = {s.name: s.value for f in text_string_to_metric_families(body.decode()) for s in f.samples}
    engine = client.server_stats()["engine"]  # idle: the same as the scrape read
    assert samples["nanovllm_http_engine_stats_up"] == 1
    assert samples["vllm:num_requests_running"] == engine["num_running"] == 0
    assert samples["vllm:num_requests_waiting"] == 0
    used = (engine["num_total_blocks"] - engine["num_free_blocks"]) / engine["num_total_blocks"]
    assert samples["vllm:kv_cache_usage_perc"] == pytest.approx(used)
    assert samples["vllm:prefix_cache_queries_total"] >= samples["vllm:prefix_cache_hits_total"] >= 0
    assert samples["vllm:prefix_cache_queries_total"] > 0 and "vllm:num_preemptions_total" in samples


def test_the_agent_loop_sends_messages_back_as_they_were_returned(front):
    """`messages.append(resp.choices[0].message)`: the SDK sends back what it received (a
    reasoning model's reasoning_content; after `parse`, `parsed`, `refusal`, `annotations` and the
    nulls), named messages and the known OpenAI fields that change nothing here are accepted; an
    unknown field too, as vLLM does; a known field that would change the output is a 400."""
    from pydantic import BaseModel, Field

    _, _, port, client, model = front
    openai, sdk = _sdk(port)
    reasoning = {"type": "regex", "regex": "<think>\n[a-z]{3,12}\n</think>\n\n[a-z]{2,8}"}
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Think first.", "name": "ann"}]
    first = sdk.chat.completions.create(model=model, messages=messages, max_tokens=48, temperature=0,
                                        response_format=reasoning).choices[0].message
    assert first.reasoning_content
    messages += [first, {"role": "user", "content": "Now a person.", "name": "bob"}]

    class Person(BaseModel):  # bounded: a random-weight model ends a string only where the schema makes it
        name: str = Field(max_length=6)
        age: int = Field(ge=0, le=120)

    parsed = sdk.chat.completions.parse(model=model, messages=messages, max_tokens=64, temperature=0.8, seed=1,
                                        response_format=Person).choices[0].message
    assert isinstance(parsed.parsed, Person)
    messages += [parsed, {"role": "user", "content": "Thanks."}]
    known = dict(metadata={"run": "a"}, store=False, service_tier="auto", prompt_cache_key="k",
                 safety_identifier="s", user="u")
    last = sdk.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0, **known,
                                       extra_body={"ignore_eos": True, "a_field_nobody_knows": 1})
    assert last.choices[0].finish_reason == "length" and last.usage.completion_tokens == 6
    # The same conversation through the ZeroMQ client gives the same answer: nothing was dropped on the way
    # that the template reads (the default template reads role and content).
    plain = [{"role": m["role"], "content": m["content"]} if isinstance(m, dict) else
             {"role": "assistant", "content": m.content} for m in messages]
    assert last.choices[0].message.content == client.generate(plain, max_tokens=6, temperature=0, ignore_eos=True).text
    for field, value in [("best_of", 2), ("reasoning_effort", "low"), ("suffix", "x")]:
        with pytest.raises(openai.BadRequestError) as e:
            sdk.chat.completions.create(model=model, messages=messages, max_tokens=2, extra_body={field: value})
        assert e.value.body["param"] == field and "not supported" in e.value.body["message"]


OUT_OF_RANGE = [("temperature", -0.5), ("top_p", 1.5), ("repetition_penalty", 1000), ("stop", ["s"] * 65),
                ("max_tokens", 2 ** 31), ("top_k", -2), ("logit_bias", {"7": 101}), ("stop_token_ids", [-1])]


@pytest.mark.parametrize("name, value", OUT_OF_RANGE, ids=[n for n, _ in OUT_OF_RANGE])
def test_one_value_out_of_range_gets_the_same_words_at_every_door(front, name, value):
    """One sampling struct, one validator: the in-process struct, the ZeroMQ client, a raw frame
    to the tokenizer (past any client's checks), the HTTP front and a raw frame to the engine all
    refuse the value with the validator's sentence, naming the field; the stage serves on."""
    from nanovllm_client import SamplingError, SamplingParams, protocol as p
    from nanovllm_client.endpoints import service_endpoints

    _, runtime_dir, port, client, model = front
    with pytest.raises(SamplingError) as offline:  # LLM, LLMEngine.add_request: built before either sees it
        SamplingParams(**{name: value})
    words = str(offline.value)
    assert offline.value.field == name and words.startswith(name)
    with pytest.raises(SamplingError) as zmq_client:
        client.generate("hi", **{name: value})
    assert str(zmq_client.value) == words
    status, out = _post(port, "/v1/completions", {"model": model, "prompt": "hi", name: value})
    assert (status, out["error"]["message"], out["error"]["param"]) == (400, words, name)
    status, out = _post(port, "/v1/chat/completions", {"model": model, name: value,
                                                       "messages": [{"role": "user", "content": "hi"}]})
    assert (status, out["error"]["message"], out["error"]["param"]) == (400, words, name)
    eps = service_endpoints(f"ipc://{runtime_dir}")
    ctx = zmq.Context()
    try:
        tokenizer = ctx.socket(zmq.DEALER)
        tokenizer.setsockopt(zmq.LINGER, 0)
        tokenizer.connect(eps.tokenizer)
        tokenizer.send(msgpack.packb([p.PROTOCOL_VERSION, "generate", {"request_id": "r", "prompt": "hi",
                                                                       "sampling": {name: value}}]))
        assert tokenizer.poll(30_000), "no answer from the tokenizer"
        reply = p.decode(tokenizer.recv())
        assert isinstance(reply, p.ErrorOutput) and (reply.message, reply.request_id) == (words, "r")
        before = client.server_stats()["engine"]["rejected_frames"]
        engine = ctx.socket(zmq.PUSH)
        engine.setsockopt(zmq.LINGER, 1000)
        engine.connect(eps.engine)
        meta = [b"c", "r", {}, b"", 0.0, 0, 0, False]
        engine.send(msgpack.packb([p.STAGE_PROTOCOL_VERSION, "tokenized", {
            "request_id": "c:r", "prompt_token_ids": p.pack_token_ids([1, 2]), "sampling": {name: value}, "meta": meta}]))
        wait_for(lambda: client.server_stats()["engine"]["rejected_frames"] > before, timeout=60,
                 what="the engine to refuse the frame")  # it has no client to answer: counted, logged
    finally:
        ctx.destroy(linger=0)
    assert client.generate("hi", max_tokens=2, ignore_eos=True).finish_reason == "length"


@pytest.mark.skipif(shutil.which("curl") is None, reason="no curl")
def test_curl_streams_chat_as_sse(front):
    _, _, port, client, model = front
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 12,
                       "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}})
    out = subprocess.run(["curl", "-sS", "-N", f"http://127.0.0.1:{port}/v1/chat/completions",
                          "-H", "Content-Type: application/json", "-H", f"Authorization: Bearer {KEY}", "-d", body],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    events = [e.removeprefix("data: ") for e in out.split("\n\n") if e.strip()]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    want = client.generate([{"role": "user", "content": "hi"}], max_tokens=12, temperature=0, ignore_eos=True)
    assert text == want.text and chunks[-1]["usage"]["completion_tokens"] == 12


def test_a_closed_connection_frees_its_kv_blocks(front):
    _, _, port, client, model = front
    body = json.dumps({"model": model, "prompt": "def f():", "max_tokens": 100_000, "ignore_eos": True,
                       "stream": True}).encode()
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Authorization: Bearer " + KEY.encode() + b"\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    assert b"200 OK" in s.recv(4096)
    wait_for(lambda: client.server_stats()["engine"].get("num_live", 0) == 1, timeout=60, what="the request running")
    s.close()
    wait_for(lambda: engine_idle(client), timeout=60, what="the engine idle, every KV block free, after the close")


def test_logprobs_through_the_openai_sdk_streamed_equal_whole(front):
    """Chat's logprobs/top_logprobs and completions' logprobs, streamed and not: the same tokens,
    each entry's text the output's text piece by piece, the alternatives as asked."""
    openai = pytest.importorskip("openai")
    _, _, port, client, model = front
    sdk = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "count to five"}]
    kw = dict(model=model, messages=messages, max_tokens=12, temperature=0, logprobs=True, top_logprobs=3,
              extra_body={"ignore_eos": True})
    whole = sdk.chat.completions.create(**kw)
    content = whole.choices[0].logprobs.content
    assert len(content) == 12 and "".join(c.token for c in content) == whole.choices[0].message.content
    assert all(len(c.top_logprobs) == 3 and c.top_logprobs[0].logprob >= c.logprob - 1e-6 for c in content)
    assert all(bytes(c.bytes).decode("utf-8", "replace") == c.token for c in content)
    chunks = list(sdk.chat.completions.create(**kw, stream=True))
    streamed = [c for ch in chunks if ch.choices and ch.choices[0].logprobs for c in ch.choices[0].logprobs.content]
    assert [(c.token, round(c.logprob, 3)) for c in streamed] == [(c.token, round(c.logprob, 3)) for c in content]
    assert sdk.chat.completions.create(**{**kw, "logprobs": False, "top_logprobs": None}).choices[0].logprobs is None
    done = sdk.completions.create(model=model, prompt="def f():", max_tokens=10, temperature=0, logprobs=2,
                                  extra_body={"ignore_eos": True})
    lists = done.choices[0].logprobs
    assert "".join(lists.tokens) == done.choices[0].text and len(lists.token_logprobs) == 10
    assert lists.text_offset == [sum(len(t) for t in lists.tokens[:i]) for i in range(10)]
    assert all(len(top) <= 2 and max(top.values()) >= lp - 1e-6 for top, lp in zip(lists.top_logprobs,
                                                                                   lists.token_logprobs))
    pieces = list(sdk.completions.create(model=model, prompt="def f():", max_tokens=10, temperature=0, logprobs=2,
                                         stream=True, extra_body={"ignore_eos": True}))
    assert [t for c in pieces if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens] == lists.tokens


def test_loglikelihood_as_an_evaluation_harness_asks_for_it(front, tiny_model_dir):
    """lm-eval's loglikelihood requests: echo + logprobs with max_tokens 0 (and 1), the prompt as
    token ids or text; the prompt's logprobs equal the offline engine's, the first token null,
    nothing generated counted."""
    from nanovllm import LLM, SamplingParams
    from tests.engine.conftest import random_prompts
    _, _, port, client, model = front
    prompts = random_prompts([7, 19], vocab=2048, seed=5)
    llm = LLM(tiny_model_dir)
    offline = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    llm.engine.close()
    status, out = _post(port, "/v1/completions", {"model": model, "prompt": prompts, "echo": True, "logprobs": 1,
                                                  "max_tokens": 0, "temperature": 0})
    assert status == 200, out
    for prompt, choice, ref in zip(prompts, out["choices"], offline):
        lists = choice["logprobs"]
        assert choice["finish_reason"] == "length" and len(lists["tokens"]) == len(prompt)
        assert lists["token_logprobs"][0] is None and lists["top_logprobs"][0] is None
        assert lists["token_logprobs"][1:] == pytest.approx([e.logprob for e in ref["prompt_logprobs"][1:]], abs=0.05)
        assert choice["text"] == "".join(lists["tokens"])
    assert out["usage"]["completion_tokens"] == 0 and out["usage"]["prompt_tokens"] == 26
    status, one = _post(port, "/v1/completions", {"model": model, "prompt": "The capital of France is",
                                                  "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0})
    lists = one["choices"][0]["logprobs"]
    assert status == 200 and one["choices"][0]["text"].startswith("The capital of France is")
    assert len(lists["tokens"]) == one["usage"]["prompt_tokens"] + 1 and lists["token_logprobs"][0] is None
    assert lists["text_offset"][-1] == len("The capital of France is")  # the generated token follows the prompt
    status, vllm = _post(port, "/v1/completions", {"model": model, "prompt": prompts[0], "max_tokens": 1,
                                                   "prompt_logprobs": 2})
    scores = vllm["choices"][0]["prompt_logprobs"]
    assert status == 200 and scores[0] is None and len(scores) == len(prompts[0])
    for token, entry in zip(prompts[0][1:], scores[1:]):
        assert str(token) in entry and len(entry) <= 3


def test_sigterm_drains_the_streams_in_flight_then_serve_stops(front):
    proc, runtime_dir, port, client, model = front
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("POST", "/v1/completions", body=json.dumps(
        {"model": model, "prompt": "def f():", "max_tokens": 200, "ignore_eos": True, "stream": True}),
        headers={"Content-Type": "application/json", **AUTH})
    r = conn.getresponse()
    first = r.readline()
    assert first.startswith(b"data: ")
    os.killpg(proc.pid, signal.SIGTERM)  # the supervisor stops the front first: it drains
    rest = r.read().decode()
    assert rest.rstrip().endswith("data: [DONE]") and '"finish_reason":"length"' in rest
    assert stopped(proc, runtime_dir, timeout=90) == 0

