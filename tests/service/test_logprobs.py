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


def test_a_stream_continued_across_an_engine_kill_keeps_its_logprobs(tiny_model_dir):
    """fp32, so the continuation (which prefills what was decoded) meets no near-tie: the same
    tokens as without the kill, every token with its entry, the prompt's entries once."""
    from nanovllm_client import Client
    from tests.service.conftest import EXACT_ARGS, TINY_ENGINE_ARGS, start_service
    from tests.service.harness import short_tmpdir, wait_for
    procs = start_service(tiny_model_dir, f"ipc://{short_tmpdir()}/lp", engine_args=TINY_ENGINE_ARGS + EXACT_ARGS)
    kw = dict(temperature=0, max_tokens=48, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    try:
        with Client(procs.url, timeout=180) as client:
            whole = client.generate(PROMPT, **kw)
            stream = client.stream(PROMPT, **kw)
            deltas = [next(stream)]
            assert not deltas[0].finished
            procs.kill("engine_proc")
            wait_for(lambda: client.engine_alive is False, timeout=60, what="engine reported dead")
            procs.restart("engine_proc")
            deltas += list(stream)
    except BaseException:
        print(procs.logs())
        raise
    finally:
        procs.stop()
    assert [t for d in deltas for t in d.token_ids] == whole.token_ids
    assert all(d.logprobs is not None and len(d.logprobs) == len(d.token_ids) for d in deltas)
    entries = [e for d in deltas for e in d.logprobs]
    assert [e.logprob for e in entries] == pytest.approx([e.logprob for e in whole.logprobs], abs=1e-3)
    assert [d.prompt_logprobs is not None for d in deltas] == [True] + [False] * (len(deltas) - 1)
