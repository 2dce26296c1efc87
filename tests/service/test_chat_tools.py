"""Tools in a chat, rendered by the tokenizer stage (`tokenizer_proc.chat` through
`RequestBuilder`, without sockets): through a template that knows tools, and through one that
does not (ChatML, as the default model's), where they are written in the form the HTTP front
parses calls back from."""
from __future__ import annotations

import copy
import json

import pytest

from nanovllm.models.tokenizer import load_tokenizer
from nanovllm.sampling_params import SamplingParams
from nanovllm_client import protocol as p
from nanovllm_client.client_state import build_request
from tokenizer_proc.chat import template_knows_tools
from tokenizer_proc.requests import RequestBuilder, RequestRejected

CLIENT = b"\x07" * 5
CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
WEATHER = {"type": "function",
           "function": {"name": "get_weather", "description": "today's weather in a city", "parameters": CITY}}
TURNS = [{"role": "user", "content": "Weather in Paris?"},
         {"role": "assistant", "content": "", "tool_calls": [
             {"id": "call_1", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
         {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
# The tools part of a template that knows them (as Qwen's and Hermes' do), kept small.
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools><|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }} {{ c.function.arguments.city }}</tool_call>"
    "{% endfor %}<|im_end|>\n{% endfor %}<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    return load_tokenizer(tokenizer_dir)


def prompt_text(tokenizer, messages, tools=None) -> str:
    req = build_request(messages, tools=tools, request_id="r")
    req = p.decode(req.encode())  # as the stage receives it: tools travel as JSON text
    out = p.decode(RequestBuilder(tokenizer).build(CLIENT, req))
    return tokenizer.decode(p.unpack_token_ids(out.prompt_token_ids))


def test_a_template_without_tools_gets_them_in_the_system_message_and_calls_as_text(tokenizer):
    assert not template_knows_tools(tokenizer)
    text = prompt_text(tokenizer, TURNS, [WEATHER])
    assert text.startswith("<|im_start|>system\n# Tools") and json.dumps(WEATHER) in text
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n' \
           '</tool_call><|im_end|>' in text
    assert "<|im_start|>user\n<tool_response>\nsunny, 21 C\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    # a chat without tools renders as it always did
    plain = [{"role": "user", "content": "hi"}]
    assert prompt_text(tokenizer, plain) == tokenizer.apply_chat_template(plain, add_generation_prompt=True,
                                                                          tokenize=False)


def test_a_template_that_knows_tools_renders_them_itself(tokenizer):
    own = copy.copy(tokenizer)
    own.chat_template = TOOLS_TEMPLATE
    assert template_knows_tools(own)
    text = prompt_text(own, TURNS, [WEATHER])
    assert text.startswith("<|im_start|>system\n<tools>" + json.dumps(WEATHER))
    assert "<tool_call>get_weather Paris</tool_call>" in text  # arguments reach it as a map
    assert "<|im_start|>tool\nsunny, 21 C<|im_end|>" in text


def test_tools_are_checked_on_the_wire_and_in_the_stage(tokenizer):
    with pytest.raises(p.ProtocolError, match="only with messages"):
        p.decode(p.GenerateReq("r", prompt="hi", tools="[]").encode())
    with pytest.raises(p.ProtocolError, match="tools"):
        p.decode(p.GenerateReq("r", messages=[{"role": "user", "content": "x"}], tools="x" * 70_000).encode())
    build = RequestBuilder(tokenizer).build
    for bad, why in [("{not json", "not valid JSON"), ('{"a": 1}', "list of tool objects")]:
        with pytest.raises(RequestRejected, match=why):
            build(CLIENT, p.GenerateReq("r", messages=[{"role": "user", "content": "x"}], tools=bad))


def test_the_default_models_template_and_the_fronts_parser_speak_one_form():
    """SmolLM2's template knows no tools: they go into the system message, and an earlier call is
    written in the very form the HTTP front's parser reads back as a call."""
    from nanovllm.models.loader import resolve_model_path
    from nanovllm_client.http.chat_output import ChatOutputParser
    from tokenizer_proc.chat import hermes_messages, render_chat

    smollm = load_tokenizer(resolve_model_path("default"))
    assert not template_knows_tools(smollm)
    text = render_chat(smollm, TURNS, json.dumps([WEATHER]))
    assert text.startswith("<|im_start|>system\n# Tools") and "named SmolLM" not in text
    assert json.dumps(WEATHER) in text and text.endswith("<|im_start|>assistant\n")
    written = hermes_messages(TURNS, [WEATHER])[2]["content"]  # the assistant's earlier turn
    parser = ChatOutputParser(tools=True)
    events = parser.feed(written) + parser.finish()
    assert not [e for e in events if e.kind == "content"]
    assert [(c.name, json.loads(c.arguments)) for c in parser.calls] == [("get_weather", {"city": "Paris"})]


THINKING_OFF = "{% if enable_thinking is defined and enable_thinking is false %}"
"""Qwen3's switch: `chat_template_kwargs` {"enable_thinking": false} closes the block at once."""
THINKING_TEMPLATE = (  # ChatML whose generation prompt opens the reasoning (as Qwen3's thinking models do)
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n" + THINKING_OFF + "<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}")


def meta_of(tokenizer, messages) -> p.RequestMeta:
    req = p.decode(build_request(messages, request_id="r").encode())
    return p.decode(RequestBuilder(tokenizer).build(CLIENT, req)).meta


def test_a_template_that_opens_think_in_the_prompt_is_told_in_the_meta(tokenizer):
    """The stage that renders the template says when the prompt ends inside a reasoning block;
    a closed block, a template that opens none, a user's own `<think>` and a plain prompt do not."""
    thinking = copy.copy(tokenizer)
    thinking.chat_template = THINKING_TEMPLATE
    chat = [{"role": "user", "content": "Why?"}]
    assert meta_of(thinking, chat).reasoning_open is True
    closed = copy.copy(tokenizer)
    closed.chat_template = THINKING_TEMPLATE.replace(THINKING_OFF, "{% if true %}")
    assert meta_of(closed, chat).reasoning_open is False
    assert meta_of(tokenizer, [{"role": "user", "content": "<think>"}]).reasoning_open is False
    req = p.decode(build_request("a prompt that ends in <think>\n", request_id="r").encode())
    out = p.decode(RequestBuilder(thinking).build(CLIENT, req))
    assert out.meta.reasoning_open is False  # only a chat's template opens anything
    with pytest.raises(p.ProtocolError, match="reasoning_open"):
        meta = p.RequestMeta(client=b"c", client_request_id="r", sampling=SamplingParams(), reasoning_open=1)
        p.decode(p.TokenizedReq(request_id="c:r", prompt_token_ids=p.pack_token_ids([1]), sampling=SamplingParams(),
                                meta=meta).encode())


# What Qwen3's template does with an assistant turn's reasoning, and a named speaker, kept small.
NAMED_REASONING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}{% if m.name %} ({{ m.name }}){% endif %}\n"
    "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}{{ m.content }}<|im_end|>\n"
    "{% endfor %}<|im_start|>assistant\n")


def test_names_and_reasoning_sent_back_reach_a_template_that_reads_them(tokenizer):
    # The HTTP front passes `name` and an assistant's `reasoning_content` on (nanovllm_client/http/schema.py);
    # a template that reads them renders them, one that does not (the default's) is unchanged by them.
    from nanovllm_client.http.schema import parse_chat
    chat = parse_chat({"model": "m", "messages": [
        {"role": "user", "content": "Capital of France?", "name": "ann"},
        {"role": "assistant", "content": "Paris.", "reasoning": "It is Paris.", "parsed": None, "refusal": None},
        {"role": "user", "content": "Thanks."}]}).prompt
    own = copy.copy(tokenizer)
    own.chat_template = NAMED_REASONING_TEMPLATE
    text = prompt_text(own, chat)
    assert "<|im_start|>user (ann)" in text and "<think>It is Paris.</think>Paris.<|im_end|>" in text
    bare = [{"role": m["role"], "content": m["content"]} for m in chat]
    assert prompt_text(tokenizer, chat) == prompt_text(tokenizer, bare)
