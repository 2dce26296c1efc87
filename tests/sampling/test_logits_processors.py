"""Logits processors against brute force: the exact set of tokens a banned word or sequence blocks."""
from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nanovllm.layers.logits_processors import BannedTokenSequences, BannedWords, WordIndex, build_logits_processors
from nanovllm.layers.token_bytes import token_byte_table
from nanovllm.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture(scope="module")
def table(tokenizer):
    return token_byte_table(tokenizer, len(tokenizer))


def test_token_bytes_concatenate_to_the_decoded_text(tokenizer, table):
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(3, len(tokenizer)) for _ in range(rng.randint(1, 12))]
        assert b"".join(table[i] for i in ids).decode("utf-8", errors="replace") == tokenizer.decode(ids)
    assert table[tokenizer.convert_tokens_to_ids("<|im_end|>")] == b""


def blocked_by(processor, output: list[int], vocab: int) -> set[int]:
    logits = processor(output, torch.zeros(vocab))
    return set(torch.nonzero(torch.isinf(logits)).flatten().tolist())


WORDS = ["self", " import", "ing ", "é", "return None", "x"]


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_banned_words_block_exactly_the_completing_tokens(tokenizer, table, data):
    index = WordIndex(table)
    word = data.draw(st.sampled_from(WORDS))
    processor = BannedWords([word], index)
    # An output that ends partway into the word, so several completions are live.
    text = data.draw(st.text(alphabet="self imortngéxRuNn", max_size=12)) + word[:data.draw(st.integers(0, len(word) - 1))]
    output = tokenizer.encode(text)
    produced = b"".join(table[t] for t in output)
    target = word.encode()
    # Blocked: exactly the tokens that would create an occurrence ending inside themselves.
    expected = {t for t in range(len(table))
                if target in (produced + table[t])[max(0, len(produced) - len(target) + 1):]}
    assert blocked_by(processor, output, len(table)) == expected


def test_banned_token_sequences_block_only_the_last_token_after_the_prefix():
    processor = BannedTokenSequences([[7], [3, 4, 5]])
    assert blocked_by(processor, [], 16) == {7}
    assert blocked_by(processor, [1, 3, 4], 16) == {7, 5}
    assert blocked_by(processor, [3, 4, 1], 16) == {7}


def test_build_checks_token_ids_against_the_vocab():
    with pytest.raises(ValueError, match=r"allowed_token_ids has token id 99 outside the vocabulary \[0, 50\)"):
        build_logits_processors(SamplingParams(allowed_token_ids=[1, 99]), 50, "cpu", lambda: None)
    with pytest.raises(ValueError, match="banned_words has token id 50"):
        build_logits_processors(SamplingParams(banned_words=[[1, 50]]), 50, "cpu", lambda: None)
    calls = []
    build_logits_processors(SamplingParams(banned_words=[[1]]), 50, "cpu", lambda: calls.append(1))
    assert calls == []  # token-id bans need no tokenizer


def test_huge_token_ids_give_a_short_error():
    with pytest.raises(ValueError, match=r"allowed_token_ids has token id <int> outside the vocabulary \[0, 50\)"):
        build_logits_processors(SamplingParams(allowed_token_ids=[10 ** 5000]), 50, "cpu", lambda: None)
