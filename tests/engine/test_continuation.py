"""Continuing a request from output it already has (`add_request(output_prefix=...)`): what a
client sends a restarted engine for a stream the dead one had begun. Greedy and seeded requests
must go on exactly as they would have; the prefix counts as output."""
from __future__ import annotations

import pytest

from nanovllm.config import Config
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.sampling_params import SamplingParams
from tests.engine.conftest import random_prompts


def new_engine(model_dir: str) -> LLMEngine:
    """A fresh engine each time: what the continuation meets is a restarted engine (nothing of
    the request in its prefix cache or sampler). fp32: in bf16 prefilling what was decoded may
    round a near-tie of the random model the other way (tests/service/conftest.py EXACT_ARGS)."""
    return LLMEngine(Config(model=model_dir, num_kvcache_blocks=64, num_threads=1, dtype="float32"))


def run(engine: LLMEngine, prompt: list[int], params: SamplingParams, prefix: list[int] | None = None):
    engine.add_request("r", prompt, params, output_prefix=prefix)
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.request_id == "r"]
    return outs


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=1.0, top_p=0.9, seed=1234),
                                      dict(temperature=0.8, repetition_penalty=1.3, frequency_penalty=0.5, seed=7)],
                         ids=["greedy", "seeded", "seeded-penalties"])
def test_a_continued_request_ends_exactly_as_the_uninterrupted_one(tiny_model_dir, sampling):
    params = SamplingParams(max_tokens=24, ignore_eos=True, **sampling)
    (prompt,) = random_prompts([37], 500)
    whole = [t for o in run(new_engine(tiny_model_dir), prompt, params) for t in o.new_token_ids]
    assert len(whole) == 24
    for cut in (1, 9, 23):
        outs = run(new_engine(tiny_model_dir), prompt, params, prefix=whole[:cut])
        # The prefix is reported again with the first new token, then the rest follows.
        assert outs[0].new_token_ids[:cut] == whole[:cut]
        assert [t for o in outs for t in o.new_token_ids] == whole, cut
        last = outs[-1]
        assert (last.finish_reason, last.num_prompt_tokens, last.num_output_tokens) == ("length", 37, 24)


def test_an_unseeded_continuation_keeps_its_prefix_and_length(tiny_model_dir):
    params = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)
    outs = run(new_engine(tiny_model_dir), [5, 6, 7, 8], params, prefix=[11, 12, 13])
    ids = [t for o in outs for t in o.new_token_ids]
    assert ids[:3] == [11, 12, 13] and len(ids) == 12 and outs[-1].num_output_tokens == 12


def test_min_tokens_counts_the_prefix(tiny_model_dir):
    """EOS is blocked until min_tokens outputs exist, the prefix among them: with 4 in the prefix
    and min_tokens 6, two more tokens come before the EOS (not six)."""
    engine = new_engine(tiny_model_dir)
    eos = engine.eos_token_ids[0]
    bias = {eos: 100.0}  # EOS is what the model would pick every time it may
    outs = run(engine, [5, 6, 7], SamplingParams(temperature=0, max_tokens=20, min_tokens=6, logit_bias=bias),
               prefix=[9, 9, 9, 9])
    ids = [t for o in outs for t in o.new_token_ids]
    assert ids[:4] == [9, 9, 9, 9] and eos not in ids[4:6] and ids[6:] == [eos] and outs[-1].finish_reason == "stop"


def test_an_impossible_continuation_is_refused_naming_why(tiny_model_dir):
    engine = LLMEngine(Config(model=tiny_model_dir, num_kvcache_blocks=64, num_threads=1, max_model_len=40))
    with pytest.raises(ValueError, match="max_tokens is 4: the request is complete"):
        engine.add_request("a", [5, 6], SamplingParams(max_tokens=4), output_prefix=[1, 2, 3, 4])
    with pytest.raises(ValueError, match="no room for another token within max_model_len 40"):
        engine.add_request("b", [5] * 20, SamplingParams(max_tokens=30), output_prefix=[1] * 20)
    with pytest.raises(ValueError, match=r"output token id 1000000 is outside the vocabulary"):
        engine.add_request("c", [5, 6], SamplingParams(max_tokens=8), output_prefix=[1, 10**6])
    assert not engine.has_unfinished_requests() and not engine.requests


def first_pair_cut(ids: list[int]) -> int:
    """The first cut k (>= 2) whose pair (ids[k-1], ids[k]) does not occur earlier in ids: banning
    that pair leaves everything before the cut as it was."""
    for k in range(2, len(ids)):
        pair = (ids[k - 1], ids[k])
        if all((ids[i - 1], ids[i]) != pair for i in range(1, k)):
            return k
    raise AssertionError("no cut with a fresh pair")


def test_a_banned_sequence_straddling_the_cut_is_still_banned(tiny_model_dir):
    """A continuation's banned token sequences see the output it came with: the prefix ends with
    the sequence's first token, so the next may not be its second. The continued answer equals
    the uninterrupted one under the same ban."""
    (prompt,) = random_prompts([29], 500, seed=3)
    whole = [t for o in run(new_engine(tiny_model_dir), prompt, SamplingParams(max_tokens=16, temperature=0,
                                                                               ignore_eos=True))
             for t in o.new_token_ids]
    cut = first_pair_cut(whole)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, banned_words=[whole[cut - 1:cut + 1]])
    banned = [t for o in run(new_engine(tiny_model_dir), prompt, params) for t in o.new_token_ids]
    assert banned[:cut] == whole[:cut] and banned[cut] != whole[cut]  # the ban bites at the cut
    continued = [t for o in run(new_engine(tiny_model_dir), prompt, params, prefix=whole[:cut])
                 for t in o.new_token_ids]
    assert continued == banned


def test_a_banned_string_straddling_the_cut_is_still_banned(tiny_model_dir):
    """The same for a banned string whose first character ends the prefix's text and whose rest
    the next token would start with: the matcher's state is rebuilt from the prefix's bytes."""
    engine = new_engine(tiny_model_dir)
    table = engine._words().table
    (prompt,) = random_prompts([31], 500, seed=4)
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    whole = [t for o in run(engine, prompt, greedy) for t in o.new_token_ids]
    for cut in range(1, len(whole)):
        before, after = table[whole[cut - 1]], table[whole[cut]]
        word = (before[-1:] + after[:1]).decode("ascii", errors="replace")
        text = b"".join(table[t] for t in whole[:cut])
        if len(word) == 2 and "\ufffd" not in word and word.encode() not in text:  # absent before the cut: the ban changes nothing there
            break
    else:
        pytest.skip("no cut with a two-character ASCII word straddling it")
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, banned_words=[word])
    banned = [t for o in run(new_engine(tiny_model_dir), prompt, params) for t in o.new_token_ids]
    assert banned[:cut] == whole[:cut] and banned[cut] != whole[cut]
    continued = [t for o in run(new_engine(tiny_model_dir), prompt, params, prefix=whole[:cut])
                 for t in o.new_token_ids]
    assert continued == banned
