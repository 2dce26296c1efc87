"""A seeded sweep of valid but extreme sampling values through the real engine.

Whatever the mix, every request must end normally with every token inside the vocabulary:
values that pass validation are values the sampler handles.
"""
from __future__ import annotations

import random

import pytest

from nanovllm.config import Config
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.sampling_params import MAX_BANNED_WORD_LENGTH, SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return LLMEngine(Config(model=tiny_model_dir, block_size=8, num_kvcache_blocks=512, max_num_seqs=64))


def extreme_params(rng: random.Random, vocab: int) -> SamplingParams:
    some_id = rng.randrange(vocab)
    return SamplingParams(
        temperature=rng.choice([0, 5e-324, 1e-45, 1e-40, 1e-12, 0.01, 1.0, 100.0, 1e300]),
        top_k=rng.choice([-1, 1, 2, vocab - 1, vocab, 10 ** 9]),
        top_p=rng.choice([1e-50, 1e-8, 0.5, 1.0]),
        min_p=rng.choice([0.0, 1e-30, 0.5, 1.0]),
        seed=rng.choice([None, 0, 2 ** 64 - 1]),
        repetition_penalty=rng.choice([0.01, 1.0, 100.0]),
        presence_penalty=rng.choice([-2.0, 0.0, 2.0]),
        frequency_penalty=rng.choice([-2.0, 0.0, 2.0]),
        logit_bias=rng.choice([{}, {some_id: 100.0}, {some_id: -100.0},
                               {t: rng.choice([-100.0, 100.0]) for t in rng.sample(range(vocab), 50)}]),
        max_tokens=6,
        min_tokens=rng.choice([0, 3, 6]),
        ignore_eos=rng.random() < 0.5,
        stop_token_ids=rng.choice([[], [some_id], list(range(20))]),
        logprobs=rng.choice([None, 0, 20]),
        allowed_token_ids=rng.choice([None, [some_id], [0], [vocab - 1]]),
        banned_words=rng.choice([[], ["the"], ["é", " a"], [[some_id]], [[3, some_id]],
                                 ["x" * MAX_BANNED_WORD_LENGTH], [[some_id] * MAX_BANNED_WORD_LENGTH]]),
    )


@pytest.mark.parametrize("seed", range(3))
def test_extreme_values_never_crash_or_leave_the_vocabulary(engine, seed):
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    params = {f"s{seed}-{i}": extreme_params(rng, vocab) for i in range(48)}
    for request_id, p in params.items():
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 20))]
        engine.add_request(request_id, prompt, p)
    ends, tokens = {}, {r: [] for r in params}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                ends[out.request_id] = out.finish_reason
    assert ends.keys() == params.keys()
    assert set(ends.values()) <= {"stop", "length"}, [(r, params[r]) for r, e in ends.items() if e not in ("stop", "length")]
    for request_id, ids in tokens.items():
        assert ids and all(0 <= t < vocab for t in ids), (ids, params[request_id])
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks
