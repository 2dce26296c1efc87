"""Logits processors against brute force: the exact set of tokens a banned word or sequence blocks."""
from __future__ import annotations

import random

import pytest
import torch
from hypothesis import assume, given, settings
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
    """Token ids in every list are below 2**32 (uint32 on the wire): the struct refuses larger
    ones at the door, in a few words, whatever their size."""
    for name, value in (("banned_words", [[10 ** 5000]]), ("allowed_token_ids", [10 ** 5000]),
                        ("stop_token_ids", [2 ** 32]), ("logit_bias", {10 ** 5000: 1.0})):
        with pytest.raises(ValueError, match=rf"{name} .*token ids.* in \[0, 2\*\*32\)") as e:
            SamplingParams(**{name: value})
        assert len(str(e.value)) < 300 and e.value.field == name


def test_allowed_token_ids_are_kept_packed_and_checked_against_the_vocab_at_either_end():
    params = SamplingParams(allowed_token_ids=[49, 0, 2 ** 32 - 1])
    assert params.allowed_token_ids.typecode == "I" and params.allowed_token_ids.itemsize == 4
    assert params.to_dict()["allowed_token_ids"] == [49, 0, 2 ** 32 - 1]  # a plain list on the wire
    with pytest.raises(ValueError, match=r"allowed_token_ids has token id 4294967295 outside the vocabulary \[0, 50\)"):
        build_logits_processors(params, 50, "cpu", lambda: None)
    [allowed] = build_logits_processors(SamplingParams(allowed_token_ids=[49, 0, 49]), 50, "cpu", lambda: None)
    assert (~allowed.blocked).nonzero().flatten().tolist() == [0, 49]


# -- the incremental banned-word matcher against brute force -----------------------------------

SYNTHETIC_BYTES = [b"a", b"b", b"\xc3", b"\xa9"]  # "é" is b"\xc3\xa9": tokens may split a character


def synthetic_table(draw_bytes: list[bytes]) -> list[bytes]:
    """Every single byte of the alphabet is a token, plus the drawn multi-byte ones, plus b"" (special)."""
    return SYNTHETIC_BYTES + [b""] + draw_bytes


def brute_force_blocked(table: list[bytes], output: list[int], words: list[str]) -> set[int]:
    produced = b"".join(table[t] for t in output)
    return {t for t in range(len(table))
            if any(w in (produced + table[t])[max(0, len(produced) - len(w) + 1):] for w in (x.encode() for x in words))}


token_bytes = st.lists(st.sampled_from(SYNTHETIC_BYTES), min_size=2, max_size=5).map(b"".join)


@settings(max_examples=150, deadline=None)
@given(extra=st.lists(token_bytes, max_size=12), words=st.lists(st.text("abé", min_size=1, max_size=6), min_size=1, max_size=4),
       data=st.data())
def test_incremental_matcher_matches_brute_force(extra, words, data):
    table = synthetic_table(extra)
    processor = BannedWords(words, WordIndex(table))
    output: list[int] = []
    for _ in range(data.draw(st.integers(1, 25))):
        move = data.draw(st.sampled_from(["one", "one", "one", "several", "same", "restart", "shrink"]))
        token = st.integers(0, len(table) - 1)
        if move == "one":
            output = output + [data.draw(token)]
        elif move == "several":
            output = output + data.draw(st.lists(token, min_size=2, max_size=6))
        elif move == "restart":  # a different output altogether (e.g. another request's history)
            before, output = output, data.draw(st.lists(token, max_size=10))
            # The processor tells another history from a continuation by its length and the token
            # where its last seen one was (O(new tokens) a step, as its docstring says); one as long
            # or longer that agrees there and differs before is not a case an engine produces (a
            # request's output only grows, or is replayed as it was after a preemption).
            assume(len(output) < len(before) or not before or output[len(before) - 1] != before[-1]
                   or output[:len(before)] == before)
        elif move == "shrink":
            output = output[:data.draw(st.integers(0, len(output)))]
        assert blocked_by(processor, output, len(table)) == brute_force_blocked(table, output, words), (output, words)


class CountingTable(list):
    reads = 0

    def __getitem__(self, i):
        CountingTable.reads += 1
        return super().__getitem__(i)


def test_each_output_token_is_read_once_however_long_the_output():
    rng = random.Random(3)
    table = CountingTable(synthetic_table([b"ab", b"ba", b"aab", b"\xc3\xa9a"]))
    processor = BannedWords(["ab" * 40, "éb", "a" * 100], WordIndex(table))
    output = []
    CountingTable.reads = 0
    for _ in range(400):
        blocked_by(processor, output, len(table))
        output.append(rng.randrange(len(table)))
    assert CountingTable.reads == 399  # one read per token: nothing is re-walked per call
