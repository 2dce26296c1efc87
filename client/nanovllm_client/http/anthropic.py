"""Anthropic's Messages API (`POST /v1/messages`) over the same chat path as /v1/chat/completions.

A Messages body is translated into a chat body (`system` first, `tool_use` blocks into an
assistant's `tool_calls`, `tool_result` blocks into `tool` messages, `thinking` blocks into the
assistant's `reasoning_content`, tools with their `input_schema`, `tool_choice` any/tool/none into
required/named/none, `stop_sequences` into `stop`) and checked by `schema.parse_chat`, so the limits,
the field rule and the sampling struct are the same as for chat. The answer goes through the same
output parser and comes back as Anthropic content blocks (`thinking`, `text`, `tool_use`), whole or
as Anthropic's SSE events (`message_start`, `content_block_start` / `_delta` / `_stop`,
`message_delta`, `message_stop`). Errors have Anthropic's shape,
`{"type": "error", "error": {"type", "message"}}`.

A stop sequence that ends the answer gives `stop_reason` "stop_sequence" and `stop_sequence` the
matched string, as the service's last delta names it (`stop_reason`).

Not here: images and documents (refused), `thinking` enabled (the model reasons or not by its
template; refused rather than ignored).
"""
from __future__ import annotations

import json
import uuid
from typing import Any

from . import chat_output
from .errors import ApiError, bad
from .schema import Call, foreign_fields, parse_chat

# Known Messages fields that change nothing here, and ones refused unless they ask for nothing.
IGNORED = {"metadata", "service_tier", "container", "cache_control", "diagnostics", "inference_geo", "speed",
           "user_profile_id", "workspace_id", "anthropic_version"}
NEUTRAL: dict[str, tuple] = {"thinking": ({"type": "disabled"},), "mcp_servers": ([],), "output_config": ({},),
                             "n": (1,)}
_MAPPED = {"model", "max_tokens", "messages", "system", "stop_sequences", "temperature", "top_p", "top_k", "stream",
           "tools", "tool_choice"}
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                405: "invalid_request_error", 413: "request_too_large", 429: "rate_limit_error",
                503: "overloaded_error"}


def error_body(e: ApiError) -> dict:
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(e.status, "api_error"), "message": e.message}}


def _text(where: str, content: Any) -> str:
    """A `system` or `tool_result` content: a string or a list of text blocks."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(b, dict) and b.get("type") == "text"
                                         and isinstance(b.get("text"), str) for b in content):
        return "".join(b["text"] for b in content)
    raise bad(f"{where} must be a string or a list of text blocks", where.split("[")[0].split(".")[0])


def _message(i: int, m: Any) -> list[dict]:
    """One Messages message as chat messages: a user turn's tool results become `tool` messages."""
    if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
        raise bad(f"messages[{i}] must be an object with role user or assistant", "messages")
    role, content = m["role"], m.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise bad(f"messages[{i}].content must be a string or a list of content blocks", "messages")
    text, reasoning, calls, results = [], [], [], []
    for j, b in enumerate(content):
        kind = b.get("type") if isinstance(b, dict) else None
        where = f"messages[{i}].content[{j}]"
        if kind == "text" and isinstance(b.get("text"), str):
            text.append(b["text"])
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            if isinstance(b.get("thinking"), str):
                reasoning.append(b["thinking"])
        elif kind == "tool_use" and role == "assistant":
            if not (isinstance(b.get("id"), str) and isinstance(b.get("name"), str)
                    and isinstance(b.get("input"), dict)):
                raise bad(f"{where}: a tool_use block needs an id, a name and an input object", "messages")
            calls.append({"id": b["id"], "type": "function",
                          "function": {"name": b["name"], "arguments": json.dumps(b["input"], ensure_ascii=False)}})
        elif kind == "tool_result" and role == "user":
            if not isinstance(b.get("tool_use_id"), str):
                raise bad(f"{where}: a tool_result block needs a tool_use_id", "messages")
            body = _text(f"{where}.content", b.get("content", ""))
            results.append({"role": "tool", "tool_call_id": b["tool_use_id"],
                            "content": ("Error: " + body) if b.get("is_error") else body})
        else:
            raise bad(f"{where}: a {str(kind)[:32]!s} block is not supported here (text, tool_use, tool_result, "
                      "thinking)", "messages")
    out: list[dict] = list(results)
    if text or reasoning or calls or not results:
        msg: dict[str, Any] = {"role": role, "content": "".join(text)}
        if reasoning:
            msg["reasoning_content"] = "".join(reasoning)
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    return out


def parse_messages(body: Any) -> Call:
    """A Messages request as the chat call it asks for; ApiError (a 400 naming the field) otherwise."""
    if not isinstance(body, dict):
        raise bad("the body must be a JSON object")
    if not isinstance(body.get("max_tokens"), int) or isinstance(body.get("max_tokens"), bool):
        raise bad("'max_tokens' is required and must be an integer", "max_tokens")
    chat: dict[str, Any] = {k: body[k] for k in ("model", "max_tokens", "temperature", "top_p", "top_k", "stream")
                            if k in body}
    chat.update(foreign_fields(body, _MAPPED, IGNORED, NEUTRAL))
    if body.get("stop_sequences") is not None:
        chat["stop"] = body["stop_sequences"]
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty list", "messages")
    chat["messages"] = []
    if body.get("system") is not None:
        chat["messages"].append({"role": "system", "content": _text("system", body["system"])})
    for i, m in enumerate(messages):
        chat["messages"] += _message(i, m)
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise bad("'tools' must be a list of tools", "tools")
        chat["tools"] = []
        for t in tools:
            if t.get("type") not in (None, "custom") or not isinstance(t.get("name"), str):
                raise bad("each tool needs a name and an input_schema (server tools are not supported here)", "tools")
            fn = {"name": t["name"], "parameters": t.get("input_schema") or {"type": "object"}}
            if isinstance(t.get("description"), str):
                fn["description"] = t["description"]
            chat["tools"].append({"type": "function", "function": fn})
    choice = body.get("tool_choice")
    if choice is not None:
        kind = choice.get("type") if isinstance(choice, dict) else None
        if kind == "auto":
            chat["tool_choice"] = "auto"
        elif kind == "any":
            chat["tool_choice"] = "required"
        elif kind == "none":
            chat["tool_choice"] = "none"
        elif kind == "tool" and isinstance(choice.get("name"), str):
            chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
        else:
            raise bad("'tool_choice' must be {type: auto | any | none} or {type: tool, name}", "tool_choice")
        if choice.get("disable_parallel_tool_use") is True:
            chat["parallel_tool_calls"] = False
    return parse_chat(chat)


def stop_reason(reason: str | None, calls: list, stop_sequence: str | None = None) -> str | None:
    """Anthropic's stop_reason for the service's finish reason (and the stop string that ended the
    answer, if one did)."""
    if reason is None:
        return None
    if calls and reason == "stop":
        return "tool_use"
    if stop_sequence is not None and reason == "stop":
        return "stop_sequence"
    return "max_tokens" if reason == "length" else "end_turn"


def _matched(reason: str | None, calls: list, stop_sequence: str | None) -> str | None:
    """The `stop_sequence` field: the matched string where stop_reason is "stop_sequence"."""
    return stop_sequence if stop_reason(reason, calls, stop_sequence) == "stop_sequence" else None


def _input(arguments: str) -> dict:
    try:
        value = json.loads(arguments) if arguments else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def message_body(events: list, calls: list, reason: str | None, usage: dict, model: str, msg_id: str,
                 stop_sequence: str | None = None) -> dict:
    """The whole answer as a Messages response (`stop_sequence`: the stop string that ended it)."""
    content: list[dict] = []
    reasoning = "".join(e.text for e in events if e.kind == "reasoning")
    text = "".join(e.text for e in events if e.kind == "content")
    if reasoning:
        content.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    if text or not calls:
        content.append({"type": "text", "text": text})
    content += [{"type": "tool_use", "id": c.call_id, "name": c.name, "input": _input(c.arguments)} for c in calls]
    return {"id": msg_id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop_reason(reason, calls, stop_sequence),
            "stop_sequence": _matched(reason, calls, stop_sequence),
            "usage": {"input_tokens": usage.get("prompt_tokens", 0),
                      "output_tokens": usage.get("completion_tokens", 0)}}


def sse(event: str, data: dict) -> bytes:
    return f"event: {event}\ndata: ".encode() + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


class StreamBlocks:
    """Parser events as Anthropic's stream events: message_start, one content block per run of
    reasoning or text and one per tool call (each opened, fed and closed in order), message_delta
    with the stop reason and usage, message_stop; an `error` event for a failure after the start."""

    def __init__(self, msg_id: str, model: str) -> None:
        self.msg_id, self.model = msg_id, model
        self.index = -1
        self.open: tuple[str, int] | None = None  # (kind, call index) of the block being fed

    def start(self) -> list[bytes]:
        return [sse("message_start", {"type": "message_start", "message": {
            "id": self.msg_id, "type": "message", "role": "assistant", "model": self.model, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": 0, "output_tokens": 0}}})]

    def finish(self, usage: dict, reason: str | None, calls: list, stop_sequence: str | None = None) -> list[bytes]:
        return self.close() + [
            sse("message_delta", {"type": "message_delta",
                                  "delta": {"stop_reason": stop_reason(reason, calls, stop_sequence),
                                            "stop_sequence": _matched(reason, calls, stop_sequence)},
                                  "usage": {"input_tokens": usage["prompt_tokens"],
                                            "output_tokens": usage["completion_tokens"]}}),
            sse("message_stop", {"type": "message_stop"})]

    def error(self, e: ApiError) -> list[bytes]:
        return [sse("error", error_body(e))]

    def _start(self, key: tuple[str, int], block: dict) -> list[bytes]:
        out = self.close()
        self.index += 1
        self.open = key
        return out + [sse("content_block_start", {"type": "content_block_start", "index": self.index,
                                                   "content_block": block})]

    def close(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [sse("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def feed(self, e: chat_output.Event) -> list[bytes]:
        out: list[bytes] = []
        if e.kind == "call":
            return self._start(("call", e.index), {"type": "tool_use", "id": e.call_id, "name": e.name, "input": {}})
        if e.kind == "arguments":
            delta = {"type": "input_json_delta", "partial_json": e.text}
        elif e.kind == "reasoning":
            if self.open != ("reasoning", 0):
                out = self._start(("reasoning", 0), {"type": "thinking", "thinking": "", "signature": ""})
            delta = {"type": "thinking_delta", "thinking": e.text}
        else:
            if self.open != ("content", 0):
                out = self._start(("content", 0), {"type": "text", "text": ""})
            delta = {"type": "text_delta", "text": e.text}
        if not e.text:
            return out
        return out + [sse("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})]


def new_id() -> str:
    return "msg_" + uuid.uuid4().hex
