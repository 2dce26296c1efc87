"""Load the tokenizer that belongs to a model name, without loading the weights or importing torch.

Loading comes in two halves, `tokenizer_loader(model)` and the call it returns, so that a
background thread can do the slow half while other threads import: transformers' lazily loaded
modules are not safe to import from two threads at once (an engine once failed to start with
"cannot import name 'AutoTokenizer' from 'transformers'" because its word-index thread and its
main thread were both inside transformers' imports). The first half imports what loading needs,
on the calling thread; the second half only reads files.

The tokenizer and detokenizer stages load through here, and neither needs torch, which takes
~200 MB a process: `AutoTokenizer` and `AutoConfig` import it (through transformers'
configuration module), the tokenizer classes themselves do not. Where the folder's files name
the class `AutoTokenizer` would choose without doubt, that class is loaded directly
(`_direct_tokenizer_class`); anything else goes through `AutoTokenizer` as before.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from typing import Any

from nanovllm.models.gguf_header import check_gguf_file, read_gguf_metadata
from nanovllm.models.model_files import is_gguf, resolve_model_path

_GENERIC_TOKENIZER_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})
"""Class names a saved fast tokenizer declares when nothing model-specific was needed."""
_DIRECT_MODEL_TYPES = {None: "TokenizersBackend", "llama": "TokenizersBackend", "qwen3": "TokenizersBackend",
                       "qwen2": "Qwen2Tokenizer"}
"""For a generic declared class, the class `AutoTokenizer` loads per config `model_type` (None: no
config.json, as in the converted GGUF tokenizer's folder): transformers replaces the declared class
for model types it lists as declaring a wrong one (qwen2 among them). The engine's architectures
only; tests/models/test_tokenizer_loading.py checks each against `AutoTokenizer`."""


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
    direct = _direct_tokenizer_class(path)
    if direct is not None:
        import transformers

        return functools.partial(getattr(transformers, direct).from_pretrained, path)
    from transformers import AutoConfig, AutoTokenizer

    # AutoTokenizer reads the model's config to choose the tokenizer class, importing that model's
    # configuration module on first use: read here, it is imported here.
    try:
        config = AutoConfig.from_pretrained(path)
    except (ValueError, OSError):  # no config.json (a tokenizer-only folder), an unknown model type
        config = None
    _import_tokenizer_class(path)
    return functools.partial(AutoTokenizer.from_pretrained, path, config=config)


def _direct_tokenizer_class(path: str) -> str | None:
    """The name of the class `AutoTokenizer` would load from `path`, where its files make that
    certain without transformers' auto classes (which import torch); None otherwise."""
    # [ZH-START]
    # 1. 读 tokenizer_config.json 和 config.json（后者可以没有）；读不了、
    #    有 auto_map（远程代码）→ None。
    # 2. 声明的类不是通用的 TokenizersBackend / PreTrainedTokenizerFast →
    #    None（交给 AutoTokenizer）。
    # 3. 按 config 的 model_type 查 _DIRECT_MODEL_TYPES（没有 config 时是 None
    #    键）；表里没有 → None。
    # [ZH-END]
    tokenizer_config = _read_json(os.path.join(path, "tokenizer_config.json"))
    config_file = os.path.join(path, "config.json")
    config = _read_json(config_file) if os.path.exists(config_file) else {}
    if tokenizer_config is None or config is None or "auto_map" in tokenizer_config or "auto_map" in config:
        return None
    if tokenizer_config.get("tokenizer_class") not in _GENERIC_TOKENIZER_CLASSES:
        return None
    if config.get("tokenizer_class") not in (None, *_GENERIC_TOKENIZER_CLASSES):
        return None
    model_type = config.get("model_type")
    return _DIRECT_MODEL_TYPES.get(model_type) if isinstance(model_type, (str, type(None))) else None


def _read_json(path: str) -> dict | None:
    """The JSON object in `path`; None where it is missing, unreadable or not an object."""
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


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
    and a first conversion, happen now; the returned call only reads the saved copy.

    The conversion imports torch (through `AutoTokenizer`), so it runs in a child process and this
    one loads the saved result; only where that saves nothing (a read-only cache, a file the
    conversion refuses) does it convert here, raising transformers' own error for a bad file."""
    # [ZH-START]
    # 1. 缓存目录里还没有转换结果：起一个子进程跑 convert_gguf_tokenizer（它导入 torch），
    #    子进程的输出和退出码都不看。
    # 2. 缓存里有了：按普通文件夹加载（folder_tokenizer_loader，不导入 torch）。
    # 3. 仍然没有（缓存只读、文件坏）：在本进程转换；坏文件在这里抛 transformers 自己的错误。
    # [ZH-END]
    check_gguf_file(path)
    cached = _tokenizer_cache_dir(path)
    if not _is_saved(cached):
        subprocess.run([sys.executable, "-c", _CONVERT_IN_CHILD, path], stdin=subprocess.DEVNULL,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    if _is_saved(cached):
        return folder_tokenizer_loader(cached)
    tokenizer = convert_gguf_tokenizer(path)
    return lambda: tokenizer


_CONVERT_IN_CHILD = "import sys; from nanovllm.models.tokenizer import convert_gguf_tokenizer; convert_gguf_tokenizer(sys.argv[1])"


def convert_gguf_tokenizer(path: str) -> Any:
    """Convert the GGUF file's vocabulary to a transformers tokenizer (~10 s, imports torch) and
    save it under the cache directory for every later load."""
    # [ZH-START]
    # AutoTokenizer 从 GGUF 转换；模板丢了就从 GGUF 元数据补回；原子地存到缓存目录
    # （存不了也不报错），返回转换出的分词器。
    # [ZH-END]
    from transformers import AutoTokenizer  # heavy import, only needed here

    directory, filename = os.path.split(os.path.abspath(path))
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=filename)
    if not tokenizer.chat_template:
        # Some transformers versions drop the template while converting; the engine needs it.
        tokenizer.chat_template = read_gguf_metadata(path).get("tokenizer.chat_template")
    _save_atomically(tokenizer, _tokenizer_cache_dir(path))
    return tokenizer


def _is_saved(cached: str) -> bool:
    return os.path.isfile(os.path.join(cached, "tokenizer_config.json"))


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
