"""A request whose sampling fails ends with finish_reason "error"; its batch neighbours do not notice."""
from __future__ import annotations

import pytest

from nanovllm import LLM, SamplingParams
from tests.engine.conftest import random_prompts

PROMPTS = random_prompts([9, 23, 4, 15, 31], vocab=2048, seed=21)


class FailsAt:
    """A custom logits processor that raises, or writes NaN, once the output has `at` tokens."""

    def __init__(self, how: str, at: int):
        self.how, self.at = how, at

    def __call__(self, output_ids, logits):
        if len(output_ids) >= self.at:
            if self.how == "raise":
                raise RuntimeError("lookup table missing")
            logits[11] = float("nan")
        return logits


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(tiny_model_dir, block_size=8, num_kvcache_blocks=256)


def neighbour_params() -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
            SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=20, ignore_eos=True),
            SamplingParams(temperature=0, repetition_penalty=1.3, logprobs=2, max_tokens=20, ignore_eos=True),
            SamplingParams(temperature=1.2, top_k=30, seed=6, banned_words=["the"], max_tokens=20, ignore_eos=True)]


@pytest.mark.parametrize("how", ["raise", "nan"])
@pytest.mark.parametrize("bad_temperature", [0.0, 0.8])
def test_one_failing_request_ends_alone_with_an_error(llm, how, bad_temperature):
    bad = SamplingParams(temperature=bad_temperature, seed=3, max_tokens=20, ignore_eos=True,
                         logits_processors=[FailsAt(how, at=4)])
    prompts = PROMPTS[:2] + [PROMPTS[4]] + PROMPTS[2:4]
    params = neighbour_params()[:2] + [bad] + neighbour_params()[2:]
    results = llm.generate(prompts, params, use_tqdm=False)
    failed = results[2]
    assert failed["finish_reason"] == "error" and len(failed["token_ids"]) == 4
    assert ("RuntimeError: lookup table missing" if how == "raise" else "NaN") in failed["error"]
    without = llm.generate(prompts[:2] + prompts[3:], neighbour_params(), use_tqdm=False)
    for got, expected in zip(results[:2] + results[3:], without):
        assert got["token_ids"] == expected["token_ids"] and got["finish_reason"] == "length"
        assert "error" not in got
    engine = llm.engine
    assert not engine.requests and not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks
    assert engine.scheduler.num_running == engine.scheduler.num_waiting == 0


def test_request_output_carries_the_error_text(llm):
    engine = llm.engine
    engine.add_request("bad", PROMPTS[0], SamplingParams(temperature=0, max_tokens=8, logits_processors=[FailsAt("raise", 0)]))
    engine.add_request("good", PROMPTS[1], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    bad = [o for o in outs if o.request_id == "bad"]
    assert len(bad) == 1 and bad[0].finished and bad[0].finish_reason == "error" and bad[0].new_token_ids == []
    assert bad[0].error == "logits processor FailsAt raised RuntimeError: lookup table missing"
    assert all(o.error is None for o in outs if o.request_id == "good")
    assert sum(len(o.new_token_ids) for o in outs if o.request_id == "good") == 8
