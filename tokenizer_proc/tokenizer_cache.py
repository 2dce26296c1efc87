"""Load a model's tokenizer for a service stage, caching GGUF-embedded ones as HF folders.

transformers converts a GGUF tokenizer by reading the whole file (~15 s on a busy 2-core
machine), and two stages (tokenizer, detokenizer) load it at every (re)start. The converted
tokenizer is saved once under the cache dir, keyed by the file's path, size and mtime, and later
loads read the small folder instead. HF folders are loaded directly.
"""
from __future__ import annotations

import hashlib
import logging
import os
import tempfile

log = logging.getLogger("tokenizer_cache")


def default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.environ.get("NANOVLLM_CACHE_DIR") or os.path.join(base, "nanovllm", "tokenizers")


def load_stage_tokenizer(model: str, cache_dir: str | None = None):
    from nanovllm.models.loader import is_gguf, resolve_model_path
    from nanovllm.models.tokenizer import load_tokenizer

    path = resolve_model_path(model)
    if not is_gguf(path):
        return load_tokenizer(path)
    stat = os.stat(path)
    key = hashlib.sha256(f"{os.path.abspath(path)}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:24]
    cached = os.path.join(cache_dir or default_cache_dir(), key)
    if os.path.isdir(cached):
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(cached)
        except Exception as e:  # a corrupt cache entry must not take the stage down
            log.warning("ignoring unreadable tokenizer cache %s: %s", cached, e)
    tokenizer = load_tokenizer(path)
    try:
        os.makedirs(os.path.dirname(cached), exist_ok=True)
        tmp = tempfile.mkdtemp(dir=os.path.dirname(cached), prefix=".tmp-")
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, cached)  # atomic: a concurrent stage sees all of it or none
    except OSError as e:  # e.g. another stage won the race, or a read-only home
        log.info("tokenizer cache not written (%s)", e)
    return tokenizer
