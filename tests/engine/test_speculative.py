"""Speculative decoding (Config.speculative="ngram"): the proposer, the draft-length rule, and the
engine's verification, which must leave greedy output token for token what it is without it.

The engine tests compare whole runs with speculation off and on, on tiny random models (fp32 and
bf16) and on the default model's packed GGUF path, and check the block manager after every step:
each sequence holds exactly the blocks its computed tokens need (rejected drafts' blocks went
back), every registered block holds the tokens its hash says (no rejected token was ever hashed),
and reference counts match the block tables. A forced proposer (right for a few tokens, then
wrong) makes every acceptance length happen, including drafts cut by a stop or max_tokens.
"""
from __future__ import annotations

import collections

import pytest

from nanovllm import LLM, SamplingParams
from nanovllm.config import Config
from nanovllm.engine.speculative import NgramIndex, Speculator
from tests.engine.conftest import random_prompts

CONFIG = dict(block_size=4, num_kvcache_blocks=400, max_num_batched_tokens=64, max_num_seqs=4, max_model_len=160)


# -- the proposer -------------------------------------------------------------------------------

def test_ngram_proposes_the_continuation_of_the_longest_latest_match():
    index = NgramIndex(1, 3)
    tokens = [1, 2, 3, 9, 9, 1, 2, 3, 7, 5, 2, 3]
    # The suffix [2, 3] was seen twice; its latest earlier occurrence ended before the 7.
    assert index.propose(tokens, 3) == [7, 5, 2]
    # A 3-token suffix beats the shorter ones: [1, 2, 3] occurs, followed first by 9, then by 7.
    tokens += [4, 1, 2, 3]
    assert index.propose(tokens, 2) == [7, 5]
    assert index.propose(tokens, 0) == []


def test_ngram_without_a_match_or_too_short_proposes_nothing():
    assert NgramIndex(2, 4).propose([5, 6, 7, 8], 4) == []
    assert NgramIndex(2, 4).propose([5], 4) == []
    assert NgramIndex(1, 1).propose([5, 5], 3) == [5]  # the continuation may overlap the suffix


def test_ngram_index_grown_step_by_step_equals_a_fresh_one():
    tokens = random_prompts([200], vocab=6, seed=3)[0]  # a small vocabulary: many repeats
    grown = NgramIndex(2, 4)
    for end in range(1, len(tokens) + 1):
        assert grown.propose(tokens[:end], 5) == NgramIndex(2, 4).propose(tokens[:end], 5)


def test_draft_length_follows_acceptance_and_row_cost():
    spec = Speculator(max_tokens=6, min_n=1, max_n=2, row_cost=0.55)
    assert spec.best_length(0.0, 6) == 0 and spec.best_length(0.4, 6) == 0  # no length beats one row
    assert spec.best_length(0.99, 6) == 6 and spec.best_length(0.99, 2) == 2
    assert 0 < spec.best_length(0.8, 6) < 6
    assert Speculator(6, 1, 2, row_cost=0.0).best_length(0.1, 6) == 6  # free rows: always worth drafting


def test_acceptance_estimate_falls_on_rejections_and_recovers_from_shadow_checks():
    spec = Speculator(max_tokens=4, min_n=1, max_n=2, row_cost=0.55)
    state = spec.new_state()
    tokens = [1, 2, 3, 1, 2]
    assert spec.draft(state, tokens, 4) == [3]  # the prior is high enough to try one token
    for _ in range(6):
        spec.record(state, 3, 0)
    assert spec.draft(state, tokens, 4) == []  # no longer worth it, but the proposal is kept ...
    assert state.shadow == 3
    low = state.acceptance
    spec.observe(state, 3)  # ... and checked against the token the request then got
    assert state.acceptance > low and state.shadow is None
    c = spec.counters
    assert (c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens) == (6, 18, 0)


def test_config_refuses_bad_speculative_settings():
    for bad in (dict(speculative="eagle"), dict(speculative="ngram", overlap_scheduling=True),
                dict(speculative_tokens=0), dict(speculative_ngram_min=3, speculative_ngram_max=2),
                dict(speculative_row_cost=-1)):
        with pytest.raises(ValueError, match="speculative"):
            Config(**bad)
    with pytest.raises(ValueError, match="speculative"):
        SamplingParams(speculative="yes")


# -- the engine ---------------------------------------------------------------------------------

def check_blocks(engine) -> None:
    """The block manager's state is what the live sequences' tables and tokens say it must be."""
    bm = engine.block_manager
    refs = collections.Counter()
    for seq in engine.requests.values():
        if seq.is_finished or not seq.block_table:
            continue
        refs.update(seq.block_table)
        assert len(seq.block_table) == bm.blocks_for(seq.num_computed_tokens), seq  # rejected drafts' blocks went back
        assert seq.num_computed_tokens == seq.num_tokens - 1 or seq.num_computed_tokens < seq.num_prompt_tokens
        for i in range(seq.num_registered_blocks):
            block = bm.blocks[seq.block_table[i]]
            assert block.token_ids == tuple(seq.token_ids[i * bm.block_size:(i + 1) * bm.block_size])
    for block in bm.blocks:
        assert block.ref_count == refs[block.block_id]
        assert (block.ref_count == 0) == (block.block_id in bm.free_block_ids)
        if block.hash is not None and bm.hash_to_block_id.get(block.hash) == block.block_id:
            assert block.token_ids is not None and len(block.token_ids) == bm.block_size


def run(model, prompts, params, speculative: str, propose=None, **config):
    """(token ids, finish reason) per prompt, the block manager checked after every step."""
    llm = LLM(model, speculative=speculative, **{**CONFIG, **config})
    engine = llm.engine
    if propose is not None:
        engine.speculator.draft = propose
    params = params if isinstance(params, list) else [params] * len(prompts)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), prompt, p)
    tokens: dict[str, list[int]] = collections.defaultdict(list)
    reasons = {}
    for _ in range(2000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                reasons[out.request_id] = out.finish_reason
        check_blocks(engine)
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks
    return [(tokens[str(i)], reasons[str(i)]) for i in range(len(prompts))], engine


def repetitive_prompts(vocab: int) -> list[list[int]]:
    """Random prompts and prompts that repeat a phrase (where n-gram drafts often hold)."""
    phrases = random_prompts([5, 7, 3], vocab, seed=11)
    return random_prompts([9, 23, 4, 31], vocab, seed=12) + [p * 4 + p[:2] for p in phrases]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_output_is_the_same_with_ngram_drafts(tiny_models, dtype):
    drafted = accepted = 0
    for arch, model in tiny_models.items():
        prompts = repetitive_prompts(2048)
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        expected, _ = run(model, prompts, params, "off", dtype=dtype)
        got, engine = run(model, prompts, params, "ngram", dtype=dtype, speculative_ngram_min=1)
        assert got == expected, arch
        drafted += engine.speculator.counters.num_draft_tokens
        accepted += engine.speculator.counters.num_accepted_tokens
    assert 0 < accepted < drafted  # drafts were verified, some kept and some rejected


def forced_proposer(prompts, references):
    """A proposer that knows each request's reference output: right for a number of tokens that
    varies with the step (0 to all), then wrong, so every acceptance length is exercised."""
    calls = [0]

    def draft(state, tokens, limit):
        calls[0] += 1
        prompt = next(p for p in prompts if tokens[:len(p)] == p)
        reference = references[prompts.index(prompt)]
        done = len(tokens) - len(prompt)
        truth = reference[done:done + limit]
        right = calls[0] % (limit + 2)
        return truth[:right] + [(t + 1) % 2048 for t in truth[right:]]
    return draft


def test_forced_drafts_of_every_acceptance_length_keep_output_stops_and_lengths(tiny_model_dir):
    prompts = [p for p in random_prompts([6, 11, 3, 17, 9], 2048, seed=5)]
    base = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    references = [tokens for tokens, _ in run(tiny_model_dir, prompts, base, "off")[0]]
    # Each request stops on a token met mid-way, or ends on max_tokens, inside drafted runs.
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[ref[7 + i]])
              for i, ref in enumerate(references[:3])]
    params += [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (5, 13)]
    expected, _ = run(tiny_model_dir, prompts, params, "off")
    got, engine = run(tiny_model_dir, prompts, params, "ngram", propose=forced_proposer(prompts, references),
                      speculative_tokens=6)
    assert got == expected
    assert [r for _, r in got] == ["stop"] * 3 + ["length"] * 2
    c = engine.speculator.counters
    assert c.accepted_per_position[0] > 0 and c.accepted_per_position[3] > 0  # long drafts were accepted whole
    assert c.num_accepted_tokens < c.num_draft_tokens  # ... and others rejected


def test_requests_that_must_not_draft_are_unchanged_beside_ones_that_do(tiny_model_dir):
    prompts = repetitive_prompts(2048)[:6]
    params = [SamplingParams(temperature=0, max_tokens=25, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=7, max_tokens=25, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=25, ignore_eos=True, min_tokens=10),
              SamplingParams(temperature=0, max_tokens=25, ignore_eos=True, repetition_penalty=1.3),
              SamplingParams(temperature=0, max_tokens=25, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0, max_tokens=25, ignore_eos=True, speculative=False)]
    expected, _ = run(tiny_model_dir, prompts, params, "off")
    got, engine = run(tiny_model_dir, prompts, params, "ngram")
    assert got == expected
    drafted = [engine.requests.get(str(i)) for i in range(6)]  # all finished: states went with them
    assert drafted == [None] * 6


def test_preemption_with_speculation_on_recomputes_to_the_same_output(tiny_model_dir):
    prompts = repetitive_prompts(2048)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    small = dict(num_kvcache_blocks=40, max_num_seqs=6)
    expected, _ = run(tiny_model_dir, prompts, params, "off", **small)
    got, engine = run(tiny_model_dir, prompts, params, "ngram", **small)
    assert got == expected
    assert engine.scheduler.num_preemptions > 0 and engine.speculator.counters.num_drafts > 0


def test_stop_strings_end_the_text_where_they_do_without_speculation(tiny_model_dir):
    llm = LLM(tiny_model_dir, **CONFIG)
    prompt = repetitive_prompts(2048)[5]
    text = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                        use_tqdm=False)[0]["text"]
    stop = text[len(text) // 2:len(text) // 2 + 3]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop])
    expected = llm.generate([prompt], params, use_tqdm=False)[0]
    spec = LLM(tiny_model_dir, speculative="ngram", **CONFIG)
    got = spec.generate([prompt], params, use_tqdm=False)[0]
    assert (got["text"], got["finish_reason"]) == (expected["text"], expected["finish_reason"])
    assert expected["finish_reason"] == "stop" and stop not in expected["text"]


def test_default_model_packed_path_greedy_is_the_same_with_speculation():
    import inspect
    import json
    llm_off = LLM("default", max_num_seqs=4)
    tok = llm_off.tokenizer
    source = inspect.getsource(json.dumps)[:900]
    questions = [f"Repeat this function exactly, renaming it to to_json:\n\n{source}",
                 "Write a short poem about the sea.",
                 "List the numbers from 1 to 30, separated by commas."]
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
               for q in questions]
    prompts = [p if isinstance(p, list) else p["input_ids"] for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=48)
    expected = [llm_off.generate([p], params, use_tqdm=False)[0]["token_ids"] for p in prompts]
    del llm_off
    llm_on = LLM("default", max_num_seqs=4, speculative="ngram")
    got = [llm_on.generate([p], params, use_tqdm=False)[0]["token_ids"] for p in prompts]
    assert got == expected
    assert llm_on.engine.speculator.counters.num_accepted_tokens > 0
