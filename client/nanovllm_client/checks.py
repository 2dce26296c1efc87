"""Field checks for decoded wire messages: every value is hostile until one of these passed it.

A frame from any socket (a client's, or a stage's reachable over tcp) decodes into plain msgpack
data; the message classes in `protocol.py` run these checks on every field before a stage reads
it. A failed check raises `ProtocolError` with a sentence naming the field, what was wrong and
what is allowed. Values appear in those sentences only through `show()`, which is bounded in
length and nesting, so building an error message can never itself fail (a 1,000-level nested
list once raised RecursionError here, killing the stage that tried to report it).
"""
from __future__ import annotations

import reprlib
from typing import Any

MAX_DEPTH = 7
"""Deepest nesting a message body may have. The deepest real one (a resync entry's stop strings)
is 6 levels: {entries: [[[client, id, {stop: [...]}], output]]}."""


class ProtocolError(ValueError):
    """A frame that is not a valid message; the text says what was wrong."""

    def __init__(self, message: str, request_id: str | None = None):
        super().__init__(message)
        self.request_id = request_id
        """The request the bad frame belonged to, when that much could be read."""


_repr = reprlib.Repr()
_repr.maxlevel, _repr.maxstring, _repr.maxother, _repr.maxlong = 2, 60, 60, 40
_repr.maxlist = _repr.maxdict = _repr.maxtuple = _repr.maxset = 6


def show(value: Any) -> str:
    """A short repr for error messages, whatever the value: depth, length and size are bounded.

    Values come from clients: a plain `repr` of a deeply nested list raises RecursionError, of a
    huge int ValueError, and of a long string fills the log. Used for wire frames and for
    `SamplingParams` alike.
    """
    try:
        return _repr.repr(value)
    except Exception:  # a hostile __repr__, or an int too long to print
        return f"<{type(value).__name__}>"


def check(ok: bool, message: str, *values: Any) -> None:
    """Raise `ProtocolError(message)` unless `ok`; each `{}` in `message` is one of `values`,
    through `show`. Pass values that way rather than formatting them into the message: the text
    is then built only on failure (a `show` per passing check once cost a client ~20 us a delta)."""
    if not ok:
        raise ProtocolError(message.format(*map(show, values)) if values else message)


def check_depth(obj: Any, limit: int = MAX_DEPTH) -> None:
    """Reject nesting deeper than `limit`, iteratively (no recursion for a hostile frame to exhaust)."""
    stack = [(obj, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > limit:
            raise ProtocolError(f"the frame nests containers deeper than {limit} levels")
        children = value.values() if type(value) is dict else value
        for child in children:
            if type(child) is list or type(child) is dict:
                stack.append((child, depth + 1))


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_str(name: str, value: Any, max_len: int, *, empty: bool = False) -> None:
    if not (isinstance(value, str) and (empty or value != "") and len(value) <= max_len):
        raise ProtocolError(f"{name} must be a {'' if empty else 'non-empty '}string of at most {max_len} characters, "
                            f"got {show(value)}")


def check_opt_str(name: str, value: Any, max_len: int) -> None:
    if value is not None:
        check_str(name, value, max_len, empty=True)


def check_bytes(name: str, value: Any, max_len: int) -> None:
    if not (isinstance(value, bytes) and len(value) <= max_len):
        raise ProtocolError(f"{name} must be binary of at most {max_len} bytes, got {show(value)}")


def check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ProtocolError(f"{name} must be true or false, got {show(value)}")


def check_int(name: str, value: Any, lo: int, hi: int) -> None:
    if not (is_int(value) and lo <= value <= hi):
        raise ProtocolError(f"{name} must be an integer in [{lo}, {hi}], got {show(value)}")


def check_number(name: str, value: Any) -> None:
    if not ((is_int(value) or isinstance(value, float)) and value == value and abs(value) != float("inf")):
        raise ProtocolError(f"{name} must be a finite number, got {show(value)}")


def check_list(name: str, value: Any, max_len: int) -> None:
    if not (isinstance(value, list) and len(value) <= max_len):
        raise ProtocolError(f"{name} must be a list of at most {max_len} items, got {show(value)}")


def check_map(name: str, value: Any, max_len: int) -> None:
    """A map with string keys (what msgpack maps from JSON-like senders hold)."""
    if not (isinstance(value, dict) and len(value) <= max_len and all(isinstance(k, str) for k in value)):
        raise ProtocolError(f"{name} must be a map of at most {max_len} entries with string keys, got {show(value)}")


def check_fields(name: str, value: dict, allowed: frozenset[str], required: frozenset[str] = frozenset()) -> None:
    """Exactly the keys a structured map may have: unknown keys and missing required ones are errors."""
    unknown = [k for k in value if k not in allowed]
    if unknown:
        raise ProtocolError(f"unknown field(s) {show(sorted(map(str, unknown)))} in {name}; allowed: {sorted(allowed)}")
    if not required <= value.keys():
        raise ProtocolError(f"missing field(s) {sorted(required - value.keys())} in {name}")


def prompt_too_long(num_tokens: int, max_model_len: int) -> str:
    """The one sentence for a prompt that does not fit, said alike by the tokenizer stage and the engine."""
    return (f"prompt has {num_tokens} tokens but max_model_len is {max_model_len} "
            "(prompt plus at least one output token must fit)")
