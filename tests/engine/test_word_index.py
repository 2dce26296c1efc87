"""String banned words need the vocabulary's token bytes: built off the step loop, at construction."""
from __future__ import annotations

import os
import shutil
import threading

import pytest

import nanovllm.models.tokenizer as tokenizer_module
from nanovllm.config import Config
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.sampling_params import SamplingParams


def drain(engine: LLMEngine) -> dict[str, list]:
    outs: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    return outs


def test_the_tokenizer_is_never_loaded_on_the_calling_thread(tiny_model_dir, monkeypatch):
    real, callers = tokenizer_module.load_tokenizer, []

    def recording(*args, **kwargs):
        callers.append(threading.current_thread())
        return real(*args, **kwargs)

    monkeypatch.setattr(tokenizer_module, "load_tokenizer", recording)
    engine = LLMEngine(Config(model=tiny_model_dir, block_size=8, num_kvcache_blocks=64))
    # Right after construction: the index may still be building; the request waits for it.
    engine.add_request("w", [5, 6, 7], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, banned_words=["the"]))
    outs = drain(engine)["w"]
    assert outs[-1].finish_reason == "length" and sum(len(o.new_token_ids) for o in outs) == 8
    assert len(callers) == 1 and callers[0] is not threading.current_thread()


def refuses_string_bans_but_not_token_bans(engine: LLMEngine) -> None:
    with pytest.raises(ValueError, match="string banned_words need the model's tokenizer, which did not load"):
        engine.add_request("s", [5, 6, 7], SamplingParams(banned_words=["the"]))
    engine.add_request("ids", [5, 6, 7], SamplingParams(temperature=0, max_tokens=4, banned_words=[[9]]))
    assert drain(engine)["ids"][-1].finish_reason in ("stop", "length")


def test_a_tokenizer_that_fails_to_load_refuses_string_bans_clearly(tiny_model_dir, monkeypatch):
    def failing(*args, **kwargs):
        raise OSError("no tokenizer files")

    monkeypatch.setattr(tokenizer_module, "load_tokenizer", failing)
    refuses_string_bans_but_not_token_bans(LLMEngine(Config(model=tiny_model_dir, block_size=8, num_kvcache_blocks=64)))


def test_a_tokenizer_without_text_tokens_refuses_string_bans_clearly(tiny_model_dir, tmp_path):
    # transformers builds an empty tokenizer from a folder without tokenizer files: bans would
    # silently never match.
    model = str(tmp_path / "no-tokenizer")
    shutil.copytree(tiny_model_dir, model)
    for name in os.listdir(model):
        if name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "added_tokens", "chat_template")):
            os.remove(os.path.join(model, name))
    refuses_string_bans_but_not_token_bans(LLMEngine(Config(model=model, block_size=8, num_kvcache_blocks=64)))
