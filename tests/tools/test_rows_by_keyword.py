"""Rows, messages and the request's own types are built by keyword outside the codec: a reader
of `RequestOutput(request_id=rid, finished=True, finish_reason=FinishReason.ABORT, ...)` does not
count arguments. Positional is for the codec alone (`nanovllm_client/protocol.py` reads rows off
the wire by position, which is what positional rows are for)."""
from __future__ import annotations

import ast
import pathlib
import typing
from dataclasses import is_dataclass

from nanovllm_client import protocol as p

ROOT = pathlib.Path(__file__).resolve().parents[2]
SOURCES = ("nanovllm", "client/nanovllm_client", "tokenizer_proc", "engine_proc", "detok_proc", "scripts", "bench")
CODECS = {ROOT / "client" / "nanovllm_client" / "protocol.py", ROOT / "bench" / "wire_codec.py"}
"""The codec, and the benchmark that mirrors it in msgspec structs of the same names."""


def wire_types() -> set[str]:
    """Every message and row type of the protocol (NamedTuples and the message dataclasses)."""
    names = set()
    for name, value in vars(p).items():
        if isinstance(value, type) and value.__module__ == p.__name__:
            if is_dataclass(value) or (issubclass(value, tuple) and hasattr(value, "_fields")):
                names.add(name)
    return names


def typed_values() -> set[str]:
    """The request's own types on each side of the wire, built in many places."""
    from detok_proc.streams import Final
    from engine_proc.admission import Queued
    from engine_proc.ledger import LiveRequest
    from engine_proc.output import StepMessages
    from nanovllm.engine.llm_engine import RequestOutput, StepStats
    from nanovllm.engine.sequence import SamplingState, Sequence
    from nanovllm_client.client_state import Delta, Result
    from nanovllm_client.http.schema import Call
    from nanovllm_client.sampling import SamplingParams

    return {t.__name__ for t in (Final, Queued, LiveRequest, StepMessages, RequestOutput, StepStats, Sequence,
                                 SamplingState, Delta, Result, Call, SamplingParams)}


def positional_constructions(names: set[str], roots: typing.Iterable[pathlib.Path]) -> list[str]:
    found = []
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            if path in CODECS:
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if not isinstance(node, ast.Call) or not node.args:
                    continue
                func = node.func
                name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
                if name in names:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {name}(...) with positional arguments")
    return found


def test_rows_and_messages_are_built_by_keyword_outside_the_codec():
    names = wire_types() | typed_values()
    assert {"RequestMeta", "OutputRow", "ResyncEntry", "DeltaRow", "StepOutput", "TokenizedReq"} <= names
    assert positional_constructions(names, [ROOT / s for s in SOURCES]) == []


def test_the_check_finds_a_positional_row(tmp_path):
    (tmp_path / "m.py").write_text("from nanovllm_client import protocol as p\n"
                                   "row = p.Usage(1, 2, 3)\nok = p.Usage(prompt_tokens=1, completion_tokens=2, "
                                   "cached_tokens=3)\n")
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        assert positional_constructions({"Usage"}, [tmp_path]) == ["m.py:2: Usage(...) with positional arguments"]
    finally:
        ROOT = saved
