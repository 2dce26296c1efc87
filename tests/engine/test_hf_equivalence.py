"""Greedy output equals HF transformers `generate` token for token (fp32), batched."""
from __future__ import annotations

import zlib

import pytest

from nanovllm import LLM, SamplingParams
from tests.engine.conftest import hf_greedy, random_prompts

LENGTHS = [1, 5, 17, 40, 3, 64]
MAX_NEW = 24


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen2"])
def test_greedy_matches_hf_batched(tiny_models, arch):
    path = tiny_models[arch]
    prompts = random_prompts(LENGTHS, vocab=2048, seed=zlib.crc32(arch.encode()) % 1000)
    expected = hf_greedy(path, prompts, MAX_NEW)
    llm = LLM(path, block_size=8, num_kvcache_blocks=256)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True), use_tqdm=False)
    assert [o["token_ids"] for o in outs] == expected


def test_chunked_prefill_mixed_with_decode_matches_hf(tiny_model_dir):
    # A 16-token step budget splits every long prompt over several steps, sharing them with
    # the decode tokens of sequences admitted earlier.
    prompts = random_prompts([50, 7, 33, 90, 2], vocab=2048, seed=5)
    expected = hf_greedy(tiny_model_dir, prompts, MAX_NEW)
    llm = LLM(tiny_model_dir, block_size=4, num_kvcache_blocks=512, max_num_batched_tokens=16)
    engine = llm.engine
    mixed_steps = 0
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True))
    got: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for o in engine.step():
            got[o.request_id].extend(o.new_token_ids)
        mixed_steps += bool(engine.last_step.num_prefill_tokens and engine.last_step.num_decode_tokens)
    assert [got[str(i)] for i in range(len(prompts))] == expected
    assert mixed_steps > 0


def test_eos_stops_and_text_is_decoded(tiny_model_dir):
    llm = LLM(tiny_model_dir, num_kvcache_blocks=64)
    eos = llm.engine.eos_token_id
    prompt = random_prompts([12], vocab=2048, seed=3)[0]
    free_run = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)[0]
    # Make the model's own 5th greedy token a stop token: generation must end right there.
    stop = free_run["token_ids"][4]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop]), use_tqdm=False)[0]
    first = free_run["token_ids"].index(stop)
    assert out["token_ids"] == free_run["token_ids"][:first + 1]
    assert out["text"] == llm.tokenizer.decode(out["token_ids"], skip_special_tokens=True)
    assert eos is not None


@pytest.mark.slow
def test_default_model_matches_hf_and_answers():
    from nanovllm.models.default_model import resolve_default_model
    import os
    import torch
    from transformers import AutoModelForCausalLM

    path = resolve_default_model()
    llm = LLM("default")
    chats = ["What is the capital of France?", "Name a primary color.", "Say hello in Spanish."]
    prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True, tokenize=False)
               for c in chats]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)
    assert "Paris" in outs[0]["text"]
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32).eval()
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([llm.tokenizer.encode(prompt)])
        with torch.inference_mode():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False)[0, ids.shape[1]:]
        assert out["token_ids"] == ref.tolist()
