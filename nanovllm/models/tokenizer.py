"""Load the tokenizer that belongs to a model name, without loading the weights.

Loading comes in two halves, `tokenizer_loader(model)` and the call it returns, so that a
background thread can do the slow half while other threads import: transformers' lazily loaded
modules are not safe to import from two threads at once (an engine once failed to start with
"cannot import name 'AutoTokenizer' from 'transformers'" because its word-index thread and its
main thread were both inside transformers' imports). The first half imports what loading needs,
on the calling thread; the second half only reads files.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from typing import Any

from nanovllm.models.gguf_loader import check_gguf_file, read_gguf_metadata
from nanovllm.models.loader import is_gguf, resolve_model_path


def load_tokenizer(model: str):
    """A transformers tokenizer for "default", an HF folder or a .gguf file."""
    return tokenizer_loader(model)()


def tokenizer_loader(model: str) -> Callable[[], Any]:
    """Import now, on the calling thread, everything loading `model`'s tokenizer takes from
    transformers, and return the load itself: a call that imports nothing, safe on any thread.
    Converting a GGUF vocabulary the first time (seconds, once per file) happens here too, since
    the conversion imports half of transformers."""
    path = resolve_model_path(model)
    if is_gguf(path):
        return gguf_tokenizer_loader(path)
    return folder_tokenizer_loader(path)


def folder_tokenizer_loader(path: str) -> Callable[[], Any]:
    """`tokenizer_loader` for a folder with HF tokenizer files."""
    from transformers import AutoConfig, AutoTokenizer

    # AutoTokenizer reads the model's config to choose the tokenizer class, importing that model's
    # configuration module on first use: read here, it is imported here.
    try:
        config = AutoConfig.from_pretrained(path)
    except (ValueError, OSError):  # no config.json (a tokenizer-only folder), an unknown model type
        config = None
    _import_tokenizer_class(path)
    return functools.partial(AutoTokenizer.from_pretrained, path, config=config)


def _import_tokenizer_class(path: str) -> None:
    """Import the module of the class `tokenizer_config.json` names: AutoTokenizer would import
    it on first use, on whatever thread loads. Best effort: where the name or transformers'
    lookup is missing, AutoTokenizer resolves the class as it always does."""
    try:
        with open(os.path.join(path, "tokenizer_config.json"), encoding="utf-8") as f:
            name = json.load(f).get("tokenizer_class")
        from transformers.models.auto.tokenization_auto import tokenizer_class_from_name
    except (OSError, ValueError, AttributeError, ImportError):
        return
    if isinstance(name, str):
        tokenizer_class_from_name(name)


# ---------------------------------------------------------------- a GGUF file's own tokenizer

def load_gguf_tokenizer(path: str) -> Any:
    """The transformers tokenizer embedded in the GGUF file, with its chat template.

    transformers converts a GGUF vocabulary in ~10 s; the result is saved once under the cache
    directory (keyed by the file's path, size and mtime) and loaded from there in ~0.2 s, which
    every stage process and CLI start benefits from.
    """
    return gguf_tokenizer_loader(path)()


def gguf_tokenizer_loader(path: str) -> Callable[[], Any]:
    """`load_gguf_tokenizer(path)` in two halves (see `nanovllm.models.tokenizer`): the imports,
    and a first conversion, happen now; the returned call only reads the saved copy."""
    check_gguf_file(path)
    cached = _tokenizer_cache_dir(path)
    if os.path.isfile(os.path.join(cached, "tokenizer_config.json")):
        return folder_tokenizer_loader(cached)
    from transformers import AutoTokenizer  # heavy import, only needed here

    directory, filename = os.path.split(os.path.abspath(path))
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=filename)
    if not tokenizer.chat_template:
        # Some transformers versions drop the template while converting; the engine needs it.
        tokenizer.chat_template = read_gguf_metadata(path).get("tokenizer.chat_template")
    _save_atomically(tokenizer, cached)
    return lambda: tokenizer


def _tokenizer_cache_dir(path: str) -> str:
    stat = os.stat(path)
    key = hashlib.sha256(f"{os.path.abspath(path)}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    root = os.environ.get("NANOVLLM_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "nanovllm")
    return os.path.join(root, "tokenizers", key)


def _save_atomically(tokenizer: Any, target: str) -> None:
    """Save under a private name and rename, so concurrent processes never read half a folder."""
    try:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        staging = tempfile.mkdtemp(dir=os.path.dirname(target))
        tokenizer.save_pretrained(staging)
        os.rename(staging, target)
    except OSError:
        pass  # another process won the race, or the cache is read-only: both are fine
