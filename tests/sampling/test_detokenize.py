"""The in-process incremental detokenizer: text equals a full decode, stop strings end it exactly."""
from __future__ import annotations

import pytest

from nanovllm.detokenize import IncrementalDetokenizer
from nanovllm.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tokenizer_dir)


def feed(tokenizer, text: str, params: SamplingParams) -> IncrementalDetokenizer:
    d = IncrementalDetokenizer(tokenizer, params)
    for token in tokenizer.encode(text):
        if d.add([token]):
            break
    return d


def test_text_grows_to_the_full_decode_without_broken_characters(tokenizer):
    text = "def café(): return '你好' 😀🎉 # naïve"
    ids = tokenizer.encode(text)
    d = IncrementalDetokenizer(tokenizer, SamplingParams())
    for token in ids:
        d.add([token])
        assert "\ufffd" not in d.text and text.startswith(d.text)
    assert d.text == text and not d.stopped


def test_stop_string_spanning_tokens_cuts_the_text(tokenizer):
    text = "x = 1\nreturn x + 你好\n"
    d = feed(tokenizer, text, SamplingParams(stop=["never", "rn x"]))
    assert d.text == "x = 1\nretu" and d.stop_reason == "rn x"
    d = feed(tokenizer, text, SamplingParams(stop=["rn x"], include_stop_str_in_output=True))
    assert d.text == "x = 1\nreturn x"
    d = feed(tokenizer, text, SamplingParams(stop=["好"]))
    assert d.text == "x = 1\nreturn x + 你"  # a stop string inside a multi-byte run


def test_earliest_stop_string_wins_and_min_tokens_delays_matching(tokenizer):
    text = "alpha beta gamma beta"
    assert feed(tokenizer, text, SamplingParams(stop=["gamma", "beta"])).text == "alpha "
    n = len(tokenizer.encode("alpha beta gamma"))
    late = feed(tokenizer, text, SamplingParams(stop=["beta"], min_tokens=n))
    assert late.text == "alpha beta gamma " and late.stopped
