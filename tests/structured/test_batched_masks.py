"""Rows whose only constraint is their grammar are masked together, in one op: each row of a
mixed batch (grammar alone, grammar with logit_bias, with min_tokens, with another processor,
unconstrained, a grammar that leaves nothing, an output that does not fit) comes out as it
does masked on its own, on the default model's vocabulary; with the compiled ops (the packed
bits applied as they are) and without (unpacked, `masked_fill_`), bit for bit the same."""
from __future__ import annotations

import llguidance
import pytest
import torch

from nanovllm.engine.sequence import Sequence
from nanovllm.engine.constraints import _stack_bits, constrain_rows
from nanovllm.layers.cpu_kernels import CpuOps
from nanovllm.layers.logits_processors import AllowedTokenIds
from nanovllm.engine.sampler import SAMPLE_FAILED, Sampler
from nanovllm.sampling_params import SamplingParams
from nanovllm.structured import StructuredOutput, compile_format, ll_tokenizer, prepare_masks
from tests.helpers.rows import sampled_row

PERSON = {"type": "json_schema", "json_schema": {"name": "p", "schema": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                     "age": {"type": "integer", "minimum": 18, "maximum": 99}},
    "required": ["name", "age"], "additionalProperties": False}}}
YES_NO = {"type": "choice", "choices": ["yes", "no"]}
PAD = 3
"""Logits this much wider than the vocabulary: the padding is never allowed by a grammar."""


@pytest.fixture(scope="module", params=["torch", "compiled"])
def ops(request):
    """None (the masks unpacked, as off the CPU) or the compiled `CpuOps` (the packed bits)."""
    if request.param == "torch":
        return None
    loaded = CpuOps.load()
    if loaded is None:
        pytest.skip("no C compiler on this machine")
    return loaded


@pytest.fixture(scope="module")
def tok():
    from nanovllm.models.tokenizer import load_tokenizer

    t = load_tokenizer("default")
    lltok = ll_tokenizer(t, len(t))
    return t, lltok, compile_format(PERSON, lltok).grammar, compile_format(YES_NO, lltok).grammar


def mixed_rows(tok) -> list[tuple[str, SamplingParams, list, list[int]]]:
    """(what, params, processors, output) per row; fresh grammars each call."""
    t, lltok, person, yes_no = tok
    eos = t.eos_token_id
    enc = lambda s: t.encode(s, add_special_tokens=False)  # noqa: E731
    so = lambda g: StructuredOutput(g, lltok)  # noqa: E731
    brace = enc('{"')[0]
    sampled = dict(temperature=0.8, max_tokens=16)
    return [
        ("grammar", SamplingParams(**sampled, seed=1), [so(person)], []),
        ("unconstrained", SamplingParams(**sampled, seed=2), [], enc("Hello")),
        ("grammar+bias", SamplingParams(**sampled, seed=3, logit_bias={brace: 7.0}), [so(person)], []),
        ("grammar later", SamplingParams(**sampled, seed=4), [so(person)], enc('{"name":"Al')),
        # min_tokens holds EOS back where the finished choice allows only EOS: the grammar wins.
        ("grammar+min_tokens", SamplingParams(**sampled, seed=5, min_tokens=8), [so(yes_no)], enc("yes")),
        ("grammar+allowed ids", SamplingParams(**sampled, seed=6), [so(person), AllowedTokenIds([brace, eos], len(t) + PAD)], []),
        ("grammar leaves nothing", SamplingParams(**sampled, seed=7), [so(yes_no)], enc("no")),
        ("does not fit", SamplingParams(**sampled, seed=8), [so(yes_no)], enc("maybe")),
        ("greedy grammar", SamplingParams(temperature=0, max_tokens=16), [so(person)], enc('{"')),
    ]


def batch(tok, rows, ops, prefetch: bool = True) -> tuple[Sampler, list[Sequence]]:
    t = tok[0]
    sampler = Sampler(len(t) + PAD, torch.device("cpu"), mask_threads=2)
    sampler.cpu_ops = ops
    seqs = [sampled_row(what, [1, 2], params, len(t) + PAD, processors=processors, eos=(t.eos_token_id,), arrival=i,
                        output=output) for i, (what, params, processors, output) in enumerate(rows)]
    if prefetch:  # as in a step: the masks filled before the sampler runs, in one parallel call
        sampler.prepare(seqs)
    return sampler, seqs


def logits_for(tok, rows) -> torch.Tensor:
    t = tok[0]
    logits = torch.randn(len(rows), len(t) + PAD, generator=torch.Generator().manual_seed(0)) * 3  # (B, V + PAD)
    for i, (what, *_rest) in enumerate(rows):
        if what == "grammar leaves nothing":  # the finished choice allows EOS alone, which the model rules out
            logits[i, t.eos_token_id] = float("-inf")
    return logits


def test_each_row_of_a_mixed_batch_is_masked_as_it_is_alone(tok, ops):
    rows = mixed_rows(tok)
    sampler, seqs = batch(tok, rows, ops)
    sampler.masks.wait()
    logits = logits_for(tok, rows)
    masked, failed = logits.clone(), {}
    constrain_rows(masked, seqs, failed, ops)
    unpacked = logits.clone()
    constrain_rows(unpacked, seqs, {})  # the masks unpacked and filled by torch
    assert torch.equal(masked, unpacked)
    for i, (what, _, processors, _) in enumerate(rows):
        alone, failed_alone = logits[i:i + 1].clone(), {}
        constrain_rows(alone, [seqs[i]], failed_alone, ops)
        assert torch.equal(masked[i], alone[0]), what
        assert failed.get(i) == failed_alone.get(0), what
        if what in ("grammar", "grammar later", "greedy grammar"):  # the processor's own row-by-row mask
            assert torch.equal(masked[i], processors[0](seqs[i].output_token_ids, logits[i].clone())), what
            assert torch.isinf(masked[i, -PAD:]).all() and bool(torch.isfinite(masked[i]).any()), what
    assert torch.equal(masked[1], logits[1])  # the unconstrained row is untouched, its padding too
    assert set(failed) == {6, 7}
    assert failed[6] == "logits allow no token (all are -inf) after penalties and constraints"
    assert failed[7].startswith("logits processor StructuredOutput raised ValueError: token") and "does not fit" in failed[7]
    # grammar+min_tokens: EOS held back leaves nothing, so the row is masked by its grammar alone.
    assert int(masked[4].argmax()) == tok[0].eos_token_id and int(torch.isfinite(masked[4]).sum()) == 1


def test_a_mixed_batch_samples_each_row_as_alone_and_fails_only_its_own_rows(tok, ops):
    logits = logits_for(tok, mixed_rows(tok))
    sampler, seqs = batch(tok, mixed_rows(tok), ops)
    together = sampler(logits.clone(), seqs)
    for i, (what, params, processors, output) in enumerate(mixed_rows(tok)):  # fresh grammars, seeds
        one, one_seqs = batch(tok, [(what, params, processors, output)], ops, prefetch=False)
        assert together[i] == one(logits[i:i + 1].clone(), one_seqs)[0], what
        assert seqs[i].sampling.take_error() == one_seqs[0].sampling.take_error(), what
    assert [i for i, token in enumerate(together) if token == SAMPLE_FAILED] == [6, 7]


def test_a_batch_of_grammar_rows_is_masked_in_place_from_the_parallel_fill_without_a_copy(tok, ops):
    t, lltok, person, _ = tok
    outputs = [t.encode(s, add_special_tokens=False) for s in ('', '{"', '{"name":"B', '{"name":"Bo","age":4')]
    grammars = [StructuredOutput(person, lltok) for _ in outputs]
    assert prepare_masks(list(zip(grammars, outputs)), llguidance.LLExecutor(2)) == len(outputs)
    bits = [g.bits(o) for g, o in zip(grammars, outputs)]
    stacked = _stack_bits(bits)  # the fill's own (G, W) array
    assert stacked.ctypes.data == bits[0].ctypes.data and stacked.shape == (len(outputs), -(-grammars[0].n_vocab // 32))
    assert _stack_bits(bits[::-1]).ctypes.data != bits[-1].ctypes.data  # rows out of order: copied
    assert (_stack_bits(bits[::-1]) == stacked[::-1]).all()
    rows = [(f"r{i}", SamplingParams(temperature=0, max_tokens=16), [g], o) for i, (g, o) in enumerate(zip(grammars, outputs))]
    sampler, seqs = batch(tok, rows, ops, prefetch=False)  # the masks above are used as they are
    logits = torch.randn(len(rows), len(t) + PAD, generator=torch.Generator().manual_seed(1))  # (B, V + PAD)
    masked, failed = logits.clone(), {}
    constrain_rows(masked, seqs, failed, ops)
    assert not failed
    for i, (g, o) in enumerate(zip(grammars, outputs)):
        assert torch.equal(masked[i], g(o, logits[i].clone()))
