"""A chat completion's text split into what OpenAI's API returns apart: reasoning
(`reasoning_content`, vLLM's name, from a `<think>...</think>` that opens the output, or from
the start up to `</think>` where the chat template opened `<think>` in the prompt), tool calls
(Hermes / Qwen style `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, and Llama 3.x's
bare `{"name": ..., "parameters": {...}}` that opens the output, several joined by ";") and
content.

One incremental parser serves both modes: streaming feeds it each text delta and sends the events
it returns at once (a tool call's arguments as they arrive); a whole answer is the same parser fed
the whole text, its events joined. Text that might be the start of a tag is held back until it
is known, so a tag split across deltas is still found and never shown as content.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
# A call written name first (Qwen's and Hermes' templates ask for it): the name is known, and the
# arguments stream, as soon as this much has arrived.
_NAME_FIRST = re.compile(r'\s*\{\s*"name"\s*:\s*"([A-Za-z0-9_.:-]{1,64})"\s*,\s*"(?:arguments|parameters)"\s*:')


@dataclass
class Event:
    """One piece of output: kind is "content", "reasoning", "call" (a tool call begins: index,
    call_id, name) or "arguments" (more of call `index`'s arguments text)."""
    kind: str
    text: str = ""
    index: int = 0
    call_id: str = ""
    name: str = ""


@dataclass
class ToolCall:
    call_id: str
    name: str
    arguments: str = ""


def _held(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that begins one of `tags` (it may complete later)."""
    for n in range(min(len(text), max(map(len, tags)) - 1), 0, -1):
        if any(tag.startswith(text[-n:]) for tag in tags):
            return n
    return 0


class _ValueEnd:
    """Finds where one JSON value ends, fed piece by piece (strings and escapes respected)."""

    def __init__(self) -> None:
        self.depth, self.in_string, self.escape, self.started, self.scalar = 0, False, False, False, False

    def feed(self, text: str) -> int | None:
        """The length of `text` that still belongs to the value, once it ends; None while it goes on."""
        for i, c in enumerate(text):
            if not self.started:
                if c.isspace():
                    continue
                self.started = True
                self.scalar = c not in "{[\""
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif c == "\\":
                    self.escape = True
                elif c == '"':
                    self.in_string = False
                    if self.depth == 0:
                        return i + 1
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                if self.depth == 0:  # a scalar's end: the enclosing object closes
                    return i
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
            elif self.scalar and self.depth == 0 and (c == "," or c.isspace()):
                return i
        return None


@dataclass
class ChatOutputParser:
    """Feed text deltas in order (`feed`), then `finish()`; each returns the events to send.

    `tools`: tool calls are parsed (the request offered tools). `reasoning`: a `<think>` that
    opens the output (after blank space) starts reasoning, up to `</think>`. `reasoning_open`:
    the prompt ended inside a reasoning block (the chat template opened `<think>`; the service
    says so on the stream's deltas), so the output starts as reasoning. `max_calls`: once
    that many calls are complete, the rest of the output is dropped (`parallel_tool_calls`
    false: 1); None, no limit."""
    tools: bool
    reasoning: bool = True
    max_calls: int | None = None
    reasoning_open: bool = False
    calls: list[ToolCall] = field(default_factory=list)
    _state: str = "start"  # start, reasoning, content, call_head, call_args, call_tail, bare_tail, bare_next, done
    _buf: str = ""
    _value: _ValueEnd | None = None
    _lstrip: bool = False  # blank space right after </think> is not content
    _bare: bool = False  # the call is Llama's bare JSON, not inside <tool_call> tags

    def __post_init__(self) -> None:
        if self.reasoning and self.reasoning_open:
            self._state = "reasoning"

    @property
    def done(self) -> bool:
        """`max_calls` calls are complete: the rest of the output is dropped, so it is not worth
        generating (the front stops the request)."""
        return self._state == "done"

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        events: list[Event] = []
        while self._step(events):
            pass
        return _merge(events)

    def finish(self) -> list[Event]:
        """The end of the output: what was held back is what it is."""
        events: list[Event] = []
        rest, self._buf = self._buf, ""
        if self._state == "start" or self._state == "content":
            events.append(Event("content", rest.lstrip() if self._lstrip else rest))
        elif self._state == "reasoning":
            events.append(Event("reasoning", rest))
        elif self._state == "call_head":  # a call never closed: its text was content after all
            if not self._whole_call(rest, events):
                events.append(Event("content", rest if self._bare else CALL_OPEN + rest))
        elif self._state == "done":  # after the last call allowed: dropped
            pass
        elif self._state == "call_args":  # cut off mid-arguments (max_tokens): as far as it went
            events.append(Event("arguments", rest, index=len(self.calls) - 1))
            self.calls[-1].arguments += rest
        self._state = "content"
        return _merge([e for e in events if e.text or e.kind == "call"])

    # -- one state step; True when it made progress and another may follow ----------------------

    def _step(self, events: list[Event]) -> bool:
        state, buf = self._state, self._buf
        if state == "done":
            self._buf = ""
            return False
        if state == "start":
            stripped = buf.lstrip()
            if not stripped:
                return False
            if self.reasoning and THINK_OPEN.startswith(stripped[:len(THINK_OPEN)]):
                if len(stripped) < len(THINK_OPEN):
                    return False  # may still become <think>
                self._state, self._buf = "reasoning", stripped[len(THINK_OPEN):]
                return True
            if self.tools and stripped.startswith("{"):  # perhaps Llama's bare call
                self._state, self._buf, self._bare = "call_head", stripped, True
                return True
            self._state = "content"
            return True
        if state == "reasoning":
            found = self._until(THINK_CLOSE, "reasoning", "content", events)
            self._lstrip = found
            return found
        if state == "content":
            if self._lstrip:
                self._buf = buf = buf.lstrip()
                if not buf:
                    return False
                self._lstrip = False
            if not self.tools:
                self._emit("content", buf, events)
                self._buf = ""
                return False
            return self._until(CALL_OPEN, "content", "call_head", events)
        if state == "call_head":
            return self._call_head(events)
        if state == "call_args":
            if not self._value.started:
                self._buf = buf = buf.lstrip()
                if not buf:
                    return False
            end = self._value.feed(buf)
            if end is None:
                self._args(buf, events)
                self._buf = ""
                return False
            self._args(buf[:end], events)
            self._state, self._buf = "bare_tail" if self._bare else "call_tail", buf[end:]
            return True
        if state == "bare_tail":  # up to the call object's closing brace
            at = buf.find("}")
            self._state, self._buf = (self._after_call("bare_next"), buf[at + 1:]) if at >= 0 else ("bare_tail", "")
            return at >= 0
        if state == "bare_next":  # another call after ";", or the end
            rest = buf.lstrip().lstrip(";").lstrip()
            if not rest:
                return False
            self._state, self._buf = ("call_head" if rest.startswith("{") else "content"), rest
            return True
        if state == "call_tail":  # the object's closing brace and blank space, up to </tool_call>
            at = buf.find(CALL_CLOSE)
            if at < 0:
                self._buf = buf[len(buf) - _held(buf, (CALL_CLOSE,)):]
                return False
            self._state, self._buf, self._lstrip = self._after_call("content"), buf[at + len(CALL_CLOSE):], True
            return True
        return False

    def _after_call(self, state: str) -> str:
        """The state after a complete call: `state`, or "done" once `max_calls` are complete."""
        return "done" if self.max_calls is not None and len(self.calls) >= self.max_calls else state

    def _until(self, tag: str, kind: str, next_state: str, events: list[Event]) -> bool:
        buf = self._buf
        at = buf.find(tag)
        if at < 0:
            cut = len(buf) - _held(buf, (tag,))
            self._emit(kind, buf[:cut], events)
            self._buf = buf[cut:]
            return False
        self._emit(kind, buf[:at], events)
        self._state, self._buf = next_state, buf[at + len(tag):]
        return True

    def _call_head(self, events: list[Event]) -> bool:
        buf = self._buf
        head = _NAME_FIRST.match(buf)
        if head:
            self._start_call(head.group(1), events)
            self._state, self._buf, self._value = "call_args", buf[head.end():], _ValueEnd()
            return True
        if self._bare:
            return False  # read whole at the end: a call after all, or content
        at = buf.find(CALL_CLOSE)
        if at < 0:
            return False  # wait for the name, or for the end of the call
        body, self._buf, self._state = buf[:at], buf[at + len(CALL_CLOSE):], "content"
        if not self._whole_call(body, events):  # not a call we can read: it stays text
            self._emit("content", CALL_OPEN + body + CALL_CLOSE, events)
        else:
            self._state = self._after_call("content")
        return True

    def _whole_call(self, body: str, events: list[Event]) -> bool:
        """A call written another way (arguments first, ...): read whole once it closed."""
        try:
            call = json.loads(body)
        except ValueError:
            return False
        if not (isinstance(call, dict) and isinstance(call.get("name"), str) and call["name"]):
            return False
        args = call.get("arguments", call.get("parameters", {}))
        self._start_call(call["name"], events)
        self._args(args if isinstance(args, str) else json.dumps(args, ensure_ascii=False), events)
        return True

    def _start_call(self, name: str, events: list[Event]) -> None:
        call = ToolCall("call_" + uuid.uuid4().hex[:24], name)
        self.calls.append(call)
        events.append(Event("call", index=len(self.calls) - 1, call_id=call.call_id, name=name))

    def _args(self, text: str, events: list[Event]) -> None:
        if text:
            self.calls[-1].arguments += text
            events.append(Event("arguments", text, index=len(self.calls) - 1))

    @staticmethod
    def _emit(kind: str, text: str, events: list[Event]) -> None:
        if text:
            events.append(Event(kind, text))


def _merge(events: list[Event]) -> list[Event]:
    """Neighbouring pieces of one kind (and call) as one."""
    out: list[Event] = []
    for e in events:
        last = out[-1] if out else None
        if last and e.kind == last.kind and e.kind != "call" and e.index == last.index:
            last.text += e.text
        else:
            out.append(e)
    return out


# -- the events in OpenAI's shapes ------------------------------------------------------------


def delta(e: Event) -> dict:
    """A streamed chunk's `delta` for one event."""
    if e.kind == "content":
        return {"content": e.text}
    if e.kind == "reasoning":
        return {"reasoning_content": e.text}
    if e.kind == "call":
        return {"tool_calls": [{"index": e.index, "id": e.call_id, "type": "function",
                                "function": {"name": e.name, "arguments": ""}}]}
    return {"tool_calls": [{"index": e.index, "function": {"arguments": e.text}}]}


def message(events: list[Event], calls: list[ToolCall]) -> dict:
    """The whole answer's `message`, from all of its events."""
    content = "".join(e.text for e in events if e.kind == "content")
    reasoning = "".join(e.text for e in events if e.kind == "reasoning")
    out: dict = {"role": "assistant", "content": content if content.strip() or not calls else None}
    if reasoning:
        out["reasoning_content"] = reasoning
    if calls:
        out["tool_calls"] = [{"id": c.call_id, "type": "function",
                              "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
    return out


def finish_reason(reason: str | None, calls: list[ToolCall]) -> str | None:
    """OpenAI's: "tool_calls" when the model stopped after calling tools."""
    return "tool_calls" if calls and reason == "stop" else reason
