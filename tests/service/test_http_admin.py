"""The HTTP front's tokenizer and cache endpoints, Anthropic's stop sequences, and the typed APIs'
streams across an engine restart: `nanovllm serve --http-port` on the tiny model in fp32 (so a
stream continued by a new engine equals the uninterrupted one), over real sockets, with the real
SDKs. One service for the module; the engine-restart test runs last (it kills the engine)."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys

import pytest

pytest.importorskip("uvicorn")

from nanovllm_client import AsyncClient, RequestError, ServiceDrainingError  # noqa: E402
from nanovllm_client.client_state import merge  # noqa: E402
from tests.service.conftest import EXACT_ARGS, START_TIMEOUT, TINY_ENGINE_ARGS  # noqa: E402
from tests.service.harness import REPO, fresh_engine_stats, wait_for  # noqa: E402
from tests.service.test_fair_share import SLOW  # noqa: E402
from tests.service.test_http_serve import KEY, serve_with_front  # noqa: E402
from tests.service.test_supervisor import read_pids  # noqa: E402


@pytest.fixture(scope="module")
def front(tiny_model_dir):
    # Steps of at least 10 ms (SLOW): the restart test's 400-token streams last 4 s or more, so its
    # kill lands while they run even when the test process itself is slow to read their first text.
    with serve_with_front(tiny_model_dir, [*TINY_ENGINE_ARGS, *EXACT_ARGS, *SLOW], f"{KEY}\n") as served:
        yield (*served, tiny_model_dir)


def _stop_inside(text: str) -> str:
    """A stop sequence that occurs in `text` after its start: three characters from its middle
    with something other than blank space in them."""
    for start in range(len(text) // 3, len(text) - 3):
        piece = text[start:start + 3]
        if piece.strip() and text.find(piece) > 0:
            return piece
    raise AssertionError(f"no stop sequence to pick in {text!r}")


def test_a_stop_sequence_ends_an_anthropic_message_as_stop_sequence(front):
    """The service names the stop string that ended an answer; the Messages API reports it as
    stop_reason "stop_sequence" with `stop_sequence` set, streamed and not, through the SDK."""
    anthropic = pytest.importorskip("anthropic")
    _, _, port, client, model = front
    chat = [{"role": "user", "content": "hello"}]
    full = client.generate(chat, max_tokens=24, temperature=0, ignore_eos=True)
    stop = _stop_inside(full.text)
    cut = client.generate(chat, max_tokens=24, temperature=0, ignore_eos=True, stop=[stop, "never-in-it"])
    assert cut.finish_reason == "stop" and cut.stop_reason == stop and cut.text == full.text[:full.text.find(stop)]
    assert client.generate(chat, max_tokens=4, temperature=0, ignore_eos=True).stop_reason is None

    sdk = anthropic.Anthropic(base_url=f"http://127.0.0.1:{port}", api_key=KEY, max_retries=0, timeout=120)
    args = dict(model=model, max_tokens=24, messages=chat, stop_sequences=["never-in-it", stop],
                extra_body={"ignore_eos": True, "temperature": 0})
    msg = sdk.messages.create(**args)
    assert (msg.stop_reason, msg.stop_sequence, msg.content[0].text) == ("stop_sequence", stop, cut.text)
    with sdk.messages.stream(**args) as s:
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    assert streamed == cut.text and (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)
    whole = sdk.messages.create(**dict(args, stop_sequences=["never-in-it"]))
    assert (whole.stop_reason, whole.stop_sequence) == ("max_tokens", None)
    # vLLM's stop_reason on chat and completions choices, streamed and not.
    openai = pytest.importorskip("openai")
    oai = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0, timeout=120)
    kw = dict(model=model, max_tokens=24, temperature=0, stop=[stop], extra_body={"ignore_eos": True})
    done = oai.chat.completions.create(messages=chat, **kw)
    assert done.choices[0].model_extra["stop_reason"] == stop and done.choices[0].message.content == cut.text
    last = [c for c in oai.chat.completions.create(messages=chat, stream=True, **kw) if c.choices][-1]
    assert last.choices[0].finish_reason == "stop" and last.choices[0].model_extra["stop_reason"] == stop
    plain = oai.completions.create(prompt=full.text[:8], **{**kw, "stop": ["never-in-it"], "max_tokens": 2})
    assert plain.choices[0].model_extra["stop_reason"] is None


def _curl(port: int, path: str, body: dict | None, key: str | None = KEY) -> tuple[int, dict]:
    """A POST through real curl: (status, JSON body)."""
    args = ["curl", "-sS", "-X", "POST", "-w", "\n%{http_code}", f"http://127.0.0.1:{port}{path}"]
    if body is not None:  # from stdin: a large body is no argument
        args += ["-H", "Content-Type: application/json", "--data-binary", "@-"]
    if key is not None:
        args += ["-H", f"Authorization: Bearer {key}"]
    out = subprocess.run(args, input=None if body is None else json.dumps(body), capture_output=True, text=True,
                         timeout=60, check=True).stdout
    text, status = out.rsplit("\n", 1)
    return int(status), json.loads(text)


needs_curl = pytest.mark.skipif(shutil.which("curl") is None, reason="no curl")


@needs_curl
def test_tokenize_and_detokenize_in_vllms_shapes(front):
    """/tokenize of a text and of a chat gives the tokenizer's own ids (a chat's count is a chat
    request's prompt_tokens), /detokenize gives the text back; the client library's commands
    answer the same, sync and async."""
    from transformers import AutoTokenizer

    _, _, port, client, model = front
    tokenizer = AutoTokenizer.from_pretrained(model)
    text = "def add(a, b):\n    return a + b  # 你好 🙂"
    status, out = _curl(port, "/tokenize", {"model": model, "prompt": text, "return_token_strs": True})
    ids = tokenizer.encode(text)
    limit = client.server_stats()["engine"]["max_model_len"]
    assert status == 200 and out == {"count": len(ids), "max_model_len": limit, "tokens": ids,
                                     "token_strs": tokenizer.convert_ids_to_tokens(ids)}
    status, back = _curl(port, "/detokenize", {"model": model, "tokens": ids})
    assert status == 200 and back == {"prompt": text}

    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello", "name": "ann"}]
    status, out = _curl(port, "/tokenize", {"messages": chat})  # model is optional, as in vLLM
    used = client.generate(chat, max_tokens=1).usage["prompt_tokens"]
    assert status == 200 and out["count"] == used == len(out["tokens"]) and "token_strs" not in out
    rendered = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert out["tokens"] == tokenizer.encode(rendered, add_special_tokens=False)
    status, bare = _curl(port, "/tokenize", {"messages": chat, "add_generation_prompt": False})
    assert status == 200 and bare["tokens"] == out["tokens"][:bare["count"]] and bare["count"] < out["count"]
    prefill = chat + [{"role": "assistant", "content": "Hi th"}]
    status, cont = _curl(port, "/tokenize", {"messages": prefill, "add_generation_prompt": False,
                                             "continue_final_message": True})
    assert status == 200 and _curl(port, "/detokenize", {"tokens": cont["tokens"]})[1]["prompt"].endswith("Hi th")

    got = client.tokenize(chat)
    assert (got.token_ids, got.max_model_len) == (out["tokens"], out["max_model_len"])
    assert client.detokenize(ids) == text
    assert client.tokenize(text, return_token_strs=True).token_strs == tokenizer.convert_ids_to_tokens(ids)

    async def with_async() -> tuple:
        async with AsyncClient(client.url, timeout=60) as c:
            return (await c.tokenize(text)).token_ids, await c.detokenize(ids)

    assert asyncio.run(with_async()) == (ids, text)


@needs_curl
def test_tokenize_and_detokenize_refuse_bad_input_naming_the_field(front):
    _, _, port, client, model = front
    vocab = len(__import__("transformers").AutoTokenizer.from_pretrained(model))
    cases = [
        ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, 400, "messages"),
        ("/tokenize", {"model": model}, 400, "prompt"),
        ("/tokenize", {"prompt": 7}, 400, "prompt"),
        ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, 400, "add_special_tokens"),
        ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": True,
                       "continue_final_message": True}, 400, "continue_final_message"),
        ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages"),
        ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ 1 }}"}, 400,
         "chat_template"),
        ("/tokenize", {"model": "nope", "prompt": "x"}, 404, "model"),
        ("/tokenize", {"prompt": "x" * 600_000}, 400, "prompt"),  # past 64 characters a token of the context
        ("/detokenize", {"tokens": [1, vocab]}, 400, "tokens"),
        ("/detokenize", {"tokens": [1, -1]}, 400, "tokens"),
        ("/detokenize", {"tokens": "1 2"}, 400, "tokens"),
        ("/detokenize", {"tokens": [1] * 100_000}, 400, "tokens"),  # more than the context
    ]
    for path, body, status, param in cases:
        got, out = _curl(port, path, body)
        assert (got, out["error"]["param"]) == (status, param), (path, body if len(str(body)) < 200 else param, out)
    assert "outside the vocabulary" in _curl(port, "/detokenize", {"tokens": [1, vocab]})[1]["error"]["message"]
    many = "🙂" * 30_000  # more tokens than one answer carries token strings for, within the text bound
    status, out = _curl(port, "/tokenize", {"prompt": many})
    assert status == 200 and out["count"] > 65_536, out.get("count")
    status, out = _curl(port, "/tokenize", {"prompt": many, "return_token_strs": True})
    assert (status, out["error"]["param"]) == (400, "prompt") and "at most 65536 tokens" in out["error"]["message"]
    assert _curl(port, "/tokenize", {"prompt": "x"}, key=None)[0] == 401
    assert _curl(port, "/detokenize", {"tokens": [1]}, key="sk-wrong")[0] == 401
    with pytest.raises(RequestError, match="outside the vocabulary"):
        client.detokenize([vocab + 5])
    assert client.detokenize([1, 2]) == _curl(port, "/detokenize", {"tokens": [1, 2]})[1]["prompt"]  # serves on


LONG = "The quick brown fox jumps over the lazy dog, then naps under the old oak tree. " * 6
"""A prompt of many full KV blocks (16 tokens each)."""


@needs_curl
def test_reset_prefix_cache_forgets_what_no_request_holds(front):
    """/reset_prefix_cache (and /flush_cache, the client library, the CLI): the cached blocks of
    finished requests are forgotten (the same prompt then finds none), while a request running
    through the reset keeps its blocks, finds them shared, and answers exactly as without it."""
    _, runtime_dir, port, client, model = front
    client.generate(LONG, max_tokens=1)
    assert client.generate(LONG, max_tokens=1).usage["cached_tokens"] >= 64
    assert _curl(port, "/reset_prefix_cache", None, key=None)[0] == 401  # the key rules of every endpoint
    assert client.generate(LONG, max_tokens=1).usage["cached_tokens"] >= 64  # ... and nothing was done

    running = "def running(x):\n" + LONG
    limit = client.server_stats()["engine"]["max_model_len"]
    want = client.generate(running, max_tokens=600, temperature=0, ignore_eos=True)
    stream = client.stream(running, max_tokens=limit - want.usage["prompt_tokens"] - 1, temperature=0,
                           ignore_eos=True)
    got = [next(stream)]
    status, out = _curl(port, "/reset_prefix_cache", None)
    assert status == 200 and out["freed_blocks"] >= 4, out  # LONG's blocks at least
    assert fresh_engine_stats(client)["num_running"] == 1  # the stream ran through the reset
    assert client.generate(running, max_tokens=1).usage["cached_tokens"] >= 64  # its blocks, kept and shared
    assert client.generate(LONG, max_tokens=1).usage["cached_tokens"] == 0  # forgotten
    while sum(len(d.token_ids) for d in got) < 600:
        got.append(next(stream))
    stream.cancel()
    assert merge(got, "r").token_ids[:600] == want.token_ids

    status, out = _curl(port, "/flush_cache", None)  # SGLang's router's name for it
    assert status == 200 and out["freed_blocks"] > 0  # the generates above cached their blocks again
    client.generate(LONG, max_tokens=1)
    assert client.reset_prefix_cache() > 0 and client.reset_prefix_cache() == 0

    async def with_async() -> int:
        async with AsyncClient(client.url, timeout=60) as c:
            await c.generate(LONG, max_tokens=1)
            return await c.reset_prefix_cache()

    assert asyncio.run(with_async()) > 0
    client.generate(LONG, max_tokens=1)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.path.join(REPO, "client")]))
    cli = subprocess.run([sys.executable, "-m", "nanovllm.cli", "reset-prefix-cache", "--url", client.url],
                         capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
    assert cli.returncode == 0 and cli.stdout.startswith("freed ") and int(cli.stdout.split()[1]) > 0, cli
    assert client.generate(LONG, max_tokens=1).usage["cached_tokens"] == 0


@needs_curl
def test_reset_prefix_cache_is_refused_while_the_engine_drains(front):
    """SIGTERM to the engine alone: it drains the stream in flight, and a cache reset meanwhile is
    a 503 naming the drain (the client library: ServiceDrainingError); the supervisor then starts a
    new engine, which serves the reset again."""
    _, runtime_dir, port, client, model = front
    limit = client.server_stats()["engine"]["max_model_len"]
    stream = client.stream("def slow():", max_tokens=limit - 16, ignore_eos=True)
    next(stream)
    engine = read_pids(runtime_dir)["engine_proc"]
    os.kill(engine, signal.SIGTERM)
    wait_for(lambda: client.server_stats()["engine_state"] == "draining", timeout=60, what="the engine draining")
    status, out = _curl(port, "/reset_prefix_cache", None)
    assert status == 503 and out["error"]["code"] == "draining" and "draining" in out["error"]["message"], out
    with pytest.raises(ServiceDrainingError):
        client.reset_prefix_cache()
    stream.cancel()  # the drain ends with it
    wait_for(lambda: client.engine_alive is True and read_pids(runtime_dir)["engine_proc"] != engine,
             timeout=START_TIMEOUT, what="the restarted engine")
    wait_for(lambda: _curl(port, "/reset_prefix_cache", None)[0] == 200, timeout=60,
             what="a reset served by the new engine")


def test_chat_messages_and_responses_streams_continue_across_an_engine_restart(front):
    """A stream of each of chat and Responses (the openai SDK) and Anthropic's Messages (its SDK),
    in flight when the engine is SIGKILLed: the supervisor restarts it, each stream is continued
    by the new engine from what the front had received, and each whole text equals the
    uninterrupted answer's, ended by its length."""
    openai = pytest.importorskip("openai")
    anthropic = pytest.importorskip("anthropic")
    _, runtime_dir, port, client, model = front
    oai = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0, timeout=120)
    ant = anthropic.Anthropic(base_url=f"http://127.0.0.1:{port}", api_key=KEY, max_retries=0, timeout=120)
    chat, tokens, greedy = [{"role": "user", "content": "hello"}], 400, {"ignore_eos": True, "temperature": 0}
    want = client.generate(chat, max_tokens=tokens, temperature=0, ignore_eos=True).text
    with contextlib.ExitStack() as opened:
        chunks = opened.enter_context(oai.chat.completions.create(
            model=model, messages=chat, max_tokens=tokens, stream=True, extra_body=greedy))
        message = opened.enter_context(ant.messages.stream(model=model, messages=chat, max_tokens=tokens,
                                                           extra_body=greedy))
        response = opened.enter_context(oai.responses.stream(model=model, input="hello", max_output_tokens=tokens,
                                                             extra_body=greedy))
        texts = {"chat": _first_text(c.choices[0].delta.content for c in chunks if c.choices),
                 "messages": _first_text(message.text_stream),
                 "responses": _first_text(e.delta for e in response if e.type == "response.output_text.delta")}
        engine = read_pids(runtime_dir)["engine_proc"]
        os.kill(engine, signal.SIGKILL)  # each stream has text: each is in the engine
        wait_for(lambda: client.engine_alive is False, timeout=60, what="the engine reported dead")
        wait_for(lambda: client.engine_alive is True and read_pids(runtime_dir)["engine_proc"] != engine,
                 timeout=START_TIMEOUT, what="the restarted engine")
        reasons = {}
        for c in chunks:
            texts["chat"] += "".join(ch.delta.content or "" for ch in c.choices)
            reasons["chat"] = next((ch.finish_reason for ch in c.choices if ch.finish_reason), reasons.get("chat"))
        texts["messages"] += "".join(message.text_stream)
        reasons["messages"] = message.get_final_message().stop_reason
        for e in response:  # its get_final_response waits for response.completed only
            texts["responses"] += e.delta if e.type == "response.output_text.delta" else ""
            reasons["responses"] = e.response.status if e.type == "response.incomplete" else reasons.get("responses")
    assert texts == dict.fromkeys(texts, want)
    assert reasons == {"chat": "length", "messages": "max_tokens", "responses": "incomplete"}
    # The new engine served the three continuations (nothing else was sent to it): the streams were
    # cut, not finished before the kill.
    wait_for(lambda: client.server_stats()["engine"].get("prefix_cache_queries", 0) > 0, timeout=30,
             what="the new engine's stats showing the continued requests")


def _first_text(pieces) -> str:
    """The first non-empty piece of text a stream yields (None pieces skipped)."""
    for piece in pieces:
        if piece:
            return piece
    raise AssertionError("the stream ended without text")
