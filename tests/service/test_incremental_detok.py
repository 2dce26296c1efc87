"""Incremental detokenization (detok_proc.incremental) against a real byte-level BPE tokenizer."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from detok_proc.incremental import DetokState

ALPHABET = st.sampled_from(list("ab cd\n文字中国😀🚀🎉éüß—") + ["ñ", "한", "ア"])
TEXTS = st.text(alphabet=ALPHABET, min_size=1, max_size=40)


@pytest.fixture(scope="session")
def tok(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


def feed(tok, ids: list[int], cuts: list[int], stop: list[str] | None = None) -> tuple[list[str], bool]:
    state = DetokState.create(tok, [], True, stop)
    bounds = sorted({c % (len(ids) + 1) for c in cuts} | {len(ids)})
    chunks, start = [], 0
    for end in bounds:
        text, stopped = state.add_tokens(ids[start:end], finished=end == len(ids))
        chunks.append(text)
        start = end
        if stopped:
            return chunks, True
    return chunks, False


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=TEXTS, cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=12))
def test_no_replacement_char_and_no_lost_char_for_any_chunking(tok, text, cuts):
    ids = tok.encode(text, add_special_tokens=False)
    chunks, _ = feed(tok, ids, cuts)
    assert "".join(chunks) == tok.decode(ids) == text
    assert not any("\ufffd" in c for c in chunks)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=TEXTS, data=st.data(), cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=12))
def test_stop_string_cuts_exactly_and_is_never_streamed(tok, text, data, cuts):
    i = data.draw(st.integers(min_value=0, max_value=len(text) - 1))
    j = data.draw(st.integers(min_value=i + 1, max_value=min(len(text), i + 4)))
    stop = text[i:j]
    ids = tok.encode(text, add_special_tokens=False)
    chunks, stopped = feed(tok, ids, cuts, [stop])
    assert stopped
    assert "".join(chunks) == text[:text.find(stop)]


def test_prompt_tail_gives_first_token_its_context(tok):
    prompt = tok.encode("x = 1\n", add_special_tokens=False)
    out = tok.encode("print(x)", add_special_tokens=False)
    state = DetokState.create(tok, prompt, True, [])
    pieces = [state.add_tokens([t], finished=k == len(out) - 1)[0] for k, t in enumerate(out)]
    assert "".join(pieces) == "print(x)"


def test_special_tokens_follow_the_request_setting(tok):
    ids = tok.encode("hi", add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
    kept = DetokState.create(tok, [], False, []).add_tokens(ids, True)[0]
    skipped = DetokState.create(tok, [], True, []).add_tokens(ids, True)[0]
    assert (kept, skipped) == ("hi<|im_end|>", "hi")
