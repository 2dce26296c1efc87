"""The null model (`Config.null_model`): fixed, instant logits; the rest of the engine runs for real."""
from __future__ import annotations

import os
import shutil
import time

import pytest

from nanovllm.config import Config
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.models.null_model import NullModel, null_next_token
from nanovllm.sampling_params import SamplingParams
from tests.engine.conftest import random_prompts

VOCAB = 2048  # the tiny model's tokenizer


@pytest.fixture(scope="module")
def config_only_dir(tiny_model_dir, tmp_path_factory) -> str:
    """The tiny model's folder without its weights: the null model must not need them."""
    path = str(tmp_path_factory.mktemp("null-model"))
    for name in os.listdir(tiny_model_dir):
        if not name.endswith(".safetensors"):
            shutil.copy(os.path.join(tiny_model_dir, name), path)
    return path


def run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> dict[str, list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    outputs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] += out.new_token_ids
    return outputs


def expected_walk(prompt: list[int], n: int) -> list[int]:
    tokens = [null_next_token(prompt[-1], VOCAB)]
    while len(tokens) < n:
        tokens.append(null_next_token(tokens[-1], VOCAB))
    return tokens


def test_outputs_follow_the_fixed_pattern_without_weights(config_only_dir):
    engine = LLMEngine(Config(model=config_only_dir, null_model=True, num_kvcache_blocks=512, max_num_seqs=16))
    assert isinstance(engine.runner.model, NullModel)
    assert engine.runner.kv_cache is None  # accounted in blocks, never written
    prompts = random_prompts([5, 40, 17, 63, 9, 30], vocab=VOCAB, seed=3)
    greedy = run(engine, prompts, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    assert [greedy[f"r{i}"] for i in range(len(prompts))] == [expected_walk(p, 50) for p in prompts]
    # Sampling lands on the same tokens: the chosen logit stands 30 above all others.
    sampled = run(engine, prompts, SamplingParams(temperature=1.0, top_p=0.9, max_tokens=50, ignore_eos=True))
    assert sampled == greedy


def test_eos_ends_a_request_where_the_walk_reaches_it(config_only_dir):
    engine = LLMEngine(Config(model=config_only_dir, null_model=True, num_kvcache_blocks=64))
    eos = engine.eos_token_id
    start = (eos - 3) % VOCAB  # the walk wraps around the vocabulary: the tiny tokenizer's EOS is id 2
    outputs = run(engine, [[100, start]], SamplingParams(temperature=0, max_tokens=10))
    assert outputs["r0"] == expected_walk([start], 3) and outputs["r0"][-1] == eos


def test_kv_pressure_preempts_and_frees_every_block(config_only_dir):
    # 12 sequences of up to 100 tokens need ~84 blocks of 16; 30 force preemptions.
    engine = LLMEngine(Config(model=config_only_dir, null_model=True, num_kvcache_blocks=30,
                              enable_prefix_caching=False))
    prompts = random_prompts([20, 35, 50, 28, 44, 31, 22, 48, 39, 26, 33, 41], vocab=VOCAB, seed=5)
    outputs = run(engine, prompts, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    assert engine.scheduler.num_preemptions > 0
    assert [outputs[f"r{i}"] for i in range(len(prompts))] == [expected_walk(p, 60) for p in prompts]
    assert engine.block_manager.num_free_blocks == 30


def test_a_step_of_64_sequences_takes_milliseconds(config_only_dir):
    engine = LLMEngine(Config(model=config_only_dir, null_model=True, max_num_seqs=64, num_threads=1))
    prompts = random_prompts([100] * 64, vocab=VOCAB, seed=7)
    start = time.perf_counter()
    outputs = run(engine, prompts, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    elapsed = time.perf_counter() - start
    assert sum(map(len, outputs.values())) == 64 * 200
    # ~204 steps of 1-3 ms each here; the bound, 50 ms a step, is loose so a loaded machine passes.
    assert elapsed < 0.05 * engine.num_steps, f"{elapsed:.2f}s for {engine.num_steps} steps"
