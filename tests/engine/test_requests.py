"""The step API: validation errors name the problem; aborts are immediate and idempotent."""
from __future__ import annotations

import pytest

from nanovllm.config import Config
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return LLMEngine(Config(model=tiny_model_dir, block_size=4, num_kvcache_blocks=32, max_model_len=100))


def drain(engine):
    outs = []
    while engine.has_unfinished_requests():
        outs.extend(engine.step())
    return outs


def test_prompt_over_max_model_len_is_rejected(engine):
    with pytest.raises(ValueError, match="max_model_len is 100"):
        engine.add_request("long", [5] * 100, SamplingParams())


def test_request_that_can_never_fit_is_rejected_not_hung(engine):
    # 32 blocks of 4 tokens hold 128 tokens; this one may need 90 + 60 (capped at 100) -> fits;
    # a tiny cache cannot hold it.
    with pytest.raises(ValueError, match="KV cache"):
        LLMEngine(Config(model=engine.config.model, block_size=4, num_kvcache_blocks=4)).add_request(
            "big", [5] * 20, SamplingParams(max_tokens=10))


def test_bad_prompts_and_ids(engine):
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("e", [], SamplingParams())
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request("v", [1, 10**9], SamplingParams())
    engine.add_request("dup", [5, 6], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("dup", [5, 6], SamplingParams())
    drain(engine)


@pytest.mark.parametrize("field,value", [("temperature", -0.5), ("max_tokens", 0), ("stop_token_ids", [-1])])
def test_invalid_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_abort_frees_blocks_at_once_and_reports_once(engine):
    total = engine.block_manager.num_total_blocks
    engine.add_request("run", [7] * 30, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    engine.add_request("wait", [8] * 30, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.block_manager.num_free_blocks < total
    assert engine.abort("run") is True
    assert engine.abort("run") is False  # idempotent
    assert engine.abort("wait") is True
    assert engine.block_manager.num_free_blocks == total  # freed before the next step
    outs = drain(engine)
    ends = [(o.request_id, o.finish_reason) for o in outs if o.finished]
    assert sorted(ends) == [("run", "abort"), ("wait", "abort")]
    assert engine.abort("never-existed") is False


def test_max_tokens_and_length_finish(engine):
    engine.add_request("len", [9] * 10, SamplingParams(temperature=0, max_tokens=7, ignore_eos=True))
    outs = drain(engine)
    tokens = [t for o in outs for t in o.new_token_ids]
    assert len(tokens) == 7 and outs[-1].finish_reason == "length" and outs[-1].num_output_tokens == 7


def test_unknown_architecture_and_missing_model(tmp_path):
    import json
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="unsupported model architecture.*GPT2LMHeadModel"):
        LLMEngine(Config(model=str(tmp_path)))
    with pytest.raises(FileNotFoundError, match="not found"):
        LLMEngine(Config(model=str(tmp_path / "nope")))


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="block_size"):
        Config(block_size=0)
    with pytest.raises(ValueError, match="dtype"):
        Config(dtype="float8")
