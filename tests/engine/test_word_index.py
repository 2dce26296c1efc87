"""String banned words need the vocabulary's token bytes: built off the step loop, at construction."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading

import pytest

import nanovllm.models.tokenizer as tokenizer_module
from nanovllm.config import Config
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.sampling_params import SamplingParams

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def drain(engine: LLMEngine) -> dict[str, list]:
    outs: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    return outs


def test_the_tokenizer_is_never_loaded_on_the_calling_thread(tiny_model_dir, monkeypatch):
    real, callers = tokenizer_module.tokenizer_loader, []

    def recording(*args, **kwargs):
        load = real(*args, **kwargs)

        def recorded_load():
            callers.append(threading.current_thread())
            return load()
        return recorded_load

    monkeypatch.setattr(tokenizer_module, "tokenizer_loader", recording)
    engine = LLMEngine(Config(model=tiny_model_dir, block_size=8, num_kvcache_blocks=64))
    # Right after construction: the index may still be building; the request waits for it.
    engine.add_request("w", [5, 6, 7], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, banned_words=["the"]))
    outs = drain(engine)["w"]
    assert outs[-1].finish_reason == "length" and sum(len(o.new_token_ids) for o in outs) == 8
    assert len(callers) == 1 and callers[0] is not threading.current_thread()


IMPORTS_ON_THE_INDEX_THREAD = r"""
import json, sys, threading
imports = []  # (thread, module) of every module imported from here on

class Recorder:
    def find_spec(self, name, path=None, target=None):
        imports.append((threading.current_thread().name, name))
        return None

sys.meta_path.insert(0, Recorder())
from nanovllm.config import Config
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.sampling_params import SamplingParams

engine = LLMEngine(Config(model=sys.argv[1], block_size=8, num_kvcache_blocks=64, num_threads=1))
# What LLM (and many an application) does next, while the index may still be building: import
# from transformers on its own thread.
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401
engine.add_request("w", [5, 6, 7], SamplingParams(temperature=0, max_tokens=2, banned_words=["the"]))
while engine.has_unfinished_requests():
    engine.step()
print(json.dumps(sorted({name for thread, name in imports if thread == "nanovllm-word-index"})))
"""


def imports_on_the_index_thread(model: str, env: dict[str, str]) -> list[str]:
    """The modules a fresh process imported on the word-index thread, with its main thread
    importing from transformers meanwhile."""
    run = subprocess.run([sys.executable, "-c", IMPORTS_ON_THE_INDEX_THREAD, model], capture_output=True,
                         text=True, timeout=600, cwd=REPO, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("start", range(3))
def test_the_index_thread_imports_nothing_in_a_fresh_process(tiny_model_dir, start):
    # transformers' lazy modules are not safe to import from two threads at once: an engine once
    # failed to start ("cannot import name 'AutoTokenizer'") when its index thread imported them
    # while the main thread did too. A race shows rarely; an import on that thread, every time.
    assert imports_on_the_index_thread(tiny_model_dir, dict(os.environ)) == []


@pytest.mark.slow
def test_the_index_thread_imports_nothing_for_the_default_gguf_model_converted_or_cached(tmp_path):
    env = dict(os.environ, NANOVLLM_CACHE_DIR=str(tmp_path / "cache"))  # the first start converts the vocabulary
    for start in ("converts", "reads the saved copy"):
        assert imports_on_the_index_thread("default", env) == [], start


def refuses_string_bans_but_not_token_bans(engine: LLMEngine) -> None:
    with pytest.raises(ValueError, match="string banned_words need the model's tokenizer, which did not load"):
        engine.add_request("s", [5, 6, 7], SamplingParams(banned_words=["the"]))
    engine.add_request("ids", [5, 6, 7], SamplingParams(temperature=0, max_tokens=4, banned_words=[[9]]))
    assert drain(engine)["ids"][-1].finish_reason in ("stop", "length")


@pytest.mark.parametrize("half", ["imports", "load"])
def test_a_tokenizer_that_fails_to_load_refuses_string_bans_clearly(tiny_model_dir, monkeypatch, half):
    def failing(*args, **kwargs):
        raise OSError("no tokenizer files")

    monkeypatch.setattr(tokenizer_module, "tokenizer_loader", failing if half == "imports" else lambda model: failing)
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
