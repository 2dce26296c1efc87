"""Grammar masks filled for a whole batch in one parallel llguidance call are bit for bit the
masks filled one row at a time, on the default model's vocabulary, across a batch of mixed formats."""
from __future__ import annotations

import random

import llguidance
import pytest
import torch

from nanovllm.structured import StructuredOutput, compile_format, ll_tokenizer, prepare_masks
from nanovllm.structured.prefetch import MaskPrefetcher

FORMATS = [
    {"type": "json_object"},
    {"type": "json_schema", "json_schema": {"name": "p", "schema": {
        "type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                         "age": {"type": "integer", "minimum": 18, "maximum": 99},
                                         "role": {"enum": ["admin", "user"]}},
        "required": ["name", "age", "role"], "additionalProperties": False}}},
    {"type": "regex", "regex": "[A-Z]{2}-[0-9]{3}"},
    {"type": "choice", "choices": ["yes", "no", "maybe"]},
    {"type": "grammar", "grammar": 'start: "(" num ("," num)* ")"\nnum: /[0-9]+/'},
    {"type": "json_schema", "json_schema": {"name": "a", "schema": {
        "type": "array", "items": {"type": "number", "minimum": 0, "maximum": 1}, "maxItems": 4}}},
]


@pytest.fixture(scope="module")
def grammars():
    from nanovllm.models.tokenizer import load_tokenizer

    tok = load_tokenizer("default")
    lltok = ll_tokenizer(tok, len(tok))
    return lltok, [compile_format(f, lltok).grammar for f in FORMATS]


def walk(grammar: StructuredOutput, steps: int, rng: random.Random) -> list[int]:
    """A random output the grammar allows, up to `steps` tokens long (serial masks)."""
    out: list[int] = []
    for _ in range(steps):
        allowed = (~grammar.blocked(out)).nonzero().flatten().tolist()
        if grammar.matcher.is_stopped() or not allowed:
            break
        out.append(rng.choice(allowed))
    return out


def test_a_parallel_fill_gives_the_serial_masks_on_a_batch_of_mixed_formats(grammars):
    lltok, texts = grammars
    rng = random.Random(0)
    rows = [texts[i % len(texts)] for i in range(24)]
    outputs = [walk(StructuredOutput(g, lltok), rng.randrange(0, 12), rng) for g in rows]
    serial = [StructuredOutput(g, lltok) for g in rows]
    parallel = [StructuredOutput(g, lltok) for g in rows]
    executor = llguidance.LLExecutor(2)
    grown = len(rows)
    for step in range(3):  # the same objects step on, as in the engine: new tokens are consumed
        if step:
            before = outputs
            outputs = [o + walk_next(g, o, rng) for g, o in zip(serial, outputs)]
            grown = sum(len(a) != len(b) for a, b in zip(before, outputs))  # the others keep their mask
            assert grown > 1
        assert prepare_masks(list(zip(serial, outputs))) == 0  # no executor: one row at a time
        assert prepare_masks(list(zip(parallel, outputs)), executor) == grown
        for s, p, out in zip(serial, parallel, outputs):
            assert torch.equal(s.blocked(out), p.blocked(out))
            assert not bool(p.blocked(out).all()), "every row allows some token"


def walk_next(grammar: StructuredOutput, output: list[int], rng: random.Random) -> list[int]:
    allowed = (~grammar.blocked(output)).nonzero().flatten().tolist()
    return [] if grammar.matcher.is_stopped() else [rng.choice(allowed)]


def test_a_row_that_does_not_fit_is_left_to_the_step_thread_which_reports_it(grammars):
    lltok, texts = grammars
    choice = texts[3]
    good, bad = StructuredOutput(choice, lltok), StructuredOutput(choice, lltok)
    bad_output = lltok.tokenize_str("hello")
    n = prepare_masks([(good, []), (bad, bad_output), (StructuredOutput(choice, lltok), [])],
                      llguidance.LLExecutor(2))
    assert n == 2
    assert torch.equal(good.blocked([]), StructuredOutput(choice, lltok).blocked([]))
    with pytest.raises(ValueError, match="does not fit the response_format"):
        bad.blocked(bad_output)


def test_the_prefetcher_fills_in_parallel_with_more_than_one_thread_and_not_with_one(grammars):
    lltok, texts = grammars
    for threads, parallel in ((1, False), (2, True)):
        masks = MaskPrefetcher(threads=threads)
        assert (masks.executor() is not None) == parallel
        rows = [StructuredOutput(g, lltok) for g in texts]
        masks.start([(g, []) for g in rows])
        masks.wait()
        for g, text in zip(rows, texts):
            assert torch.equal(g.blocked([]), StructuredOutput(text, lltok).blocked([]))
    with pytest.raises(ValueError, match="threads must be at least 1"):
        MaskPrefetcher(threads=0)


def test_the_prefetcher_keeps_one_executor_and_builds_it_again_only_for_another_thread_count():
    masks = MaskPrefetcher(threads=2)
    first = masks.executor()
    assert first is not None and masks.executor() is first  # built once, not per step
    masks.threads = 3
    third = masks.executor()
    assert third is not first and masks.executor() is third
    masks.threads = 1
    assert masks.executor() is None
    masks.threads = 3
    assert masks.executor() is third  # a count back to one thread keeps the executor it had
