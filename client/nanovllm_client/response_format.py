"""A request's `response_format`: OpenAI's shape (json_object, json_schema) and the extensions
regex, grammar (Lark) and choice, checked with size and depth limits (`check_response_format`).

Torch-free and without llguidance, so every door checks a format the same way before anything
compiles it: the sampling struct (`sampling.SamplingParams`) calls it, and the engine compiles
what it passed (`nanovllm.structured`).
"""
from __future__ import annotations

import json
from typing import Any

MAX_FORMAT_CHARS = 64 * 1024
"""A response_format's JSON text (regex or grammar included) is at most this long; a json_schema's
may be up to MAX_SCHEMA_CHARS."""
MAX_SCHEMA_CHARS = 1024 * 1024
"""A json_schema format's JSON text is at most this long: real schemas reach it (Kubernetes,
JsonSchemaStore), and every schema of JSONSchemaBench under it compiled within a second and 30
MiB but one (`docs/benchmarks.md`, `bench/jsonschema_bench.py --compile`). Regex and Lark
formats keep MAX_FORMAT_CHARS: a 1 MiB regex held 185 MiB compiled."""
MAX_SCHEMA_DEPTH = 64
"""Containers (maps and lists) nested deeper than this in a response_format are refused."""
MAX_CHOICES = 256
MAX_CHOICE_CHARS = 1024
TYPES = ("json_object", "json_schema", "regex", "grammar", "choice")


def _depth(value: Any, limit: int) -> int:
    """Nesting depth of containers, stopping (iteratively) once past `limit`."""
    stack = [(value, 1)]
    deepest = 0
    while stack:
        v, d = stack.pop()
        if isinstance(v, (dict, list)):
            deepest = max(deepest, d)
            if deepest > limit:
                return deepest
            stack.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v))
    return deepest


def check_response_format(value: Any) -> dict | None:
    """The format as a plain dict (None for none / {"type": "text"}); ValueError naming the problem."""
    if value is None:
        return None
    if isinstance(value, str):  # JSON text, as the wire carries it (the kind's own limit follows)
        if len(value) > MAX_SCHEMA_CHARS:
            raise ValueError(f"response_format is {len(value)} characters of JSON, at most {MAX_SCHEMA_CHARS}")
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ValueError(f"response_format is not valid JSON text: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"response_format must be a map with a 'type', got {type(value).__name__}")
    if _depth(value, MAX_SCHEMA_DEPTH) > MAX_SCHEMA_DEPTH:
        raise ValueError(f"response_format nests containers deeper than {MAX_SCHEMA_DEPTH} levels")
    try:
        text = json.dumps(value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"response_format must be JSON-serializable: {e}") from None
    kind = value.get("type")
    limit = MAX_SCHEMA_CHARS if kind == "json_schema" else MAX_FORMAT_CHARS
    if len(text) > limit:
        raise ValueError(f"response_format is {len(text)} characters of JSON, at most {limit}"
                         + (" for a json_schema" if kind == "json_schema" else f" ({MAX_SCHEMA_CHARS} for a json_schema)"))
    if kind == "text":
        return None
    if kind not in TYPES:
        raise ValueError(f"response_format type must be one of {', '.join(('text',) + TYPES)}, got {str(kind)[:64]!r}")

    def keys(*allowed: str) -> None:
        extra = set(value) - {"type", *allowed}
        if extra:
            raise ValueError(f"response_format of type {kind} has unknown key(s) {sorted(map(str, extra))[:8]}")

    if kind == "json_object":
        keys()
    elif kind == "json_schema":
        keys("json_schema")
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), (dict, bool)):
            raise ValueError("response_format json_schema needs {'json_schema': {'name': ..., 'schema': {...}}}")
        extra = set(spec) - {"name", "schema", "strict", "description"}
        if extra:
            raise ValueError(f"response_format json_schema has unknown key(s) {sorted(map(str, extra))[:8]}")
    elif kind in ("regex", "grammar"):
        keys(kind)
        if not isinstance(value.get(kind), str) or not value[kind]:
            raise ValueError(f"response_format of type {kind} needs a non-empty string '{kind}'")
    else:
        keys("choices")
        choices = value.get("choices")
        if (not isinstance(choices, list) or not choices or len(choices) > MAX_CHOICES
                or not all(isinstance(c, str) and 0 < len(c) <= MAX_CHOICE_CHARS for c in choices)):
            raise ValueError(f"response_format choice needs 'choices': 1 to {MAX_CHOICES} non-empty strings "
                             f"of at most {MAX_CHOICE_CHARS} characters")
    return value
