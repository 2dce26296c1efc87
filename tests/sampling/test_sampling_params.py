"""SamplingParams: every invalid value is a SamplingError naming the field and its range; the wire form round-trips."""
from __future__ import annotations

import msgpack
import pytest

from nanovllm import sampling_params as sp
from nanovllm.sampling_params import SamplingParams

INVALID = [
    ("temperature", -0.1, ">= 0"), ("temperature", float("nan"), ">= 0"), ("temperature", "hot", ">= 0"),
    ("top_k", -2, "-1 or 0 (disabled) or an integer in [1, 2147483647]"), ("top_k", 1.5, "[1, 2147483647]"),
    ("top_k", 2 ** 31, "[1, 2147483647]"),
    ("top_p", 0.0, "(0, 1]"), ("top_p", 1.01, "(0, 1]"),
    ("min_p", -0.01, "[0, 1]"), ("min_p", 1.5, "[0, 1]"),
    ("seed", -2 ** 63 - 1, "[-2**63, 2**64)"), ("seed", 2 ** 64, "[-2**63, 2**64)"), ("seed", 1.0, "[-2**63, 2**64)"),
    ("repetition_penalty", 0.0, "[0.01, 100]"), ("presence_penalty", 2.5, "[-2, 2]"), ("frequency_penalty", -2.1, "[-2, 2]"),
    ("logit_bias", {5: 101}, "[-100, 100]"), ("logit_bias", {-3: 1.0}, "token ids in [0, 2**32)"),
    ("logit_bias", {"4294967296": 1.0}, "token ids in [0, 2**32)"), ("logit_bias", [1, 2], "map"),
    ("max_tokens", 0, "[1, 2147483647]"), ("max_tokens", 2 ** 31, "[1, 2147483647]"),
    ("min_tokens", -1, "[0, max_tokens"), ("min_tokens", 100, "[0, max_tokens=64]"),
    ("ignore_eos", 1, "true or false"), ("skip_special_tokens", "yes", "true or false"),
    ("include_stop_str_in_output", None, "true or false"),
    ("stop_token_ids", [-1], "token ids in [0, 2**32)"), ("stop_token_ids", [2 ** 32], "token ids in [0, 2**32)"),
    ("stop", [""], "non-empty strings"), ("stop", [3], "non-empty strings"),
    ("logprobs", -1, "[0, 20]"), ("logprobs", 21, "[0, 20]"),
    ("banned_words", [""], "non-empty strings"), ("banned_words", [[]], "non-empty lists"), ("banned_words", "abc", "list"),
    ("allowed_token_ids", [], "non-empty list"), ("allowed_token_ids", [1, -2], "token ids in [0, 2**32)"),
    ("logits_processors", [42], "callables"), ("cache_salt", "", "non-empty string"),
    ("cache_salt", "s" * 257, "at most 256 characters"),
    ("response_format", {"type": "xml"}, "type must be one of"), ("response_format", "{", "not valid JSON"),
]


@pytest.mark.parametrize("field,value,allowed", INVALID, ids=[f"{f}={v!r}" for f, v, _ in INVALID])
def test_invalid_values_name_field_and_range(field, value, allowed):
    with pytest.raises(sp.SamplingError) as e:
        SamplingParams(**{field: value})
    assert str(e.value).startswith(field) and allowed in str(e.value) and e.value.field == field
    if field in sp.WIRE_FIELDS:
        with pytest.raises(sp.SamplingError) as wire:  # the same words for the same value off the wire
            SamplingParams.from_dict({field: value})
        assert str(wire.value) == str(e.value)


def test_defaults_are_valid_and_boundaries_accepted():
    SamplingParams()
    SamplingParams(temperature=0, top_k=1, top_p=1.0, min_p=1.0, seed=2 ** 64 - 1, repetition_penalty=0.01,
                   presence_penalty=-2, frequency_penalty=2, logit_bias={0: -100, "7": 100}, min_tokens=64,
                   logprobs=0, stop="x", banned_words=["a", [1, 2]], allowed_token_ids=[0])
    SamplingParams(seed=-2 ** 63, top_k=2 ** 31 - 1, max_tokens=2 ** 31 - 1, stop_token_ids=[2 ** 32 - 1],
                   logit_bias={"4294967295": 1.0}, temperature=1e300)
    assert SamplingParams(top_k=0) == SamplingParams(top_k=-1)  # 0 disables, as in vLLM


def test_the_struct_is_frozen_and_a_copy_is_checked_again():
    import dataclasses

    params = SamplingParams(temperature=0.5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.temperature = 3
    assert dataclasses.replace(params, max_tokens=9).max_tokens == 9
    with pytest.raises(sp.SamplingError, match="max_tokens"):
        dataclasses.replace(params, max_tokens=0)


def test_text_params_keep_what_the_detokenizer_reads_and_nothing_it_does_not():
    full = SamplingParams(temperature=0.3, stop=["\n"], include_stop_str_in_output=True, skip_special_tokens=False,
                          min_tokens=5, max_tokens=90, allowed_token_ids=list(range(1000)), logit_bias={1: 2.0})
    text = full.text_params()
    assert text == SamplingParams(stop=["\n"], include_stop_str_in_output=True, skip_special_tokens=False,
                                  min_tokens=5, max_tokens=90)
    assert set(text.to_dict()) <= set(sp.TEXT_FIELDS)
    plain = SamplingParams(stop=["x"])
    assert plain.text_params() is plain  # nothing to drop: the same object


def test_wire_round_trip_through_msgpack():
    params = SamplingParams(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05, seed=123, repetition_penalty=1.1,
                            presence_penalty=0.5, frequency_penalty=-0.5, logit_bias={17: -5.5, 3: 2.0},
                            max_tokens=33, min_tokens=2, ignore_eos=True, stop_token_ids=[9], stop=["\n\n", "END"],
                            include_stop_str_in_output=True, logprobs=5, skip_special_tokens=False,
                            banned_words=["bad word", [4, 5, 6]], allowed_token_ids=[1, 2, 3, 4])
    wire = msgpack.packb(params.to_dict())
    back = SamplingParams.from_dict(msgpack.unpackb(wire, raw=False))  # default strict_map_key: string keys only
    assert back == params
    assert back.logit_bias == {17: -5.5, 3: 2.0}
    assert SamplingParams.from_dict(SamplingParams().to_dict()) == SamplingParams()
    assert SamplingParams().to_dict() == {}  # defaults are omitted


def test_from_dict_rejects_unknown_and_in_process_fields():
    with pytest.raises(ValueError, match=r"unknown sampling parameter\(s\) \['temprature'\]"):
        SamplingParams.from_dict({"temprature": 0.5})
    with pytest.raises(ValueError, match="logits_processors"):
        SamplingParams.from_dict({"logits_processors": []})
    with pytest.raises(ValueError, match="in-process only"):
        SamplingParams(logits_processors=[lambda ids, logits: logits]).to_dict()


def test_single_stop_string_and_string_bias_keys_are_normalized():
    p = SamplingParams(stop="###", logit_bias={"12": 1})
    assert p.stop == ["###"] and p.logit_bias == {12: 1.0}


def nested(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


class LoudRepr:
    def __repr__(self) -> str:
        raise RuntimeError("repr is hostile")


@pytest.mark.parametrize("field", ["temperature", "top_k", "seed", "logit_bias", "stop", "banned_words",
                                   "allowed_token_ids", "stop_token_ids", "max_tokens"])
@pytest.mark.parametrize("value", [nested(1000), "x" * 100_000, LoudRepr(), 10 ** 5000],
                         ids=["nested-1000", "long-string", "hostile-repr", "huge-int"])
def test_hostile_values_give_a_short_clean_error(field, value):
    with pytest.raises(ValueError) as e:
        SamplingParams(**{field: value})
    assert str(e.value).startswith(field) and len(str(e.value)) < 400


def test_huge_numbers_are_value_errors_not_overflow():
    for field in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty"):
        with pytest.raises(ValueError, match=field):
            SamplingParams(**{field: 10 ** 400})
    with pytest.raises(ValueError, match=r"logit_bias\[1\] must be in \[-100, 100\]"):
        SamplingParams(logit_bias={1: 10 ** 400})
    with pytest.raises(ValueError, match=r"logit_bias keys must be token ids in \[0, 2\*\*32\), got <int>"):
        SamplingParams(logit_bias={10 ** 5000: 101})


def test_repetition_penalty_range_is_what_the_sampler_handles_exactly():
    for value in (1e-300, 0.009, 100.5, 1e300):
        with pytest.raises(ValueError, match=r"repetition_penalty must be in \[0.01, 100\]"):
            SamplingParams(repetition_penalty=value)
    SamplingParams(repetition_penalty=100)


def test_mixed_key_types_are_value_errors_not_sorting_type_errors():
    with pytest.raises(ValueError, match="logit_bias keys"):
        SamplingParams(logit_bias={b"1": 1.0, "2": 1.0})
    with pytest.raises(ValueError, match="logit_bias keys"):
        SamplingParams(logit_bias={"²": 1.0})  # a digit to str.isdigit, not to int()
    with pytest.raises(ValueError, match=r"unknown sampling parameter\(s\) \['y', b'x'\]"):
        SamplingParams.from_dict({b"x": 1, "y": 2, "top_p": 0.5})


LIMITS = [  # field, the largest valid value, one over the limit, the limit's text in the error
    ("banned_words", ["w"] * sp.MAX_BANNED_WORDS, ["w"] * (sp.MAX_BANNED_WORDS + 1), "at most 64 entries"),
    ("banned_words", ["é" * sp.MAX_BANNED_WORD_LENGTH], ["é" * (sp.MAX_BANNED_WORD_LENGTH + 1)], "at most 128"),
    ("banned_words", [[7] * sp.MAX_BANNED_WORD_LENGTH], [[7] * (sp.MAX_BANNED_WORD_LENGTH + 1)], "at most 128"),
    ("stop", ["s"] * sp.MAX_STOP_STRINGS, ["s"] * (sp.MAX_STOP_STRINGS + 1), "at most 64 strings"),
    ("stop", "s" * sp.MAX_STOP_STRING_LENGTH, "s" * (sp.MAX_STOP_STRING_LENGTH + 1), "at most 1024 characters"),
    ("stop_token_ids", [1] * sp.MAX_STOP_TOKEN_IDS, [1] * (sp.MAX_STOP_TOKEN_IDS + 1), "at most 1024"),
    ("allowed_token_ids", list(range(sp.MAX_ALLOWED_TOKEN_IDS)), list(range(sp.MAX_ALLOWED_TOKEN_IDS + 1)),
     "at most 262144"),
    ("logit_bias", {i: 1.0 for i in range(sp.MAX_LOGIT_BIAS)}, {i: 1.0 for i in range(sp.MAX_LOGIT_BIAS + 1)},
     "at most 1024"),
]


@pytest.mark.parametrize("field,largest,over,limit", LIMITS, ids=[f"{f}-{i}" for i, (f, *_) in enumerate(LIMITS)])
def test_per_request_work_is_bounded(field, largest, over, limit):
    SamplingParams(**{field: largest})
    with pytest.raises(ValueError) as e:
        SamplingParams(**{field: over})
    assert str(e.value).startswith(field) and limit in str(e.value) and len(str(e.value)) < 400


def test_limits_are_checked_before_the_entries():
    class Endless(list):  # a list whose entries must never be walked
        def __iter__(self):
            raise AssertionError("entries walked before the size check")
    for field in ("stop", "banned_words", "stop_token_ids", "allowed_token_ids"):
        with pytest.raises(ValueError, match=field):
            SamplingParams(**{field: Endless([1] * 10 ** 6)})
