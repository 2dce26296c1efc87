"""A request's `cache_salt` keeps its prompt out of other requests' prefix-cache hits."""
from __future__ import annotations

import pytest

from nanovllm.config import Config
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.sampling_params import MAX_CACHE_SALT_LENGTH, SamplingParams
from tests.engine.conftest import random_prompts


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return LLMEngine(Config(model=tiny_model_dir, block_size=8, num_kvcache_blocks=256, dtype="float32"))


def cached(engine: LLMEngine, request_id: str, prompt: list[int], salt: str | None) -> tuple[int, list[int]]:
    """(prompt tokens served from the cache, the greedy output) of one request run alone."""
    engine.add_request(request_id, prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, cache_salt=salt))
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.request_id == request_id]
    assert outs[-1].finished
    return outs[-1].num_cached_tokens, [t for o in outs for t in o.new_token_ids]


def test_a_salted_prompt_is_cached_only_for_the_same_salt(engine):
    prompt = random_prompts([41], vocab=2048, seed=21)[0]  # five full blocks of 8, and a last token
    first, answer = cached(engine, "a1", prompt, "tenant-a")
    assert first == 0
    assert cached(engine, "a2", prompt, "tenant-a") == (40, answer)  # its own tenant: every full block
    assert cached(engine, "b1", prompt, "tenant-b")[0] == 0  # another tenant: nothing
    assert cached(engine, "n1", prompt, None)[0] == 0  # no salt: the unsalted cache, also empty of it
    assert cached(engine, "n2", prompt, None) == (40, answer)  # the unsalted share among themselves
    assert cached(engine, "b2", prompt, "tenant-b") == (40, answer)  # b now has its own copy
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks


def test_the_salt_separates_from_the_first_block_on(engine):
    # Only the first block's hash takes the salt; the chain carries it to every later block, so a
    # prompt that shares a later block's tokens but not the salt never meets it.
    shared = random_prompts([24], vocab=2048, seed=22)[0]
    cached(engine, "c1", shared + [5] * 9, "x")
    assert cached(engine, "c2", shared + [6] * 9, "x")[0] == 24
    assert cached(engine, "c3", shared + [6] * 9, "y")[0] == 0


@pytest.mark.parametrize("bad, message", [
    ("", "cache_salt must be null or a non-empty string"), (7, "cache_salt must be null or a non-empty string"),
    ("s" * (MAX_CACHE_SALT_LENGTH + 1), f"at most {MAX_CACHE_SALT_LENGTH} characters")])
def test_a_bad_salt_is_refused_naming_the_field(bad, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(cache_salt=bad)


def test_the_salt_travels_in_the_wire_dict():
    params = SamplingParams(cache_salt="tenant-a")
    assert SamplingParams.from_dict(params.to_dict()).cache_salt == "tenant-a"
