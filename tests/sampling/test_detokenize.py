"""The incremental detokenizer behind both the offline `LLM` and the service's detokenizer stage:
text equals a full decode, no split character is ever streamed, stop strings cut exactly, and any
batching of the same tokens (a restarted stage feeds them all at once) gives the same result."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanovllm.detokenize import PROMPT_CONTEXT_TOKENS, IncrementalDetokenizer, direct_decode
from nanovllm.sampling_params import SamplingParams

ALPHABET = st.sampled_from(list("ab cd\n文字中国😀🚀🎉éüß—") + ["ñ", "한", "ア", "\u0301"])
TEXTS = st.text(alphabet=ALPHABET, min_size=1, max_size=30)
HYPOTHESIS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def tok(tokenizer_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture(scope="module")
def sentencepiece_tok():
    """A SentencePiece-style tokenizer: a decode drops the space that starts it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "<s>": 1, "▁Hello": 2, "▁world": 3, "!": 4}
    inner = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    inner.pre_tokenizer, inner.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    return PreTrainedTokenizerFast(tokenizer_object=inner, bos_token="<s>")


def encode_pieces(tok, pieces: list[str]) -> list[int]:
    """Token ids whose boundaries fall between the pieces (and inside them, where BPE splits)."""
    return [t for piece in pieces for t in tok.encode(piece, add_special_tokens=False)]


def detokenizer(tok, prompt_tail=(), **text_params) -> IncrementalDetokenizer:
    """A detokenizer for a request with these text-side sampling parameters."""
    params = SamplingParams(max_tokens=max(64, text_params.get("min_tokens", 0)), **text_params)
    return IncrementalDetokenizer(tok, params, prompt_tail=prompt_tail)


def feed_one_by_one(tok, ids: list[int], params: SamplingParams) -> IncrementalDetokenizer:
    d = IncrementalDetokenizer(tok, params)
    for token in ids:
        d.add([token])
    return d


# ---------------------------------------------------------------- decoding

def test_text_grows_to_the_full_decode_without_broken_characters(tok):
    text = "def café(): return '你好' 😀🎉 # naïve"
    ids = tok.encode(text)
    d = IncrementalDetokenizer(tok)
    pieces = [d.add([token]) for token in ids]
    assert not any("\ufffd" in p for p in pieces) and "".join(pieces) == d.text == text
    assert [p for p in pieces if p] != [text]  # text came out as it was decoded, not at the end
    assert d.token_ids == ids and not d.stopped


def test_a_character_is_released_by_the_token_that_completes_it(tok):
    ids = encode_pieces(tok, ["ab", "😀"])
    emoji = ids[len(tok.encode("ab")):]
    assert len(emoji) > 1, "the emoji should be split over byte tokens"
    d = IncrementalDetokenizer(tok)
    assert [d.add([t]) for t in ids] == ["ab"] + [""] * (len(emoji) - 1) + ["😀"]


def test_a_character_that_never_completes_comes_out_at_the_end(tok):
    ids = tok.encode("x😀", add_special_tokens=False)[:-1]  # the emoji's last byte never comes
    assert tok.decode(ids).endswith("\ufffd")
    d = IncrementalDetokenizer(tok)
    assert d.add(ids) == "x"
    assert d.add([], finished=True) == tok.decode(ids)[1:] and d.text == tok.decode(ids)
    with pytest.raises(RuntimeError, match="finished"):
        d.add([1])


def test_prompt_tail_gives_the_first_output_token_its_left_context(sentencepiece_tok):
    hello, world = 2, 3
    assert sentencepiece_tok.decode([world]) == "world"  # alone, the decode drops its space
    with_context = detokenizer(sentencepiece_tok, prompt_tail=[hello])
    assert with_context.add([world]) == " world"
    assert IncrementalDetokenizer(sentencepiece_tok).add([world]) == "world"
    # Skipped special tokens are no context: the window reaches back past them.
    padded = detokenizer(sentencepiece_tok, prompt_tail=[hello] + [1] * (PROMPT_CONTEXT_TOKENS - 1))
    assert padded.add([world]) == " world"
    too_far = detokenizer(sentencepiece_tok, prompt_tail=[hello] + [1] * PROMPT_CONTEXT_TOKENS)
    assert too_far.add([world]) == "world"


def test_a_prompt_ending_inside_a_character_loses_no_output_byte(tok):
    ids = tok.encode("hi 你好", add_special_tokens=False)
    assert "\ufffd" in tok.decode(ids[:-1]), "the last character should span tokens"
    d = detokenizer(tok, prompt_tail=ids[:-1])
    assert d.add(ids[-1:], finished=True) == tok.decode(ids[-1:])


def test_special_tokens_follow_the_request_setting(tok):
    ids = tok.encode("hi", add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
    kept = detokenizer(tok, skip_special_tokens=False).add(ids, finished=True)
    skipped = IncrementalDetokenizer(tok).add(ids, finished=True)
    assert (kept, skipped) == ("hi<|im_end|>", "hi")


# ---------------------------------------------------------------- stop strings

def test_stop_string_spanning_tokens_cuts_the_text(tok):
    ids = tok.encode("x = 1\nreturn x + 你好\n")
    d = feed_one_by_one(tok, ids, SamplingParams(stop=["never", "rn x"]))
    assert d.text == "x = 1\nretu" and d.stop_reason == "rn x"
    assert d.token_ids == ids[:len(d.token_ids)] and len(d.token_ids) < len(ids)
    assert feed_one_by_one(tok, ids, SamplingParams(stop=["rn x"], include_stop_str_in_output=True)).text == "x = 1\nreturn x"
    assert feed_one_by_one(tok, ids, SamplingParams(stop=["好"])).text == "x = 1\nreturn x + 你"


def test_text_that_may_begin_a_stop_string_is_held_until_it_cannot(tok):
    ids = encode_pieces(tok, list("xabaabc"))
    d = detokenizer(tok, stop=["abc"])
    assert [d.add([t]) for t in ids] == ["x", "", "", "ab", "a", "", ""]
    assert d.text == "xaba" and d.stop_reason == "abc"
    d = detokenizer(tok, stop=["abc"])
    assert d.add(ids[:3]) == "x" and d.add([], finished=True) == "ab"  # nothing more can come


def test_the_stop_string_that_ends_first_wins_and_the_longest_on_a_tie(tok):
    ids = tok.encode("alpha beta gamma beta")
    assert feed_one_by_one(tok, ids, SamplingParams(stop=["gamma", "beta"])).text == "alpha "
    ids = encode_pieces(tok, list("xabcd"))
    assert detokenizer(tok, stop=["abcd", "bc"]).add(ids) == "xa"  # "bc" is complete first
    d = detokenizer(tok, stop=["bc", "abc"])
    assert (d.add(ids), d.stop_reason) == ("x", "abc")
    d = detokenizer(tok, stop=["abc", "ab"])
    assert (d.add(ids), d.stop_reason) == ("x", "ab")


def test_min_tokens_lets_no_stop_string_end_the_output_early(tok):
    ids = tok.encode("alpha beta gamma beta")
    n = len(tok.encode("alpha beta gamma"))
    late = feed_one_by_one(tok, ids, SamplingParams(stop=["beta"], min_tokens=n))
    assert late.text == "alpha beta gamma " and late.stopped
    # A stop string that begins before min_tokens and ends after it counts.
    ids = encode_pieces(tok, list("xyzw"))
    d = detokenizer(tok, stop=["yz"], min_tokens=3)
    assert d.add(ids) == "x" and len(d.token_ids) == 3
    d = detokenizer(tok, stop=["xy"], min_tokens=3)
    assert d.add(ids, finished=True) == "xyzw" and not d.stopped
    # A match too early to count is not held: it cannot become the start of a later one.
    d = detokenizer(tok, stop=["xy"], min_tokens=3)
    assert [d.add([t]) for t in ids] == ["", "xy", "z", "w"]
    # Matching goes on inside a match too early to count.
    d = detokenizer(tok, stop=["aa"], min_tokens=3)
    assert (d.add(encode_pieces(tok, list("aaaa"))), d.stop_reason, len(d.token_ids)) == ("a", "aa", 3)


def test_after_a_stop_nothing_changes(tok):
    d = detokenizer(tok, stop=["b"])
    assert d.add(encode_pieces(tok, list("abc"))) == "a"
    assert (d.add([5, 6], finished=True), d.text, len(d.token_ids), d.stop_reason) == ("", "a", 2, "b")


# ---------------------------------------------------------------- any batching, same result

@st.composite
def requests(draw, tok):
    text = draw(TEXTS)
    cut_at = sorted(draw(st.sets(st.integers(1, len(text) - 1), max_size=8))) if len(text) > 1 else []
    pieces = [text[i:j] for i, j in zip([0, *cut_at], [*cut_at, len(text)])]
    ids = encode_pieces(tok, pieces)
    substrings = st.integers(0, len(text) - 1).flatmap(
        lambda i: st.integers(i + 1, min(len(text), i + 6)).map(lambda j: text[i:j]))
    stops = draw(st.lists(st.one_of(substrings, st.text(alphabet=ALPHABET, min_size=1, max_size=4)), max_size=3))
    if stops and draw(st.booleans()):  # a stop string that is a prefix of another
        stops.append(stops[0][:draw(st.integers(1, len(stops[0])))])
    prompt = tok.encode(draw(st.text(alphabet=ALPHABET, max_size=6)), add_special_tokens=False)
    params = dict(prompt_tail=prompt[:draw(st.integers(0, len(prompt)))], stop=stops,
                  include_stop_str_in_output=draw(st.booleans()),
                  min_tokens=draw(st.sampled_from([0, 0, draw(st.integers(0, len(ids) + 1))])))
    splits = sorted(draw(st.sets(st.integers(0, len(ids)), max_size=10)) | {len(ids)})
    return text, ids, params, splits


def expected_output(tok, text: str, ids: list[int], params: dict) -> tuple[str, str | None]:
    """Reference: the earliest-ending stop match (longest on a tie) among those that end in
    text decoded once min_tokens tokens are in."""
    before_min = detokenizer(tok, prompt_tail=params["prompt_tail"])
    before_min.add(ids[:max(params["min_tokens"] - 1, 0)])
    searchable_from = len(before_min.text)
    best = None
    for stop in params["stop"]:
        start = text.find(stop, max(0, searchable_from - len(stop) + 1))
        if start >= 0 and (best is None or (start + len(stop), -len(stop)) < (best[0] + len(best[1]), -len(best[1]))):
            best = (start, stop)
    if best is None:
        return text, None
    start, stop = best
    return text[:start + len(stop)] if params["include_stop_str_in_output"] else text[:start], stop


@HYPOTHESIS
@given(data=st.data())
def test_any_split_of_the_tokens_releases_the_same_text_and_stops_at_the_same_token(tok, data):
    text, ids, params, splits = data.draw(requests(tok))
    assert tok.decode(ids) == text
    whole = detokenizer(tok, **params)
    whole_out = whole.add(ids, finished=True)

    split = detokenizer(tok, **params)
    chunks, start = [], 0
    for end in splits:
        chunks.append(split.add(ids[start:end], finished=end == len(ids)))
        start = end
        if end < len(ids):
            # A restarted detokenizer stage rebuilds the request from all its tokens so far.
            rebuilt = detokenizer(tok, **params)
            rebuilt.add(ids[:end])
            assert (rebuilt.text, rebuilt.stop_reason, rebuilt.token_ids) == (split.text, split.stop_reason, split.token_ids)

    assert not any("\ufffd" in c for c in chunks)
    assert "".join(chunks) == split.text == whole_out == whole.text
    assert (split.stop_reason, split.token_ids) == (whole.stop_reason, whole.token_ids)
    assert (whole.text, whole.stop_reason) == expected_output(tok, text, ids, params)
    if whole.stopped:
        assert params["min_tokens"] <= len(whole.token_ids) <= len(ids) and ids[:len(whole.token_ids)] == whole.token_ids
    else:
        assert whole.token_ids == ids


# ---------------------------------------------------------------- the direct decode

@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_the_direct_decode_equals_the_tokenizers_decode(tok, data):
    direct = direct_decode(tok)
    assert direct is not None, "the test tokenizer should take the direct path"
    special = sorted(tok.all_special_ids)
    ids = data.draw(st.lists(st.one_of(st.integers(0, len(tok) - 1), st.sampled_from(special)), max_size=12))
    for skip in (True, False):
        assert direct(ids, skip_special_tokens=skip) == tok.decode(ids, skip_special_tokens=skip)


def test_the_direct_decode_is_not_taken_where_decode_does_more(tokenizer_dir):
    from transformers import AutoTokenizer

    cleaning = AutoTokenizer.from_pretrained(tokenizer_dir, clean_up_tokenization_spaces=True)
    assert direct_decode(cleaning) is None

    class Shouting(type(cleaning)):
        def decode(self, *args, **kwargs):
            return super().decode(*args, **kwargs).upper()

    shouting = Shouting.from_pretrained(tokenizer_dir, clean_up_tokenization_spaces=False)
    assert direct_decode(shouting) is None
    d = IncrementalDetokenizer(shouting)
    ids = shouting.encode("hello world", add_special_tokens=False)
    assert d.add(ids, finished=True) == "HELLO WORLD"
