"""`chat_template_kwargs`: extra variables a chat's template is rendered with (vLLM's extension;
e.g. {"enable_thinking": false} for Qwen3, whose template then closes the reasoning block at once).

They travel as JSON text (like `tools`: nesting never meets the frame's limit) and are read by
one function on both sides: the HTTP front (a 400 naming the field) and the tokenizer stage,
which receives them from any client and passes them to `apply_chat_template`. A value is plain
JSON; a name is an identifier, and never one of `apply_chat_template`'s own parameters (which
would change how it renders, or fail as a duplicate argument, instead of setting a variable).
"""
from __future__ import annotations

import json
import re
from typing import Any

from .checks import ProtocolError

MAX_TEMPLATE_KWARGS_CHARS = 8192
"""The JSON text's length: a few switches, not a second prompt."""
MAX_TEMPLATE_KWARGS = 32
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
RESERVED = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})
"""`apply_chat_template`'s parameters (and the chat itself): set by the stage, never by a request."""


def template_kwargs_text(value: Any) -> str:
    """A request's `chat_template_kwargs` (an object) -> its wire text; ProtocolError naming the
    problem."""
    if not isinstance(value, dict):
        raise ProtocolError("chat_template_kwargs must be an object of template variables")
    try:
        text = json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        raise ProtocolError("chat_template_kwargs must hold plain JSON values (finite numbers, not nested "
                            "too deep)") from None
    parse_template_kwargs(text)
    return text


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not plain JSON")


def parse_template_kwargs(text: Any) -> dict[str, Any]:
    """The wire text -> the variables, checked: a JSON object of at most MAX_TEMPLATE_KWARGS
    identifiers (none of RESERVED), within MAX_TEMPLATE_KWARGS_CHARS; ProtocolError otherwise."""
    if not isinstance(text, str) or len(text) > MAX_TEMPLATE_KWARGS_CHARS:
        raise ProtocolError(f"chat_template_kwargs must be JSON text of at most {MAX_TEMPLATE_KWARGS_CHARS} "
                            "characters")
    try:
        value = json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError):
        raise ProtocolError("chat_template_kwargs is not valid JSON text") from None
    if not isinstance(value, dict) or len(value) > MAX_TEMPLATE_KWARGS:
        raise ProtocolError(f"chat_template_kwargs must be an object of at most {MAX_TEMPLATE_KWARGS} variables")
    for name in value:
        if not _NAME.fullmatch(name):
            raise ProtocolError(f"chat_template_kwargs: {name[:64]!r} is not a variable name (letters, digits, "
                                "'_', at most 64)")
        if name in RESERVED:
            raise ProtocolError(f"chat_template_kwargs: {name!r} is set by the server, not by a request")
    return value
