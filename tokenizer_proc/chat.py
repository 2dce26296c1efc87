"""A chat rendered to prompt text through the model's chat template, tools included.

A template that knows tools (Qwen2.5/3, Llama 3.x, Hermes: it reads `tools`) gets them, and
the earlier tool calls and results, as it expects them. A template that does not (SmolLM2, the
default model; plain ChatML) would drop them without a word, so for it the tools are written into
the system message in the Hermes / Qwen form, earlier calls as `<tool_call>` JSON in the
assistant's turn and results as `<tool_response>` in a user turn: the form the HTTP front parses
calls back from. A chat without tools renders exactly as before. A request's
`chat_template_kwargs` (checked by `nanovllm_client.template_kwargs`) reach the template as
variables, e.g. {"enable_thinking": false} for Qwen3.

A template may open the reasoning itself (Qwen3 thinking variants, DeepSeek-R1: the generation
prompt ends in `<think>`): the output then starts inside the block with no `<think>` of its own,
and `opens_reasoning` tells the request's meta so, for the HTTP front's parser.
"""
# [ZH-START]
# 【模块定位】把对话（可带 tools）经模型自己的 chat 模板渲染成 prompt 文本，供 RequestBuilder 分词。
# 模板认识 tools（Qwen2.5/3、Llama 3.x、Hermes）：原样交给模板；模板不认识（SmolLM2、纯 ChatML）
# 会悄悄丢掉，所以改为把工具说明写进 system 消息（Hermes/Qwen 格式），历史调用写成 assistant 里的
# <tool_call> JSON，工具结果写成 user 里的 <tool_response>——正是 HTTP 前端解析工具调用的格式。
# 没有 tools 的对话渲染结果不变。请求的 chat_template_kwargs（由 nanovllm_client.template_kwargs
# 检查）作为变量传给模板，例如 Qwen3 的 {"enable_thinking": false}。
# 模板自己在生成提示末尾打开 <think>（Qwen3 思考版、DeepSeek-R1）时，输出从思考块内部开始、
# 不带自己的 <think>：opens_reasoning 判断这一点，写进请求的 meta，供 HTTP 前端的解析器使用。
# [ZH-END]
from __future__ import annotations

import json
from typing import Any

from nanovllm_client.template_kwargs import parse_template_kwargs

THINK_OPEN = "<think>"
_TOOLS_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>')


def template_knows_tools(tokenizer: Any) -> bool:
    template = getattr(tokenizer, "chat_template", None)
    text = template if isinstance(template, str) else json.dumps(template or "")
    return "tools" in text


def parse_tools(text: str | None) -> list[dict] | None:
    """The wire's JSON text -> the tool list; ValueError naming the problem."""
    if text is None:
        return None
    try:
        tools = json.loads(text)
    except ValueError as e:
        raise ValueError(f"tools is not valid JSON text: {str(e)[:200]}") from None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise ValueError("tools must be a list of tool objects")
    return tools or None


def _arguments(value: Any) -> Any:
    """A call's arguments as the templates read them: a map where the text is a JSON object."""
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except ValueError:
            return value
        return parsed if isinstance(parsed, dict) else value
    return value


def _with_arguments(messages: list[dict]) -> list[dict]:
    out = []
    for m in messages:
        if m.get("tool_calls"):
            m = dict(m, tool_calls=[dict(c, function=dict(c.get("function") or {}, arguments=_arguments(
                (c.get("function") or {}).get("arguments")))) for c in m["tool_calls"] if isinstance(c, dict)])
        out.append(m)
    return out


def hermes_messages(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """The chat for a template that does not know tools: tools in the system message, calls and
    results as text."""
    out: list[dict] = []
    for m in messages:
        role, content = m["role"], m["content"]
        if role == "assistant" and m.get("tool_calls"):
            calls = [json.dumps({"name": (c.get("function") or {}).get("name"),
                                 "arguments": _arguments((c.get("function") or {}).get("arguments"))},
                                ensure_ascii=False)
                     for c in m["tool_calls"] if isinstance(c, dict)]
            content = "\n".join(([content] if content else []) + [f"<tool_call>\n{c}\n</tool_call>" for c in calls])
            out.append({"role": "assistant", "content": content})
        elif role == "tool":
            response = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("_tool_results"):  # consecutive results: one user turn, as Qwen's template does
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response, "_tool_results": True})
        else:
            out.append({"role": role, "content": content})
    out = [{"role": m["role"], "content": m["content"]} for m in out]
    if tools:
        described = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        prompt = _TOOLS_PROMPT.format(tools=described)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def render_chat(tokenizer: Any, messages: list[dict], tools_text: str | None,
                template_kwargs_text: str | None = None, *, add_generation_prompt: bool = True,
                continue_final_message: bool = False) -> str:
    """The prompt text for a chat; ValueError for bad tools or template variables
    (`chat_template_kwargs`, passed to the template as they are), the template's own errors as
    they come. A request always ends with the generation prompt; a tokenize command may ask for
    none, or for the last message left open (`continue_final_message`)."""
    tools = parse_tools(tools_text)
    variables = parse_template_kwargs(template_kwargs_text) if template_kwargs_text is not None else {}
    variables.update(add_generation_prompt=add_generation_prompt, tokenize=False)
    if continue_final_message:
        variables["continue_final_message"] = True
    uses_tools = tools is not None or any(m.get("tool_calls") or m.get("role") == "tool" for m in messages)
    if not uses_tools:
        return tokenizer.apply_chat_template(messages, **variables)
    if template_knows_tools(tokenizer):
        return tokenizer.apply_chat_template(_with_arguments(messages), tools=tools, **variables)
    return tokenizer.apply_chat_template(hermes_messages(messages, tools), **variables)


def opens_reasoning(prompt: str) -> bool:
    """The rendered prompt ends inside a reasoning block: `<think>` and nothing but blank space
    after it. Only its end counts: a `<think>` a user wrote earlier in the chat opens nothing."""
    return prompt.rstrip().endswith(THINK_OPEN)
