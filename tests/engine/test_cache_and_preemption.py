"""Prefix caching and preemption change how much is computed, never what is generated: in either
precision `dtype="auto"` picks (the `auto_dtype` fixture runs each test both ways)."""
from __future__ import annotations

from nanovllm import LLM, SamplingParams
from tests.engine.conftest import random_prompts

PARAMS = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def test_prefix_cache_reuses_blocks_and_keeps_greedy_output(tiny_model_dir, auto_dtype):
    shared = random_prompts([48], vocab=2048, seed=11)[0]
    tails = random_prompts([5, 9, 2, 13], vocab=2048, seed=12)
    prompts = [shared + t for t in tails]
    cold = LLM(tiny_model_dir, block_size=8, num_kvcache_blocks=256, enable_prefix_caching=False)
    expected = [o["token_ids"] for o in cold.generate(prompts, PARAMS, use_tqdm=False)]
    assert cold.engine.block_manager.prefix_cache_hits == 0

    warm = LLM(tiny_model_dir, block_size=8, num_kvcache_blocks=256)
    first = warm.generate(prompts[:1], PARAMS, use_tqdm=False)  # fills the cache with the shared prefix
    rest = warm.generate(prompts[1:], PARAMS, use_tqdm=False)
    assert [o["token_ids"] for o in first + rest] == expected
    assert warm.engine.block_manager.prefix_cache_hits >= 3 * 48  # six blocks of the prefix, three requests
    assert warm.engine.block_manager.num_free_blocks == 256


def test_preemption_keeps_greedy_output(tiny_model_dir, auto_dtype):
    prompts = random_prompts([30, 25, 28, 31, 22, 27], vocab=2048, seed=13)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    roomy = LLM(tiny_model_dir, block_size=4, num_kvcache_blocks=400)
    expected = [o["token_ids"] for o in roomy.generate(prompts, params, use_tqdm=False)]
    assert roomy.engine.scheduler.num_preemptions == 0
    # 6 sequences of up to ~71 tokens need ~108 blocks; 40 forces preemption.
    tight = LLM(tiny_model_dir, block_size=4, num_kvcache_blocks=40, enable_prefix_caching=False)
    got = [o["token_ids"] for o in tight.generate(prompts, params, use_tqdm=False)]
    assert tight.engine.scheduler.num_preemptions > 0
    assert got == expected
    assert tight.engine.block_manager.num_free_blocks == 40


def test_preemption_keeps_banned_word_decisions(tiny_model_dir, auto_dtype):
    # Banned strings keep matcher state between steps; a preempted, recomputed request must still
    # get the tokens it gets without preemption.
    prompts = random_prompts([30, 25, 28, 31, 22, 27], vocab=2048, seed=13)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    roomy = LLM(tiny_model_dir, block_size=4, num_kvcache_blocks=400)
    free = roomy.generate(prompts, params, use_tqdm=False)
    tok = roomy.tokenizer
    words = [w for o in free if (w := tok.decode(o["token_ids"][8:10])).strip() and "\ufffd" not in w]
    banned = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, banned_words=words)
    expected = [o["token_ids"] for o in roomy.generate(prompts, banned, use_tqdm=False)]
    assert expected != [o["token_ids"] for o in free]  # the bans matter
    tight = LLM(tiny_model_dir, block_size=4, num_kvcache_blocks=40, enable_prefix_caching=False)
    got = [o["token_ids"] for o in tight.generate(prompts, banned, use_tqdm=False)]
    assert tight.engine.scheduler.num_preemptions > 0
    assert got == expected
