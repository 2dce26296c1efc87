"""Tokenizers load without torch, and exactly as transformers' `AutoTokenizer` would load them."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from nanovllm.models.default_model import resolve_default_model
from nanovllm.models.tokenizer import _tokenizer_cache_dir, load_tokenizer

TEXTS = ["Hello world", "  leading spaces", "Grüße 你好 😀🎉 café", "<|im_start|>user\nhi<|im_end|>", "tabs\tand\n\nlines"]
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Grüße, 你好 😀 <|im_end|> tabs\tand  spaces"},
    {"role": "assistant", "content": "Hi."},
    {"role": "user", "content": "What is the capital of France?"},
]
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def default_gguf() -> str:
    try:
        return resolve_default_model()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def converted_gguf_folder(default_gguf) -> str:
    """The saved folder of the default model's converted tokenizer (converted now if not yet)."""
    load_tokenizer(default_gguf)
    return _tokenizer_cache_dir(default_gguf)


def _folders(tiny_models, tokenizer_dir, converted_gguf_folder) -> dict[str, str]:
    return {**tiny_models, "tokenizer only": tokenizer_dir, "converted gguf": converted_gguf_folder}


def test_every_test_tokenizer_loads_as_auto_tokenizer_loads_it(tiny_models, tokenizer_dir, converted_gguf_folder):
    from transformers import AutoTokenizer

    for name, path in _folders(tiny_models, tokenizer_dir, converted_gguf_folder).items():
        ours, auto = load_tokenizer(path), AutoTokenizer.from_pretrained(path)
        assert type(ours) is type(auto), name
        assert ours.get_vocab() == auto.get_vocab(), name
        assert ours.all_special_ids == auto.all_special_ids and ours.eos_token_id == auto.eos_token_id, name
        for text in TEXTS:
            ids = ours.encode(text)
            assert ids == auto.encode(text), (name, text)
            assert ours.decode(ids) == auto.decode(ids), (name, text)
            assert ours.decode(ids, skip_special_tokens=True) == auto.decode(ids, skip_special_tokens=True)
            assert ours.convert_ids_to_tokens(ids) == auto.convert_ids_to_tokens(ids), (name, text)
        for generation_prompt in (True, False):
            assert (ours.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=generation_prompt)
                    == auto.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=generation_prompt)), name


def _modules_after_loading(model: str) -> set[str]:
    """The modules a fresh process holds after loading `model`'s tokenizer and context length as
    the tokenizer and detokenizer stages do."""
    code = ("import sys; from nanovllm.models.model_files import max_model_len; "
            "from nanovllm.models.tokenizer import load_tokenizer; import tokenizer_proc.server, detok_proc.server; "
            "load_tokenizer(sys.argv[1]).encode('hi'); max_model_len(sys.argv[1]); print(' '.join(sys.modules))")
    out = subprocess.run([sys.executable, "-c", code, model], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return set(out.stdout.split())


def test_stages_load_an_hf_folder_and_the_default_gguf_without_torch(tiny_model_dir, default_gguf):
    load_tokenizer(default_gguf)  # the first load converts the GGUF vocabulary, in a child process
    for model in (tiny_model_dir, default_gguf):
        modules = _modules_after_loading(model)
        assert "transformers" in modules and "tokenizers" in modules, model
        assert "torch" not in modules, model


def test_a_first_gguf_conversion_keeps_torch_out_of_the_loading_process(default_gguf, tmp_path):
    env = dict(os.environ, NANOVLLM_CACHE_DIR=str(tmp_path))
    code = ("import sys; from nanovllm.models.tokenizer import load_tokenizer; "
            "print(load_tokenizer(sys.argv[1]).encode('Paris'), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, default_gguf], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == "False"
    assert os.listdir(tmp_path / "tokenizers"), "the conversion was saved for later loads"
