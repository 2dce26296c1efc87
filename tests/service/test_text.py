"""Text correctness over tcp://127.0.0.1, with a model scripted to emit exact token chains."""
from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from nanovllm_client import Client
from tests.service.chain_model import SPLIT_TEXT
from tests.service.harness import idle_before_the_natural_end, num_steps


@pytest.fixture
def tcp_client(tcp_chain_service):
    assert tcp_chain_service.url.startswith("tcp://127.0.0.1:")
    with Client(tcp_chain_service.url, timeout=60) as c:
        yield c
    tcp_chain_service.assert_running()


def test_chinese_and_emoji_split_over_byte_tokens_stream_without_replacement_chars(tcp_client, chain_model):
    path, chains = chain_model
    tok = AutoTokenizer.from_pretrained(path)
    split = chains["split"]
    assert all("\ufffd" in tok.decode([t]) for t in split[1:-1]), "every output token should be a lone byte"
    deltas = list(tcp_client.stream(prompt_token_ids=split[:1], max_tokens=30, temperature=0))
    assert [t for d in deltas for t in d.token_ids] == split[1:]
    assert not any("\ufffd" in d.text for d in deltas)
    assert "".join(d.text for d in deltas) == SPLIT_TEXT
    # Each character comes in the delta whose tokens complete it. (One delta per character when the
    # detokenizer keeps up; a stage that fell behind merges the steps waiting for it into one delta.)
    ids, text = [], ""
    for d in deltas:
        ids, text = ids + d.token_ids, text + d.text
        assert text == tok.decode(ids, skip_special_tokens=True).rstrip("\ufffd")
    assert deltas[-1].finish_reason == "stop"


def test_skip_special_tokens_is_per_request(tcp_client, chain_model):
    _, chains = chain_model
    start = chains["split"][:1]
    kept = tcp_client.generate(prompt_token_ids=start, max_tokens=30, skip_special_tokens=False)
    skipped = tcp_client.generate(prompt_token_ids=start, max_tokens=30)
    assert kept.text == SPLIT_TEXT + "<|im_end|>"
    assert skipped.text == SPLIT_TEXT


def test_stop_string_is_held_back_then_the_engine_request_is_aborted(tcp_client, chain_model):
    path, chains = chain_model
    tok = AutoTokenizer.from_pretrained(path)
    words = [tok.decode([t]) for t in chains["cycle"][1:]]  # an endless cycle w0 w1 w2 w0 w1 ...
    stop = words[2] + words[0]  # spans two tokens: w2 must be held back until w0 decides
    since = num_steps(tcp_client)
    deltas = list(tcp_client.stream(prompt_token_ids=chains["cycle"][:1], max_tokens=900, temperature=0,
                                    stop=[stop]))
    assert "".join(d.text for d in deltas) == words[0] + words[1]
    assert deltas[-1].finish_reason == "stop"
    # Left alone the engine would run 900 steps; the detokenizer's abort ends it now.
    idle_before_the_natural_end(tcp_client, since, 900, "the stopped request to leave the engine")


def test_greedy_stream_over_tcp_equals_offline_generate(tcp_client, chain_model):
    from nanovllm import LLM, SamplingParams

    path, chains = chain_model
    prompts = [chains["split"][:1], chains["cycle"][:1], [5, 6, 7, 8]]
    want = LLM(path, num_kvcache_blocks=64, num_threads=1).generate(
        prompts, SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)
    for prompt, expected in zip(prompts, want):
        got = tcp_client.generate(prompt_token_ids=prompt, max_tokens=20, temperature=0)
        assert (got.text, got.token_ids) == (expected["text"], expected["token_ids"])
