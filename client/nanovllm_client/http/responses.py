"""OpenAI's Responses API (`POST /v1/responses`), stateless, over the same chat path.

The body is translated into a chat body and checked by `schema.parse_chat` (limits, the field rule,
the sampling struct: chat's): `instructions` first as the system message, then `input`, a string
or items (messages with text parts, `function_call` items into an assistant's `tool_calls`,
`function_call_output` items into `tool` messages, `reasoning` items into the next assistant
message's `reasoning_content`); function `tools` (flat, Responses' form) and `tool_choice`;
`text.format` (`json_schema`, `json_object`) into `response_format`; `max_output_tokens`. The
answer, through the same output parser, comes back as output items (`reasoning`, `message` with
`output_text`, `function_call`), whole or as the Responses stream events. Nothing is stored:
`previous_response_id` and `conversation` are refused, and `store` changes nothing.
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Any

from . import chat_output
from .errors import bad
from .schema import Call, foreign_fields, parse_chat

IGNORED = {"store", "metadata", "user", "include", "service_tier", "prompt_cache_key", "safety_identifier",
           "stream_options"}
NEUTRAL: dict[str, tuple] = {"previous_response_id": (), "conversation": (), "background": (False,),
                             "reasoning": ({},), "truncation": ("disabled",), "prompt": (), "top_logprobs": (0,),
                             "max_tool_calls": (), "n": (1,)}
_MAPPED = {"model", "input", "instructions", "tools", "tool_choice", "text", "max_output_tokens", "temperature",
           "top_p", "stream", "parallel_tool_calls"}


def _parts(where: str, content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") in ("input_text", "output_text", "text")
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise bad(f"{where} must be a string or a list of text parts (input_text / output_text)", "input")


def _messages(items: Any) -> list[dict]:
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise bad("'input' must be a string or a non-empty list of items", "input")
    out: list[dict] = []
    reasoning: list[str] = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise bad(f"input[{i}] must be an object", "input")
        kind = item.get("type", "message")
        if kind == "message" and item.get("role") in ("user", "system", "developer", "assistant"):
            msg = {"role": item["role"], "content": _parts(f"input[{i}].content", item.get("content", ""))}
            if item["role"] == "assistant" and reasoning:
                msg["reasoning_content"], reasoning = "".join(reasoning), []
            out.append(msg)
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise bad(f"input[{i}]: a function_call needs call_id, name and arguments", "input")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if out and out[-1]["role"] == "assistant":  # the same turn's text or earlier calls
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                msg = {"role": "assistant", "content": "", "tool_calls": [call]}
                if reasoning:
                    msg["reasoning_content"], reasoning = "".join(reasoning), []
                out.append(msg)
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise bad(f"input[{i}]: a function_call_output needs a call_id", "input")
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": output if isinstance(output, str) else _parts(f"input[{i}].output", output)})
        elif kind == "reasoning":
            texts = [p.get("text") for p in (item.get("content") or item.get("summary") or []) if isinstance(p, dict)]
            reasoning.append("".join(t for t in texts if isinstance(t, str)))
        else:
            raise bad(f"input[{i}]: a {str(kind)[:32]} item is not supported here (message, function_call, "
                      "function_call_output, reasoning)", "input")
    return out


def parse_response_request(body: Any) -> Call:
    """A Responses request as the chat call it asks for; ApiError (a 400 naming the field) otherwise."""
    if not isinstance(body, dict):
        raise bad("the body must be a JSON object")
    chat: dict[str, Any] = {k: body[k] for k in ("model", "temperature", "top_p", "stream", "parallel_tool_calls")
                            if k in body}
    stateless = "; this server keeps no state: send the whole conversation as input"
    chat.update(foreign_fields(body, _MAPPED, IGNORED, NEUTRAL,
                               {"previous_response_id": stateless, "conversation": stateless}))
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    chat["messages"] = ([{"role": "system", "content": body["instructions"]}]
                        if isinstance(body.get("instructions"), str) else []) + _messages(body.get("input"))
    if body.get("instructions") is not None and not isinstance(body["instructions"], str):
        raise bad("'instructions' must be a string", "instructions")
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list) or not all(isinstance(t, dict) and t.get("type") == "function"
                                                  and isinstance(t.get("name"), str) for t in tools):
            raise bad("'tools' must be a list of function tools (name, parameters); built-in tools are not "
                      "supported here", "tools")
        chat["tools"] = [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters",
                                                                             "strict") if t.get(k) is not None}}
                         for t in tools]
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise bad("'tool_choice' must be auto, none, required or {type: function, name}", "tool_choice")
        chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    elif choice is not None:
        chat["tool_choice"] = choice
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if body.get("text") is not None and not isinstance(body["text"], dict):
        raise bad("'text' must be an object with a format", "text")
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        chat["response_format"] = {"type": "json_schema", "json_schema": {
            k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}}
    elif isinstance(fmt, dict) and fmt.get("type") == "json_object":
        chat["response_format"] = {"type": "json_object"}
    elif fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise bad("'text.format' must be text, json_schema or json_object", "text")
    return parse_chat(chat)


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def response_body(rid: str, created: int, model: str, body_status: str, output: list, usage: dict | None,
                  reason: str | None) -> dict:
    """A Responses `response` object (usage from the service's, or None while in progress)."""
    incomplete = {"reason": "max_output_tokens"} if reason == "length" else None
    out = {"id": rid, "object": "response", "created_at": created, "status": body_status,
           "incomplete_details": incomplete, "error": None, "model": model, "output": output,
           "parallel_tool_calls": True, "tool_choice": "auto", "tools": [], "metadata": {}}
    if usage is not None:
        out["usage"] = {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
                        "total_tokens": usage["total_tokens"],
                        "input_tokens_details": {"cached_tokens": usage.get("prompt_tokens_details", {})
                                                 .get("cached_tokens", 0)},
                        "output_tokens_details": {"reasoning_tokens": 0}}
    return out


def output_items(events: list[chat_output.Event], calls: list[chat_output.ToolCall]) -> list[dict]:
    """The whole answer's output items."""
    items: list[dict] = []
    reasoning = "".join(e.text for e in events if e.kind == "reasoning")
    text = "".join(e.text for e in events if e.kind == "content")
    if reasoning:
        items.append({"type": "reasoning", "id": _item_id("rs"), "summary": [],
                      "content": [{"type": "reasoning_text", "text": reasoning}]})
    if text or not calls:
        items.append({"type": "message", "id": _item_id("msg"), "status": "completed", "role": "assistant",
                      "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]})
    items += [{"type": "function_call", "id": _item_id("fc"), "call_id": c.call_id, "name": c.name,
               "arguments": c.arguments, "status": "completed"} for c in calls]
    return items


class StreamItems:
    """Parser events as the Responses stream's events: an output item per run of reasoning or text
    and per function call, each added, fed and done in order; `sequence_number` counts them all."""

    def __init__(self, rid: str, created: int, model: str):
        self.rid, self.created, self.model = rid, created, model
        self.items: list[dict] = []
        self.open: tuple[str, int] | None = None
        self.seq = 0

    def event(self, kind: str, **data: Any) -> bytes:
        body = {"type": kind, "sequence_number": self.seq, **data}
        self.seq += 1
        return f"event: {kind}\ndata: ".encode() + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"

    def start(self) -> list[bytes]:
        pending = response_body(self.rid, self.created, self.model, "in_progress", [], None, None)
        return [self.event("response.created", response=pending), self.event("response.in_progress", response=pending)]

    def _add(self, key: tuple[str, int], item: dict) -> list[bytes]:
        out = self.close()
        self.items.append(item)
        self.open = key
        out.append(self.event("response.output_item.added", output_index=len(self.items) - 1, item=dict(item)))
        if item["type"] == "message":
            out.append(self.event("response.content_part.added", item_id=item["id"], output_index=len(self.items) - 1,
                                  content_index=0, part={"type": "output_text", "text": "", "annotations": []}))
        return out

    def close(self) -> list[bytes]:
        """End the item being fed: its done events."""
        if self.open is None:
            return []
        self.open = None
        item, index = self.items[-1], len(self.items) - 1
        out = []
        if item["type"] == "message":
            part = item["content"][0]
            out += [self.event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                               text=part["text"], logprobs=[]),
                    self.event("response.content_part.done", item_id=item["id"], output_index=index,
                               content_index=0, part=part)]
        elif item["type"] == "reasoning":
            out.append(self.event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                  content_index=0, text=item["content"][0]["text"]))
        else:
            out.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                  name=item["name"], arguments=item["arguments"]))
        item["status"] = "completed"
        return out + [self.event("response.output_item.done", output_index=index, item=item)]

    def feed(self, e: chat_output.Event) -> list[bytes]:
        out: list[bytes] = []
        if e.kind == "call":
            return self._add(("call", e.index), {"type": "function_call", "id": _item_id("fc"), "call_id": e.call_id,
                                                 "name": e.name, "arguments": "", "status": "in_progress"})
        if e.kind == "arguments":
            if not e.text:
                return out
            item = self.items[-1]
            item["arguments"] += e.text
            return [self.event("response.function_call_arguments.delta", item_id=item["id"],
                               output_index=len(self.items) - 1, delta=e.text)]
        if e.kind == "reasoning":
            if self.open != ("reasoning", 0):
                out = self._add(("reasoning", 0), {"type": "reasoning", "id": _item_id("rs"), "summary": [],
                                                   "content": [{"type": "reasoning_text", "text": ""}]})
            if e.text:
                self.items[-1]["content"][0]["text"] += e.text
                out.append(self.event("response.reasoning_text.delta", item_id=self.items[-1]["id"],
                                      output_index=len(self.items) - 1, content_index=0, delta=e.text))
            return out
        if self.open != ("content", 0):
            out = self._add(("content", 0), {"type": "message", "id": _item_id("msg"), "status": "in_progress",
                                             "role": "assistant",
                                             "content": [{"type": "output_text", "text": "", "annotations": [],
                                                          "logprobs": []}]})
        if e.text:
            self.items[-1]["content"][0]["text"] += e.text
            out.append(self.event("response.output_text.delta", item_id=self.items[-1]["id"],
                                  output_index=len(self.items) - 1, content_index=0, delta=e.text, logprobs=[]))
        return out

    def error(self, e: Any) -> list[bytes]:
        return [self.event("error", code=e.code, message=e.message, param=e.param)]

    def finish(self, usage: dict, reason: str | None, calls: list | None = None,
               stop_sequence: str | None = None) -> list[bytes]:
        """The last events (`stop_sequence`, the stop string that ended the answer, has no place in a
        response: its status is "completed" either way)."""
        out = self.close()
        if not self.items:  # nothing at all: an empty message, as the whole answer has
            out += self._add(("content", 0), output_items([], [])[0]) + self.close()
        status = "incomplete" if reason == "length" else "completed"
        done = response_body(self.rid, self.created, self.model, status, self.items, usage, reason)
        return out + [self.event("response.incomplete" if status == "incomplete" else "response.completed",
                                 response=done)]


def new_id() -> tuple[str, int]:
    return "resp_" + uuid.uuid4().hex, int(time.time())
