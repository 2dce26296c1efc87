"""Request bodies of /v1/completions and /v1/chat/completions mapped to the async client's call.

Fields follow one rule (docs/service.md, "Request fields"): a field is mapped (OpenAI's name or
vLLM's extension name); or it is a known OpenAI or vLLM field that changes nothing in the output
here, accepted and ignored (`IGNORED`); or a known field that would change the output and is not
implemented, refused with a 400 naming it unless it asks for nothing (`NEUTRAL`: null, or its
neutral value, which routers fill in); or unknown, accepted as vLLM does and logged once by name.
Messages take the same rule, so an assistant message goes back exactly as this server returned it
(`reasoning_content` reaches the chat template, which reads it where it knows it). Sampling fields
are mapped onto the one sampling struct (`SamplingParams`), whose own validator checks them, as at
every other door: a value out of range gets the same words here as from the ZeroMQ client or
`LLM`, in a 400 naming the body's field. The rest of the body (the prompt or messages, tools,
stream options) is checked here.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace
from typing import Any

import logging

from ..checks import ProtocolError, check_int
from ..protocol import MAX_PRIORITY, MAX_TOOLS_CHARS
from ..response_format import MAX_FORMAT_CHARS
from ..sampling import MAX_LOGPROBS, SamplingError, SamplingParams
from ..template_kwargs import template_kwargs_text
from .chat_output import ChatOutputParser
from .errors import bad

MAX_MESSAGES = 4096
MAX_N = 16
"""Choices per prompt (`n`): each is a request of its own, sharing the prompt's KV blocks through
the prefix cache."""
MAX_CHOICES = 64
"""Choices of one request in all (prompts x n): each holds a stream."""
# A message's fields beyond role and content, by role: read, and passed to the chat template.
_MESSAGE_FIELDS = {"assistant": {"tool_calls", "reasoning_content", "reasoning"}, "tool": {"tool_call_id"}}
# What the SDKs send back in an assistant message as this server returned it, without effect here.
_MESSAGE_IGNORED = {"parsed", "refusal", "annotations"}
# A message field that would change the prompt and is not implemented: only null (or these) accepted.
_MESSAGE_NEUTRAL: dict[str, tuple] = {"audio": (), "function_call": (), "tool_calls": ([],)}
MAX_TOOLS = 128
MAX_TOOL_CALLS = 64
_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")

# OpenAI's names and vLLM's extension names for the sampling struct's fields (the same names,
# but chat's max_completion_tokens): mapped onto it, checked by it.
_SAMPLING = {name: name for name in (
    "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
    "seed", "max_tokens", "min_tokens", "stop", "stop_token_ids", "ignore_eos", "logit_bias",
    "skip_special_tokens", "include_stop_str_in_output", "response_format")}
_CHAT_SAMPLING = {**_SAMPLING, "max_completion_tokens": "max_tokens"}
# Known OpenAI / vLLM fields that change nothing in the output here: accepted and ignored.
IGNORED = {"user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier", "prediction",
           "request_id", "priority_tier"}
# Known fields that would change the output and are not implemented: accepted only at a value that
# asks for nothing (null, or these; routers such as SGLang's smg fill in "logprobs": false), else
# refused with a 400 naming the field. Values compare by type too (True is not 1).
NEUTRAL: dict[str, tuple] = {
    "best_of": (1,), "suffix": ("",),
    "functions": (), "function_call": (), "audio": (), "modalities": (["text"],), "reasoning_effort": (),
    "verbosity": (), "web_search_options": (), "use_beam_search": (False,), "length_penalty": (1.0, 1),
    "guided_json": (), "guided_regex": (), "guided_choice": (), "guided_grammar": (),
    "guided_decoding_backend": (), "structured_outputs": (), "truncate_prompt_tokens": (), "documents": (),
    "chat_template": (), "continue_final_message": (False,), "add_generation_prompt": (True,),
    "return_tokens_as_token_ids": (False,), "bad_words": ([],), "allowed_token_ids": (), "mm_processor_kwargs": (),
    "return_token_ids": (False,), "kv_transfer_params": (), "vllm_xargs": ()}
_COMMON = set(_SAMPLING) | {"model", "stream", "stream_options", "priority", "n", "prompt_logprobs"}
COMPLETION_FIELDS = _COMMON | {"prompt", "logprobs", "echo"}
CHAT_FIELDS = _COMMON | set(_CHAT_SAMPLING) | {"messages", "tools", "tool_choice", "parallel_tool_calls",
                                                "chat_template_kwargs", "logprobs", "top_logprobs"}
log = logging.getLogger("nanovllm_client.http")
_LOGGED: set[str] = set()
"""Field names already logged as ignored (each once per process)."""


def _neutral(value: Any, neutral: tuple) -> bool:
    return value is None or any(type(value) is type(v) and value == v for v in neutral)


def check_neutral(name: str, value: Any, neutral: tuple, why: str = "") -> None:
    """A known field that would change the output and is not implemented: a 400 naming it unless
    `value` asks for nothing (null, or one of `neutral`)."""
    if not _neutral(value, neutral):
        values = " or ".join(["null"] + [json.dumps(v) for v in neutral])
        raise bad(f"'{name}' is not supported by this server (only {values}{why})", name[:64])


def foreign_fields(body: dict, mapped: set[str], ignored: set[str], neutral: dict[str, tuple],
                   why: dict[str, str] | None = None) -> dict:
    """Another API's body (Anthropic's Messages, Responses) under the same rule: beyond the fields
    it maps, its known fields without effect dropped, its known unimplemented ones checked
    (`check_neutral`, with `why[name]` added to the refusal), and the rest returned, to go on to
    the chat body, whose rule maps a vLLM name and logs an unknown one."""
    rest = {}
    for name, value in body.items():
        if name in mapped or name in ignored:
            continue
        if name in neutral:
            check_neutral(name, value, neutral[name], (why or {}).get(name, ""))
        else:
            rest[name] = value
    return rest


def _ignored(where: str, name: str, known: bool) -> None:
    """Log, once per name, a field accepted without effect."""
    key = f"{where}.{name}"
    if key not in _LOGGED and len(_LOGGED) < 1024:  # a client inventing names cannot grow this without end
        _LOGGED.add(key)
        log.info("%s field %r accepted and ignored: %s", where, name[:64],
                 "it changes nothing here" if known else "this server does not know it")


@dataclass
class Call:
    """What one HTTP request asks of the service."""
    model: str
    stream: bool
    include_usage: bool
    prompt: str | list[int] | list[dict[str, Any]]
    """Text, token ids (completions) or the chat's messages as the template reads them."""
    sampling: SamplingParams
    kwargs: dict[str, Any] = field(default_factory=dict)
    """The client call's other arguments: priority, tools, chat_template_kwargs."""
    tools: bool = False
    """The request offers tools: the output is parsed for tool calls."""
    max_tool_calls: int | None = None
    """`parallel_tool_calls: false`: 1, the first call is returned and the rest of the output
    dropped; None: every call the model writes."""
    forced: bool = False
    """`tool_choice` forces a call: `response_format` is the call's grammar (its compile errors
    name the tools, not response_format)."""
    prompts: list = field(default_factory=list)
    """Completions given a list of prompts: all of them (`prompt` is the first); else empty."""
    n: int = 1
    """Choices per prompt."""
    logprobs: bool = False
    """The answer carries its tokens' logprobs (`sampling.logprobs` alternatives each)."""
    echo: bool = False
    """Completions: the prompt (text, and with logprobs its tokens' logprobs) comes first."""
    echo_only: bool = False
    """Completions' echo with max_tokens 0: the prompt alone; the one token the engine makes
    (it makes at least one) is dropped, and counted as none."""
    prompt_logprobs: bool = False
    """vLLM's `prompt_logprobs` was asked for: the answer carries them in vLLM's shape."""

    def choices(self) -> list[tuple[int, Any, SamplingParams]]:
        """(index, prompt, sampling) of each choice, OpenAI's order: prompt i's j-th choice is index
        i * n + j. With `n` > 1 and a seed, choice j draws with seed + j (seed - j past the top of
        the seed range): different choices, each reproducible; without a seed they differ anyway."""
        out = []
        for i, prompt in enumerate(self.prompts or [self.prompt]):
            for j in range(self.n):
                sampling = self.sampling
                if j and sampling.seed is not None:
                    seed = sampling.seed + j if sampling.seed + j < 2 ** 64 else sampling.seed - j
                    sampling = replace(sampling, seed=seed)
                out.append((i * self.n + j, prompt, sampling))
        return out

    def output_parser(self, reasoning_open: bool = False) -> ChatOutputParser:
        """The parser a chat answer goes through, streamed or whole: one configuration for both.
        `reasoning_open`: the stream's deltas say the prompt ended inside a reasoning block."""
        return ChatOutputParser(tools=self.tools, max_calls=self.max_tool_calls, reasoning_open=reasoning_open)


def _integer(name: str, value: Any, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(f"'{name}' must be an integer", name)
    if not lo <= value <= hi:
        raise bad(f"'{name}' must be between {lo} and {hi}, got {value}", name)
    return value


def _bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise bad(f"'{name}' must be a boolean", name)
    return value


def _common(body: dict, allowed: set[str]) -> tuple[str, bool, bool, dict]:
    """The body's model, stream and include_usage, and the call's keywords other than sampling."""
    for name in sorted(str(k) for k in body if k not in allowed):
        if name in NEUTRAL:
            check_neutral(name, body[name], NEUTRAL[name])
        else:
            _ignored("request", name, name in IGNORED)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("'model' is required and must be a string", "model")
    stream = _bool("stream", body.get("stream", False))
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise bad("'stream_options' supports only include_usage", "stream_options")
        include_usage = _bool("stream_options.include_usage", options.get("include_usage", False))
    user = body.get("user")
    if user is not None and (not isinstance(user, str) or len(user) > 256):
        raise bad("'user' must be a string of at most 256 characters", "user")
    kw: dict[str, Any] = {}
    if body.get("priority") is not None:
        try:
            check_int("priority", body["priority"], -MAX_PRIORITY, MAX_PRIORITY)
        except ProtocolError as e:
            raise bad(str(e), "priority") from None
        kw["priority"] = body["priority"]
    return model, stream, include_usage, kw


def _sampling(body: dict, names: dict[str, str], **override: Any) -> SamplingParams:
    """The body's sampling fields (`names`: body name -> struct field; null means the default) as
    the one struct, checked by its validator; a 400 naming the body's field it refused."""
    given = {field_name: (body_name, body[body_name]) for body_name, field_name in names.items()
             if body.get(body_name) is not None}
    values = {field_name: value for field_name, (_, value) in given.items()}
    values.update(override)
    try:
        return SamplingParams(**values)
    except SamplingError as e:
        raise bad(str(e), given.get(e.field, (e.field,))[0]) from None


def _logprob_fields(body: dict, stream: bool, chat: bool) -> tuple[dict, bool]:
    """The sampling fields the body's logprob fields ask for, and whether it asks for logprobs:
    chat's `logprobs` (a boolean) with `top_logprobs` alternatives, completions' `logprobs` (the
    number of alternatives); vLLM's `prompt_logprobs` (not with stream, as vLLM)."""
    fields: dict[str, int] = {}
    if chat:
        wanted = body.get("logprobs") is not None and _bool("logprobs", body["logprobs"])
        top = 0 if body.get("top_logprobs") is None else _integer("top_logprobs", body["top_logprobs"], 0, MAX_LOGPROBS)
        if top and not wanted:
            raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        if wanted:
            fields["logprobs"] = top
    elif body.get("logprobs") is not None:
        fields["logprobs"] = _integer("logprobs", body["logprobs"], 0, MAX_LOGPROBS)
    if body.get("prompt_logprobs") is not None:
        if stream:
            raise bad("'prompt_logprobs' is not available with 'stream'", "prompt_logprobs")
        fields["prompt_logprobs"] = _integer("prompt_logprobs", body["prompt_logprobs"], 0, MAX_LOGPROBS)
    return fields, "logprobs" in fields


def parse_completion(body: Any) -> Call:
    if not isinstance(body, dict):
        raise bad("the body must be a JSON object")
    model, stream, usage, kw = _common(body, COMPLETION_FIELDS)
    prompt = body.get("prompt")
    prompts = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else [prompt]
    for p in prompts:
        if isinstance(p, list):
            if not p or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 1 << 31 for t in p):
                raise bad("'prompt' must be a string, a list of token ids, or a list of either", "prompt")
        elif not isinstance(p, str) or not p:
            raise bad("'prompt' is required and must be a non-empty string, a list of token ids, or a list of "
                      "either", "prompt")
    extra, logprobs = _logprob_fields(body, stream, chat=False)
    echo = body.get("echo") is not None and _bool("echo", body["echo"])
    echo_only = echo and body.get("max_tokens") == 0 and not isinstance(body["max_tokens"], bool)
    if echo_only:
        extra["max_tokens"] = 1
    if echo and "prompt_logprobs" not in extra and (logprobs or any(isinstance(q, list) for q in prompts)):
        extra["prompt_logprobs"] = extra.get("logprobs", 0)  # the prompt's tokens (and their text)
    call = Call(model=model, stream=stream, include_usage=usage, prompt=prompts[0],
                sampling=_sampling(body, _SAMPLING, **extra), kwargs=kw, prompts=prompts if len(prompts) > 1 else [],
                n=_n(body), logprobs=logprobs, echo=echo, echo_only=echo_only,
                prompt_logprobs=body.get("prompt_logprobs") is not None)
    if len(prompts) * call.n > MAX_CHOICES:
        raise bad(f"{len(prompts)} prompts x n={call.n} is more than {MAX_CHOICES} choices in one request", "prompt")
    return call


def _n(body: dict) -> int:
    n = body.get("n")
    return 1 if n is None else _integer("n", n, 1, MAX_N)


def _forced(choice: Any, tools: list[dict] | None) -> list[dict] | None:
    """The tools one of which tool_choice forces a call of: all for "required", one by name;
    None for "auto" (the default) and "none"."""
    if choice is None or choice in ("auto", "none"):
        return None
    if not tools:
        raise bad("'tool_choice' other than \"none\" needs 'tools'", "tool_choice")
    if choice == "required":
        return tools
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) and choice.get("type") == "function" \
        and isinstance(choice.get("function"), dict) else None
    named = [t for t in tools if t["function"]["name"] == name]
    if not named:
        raise bad("'tool_choice' must be \"auto\", \"none\", \"required\" or {\"type\": \"function\", "
                  "\"function\": {\"name\": ...}} naming one of the tools", "tool_choice")
    return named[:1]


def _call_grammar(tools: list[dict]) -> str:
    """A response_format forcing exactly one call of one of `tools`, in the form the chat
    templates ask for, its arguments following the tool's parameter schema (structured output
    enforces it).

    Each tool's parameter schema sits under `$defs` of the grammar's schema (`tool_<i>`) and the
    call's arguments refer to it: a schema's own references (`#/$defs/...`, `#/definitions/...`,
    `#` itself) point into its document, so each is moved under that place (`_relocated`)."""
    defs = {}
    options = []
    for i, t in enumerate(tools):
        where = f"/$defs/tool_{i}"
        params = t["function"].get("parameters") or {"type": "object"}
        params = {k: v for k, v in params.items() if k not in ("$id", "$schema")}  # its document is this one now
        defs[f"tool_{i}"] = _relocated(params, where, i)
        options.append({"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                         "arguments": {"$ref": "#" + where}},
                        "required": ["name", "arguments"], "additionalProperties": False})
    schema = {"anyOf": options, "$defs": defs,
              "x-guidance": {"whitespace_flexible": False}}  # compact JSON: no run of blank space to the token limit
    grammar = ('start: "<tool_call>\\n" call "\\n</tool_call>"\ncall: %json '
               + json.dumps(schema, separators=(",", ":")))
    return json.dumps({"type": "grammar", "grammar": grammar}, separators=(",", ":"))


_LITERALS = {"const", "enum", "default", "examples"}
"""Schema keywords whose values are data, not schemas: a "$ref" in them is left as it is."""
_NAMED = {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}
"""Schema keywords whose values map names (any, "enum" too) to schemas."""


def _relocated(schema: Any, where: str, tool: int) -> Any:
    """`schema` with each local reference `#<pointer>` made `#<where><pointer>`; any other
    reference (a URL, a relative `$id` name) is refused: the grammar has nothing to fetch it from."""
    if isinstance(schema, list):
        return [_relocated(v, where, tool) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str):
            if not value.startswith("#"):
                raise bad(f"tools[{tool}].function.parameters: \"$ref\": {value[:100]!r} cannot be used in a "
                          "forced call (tool_choice): only references within the schema (\"#/$defs/...\") can",
                          "tools")
            out[key] = "#" + where + value[1:]
        elif key in _LITERALS:
            out[key] = value
        elif key in _NAMED and isinstance(value, dict):
            out[key] = {name: _relocated(v, where, tool) for name, v in value.items()}
        else:
            out[key] = _relocated(value, where, tool)
    return out


def _tools(body: dict) -> tuple[list[dict] | None, list[dict] | None]:
    """The tools offered, checked (None: none, or tool_choice "none"), and those tool_choice
    forces a call of. They reach the model only through its chat template, so every one must be
    a function with a usable name."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None:
        return None, _forced(choice, None)
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise bad(f"'tools' must be a list of at most {MAX_TOOLS} tools", "tools")
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or set(tool) - {"type", "function"} or \
                not isinstance(fn, dict):
            raise bad(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}", "tools")
        if not isinstance(fn.get("name"), str) or not _FUNCTION_NAME.fullmatch(fn["name"]):
            raise bad(f"tools[{i}].function.name must be 1 to 64 letters, digits, '_' or '-'", "tools")
        extra = set(fn) - {"name", "description", "parameters", "strict"}
        if extra or not isinstance(fn.get("description", ""), str) or \
                not isinstance(fn.get("parameters", {}), dict):
            raise bad(f"tools[{i}].function may have name, description (a string), parameters (a JSON "
                      f"schema object) and strict", "tools")
    text = json.dumps(tools, separators=(",", ":"))
    if len(text) > MAX_TOOLS_CHARS:
        raise bad(f"'tools' is {len(text)} characters of JSON, at most {MAX_TOOLS_CHARS}", "tools")
    return (None if choice == "none" or not tools else tools), _forced(choice, tools)


def _tool_calls(i: int, calls: Any) -> list[dict]:
    """An assistant message's earlier tool calls, as its chat template reads them."""
    if not isinstance(calls, list) or not 0 < len(calls) <= MAX_TOOL_CALLS:
        raise bad(f"messages[{i}].tool_calls must be a list of 1 to {MAX_TOOL_CALLS} calls", "messages")
    out = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or \
                not isinstance(fn.get("arguments"), str) or not isinstance(call.get("id", ""), str):
            raise bad(f"messages[{i}].tool_calls: each needs an id and a function with name and arguments "
                      "(a string)", "messages")
        out.append({"id": call.get("id", ""), "type": "function",
                    "function": {"name": fn["name"][:64], "arguments": fn["arguments"]}})
    return out


def parse_chat(body: Any) -> Call:
    if not isinstance(body, dict):
        raise bad("the body must be a JSON object")
    model, stream, usage, kw = _common(body, CHAT_FIELDS)
    tools, forced = _tools(body)
    parallel = body.get("parallel_tool_calls")
    parallel = True if parallel is None else _bool("parallel_tool_calls", parallel)
    if tools is not None:
        kw["tools"] = tools
    grammar = {}
    if forced:
        if body.get("response_format") is not None:
            raise bad("'tool_choice' that forces a call cannot be combined with 'response_format'", "tool_choice")
        try:
            grammar["response_format"] = _call_grammar(forced)
        except RecursionError:
            raise bad("the forced tools' parameter schemas nest too deep", "tools") from None
        if len(grammar["response_format"]) > MAX_FORMAT_CHARS:
            raise bad("the forced tools' parameter schemas are too large", "tool_choice")
    extra, logprobs = _logprob_fields(body, stream, chat=True)
    sampling = _sampling(body, _CHAT_SAMPLING, **grammar, **extra)
    if body.get("chat_template_kwargs") is not None:  # vLLM's: variables for the chat template
        try:
            kw["chat_template_kwargs"] = template_kwargs_text(body["chat_template_kwargs"])
        except ProtocolError as e:
            raise bad(str(e), "chat_template_kwargs") from None
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or len(messages) > MAX_MESSAGES:
        raise bad(f"'messages' must be a non-empty list of at most {MAX_MESSAGES} messages", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}] must be an object with role and content", "messages")
        role, content = m.get("role"), m.get("content")
        if role not in ("system", "user", "assistant", "developer", "tool"):
            raise bad(f"messages[{i}].role must be system, user, assistant, developer or tool", "messages")
        message: dict[str, Any] = {"role": "system" if role == "developer" else role}
        for name in sorted(str(k) for k in m if k not in ("role", "content")):
            if name in _MESSAGE_FIELDS.get(role, ()) or name == "name":
                continue  # read below
            if name in _MESSAGE_NEUTRAL:
                if not _neutral(m[name], _MESSAGE_NEUTRAL[name]):
                    raise bad(f"messages[{i}].{name[:64]} is not supported by this server", "messages")
            else:
                _ignored("message", name, name in _MESSAGE_IGNORED)
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(c, dict) and c.get("type") == "text" and isinstance(c.get("text"), str)
                       for c in content):
                raise bad(f"messages[{i}].content: only text parts are supported", "messages")
            content = "".join(c["text"] for c in content)
        calls = m.get("tool_calls") if role == "assistant" else None
        if content is None and calls is not None:
            content = ""  # an assistant turn that only called tools
        if not isinstance(content, str):
            raise bad(f"messages[{i}].content must be a string", "messages")
        message["content"] = content
        for name in ("name", "reasoning_content", "reasoning"):  # the template reads these where it knows them
            value = m.get(name)
            if value is None or (name != "name" and role != "assistant"):
                continue
            if not isinstance(value, str) or (name == "name" and len(value) > 256):
                raise bad(f"messages[{i}].{name} must be a string" + (" of at most 256 characters"
                                                                       if name == "name" else ""), "messages")
            message["reasoning_content" if name == "reasoning" else name] = value
        if calls:  # none, null or [] (as an SDK may send it back): no call
            message["tool_calls"] = _tool_calls(i, calls)
        if role == "tool" and m.get("tool_call_id") is not None:
            if not isinstance(m["tool_call_id"], str) or len(m["tool_call_id"]) > 256:
                raise bad(f"messages[{i}].tool_call_id must be a string of at most 256 characters", "messages")
            message["tool_call_id"] = m["tool_call_id"]
        out.append(message)
    # parallel_tool_calls false: one call at most. A forced call is one already (its grammar).
    return Call(model=model, stream=stream, include_usage=usage, prompt=out, sampling=sampling, kwargs=kw,
                tools=tools is not None, max_tool_calls=None if parallel or tools is None else 1, forced=bool(forced),
                n=_n(body), logprobs=logprobs, prompt_logprobs=body.get("prompt_logprobs") is not None)
