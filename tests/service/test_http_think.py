"""A chat template that opens `<think>` in the generation prompt (Qwen3's thinking models,
DeepSeek-R1): the output starts inside the reasoning with no `<think>` of its own. The tokenizer
stage, which renders the template, says so in the request's meta; the detokenizer passes it on in
the stream's deltas; the HTTP front then returns the text before `</think>` as reasoning_content
and the rest as content, streamed and not. Real processes (`nanovllm serve --http-port`), the
tiny random Qwen3 with that template, the openai package."""
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
