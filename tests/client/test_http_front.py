"""The HTTP front (nanovllm_client.http) over a real socket, against a fake service client:
the request mapping, OpenAI's error shapes and statuses, SSE framing, keys, limits, disconnects."""
import asyncio
import http.client
import json
import pathlib
import re
import socket
import threading
import time

import pytest

pytest.importorskip("starlette")
uvicorn = pytest.importorskip("uvicorn")

from nanovllm_client.client_state import Delta  # noqa: E402
from nanovllm_client.sampling import SamplingParams  # noqa: E402
from nanovllm_client.errors import ServiceDrainingError  # noqa: E402
from nanovllm_client.protocol import FinishReason  # noqa: E402
from nanovllm_client.http.app import Settings, build_app  # noqa: E402
from nanovllm_client.http.schema import parse_chat, parse_completion  # noqa: E402
from nanovllm_client.http.errors import ApiError  # noqa: E402
from nanovllm_client.http.server import build_server  # noqa: E402
from nanovllm_client.http.tenant import tenant_of  # noqa: E402


class FakeStream:
    def __init__(self, words, slow, reason="length", reasoning_open=False):
        self.words, self.slow, self.reason, self.cancelled, self.done = words, slow, reason, False, False
        self.reasoning_open, self.stopped = reasoning_open, False

    def __aiter__(self):
        return self._gen()

    async def _gen(self):
        for i, w in enumerate(self.words):
            if self.slow:
                await asyncio.sleep(self.slow)
            if self.stopped:  # as the service ends a request stopped mid-way: "abort", with its usage
                yield Delta(request_id="r", text="", token_ids=[], finish_reason=FinishReason.ABORT,
                            usage={"prompt_tokens": 3, "completion_tokens": i, "cached_tokens": 0})
                break
            last = i == len(self.words) - 1
            yield Delta(request_id="r", text=w, token_ids=[i], finish_reason=FinishReason(self.reason) if last else None,
                        usage={"prompt_tokens": 3, "completion_tokens": len(self.words), "cached_tokens": 0}
                        if last else None, reasoning_open=self.reasoning_open)
        self.done = True

    def cancel(self):
        self.cancelled = True

    def stop(self):
        self.stopped = True


class FakeClient:
    def __init__(self):
        self.calls, self.streams, self.slow, self.draining = [], [], 0.0, False
        self.words, self.reason = None, "length"  # what the next streams answer (default: "Hello!")
        self.reasoning_open = False  # the next streams' deltas say the prompt opened <think>

    async def stream(self, prompt, **kw):
        if self.draining:
            raise ServiceDrainingError("draining")
        self.calls.append((prompt, kw))
        words = self.words or (["Hel", "lo", "!"] if not self.slow else ["x"] * 200)
        s = FakeStream(words, self.slow, self.reason, self.reasoning_open)
        self.streams.append(s)
        return s


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(app):
    """`app` served by uvicorn on a thread, once it is listening: (server, thread, port)."""
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    return server, t, port


@pytest.fixture(scope="module")
def front():
    client = FakeClient()
    server, t, port = _serve(build_app(client, Settings(model="m", api_keys=("k1", "secret"), max_body_bytes=10_000,
                                                        max_streams=4)))
    yield client, port
    server.should_exit = True
    t.join(10)


def _req(port, method, path, body=None, key="secret", raw=None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    conn.request(method, path, body=data, headers=headers)
    r = conn.getresponse()
    out = r.status, r.read()
    conn.close()
    return out


def test_mapping_names_and_refusals():
    call = parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 5,
                       "temperature": 0, "top_k": 3, "min_p": 0.1, "repetition_penalty": 1.1, "seed": 7,
                       "stop": "x", "logit_bias": {"42": -100}, "ignore_eos": True, "priority": 2,
                       "presence_penalty": 0.5, "frequency_penalty": 0.5, "min_tokens": 1, "user": "u"})
    assert call.prompt == [{"role": "user", "content": "hi"}]
    assert call.sampling == SamplingParams(temperature=0, top_k=3, min_p=0.1, repetition_penalty=1.1, seed=7,
                                           max_tokens=5, stop=["x"], logit_bias={42: -100.0}, ignore_eos=True,
                                           presence_penalty=0.5, frequency_penalty=0.5, min_tokens=1)
    assert call.kwargs == {"priority": 2}
    assert parse_completion({"model": "m", "prompt": [1, 2, 3]}).prompt == [1, 2, 3]
    # What a router fills in (smg: "logprobs": false on chat, "echo": false on completions) asks for nothing.
    plain = parse_completion({"model": "m", "prompt": "a", "echo": False, "logprobs": None, "temperature": None})
    assert plain.kwargs == {} and plain.sampling == SamplingParams()
    plain = parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}], "logprobs": False,
                        "top_logprobs": None})
    assert plain.kwargs == {} and plain.sampling == SamplingParams()
    hi = [{"role": "user", "content": "hi"}]
    assert parse_chat({"model": "m", "messages": hi, "logprobs": True}).sampling.logprobs == 0
    wanted = parse_chat({"model": "m", "messages": hi, "logprobs": True, "top_logprobs": 5})
    assert wanted.logprobs and wanted.sampling.logprobs == 5 and wanted.sampling.prompt_logprobs is None
    echo = parse_completion({"model": "m", "prompt": [5, 6], "echo": True, "max_tokens": 0})
    assert echo.echo_only and echo.sampling.max_tokens == 1 and echo.sampling.prompt_logprobs == 0  # its text
    assert parse_completion({"model": "m", "prompt": "a", "echo": True}).sampling.prompt_logprobs is None
    assert parse_completion({"model": "m", "prompt": "a", "echo": True, "logprobs": 3}).sampling.prompt_logprobs == 3
    for body, param in [({"model": "m", "messages": hi, "logprobs": 1}, "logprobs"),
                        ({"model": "m", "messages": hi, "top_logprobs": 21, "logprobs": True}, "top_logprobs"),
                        ({"model": "m", "messages": hi, "top_logprobs": 2}, "top_logprobs")]:
        with pytest.raises(ApiError) as e:
            parse_chat(body)
        assert e.value.status == 400 and e.value.param == param
    schema = {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "object"}}}
    call = parse_completion({"model": "m", "prompt": "a", "response_format": schema})
    assert call.sampling.response_format == schema
    too_big = {"type": "regex", "regex": "a" * (64 * 1024)}
    for body, param in [({"model": "m", "prompt": "a", "response_format": "json_object"}, "response_format"),
                        ({"model": "m", "prompt": "a", "response_format": {"schema": {}}}, "response_format"),
                        ({"model": "m", "prompt": "a", "response_format": too_big}, "response_format"),
                        ({"model": "m", "prompt": "a", "logprobs": 21}, "logprobs"),
                        ({"model": "m", "prompt": "a", "logprobs": True}, "logprobs"),
                        ({"model": "m", "prompt": "a", "echo": 1}, "echo"),
                        ({"model": "m", "prompt": "a", "max_tokens": 0}, "max_tokens"),
                        ({"model": "m", "prompt": "a", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
                        ({"model": "m", "prompt": "a", "n": 17}, "n"),
                        ({"model": "m", "prompt": "a", "temperature": "hot"}, "temperature"),
                        ({"model": "m", "prompt": "a", "temperature": float("nan")}, "temperature"),
                        ({"model": "m", "prompt": "a", "max_tokens": True}, "max_tokens"),
                        ({"model": "m", "prompt": "a", "logit_bias": {"x": 1}}, "logit_bias"),
                        ({"model": "m", "prompt": "a", "top_p": 0}, "top_p"),
                        ({"model": "m", "prompt": "a", "priority": 2 ** 40}, "priority"),
                        ({"model": "m", "prompt": ""}, "prompt"),
                        ({"prompt": "a"}, "model")]:
        with pytest.raises(ApiError) as e:
            parse_completion(body)
        assert e.value.status == 400 and e.value.param == param, body
    city = {"type": "object", "properties": {"city": {"type": "string"}}}
    weather = {"type": "function",
               "function": {"name": "get_weather", "description": "today's weather", "parameters": city}}
    turns = [{"role": "user", "content": "Weather in Paris?"},
             {"role": "assistant", "content": None, "tool_calls": [
                 {"id": "call_1", "type": "function",
                  "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
             {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    call = parse_chat({"model": "m", "messages": turns, "tools": [weather], "tool_choice": "auto"})
    assert call.tools and call.kwargs["tools"] == [weather]
    assert call.prompt[1] == {"role": "assistant", "content": "", "tool_calls": turns[1]["tool_calls"]}
    assert call.prompt[2] == turns[2]
    forced = parse_chat({"model": "m", "messages": turns[:1], "tools": [weather],
                         "tool_choice": "required"}).sampling.response_format
    assert forced["type"] == "grammar" and '{"const":"get_weather"}' in forced["grammar"]
    call = parse_chat({"model": "m", "messages": turns[:1], "tools": [weather], "tool_choice": "none"})
    assert not call.tools and "tools" not in call.kwargs
    one = parse_chat({"model": "m", "messages": turns[:1], "tools": [weather], "parallel_tool_calls": False})
    assert one.max_tool_calls == 1 and not one.forced
    assert parse_chat({"model": "m", "messages": turns[:1], "tools": [weather]}).max_tool_calls is None
    # A forced call's grammar holds one call; a schema's own references are moved with it.
    located = {"type": "object", "properties": {"at": {"$ref": "#/$defs/Place"}, "near": {"$ref": "#"}},
               "$defs": {"Place": {"type": "string", "enum": ["Paris", {"$ref": "#/not-a-ref"}]}}}
    forced = parse_chat({"model": "m", "messages": turns[:1], "parallel_tool_calls": False, "tool_choice": "required",
                         "tools": [weather, {"type": "function", "function": {"name": "f", "parameters": located}}]})
    assert forced.forced and forced.max_tool_calls == 1
    grammar = forced.sampling.response_format["grammar"]
    assert grammar.startswith('start: "<tool_call>\\n" call "\\n</tool_call>"\n')  # exactly one call
    defs = json.loads(grammar.split("%json ", 1)[1])["$defs"]
    assert defs["tool_0"] == city
    assert defs["tool_1"]["properties"] == {"at": {"$ref": "#/$defs/tool_1/$defs/Place"},
                                            "near": {"$ref": "#/$defs/tool_1"}}
    assert defs["tool_1"]["$defs"]["Place"]["enum"][1] == {"$ref": "#/not-a-ref"}  # data, not a reference
    for extra, param in [({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools"),
                         ({"tools": [{"type": "retrieval"}]}, "tools"),
                         ({"tools": weather}, "tools"),
                         ({"tools": [weather], "tool_choice": {"type": "function", "function": {"name": "x"}}},
                          "tool_choice"),
                         ({"tool_choice": "required"}, "tool_choice"),
                         ({"tools": [weather], "tool_choice": "required", "response_format": {"type": "json_object"}},
                          "tool_choice"),
                         ({"tools": [weather], "parallel_tool_calls": "no"}, "parallel_tool_calls"),
                         ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
                             "type": "object", "properties": {"a": {"$ref": "https://example.com/a.json"}}}}}],
                           "tool_choice": "required"}, "tools")]:
        with pytest.raises(ApiError) as e:
            parse_chat({"model": "m", "messages": turns[:1], **extra})
        assert e.value.param == param, extra
    with pytest.raises(ApiError) as e:  # calls only on an assistant message
        parse_chat({"model": "m", "messages": [{"role": "user", "content": "x", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]})
    assert "messages[0].tool_calls" in e.value.message
    with pytest.raises(ApiError) as e:
        parse_chat({"model": "m", "messages": [{"role": "user", "content": "x", "name": 7}]})
    assert "messages[0].name must be a string" in e.value.message


def test_models_completion_chat(front):
    client, port = front
    status, body = _req(port, "GET", "/v1/models")
    assert status == 200 and json.loads(body)["data"][0]["id"] == "m"
    status, body = _req(port, "POST", "/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 3})
    out = json.loads(body)
    assert status == 200 and out["choices"][0]["text"] == "Hello!" and out["choices"][0]["finish_reason"] == "length"
    assert out["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    # The service is told which API key the request came with (a digest): the client it counts as.
    assert client.calls[-1] == ("hi", {"sampling": SamplingParams(max_tokens=3), "tenant": tenant_of("secret", None)})
    assert tenant_of("secret", "10.0.0.1").startswith("key:") and "secret" not in tenant_of("secret", None)
    assert tenant_of("k1", None) != tenant_of("secret", None) and tenant_of(None, "10.0.0.1") == "peer:10.0.0.1"
    status, body = _req(port, "POST", "/v1/chat/completions",
                        {"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert status == 200 and json.loads(body)["choices"][0]["message"] == {"role": "assistant", "content": "Hello!"}


def test_streaming_sse(front):
    _, port = front
    status, body = _req(port, "POST", "/v1/chat/completions",
                        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True,
                         "stream_options": {"include_usage": True}})
    events = [e[len("data: "):] for e in body.decode().split("\n\n") if e]
    assert status == 200 and events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == "Hello!"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 6
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    status, body = _req(port, "POST", "/v1/completions", {"model": "m", "prompt": "x", "stream": True})
    events = [e for e in body.decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]" and "usage" not in json.loads(events[0][6:])


def test_tool_calls_and_reasoning_whole_and_streamed(front):
    client, port = front
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    body = {"model": "m", "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [weather]}
    client.words = ["<think>It is a weather", " question.</th", "ink>\n<tool_", 'call>\n{"name": "get_weather", ',
                    '"arguments": {"city":', ' "Paris"}}\n</tool_call>']
    client.reason = "stop"
    try:
        status, out = _req(port, "POST", "/v1/chat/completions", body)
        assert client.calls[-1][1]["tools"] == [weather]
        choice = json.loads(out)["choices"][0]
        assert status == 200 and choice["finish_reason"] == "tool_calls", out
        message = choice["message"]
        assert message["content"] is None and message["reasoning_content"] == "It is a weather question."
        [tool_call] = message["tool_calls"]
        assert tool_call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
        assert tool_call["type"] == "function" and tool_call["id"].startswith("call_")
        status, out = _req(port, "POST", "/v1/chat/completions", {**body, "stream": True})
        chunks = [json.loads(e[6:]) for e in out.decode().split("\n\n") if e and e != "data: [DONE]"]
        deltas = [c["choices"][0]["delta"] for c in chunks]
        assert "".join(d.get("reasoning_content", "") for d in deltas) == "It is a weather question."
        calls = [t for d in deltas for t in d.get("tool_calls", [])]
        assert calls[0]["function"] == {"name": "get_weather", "arguments": ""} and calls[0]["index"] == 0
        assert "".join(t["function"]["arguments"] for t in calls) == '{"city": "Paris"}'
        assert len(calls) >= 3  # the arguments came in pieces, as they arrived
        assert not any(d.get("content") for d in deltas)
        assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
        # without tools the same text is content (after the reasoning)
        status, out = _req(port, "POST", "/v1/chat/completions", {**body, "tools": None})
        message = json.loads(out)["choices"][0]["message"]
        assert message["content"].startswith("<tool_call>") and "tool_calls" not in message
    finally:
        client.words, client.reason = None, "length"


def test_reasoning_opened_by_the_prompt_whole_and_streamed(front):
    """The deltas say the chat template opened <think> in the prompt: the output up to </think>
    is reasoning_content, the rest content; the same text without the flag is all content."""
    client, port = front
    body = {"model": "m", "messages": [{"role": "user", "content": "Why?"}]}
    client.words, client.reasoning_open = ["Because", " it is.\n</th", "ink>\n\nSo", " it is."], True
    try:
        message = json.loads(_req(port, "POST", "/v1/chat/completions", body)[1])["choices"][0]["message"]
        assert (message["reasoning_content"], message["content"]) == ("Because it is.\n", "So it is.")
        status, out = _req(port, "POST", "/v1/chat/completions", {**body, "stream": True})
        deltas = [json.loads(e[6:])["choices"][0]["delta"] for e in out.decode().split("\n\n")
                  if e and e != "data: [DONE]"]
        assert "".join(d.get("reasoning_content", "") for d in deltas) == "Because it is.\n"
        assert "".join(d.get("content", "") for d in deltas) == "So it is."
        client.reasoning_open = False
        message = json.loads(_req(port, "POST", "/v1/chat/completions", body)[1])["choices"][0]["message"]
        assert message["content"] == "Because it is.\n</think>\n\nSo it is." and "reasoning_content" not in message
    finally:
        client.words, client.reasoning_open = None, False


def test_one_call_stops_the_request(front):
    """parallel_tool_calls false: once the first call is complete the request is stopped (the
    rest would be dropped), and its usage is what the service counted up to then."""
    client, port = front
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    body = {"model": "m", "messages": [{"role": "user", "content": "Weather?"}], "tools": [weather],
            "parallel_tool_calls": False}
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    client.words = [call[:30], call[30:], "\n<tool_call>", "\n{", '"name": "now"'] + [" more"] * 20
    try:
        for stream in (False, True):
            status, out = _req(port, "POST", "/v1/chat/completions", {**body, "stream": stream,
                                                                     "stream_options": {"include_usage": True}}
                               if stream else body)
            assert status == 200
            if stream:
                chunks = [json.loads(e[6:]) for e in out.decode().split("\n\n") if e and e != "data: [DONE]"]
                calls = [t for c in chunks if c["choices"] for t in c["choices"][0]["delta"].get("tool_calls", [])]
                assert "".join(t["function"]["arguments"] for t in calls) == '{"city": "Paris"}'
                assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "tool_calls"
                usage = chunks[-1]["usage"]
            else:
                choice = json.loads(out)["choices"][0]
                assert choice["finish_reason"] == "tool_calls" and len(choice["message"]["tool_calls"]) == 1
                usage = json.loads(out)["usage"]
            assert client.streams[-1].stopped
            assert usage["completion_tokens"] == 2  # the call's two pieces: nothing generated after them
        body["parallel_tool_calls"] = True  # every call wanted: nothing is stopped
        _req(port, "POST", "/v1/chat/completions", body)
        assert not client.streams[-1].stopped
    finally:
        client.words = None


def test_errors_in_openai_shape(front):
    client, port = front
    cases = [(_req(port, "GET", "/v1/models", key=None), 401),
             (_req(port, "GET", "/v1/models", key="wrong"), 401),
             (_req(port, "GET", "/v1/nothing"), 404),
             (_req(port, "POST", "/v1/completions", {"model": "other", "prompt": "a"}), 404),
             (_req(port, "POST", "/v1/completions", raw=b"{not json"), 400),
             (_req(port, "POST", "/v1/completions", raw=b"[1]"), 400),
             (_req(port, "POST", "/v1/completions", {"model": "m", "prompt": "a" * 20_000}), 413),
             (_req(port, "POST", "/v1/completions", {"model": "m", "prompt": "a", "best_of": 2}), 400)]
    for (status, body), want in cases:
        err = json.loads(body)["error"]
        assert status == want and set(err) == {"message", "type", "param", "code"}, (want, body)
    client.draining = True
    try:
        status, body = _req(port, "POST", "/v1/completions", {"model": "m", "prompt": "a"})
    finally:
        client.draining = False
    assert status == 503 and json.loads(body)["error"]["code"] == "draining"


def test_disconnect_aborts_and_stream_limit(front):
    client, port = front
    client.slow = 0.05
    try:
        socks = []
        body = json.dumps({"model": "m", "prompt": "x", "stream": True}).encode()
        for _ in range(4):
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k1\r\n"
                      b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            assert b"200 OK" in s.recv(4096)
            socks.append(s)
        status, out = _req(port, "POST", "/v1/completions", {"model": "m", "prompt": "a"})
        assert status == 429 and json.loads(out)["error"]["type"] == "rate_limit_error"
        for s in socks:
            s.close()
        streams = client.streams[-4:]
        deadline = time.monotonic() + 10
        while not all(s.cancelled for s in streams):
            assert time.monotonic() < deadline, "a closed connection did not abort its request"
            time.sleep(0.05)
        assert not any(s.done for s in streams)
    finally:
        client.slow = 0.0
    status, body = _req(port, "GET", "/metrics")
    assert status == 200 and b"nanovllm_http_client_disconnects_total 4" in body
    assert b"nanovllm_http_active_requests 0" in body


def _wait(predicate, what, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_over_the_connection_limit_a_request_gets_503_in_openai_shape():
    port = _free_port()
    server = build_server(build_app(FakeClient(), Settings(model="m")), host="127.0.0.1", port=port,
                          max_connections=2, idle_timeout=5.0, drain_timeout=5.0)
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    idle = []
    try:
        _wait(lambda: server.started, "the server to start")
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]  # open, saying nothing
        _wait(lambda: len(server.server_state.connections) == 2, "two open connections")
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("POST", "/v1/completions", body=json.dumps({"model": "m", "prompt": "a"}),
                     headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        body = json.loads(r.read())
        assert r.status == 503 and r.getheader("connection") == "close", (r.status, body)
        assert body == {"error": {"message": "too many open connections (at most 2); retry later",
                                  "type": "service_unavailable", "param": None, "code": "too_many_connections"}}
        conn.close()
        for s in idle:
            s.close()
        _wait(lambda: not server.server_state.connections, "the connections to close")
        status, out = _req(port, "POST", "/v1/completions", {"model": "m", "prompt": "a"})
        assert status == 200 and json.loads(out)["choices"][0]["text"] == "Hello!"
    finally:
        for s in idle:
            s.close()
        server.should_exit = True
        t.join(10)


def test_cli_help_and_a_public_bind_without_keys_is_refused(tmp_path):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "nanovllm_client.http", "--help"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and "--api-key-file" in out.stdout and "--drain-timeout" in out.stdout
    out = subprocess.run([sys.executable, "-m", "nanovllm_client.http", "--host", "0.0.0.0", "--port", "1"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "requires --api-key-file" in out.stderr
    empty = tmp_path / "keys"
    empty.write_text("# no key\n\n")
    out = subprocess.run([sys.executable, "-m", "nanovllm_client.http", "--api-key-file", str(empty)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "holds no key" in out.stderr


def _doc_fields(marker: str) -> dict[str, tuple]:
    """The fields docs/service.md lists after `<!-- marker -->`: name -> the neutral values shown."""
    doc = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "service.md").read_text(encoding="utf-8")
    row = doc.split(f"<!-- {marker} -->\n", 1)[1].split("\n", 1)[0]
    cell = row.split(" | ")[0].lstrip("| ")
    out = {}
    for name, shown in re.findall(r"`(\w+)`(?: \(([^)]*)\))?", cell):
        out[name] = tuple(json.loads(v) for v in shown.split(", ")) if shown and marker.startswith("request") else ()
    return out


def test_docs_list_the_fields_the_front_ignores_and_refuses():
    from nanovllm_client.http import schema
    assert set(_doc_fields("request-fields: ignored")) == schema.IGNORED
    neutral = _doc_fields("request-fields: neutral")
    assert neutral == {k: tuple(v) for k, v in schema.NEUTRAL.items()}
    assert set(_doc_fields("message-fields: ignored")) == schema._MESSAGE_IGNORED
    assert set(_doc_fields("message-fields: neutral")) == set(schema._MESSAGE_NEUTRAL)
    assert {"name", "reasoning_content", "reasoning"} <= set(_doc_fields("message-fields: read"))


def test_the_field_rule(caplog):
    from nanovllm_client.http import schema
    hi = [{"role": "user", "content": "hi"}]
    for name in schema.IGNORED:  # known, no effect: accepted
        assert parse_chat({"model": "m", "messages": hi, name: "x"}).sampling == SamplingParams()
    for name, neutral in schema.NEUTRAL.items():  # known, would change the output: only what asks for nothing
        parse_chat({"model": "m", "messages": hi, name: None})
        for value in neutral:
            parse_chat({"model": "m", "messages": hi, name: value})
        with pytest.raises(ApiError) as e:
            parse_chat({"model": "m", "messages": hi, name: {"asks": "something"}})
        assert e.value.status == 400 and e.value.param == name and f"'{name}' is not supported" in e.value.message
    with pytest.raises(ApiError):  # True is not 1
        parse_chat({"model": "m", "messages": hi, "n": True})
    with caplog.at_level("INFO", logger="nanovllm_client.http"):
        for _ in range(3):
            parse_chat({"model": "m", "messages": hi, "an_unknown_field_for_the_test": 1})
    logged = [r for r in caplog.records if "an_unknown_field_for_the_test" in r.getMessage()]
    assert len(logged) == 1 and "does not know it" in logged[0].getMessage()


def test_an_assistant_message_goes_back_as_it_was_returned():
    returned = {"role": "assistant", "content": "Paris.", "reasoning_content": "The capital.", "parsed": {"a": 1},
                "refusal": None, "annotations": [], "audio": None, "function_call": None, "tool_calls": None}
    call = parse_chat({"model": "m", "messages": [{"role": "user", "content": "Capital?", "name": "ann"}, returned,
                                                  {"role": "user", "content": "And Peru?"}]})
    assert call.prompt == [{"role": "user", "content": "Capital?", "name": "ann"},
                           {"role": "assistant", "content": "Paris.", "reasoning_content": "The capital."},
                           {"role": "user", "content": "And Peru?"}]
    reasoning = parse_chat({"model": "m", "messages": [dict(returned, reasoning_content=None, reasoning="r")]})
    assert reasoning.prompt[0]["reasoning_content"] == "r"  # vLLM's newer name, as templates read the older
    for bad_field in [{"audio": {"id": "a"}}, {"function_call": {"name": "f", "arguments": "{}"}}]:
        with pytest.raises(ApiError) as e:
            parse_chat({"model": "m", "messages": [dict(returned, **bad_field)]})
        assert e.value.param == "messages" and next(iter(bad_field)) in e.value.message


def _raw(port, method, path, headers, body=None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request(method, path, body=body, headers=headers)
    r = conn.getresponse()
    out = r.status, dict((k.lower(), v) for k, v in r.getheaders()), r.read()
    conn.close()
    return out


def test_cors_only_for_the_origins_allowed():
    from nanovllm_client.http.__main__ import origins
    assert origins("") == () and origins("https://app.example, http://localhost:3000/") == (
        "https://app.example", "http://localhost:3000")
    with pytest.raises(Exception, match="not an origin"):
        origins("app.example/path")
    allowed = "https://app.example"
    server, t, port = _serve(build_app(FakeClient(), Settings(model="m", api_keys=("k",), allowed_origins=(allowed,))))
    plain_server, plain_t, plain_port = _serve(build_app(FakeClient(), Settings(model="m", api_keys=("k",))))
    try:
        body = json.dumps({"model": "m", "prompt": "a"})
        post = {"Content-Type": "application/json", "Authorization": "Bearer k"}
        # A preflight carries no key and gets the permission; the request then gets the header.
        status, headers, _ = _raw(port, "OPTIONS", "/v1/completions", {
            "Origin": allowed, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type"})
        assert status == 200 and headers["access-control-allow-origin"] == allowed
        assert "POST" in headers["access-control-allow-methods"]
        status, headers, _ = _raw(port, "POST", "/v1/completions", dict(post, Origin=allowed), body)
        assert status == 200 and headers["access-control-allow-origin"] == allowed
        status, headers, _ = _raw(port, "POST", "/v1/completions", dict(post, Origin="https://evil.example"), body)
        assert "access-control-allow-origin" not in headers  # the browser then hides the answer
        keyless = {"Origin": allowed, "Content-Type": "application/json"}
        status, headers, _ = _raw(port, "POST", "/v1/completions", keyless, body)
        assert status == 401  # the key rules stand
        status, headers, _ = _raw(plain_port, "POST", "/v1/completions", dict(post, Origin=allowed), body)
        assert status == 200 and "access-control-allow-origin" not in headers  # off by default
    finally:
        for s, th in ((server, t), (plain_server, plain_t)):
            s.should_exit = True
            th.join(10)


def _sse_chunks(raw: bytes) -> list[dict]:
    return [json.loads(line[6:]) for line in raw.decode().split("\n\n") if line.startswith("data: {")]


def test_n_choices_and_a_list_of_prompts(front):
    client, port = front
    client.words, client.calls = ["a", "b"], []
    status, body = _req(port, "POST", "/v1/completions", {"model": "m", "prompt": ["one", [5, 6]], "n": 2, "seed": 9,
                                                           "temperature": 0.7})
    out = json.loads(body)
    assert status == 200 and [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in out["choices"]] == ["ab"] * 4
    # prompt i's j-th choice is index i * n + j; choice j draws with seed + j
    assert [(p, kw["sampling"].seed) for p, kw in client.calls] == [("one", 9), ("one", 10), ([5, 6], 9), ([5, 6], 10)]
    assert out["usage"] == {"prompt_tokens": 6, "completion_tokens": 8, "total_tokens": 14}  # each prompt once
    status, body = _req(port, "POST", "/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "x"}],
                                                                "n": 3, "stream": True,
                                                                "stream_options": {"include_usage": True}})
    chunks = _sse_chunks(body)
    by_index: dict[int, str] = {}
    for c in chunks:
        for choice in c["choices"]:
            by_index[choice["index"]] = by_index.get(choice["index"], "") + (choice["delta"].get("content") or "")
    assert status == 200 and by_index == {0: "ab", 1: "ab", 2: "ab"}
    assert sum(1 for c in chunks for ch in c["choices"] if ch["finish_reason"]) == 3  # each choice ends once
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
    for body, param in [({"model": "m", "prompt": "a", "n": 17}, "n"), ({"model": "m", "prompt": ["a"] * 33, "n": 2},
                                                                        "prompt"),
                        ({"model": "m", "prompt": ["a", ""]}, "prompt"), ({"model": "m", "prompt": "a", "n": 0}, "n")]:
        status, raw = _req(port, "POST", "/v1/completions", body)
        assert status == 400 and json.loads(raw)["error"]["param"] == param, body
