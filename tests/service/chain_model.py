"""A tiny model whose greedy output is scripted: it follows a token chain.

With every attention output projection and MLP down projection zeroed, the residual stream at
a position is just the embedding of its token, so the next token depends on the current token
only. Setting lm_head row `b` to the normalized embedding of `a` makes greedy decoding go
a -> b. That lets end-to-end tests make the real engine produce exact text, e.g. characters
split over several byte tokens, or an endless cycle for stop strings and aborts.
"""
from __future__ import annotations

import torch
from safetensors.torch import load_file, save_file

from tests.helpers.tiny_models import make_tiny_model

SPLIT_TEXT = "中文🚀"
"""Characters the tiny tokenizer has no merges for: each one is 3-4 single-byte tokens."""
CYCLE_WORDS = [" hello", " world", " again"]


def unique_chain(tokenizer, text: str) -> list[int]:
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(set(ids)) != len(ids):
        raise ValueError(f"{text!r} repeats a token; a chain needs each token once: {ids}")
    return ids


def make_chain_model(path: str, tokenizer_dir: str) -> dict[str, list[int]]:
    """Save the model; return its scripted chains (`split` ends in EOS, `cycle` loops forever)."""
    from transformers import AutoTokenizer

    make_tiny_model(path, "qwen3", tokenizer_dir=tokenizer_dir)
    tok = AutoTokenizer.from_pretrained(path)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    split = unique_chain(tok, SPLIT_TEXT)
    cycle = [unique_chain(tok, w)[0] for w in CYCLE_WORDS]
    split_start = unique_chain(tok, " Say")[0]
    cycle_start = unique_chain(tok, " Loop")[0]
    edges = list(zip([split_start] + split, split + [eos]))
    edges += list(zip([cycle_start] + cycle, cycle + [cycle[0]]))
    predecessors = [a for a, _ in edges]
    if len(set(predecessors)) != len(predecessors):
        raise ValueError("chains share a token; pick other words")

    weights_path = f"{path}/model.safetensors"
    weights = load_file(weights_path)
    for name in weights:
        if name.endswith("self_attn.o_proj.weight") or name.endswith("mlp.down_proj.weight"):
            weights[name] = torch.zeros_like(weights[name])
    embed = weights["model.embed_tokens.weight"]  # (vocab, hidden)
    lm_head = torch.zeros_like(weights["lm_head.weight"])
    for a, b in edges:
        lm_head[b] += 4.0 * embed[a] / embed[a].norm()  # a token with two predecessors answers both
    weights["lm_head.weight"] = lm_head
    save_file(weights, weights_path, metadata={"format": "pt"})
    return {"split": [split_start] + split + [eos], "cycle": [cycle_start] + cycle}
