"""Shared fixtures: tiny random-weight models with a real (offline-trained) tokenizer."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.helpers.tiny_models import make_tiny_model, make_tokenizer  # noqa: E402


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tokenizer"))
    make_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tokenizer_dir) -> str:
    """A random-weight tiny Qwen3 folder with a tokenizer (`<|im_end|>` is EOS)."""
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny-qwen3")), "qwen3", tokenizer_dir=tokenizer_dir)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory, tokenizer_dir) -> dict[str, str]:
    """One tiny folder per supported architecture."""
    return {
        arch: make_tiny_model(str(tmp_path_factory.mktemp(f"tiny-{arch}")), arch, tokenizer_dir=tokenizer_dir, seed=i)
        for i, arch in enumerate(("qwen3", "llama", "qwen2"))
    }
