"""A chat template that opens `<think>` in the generation prompt (Qwen3's thinking models,
DeepSeek-R1): the output starts inside the reasoning with no `<think>` of its own. The tokenizer
stage, which renders the template, says so in the request's meta; the detokenizer passes it on in
the stream's deltas; the HTTP front then returns the text before `</think>` as reasoning_content
and the rest as content, streamed and not. `chat_template_kwargs` {"enable_thinking": false}
(Qwen3's switch) makes the template close the block instead. Real processes (`nanovllm serve
--http-port`), the tiny random Qwen3 with that template, the openai package."""
from __future__ import annotations

import os
import shutil

import pytest

pytest.importorskip("uvicorn")

from tests.service.harness import short_tmpdir  # noqa: E402
from tests.service.test_chat_tools import THINKING_TEMPLATE  # noqa: E402
from tests.service.test_http_curve import serve_with_http  # noqa: E402


@pytest.fixture(scope="module")
def thinking_front(tiny_model_dir):
    from transformers import AutoTokenizer

    root = short_tmpdir()
    model = os.path.join(root, "thinking")
    shutil.copytree(tiny_model_dir, model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.chat_template = THINKING_TEMPLATE
    tokenizer.save_pretrained(model)
    with serve_with_http(model, f"ipc://{root}/svc", os.path.join(root, "run")) as (_, port, client):
        yield port, client, model


def test_reasoning_content_from_a_prompt_that_opened_think(thinking_front):
    openai = pytest.importorskip("openai")
    port, client, model = thinking_front
    sdk = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "Think first."}]
    # The output is held to the form a thinking model writes (a random-weight model does not).
    form = {"type": "regex", "regex": "[a-z]{3,12}\n</think>\n\n[a-z]{2,8}"}
    raw = client.generate(messages, max_tokens=48, temperature=0, response_format=form)
    thought, answer = raw.text.split("\n</think>\n\n")
    args = dict(model=model, messages=messages, max_tokens=48, temperature=0, response_format=form)
    message = sdk.chat.completions.create(**args).choices[0].message
    assert (message.reasoning_content, message.content) == (thought + "\n", answer)
    deltas = [c.choices[0].delta for c in sdk.chat.completions.create(stream=True, **args) if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == thought + "\n"
    assert "".join(d.content or "" for d in deltas) == answer


def test_chat_template_kwargs_reach_the_template(thinking_front):
    """vLLM's `chat_template_kwargs`: {"enable_thinking": false} makes the template close the
    reasoning block in the prompt (Qwen3's switch), so the whole answer is content; the prompt
    counted is the one the template rendered with the variable."""
    from transformers import AutoTokenizer

    openai = pytest.importorskip("openai")
    port, client, model = thinking_front
    sdk = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "Answer at once."}]
    form = {"type": "regex", "regex": "[a-z]{2,8}"}
    args = dict(model=model, messages=messages, max_tokens=16, temperature=0, response_format=form,
                extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    out = sdk.chat.completions.create(**args)
    message = out.choices[0].message
    assert getattr(message, "reasoning_content", None) is None and 2 <= len(message.content) <= 8, message
    assert message.content == client.generate(messages, max_tokens=16, temperature=0, response_format=form,
                                              chat_template_kwargs={"enable_thinking": False}).text
    tokenizer = AutoTokenizer.from_pretrained(model)
    off = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, enable_thinking=False)
    on = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert off.endswith("<think>\n\n</think>\n\n") and on.endswith("<think>\n")
    assert out.usage.prompt_tokens == len(tokenizer.encode(off, add_special_tokens=False))
    deltas = [c.choices[0].delta for c in sdk.chat.completions.create(stream=True, **args) if c.choices]
    assert not any(getattr(d, "reasoning_content", None) for d in deltas)
    assert "".join(d.content or "" for d in deltas) == message.content
    # Without it the same prompt opens the block: the answer is reasoning (the regex never closes it).
    thinking = sdk.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0,
                                           response_format=form).choices[0].message
    assert thinking.reasoning_content and not thinking.content


@pytest.mark.parametrize("value, says", [
    ([1], "must be an object"), ({"add_generation_prompt": False}, "set by the server"),
    ({"not a name": 1}, "not a variable name"), ({f"v{i}": i for i in range(33)}, "at most 32"),
    ({"big": "x" * 9000}, "at most 8192"), ("enable_thinking", "must be an object")])
def test_bad_chat_template_kwargs_are_a_400_naming_them(thinking_front, value, says):
    openai = pytest.importorskip("openai")
    port, _, model = thinking_front
    sdk = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)
    with pytest.raises(openai.BadRequestError) as e:
        sdk.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                    extra_body={"chat_template_kwargs": value})
    assert e.value.body["param"] == "chat_template_kwargs" and says in e.value.body["message"], e.value.body


def test_the_stage_checks_chat_template_kwargs_from_any_client(thinking_front):
    """The tokenizer stage reads them from the wire as strictly as the front does: a client that
    sends the JSON text itself gets the same refusal, and the stage keeps serving."""
    from nanovllm_client import RequestError

    _, client, _ = thinking_front
    chat = [{"role": "user", "content": "x"}]
    for text, says in (('{"tokenize": true}', "set by the server"), ('{"x": NaN}', "not valid JSON"),
                       ("[]", "must be an object")):
        with pytest.raises(RequestError, match=says):
            client.generate(chat, max_tokens=2, chat_template_kwargs=text)
    with pytest.raises(RequestError, match="only with messages"):
        client.generate("a prompt", max_tokens=2, chat_template_kwargs='{"enable_thinking": false}')
    assert client.generate(chat, max_tokens=2, chat_template_kwargs='{"enable_thinking": false}').text is not None
