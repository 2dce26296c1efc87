"""Logprobs through the service: the engine's entries, with each token's text, streamed to the
client and equal to the offline engine's."""
from __future__ import annotations

import pytest

from nanovllm import LLM, SamplingParams
from tests.engine.conftest import random_prompts

PROMPT = random_prompts([14], vocab=2048, seed=21)[0]
ABS = 0.05
"""bf16 (what `auto` gives here with AVX-512-BF16) batched differently than offline: the same
kernels, other rounding."""


@pytest.fixture(scope="module")
def offline(tiny_model_dir):
    llm = LLM(tiny_model_dir)
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3,
                                                prompt_logprobs=2), use_tqdm=False)[0]
    llm.engine.close()
    return out


def _same(ours, theirs):
    assert [e.token_id for e in ours] == [e.token_id for e in theirs]
    for a, b in zip(ours, theirs):
        assert a.logprob == pytest.approx(b.logprob, abs=ABS)
        assert [t.token_id for t in a.top][:1] == b.top_token_ids[:1]
        assert [t.logprob for t in a.top] == pytest.approx(b.top_logprobs, abs=ABS)


def test_streamed_logprobs_equal_the_offline_engines(client, offline):
    deltas = list(client.stream(PROMPT, temperature=0, max_tokens=8, ignore_eos=True, logprobs=3, prompt_logprobs=2))
    assert [t for d in deltas for t in d.token_ids] == offline["token_ids"]
    for d in deltas:  # one entry per token, each with its text and bytes
        assert d.logprobs is not None and len(d.logprobs) == len(d.token_ids)
        assert [e.token_id for e in d.logprobs] == d.token_ids
    entries = [e for d in deltas for e in d.logprobs]
    _same(entries, offline["logprobs"])
    assert all(len(e.top) == 3 and e.rank >= 1 for e in entries)
    assert b"".join(e.bytes for e in entries).decode("utf-8", "replace") == "".join(d.text for d in deltas)
    assert deltas[0].prompt_logprobs is not None and all(d.prompt_logprobs is None for d in deltas[1:])
    assert [e.token_id for e in deltas[0].prompt_logprobs] == PROMPT
    _same(deltas[0].prompt_logprobs, offline["prompt_logprobs"])
    result = client.generate(PROMPT, temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    assert [e.token_id for e in result.logprobs] == result.token_ids and result.prompt_logprobs is None
    assert all(e.top == [] for e in result.logprobs)
    assert client.generate(PROMPT, max_tokens=2).logprobs is None
