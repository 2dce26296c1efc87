"""Sampling through the real engine on a tiny random-weight model, checked against HF transformers."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch

from nanovllm import LLM, SamplingParams
from tests.engine.conftest import random_prompts

PROMPTS = random_prompts([9, 23, 4, 15, 31], vocab=2048, seed=11)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(tiny_model_dir, dtype="float32", block_size=8, num_kvcache_blocks=256)  # against HF in fp32


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def greedy(llm, prompt, n=24, **kw):
    return llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw), use_tqdm=False)[0]


def test_seeded_request_is_identical_whatever_its_neighbours(llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=24, ignore_eos=True)
    alone = llm.generate([PROMPTS[0]], seeded, use_tqdm=False)[0]
    crowd1 = llm.generate([PROMPTS[1], PROMPTS[0], PROMPTS[2]],
                          [SamplingParams(temperature=0.8, max_tokens=30), seeded, SamplingParams(temperature=0, max_tokens=5)],
                          use_tqdm=False)[1]
    crowd2 = llm.generate([PROMPTS[3], PROMPTS[4], PROMPTS[2], PROMPTS[0]],
                          [SamplingParams(temperature=1.2, top_k=5, seed=9, max_tokens=12),
                           SamplingParams(temperature=0.7, min_p=0.1, max_tokens=40, ignore_eos=True),
                           SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True), seeded], use_tqdm=False)[3]
    assert alone["token_ids"] == crowd1["token_ids"] == crowd2["token_ids"]
    assert alone["text"].encode() == crowd1["text"].encode() == crowd2["text"].encode()
    reseeded = llm.generate([PROMPTS[0]], SamplingParams(temperature=1.0, top_p=0.95, seed=1235, max_tokens=24, ignore_eos=True),
                            use_tqdm=False)[0]
    assert reseeded["token_ids"] != alone["token_ids"]


def test_banned_word_never_appears_though_greedy_output_has_it(llm):
    prompt = PROMPTS[1]
    free = greedy(llm, prompt, 32)
    tok = llm.tokenizer
    # A word the model prefers that takes two tokens: it is blocked as a string, whatever the spelling.
    k = next(i for i in range(2, len(free["token_ids"]) - 1)
             if len(w := tok.decode(free["token_ids"][i:i + 2])) >= 3 and w.strip() and "\ufffd" not in w)
    word = tok.decode(free["token_ids"][k:k + 2])
    assert word in free["text"]
    banned = greedy(llm, prompt, 32, banned_words=[word])
    assert word not in banned["text"]
    assert banned["token_ids"][:k] == free["token_ids"][:k]
    # As a token sequence: only the second token is blocked, and only right after the first.
    pair = free["token_ids"][k:k + 2]
    seq_banned = greedy(llm, prompt, 32, banned_words=[pair])
    ids = seq_banned["token_ids"]
    assert ids[:k + 1] == free["token_ids"][:k + 1]
    assert all(ids[i:i + 2] != pair for i in range(len(ids) - 1))


def test_logprobs_match_hf_log_softmax(llm, hf_model):
    prompt = PROMPTS[2]
    out = llm.generate([prompt], SamplingParams(temperature=1.0, seed=5, logprobs=5, max_tokens=12, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out["logprobs"]) == len(out["token_ids"]) == 12
    with torch.inference_mode():
        logits = hf_model(torch.tensor([prompt + out["token_ids"]])).logits[0]  # (T, V)
    ref = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)  # the distribution each token was drawn from
    for j, lp in enumerate(out["logprobs"]):
        assert lp.token_id == out["token_ids"][j]
        assert lp.logprob == pytest.approx(ref[j, lp.token_id].item(), abs=1e-4)
        assert lp.rank == int((ref[j] > ref[j, lp.token_id]).sum()) + 1
        top = ref[j].topk(5)
        assert lp.top_token_ids == top.indices.tolist()
        assert lp.top_logprobs == pytest.approx(top.values.tolist(), abs=1e-4)


def _check_prompt_logprobs(entries, prompt, hf_model, k):
    with torch.inference_mode():
        ref = torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0, :-1], dim=-1)  # position p scores p + 1
    assert [e.token_id for e in entries] == prompt
    first, entries = entries[0], entries[1:]  # the first token is given: logprob 0, no alternatives
    assert (first.logprob, first.rank, first.top_token_ids) == (0.0, 1, [])
    for j, e in enumerate(entries):
        assert e.logprob == pytest.approx(ref[j, e.token_id].item(), abs=1e-4)
        assert e.rank == int((ref[j] > ref[j, e.token_id]).sum()) + 1
        top = ref[j].topk(k) if k else None
        assert e.top_token_ids == (top.indices.tolist() if k else [])
        assert e.top_logprobs == pytest.approx(top.values.tolist() if k else [], abs=1e-4)


def test_prompt_logprobs_match_hf_log_softmax(llm, hf_model):
    out = llm.generate([PROMPTS[4], PROMPTS[1]], [SamplingParams(max_tokens=2, prompt_logprobs=3),
                                                  SamplingParams(max_tokens=2, prompt_logprobs=0)], use_tqdm=False)
    _check_prompt_logprobs(out[0]["prompt_logprobs"], PROMPTS[4], hf_model, 3)
    _check_prompt_logprobs(out[1]["prompt_logprobs"], PROMPTS[1], hf_model, 0)
    assert "prompt_logprobs" not in greedy(llm, PROMPTS[4], 2)


def test_prompt_logprobs_over_chunks_and_a_cached_prefix(tiny_model_dir, hf_model):
    """Chunked prefill scores every position once, in order; a prompt already in the prefix
    cache is computed whole again (its cached blocks would skip the positions to score), and
    the request after it, without prompt logprobs, still hits the cache."""
    llm = LLM(tiny_model_dir, dtype="float32", block_size=8, num_kvcache_blocks=256, max_num_batched_tokens=16,
              max_num_seqs=4)
    prompt = random_prompts([45], vocab=2048, seed=3)[0]
    plain = llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)  # fills the prefix cache
    assert plain[0]["token_ids"]
    out = llm.generate([prompt, PROMPTS[3]], SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2), use_tqdm=False)
    _check_prompt_logprobs(out[0]["prompt_logprobs"], prompt, hf_model, 2)
    _check_prompt_logprobs(out[1]["prompt_logprobs"], PROMPTS[3], hf_model, 2)
    assert out[0]["token_ids"] == llm.generate([prompt], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0]["token_ids"]
    engine = llm.engine
    engine.add_request("again", prompt, SamplingParams(max_tokens=1))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert outputs[-1].num_cached_tokens >= 40 and outputs[-1].prompt_logprobs is None


def test_repetition_penalty_matches_hf_generate(llm, hf_model):
    prompt = PROMPTS[3]
    ours = greedy(llm, prompt, 20, repetition_penalty=1.8, min_tokens=20)["token_ids"]
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        ref = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, min_new_tokens=20,
                                do_sample=False, repetition_penalty=1.8, pad_token_id=0)[0, len(prompt):].tolist()
    assert ours == ref
    assert ours != greedy(llm, prompt, 20, min_tokens=20)["token_ids"]  # the penalty mattered


def test_presence_and_frequency_penalties_match_the_openai_formula(llm, hf_model):
    prompt, presence, frequency = PROMPTS[0], 1.5, 0.8
    ours = greedy(llm, prompt, 16, presence_penalty=presence, frequency_penalty=frequency)["token_ids"]
    out: list[int] = []
    with torch.inference_mode():
        for _ in range(16):
            logits = hf_model(torch.tensor([prompt + out])).logits[0, -1]
            counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.shape[0]).float()
            out.append(int((logits - frequency * counts - presence * (counts > 0)).argmax()))
    assert ours == out
    assert ours != greedy(llm, prompt, 16)["token_ids"]


def test_stop_strings_cut_the_text(llm):
    prompt = PROMPTS[4]
    free = greedy(llm, prompt, 40)
    stop = free["text"][12:16]
    at = free["text"].index(stop)
    cut = greedy(llm, prompt, 40, stop=[stop, "\x00never"])
    assert cut["text"] == free["text"][:at] and cut["finish_reason"] == "stop"
    assert cut["token_ids"] == free["token_ids"][:len(cut["token_ids"])] and len(cut["token_ids"]) < 40
    kept = greedy(llm, prompt, 40, stop=stop, include_stop_str_in_output=True)
    assert kept["text"] == free["text"][:at + len(stop)]
    assert greedy(llm, prompt, 40)["finish_reason"] == "length"


def test_min_tokens_holds_back_stop_tokens(llm):
    prompt = PROMPTS[0]
    free = greedy(llm, prompt, 12)["token_ids"]
    stop = free[1]
    early = greedy(llm, prompt, 12, stop_token_ids=[stop])
    assert early["token_ids"] == free[:2] and early["finish_reason"] == "stop"
    held = greedy(llm, prompt, 12, stop_token_ids=[stop], min_tokens=6)["token_ids"]
    assert stop not in held[:6] and len(held) >= 6


def test_allowed_ids_bias_and_special_tokens(llm):
    prompt = PROMPTS[1]
    allowed = [100, 200, 300]
    out = llm.generate([prompt], SamplingParams(temperature=1.5, max_tokens=20, allowed_token_ids=allowed, seed=1),
                       use_tqdm=False)[0]
    assert set(out["token_ids"]) <= set(allowed)
    assert set(greedy(llm, prompt, 6, logit_bias={777: 100})["token_ids"]) == {777}
    im_start = llm.tokenizer.convert_tokens_to_ids("<|im_start|>")
    shown = greedy(llm, prompt, 2, allowed_token_ids=[im_start], skip_special_tokens=False)
    hidden = greedy(llm, prompt, 2, allowed_token_ids=[im_start])
    assert shown["text"] == "<|im_start|><|im_start|>" and hidden["text"] == ""


def test_mixed_batch_then_aborts_leave_no_request_state(llm):
    """A request's sampling state lives on its `Sequence`: once the request ends, nothing (the
    sampler included) holds either."""
    engine = llm.engine
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"m{i}", p, SamplingParams(temperature=0.9, seed=i, logprobs=2, banned_words=["the"],
                                                      repetition_penalty=1.2, max_tokens=50))
    requests = [weakref.ref(seq) for seq in engine.requests.values()]
    assert all(r().sampling is not None and r().sampling.generator is not None for r in requests)
    for _ in range(3):
        engine.step()
    engine.abort("m0")
    engine.abort("m3")
    while engine.has_unfinished_requests():
        for o in engine.step():
            assert o.logprobs is not None and len(o.logprobs) == len(o.new_token_ids)
    gc.collect()
    assert [r() for r in requests] == [None] * len(PROMPTS)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks


def test_engine_rejects_ids_outside_the_vocab(llm):
    vocab = llm.engine.model_config.vocab_size
    for params in (SamplingParams(allowed_token_ids=[vocab]), SamplingParams(banned_words=[[1, vocab]]),
                   SamplingParams(logit_bias={vocab: 1.0})):
        with pytest.raises(ValueError, match="outside the vocabulary"):
            llm.engine.add_request("bad", [1, 2, 3], params)
    assert "bad" not in llm.engine.requests and not llm.engine.has_unfinished_requests()
