"""Load the tokenizer that belongs to a model name, without loading the weights."""
from __future__ import annotations

from nanovllm.models.loader import is_gguf, resolve_model_path


def load_tokenizer(model: str):
    """A transformers tokenizer for "default", an HF folder or a .gguf file."""
    path = resolve_model_path(model)
    if is_gguf(path):
        from nanovllm.models.gguf_loader import load_gguf_tokenizer
        return load_gguf_tokenizer(path)
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)
