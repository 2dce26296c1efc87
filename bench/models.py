"""Random-weight Qwen3 checkpoints of the benchmark shapes, built offline in seconds."""
from __future__ import annotations

import argparse
import os
import tempfile

import torch

SHAPES = {
    # 20M params: the "tiny" model the peers were measured on.
    "tiny": dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                 head_dim=64, intermediate_size=1408, vocab_size=8192),
    # 158M params.
    "mid": dict(hidden_size=1024, num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=8,
                head_dim=64, intermediate_size=2816, vocab_size=8192),
    # Qwen3-0.6B's shape (GPU benchmark).
    "qwen3-0.6b": dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, intermediate_size=3072, vocab_size=151936, tie_word_embeddings=True),
}


def make_bench_model(shape: str, root: str, dtype: torch.dtype = torch.float32) -> str:
    from transformers import AutoModelForCausalLM, Qwen3Config

    path = os.path.join(root, f"qwen3-{shape}-{str(dtype).removeprefix('torch.')}")
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    shape_config = {"tie_word_embeddings": False, **SHAPES[shape]}  # a shape may tie its embeddings
    config = Qwen3Config(max_position_embeddings=4096, eos_token_id=1, bos_token_id=1, pad_token_id=0, **shape_config)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=dtype).save_pretrained(path)
    return path


def add_model_flags(ap: argparse.ArgumentParser, shape: str = "qwen3-0.6b", dtype_help: str | None = None) -> None:
    """The flags the benches that build a bench model share: --shape, --model-dir, --device, --dtype."""
    ap.add_argument("--shape", default=shape, choices=list(SHAPES))
    ap.add_argument("--model-dir", default=os.path.join(tempfile.gettempdir(), "nanovllm-bench-models"))
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"], help=dtype_help)
