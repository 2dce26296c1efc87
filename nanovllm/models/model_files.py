"""Find a model's files and read its config and context length, without importing torch.

The tokenizer and detokenizer stages need the model's path, its config (for the context length)
and its tokenizer, never its weights: keeping this module torch-free keeps torch out of those
processes. `nanovllm.models.loader` builds on it to load the weights.
"""
# [ZH-START]
# 【模块定位】模型文件的路径、配置和上下文长度，不导入 torch。
# 分词、反分词两个阶段只需要这些（再加分词器），不需要权重；torch 每进程约 200 MB，
# 所以它们从这里读，loader.py 在此之上加载权重。
# [ZH-END]
from __future__ import annotations

import json
import os

MAX_DEFAULT_MODEL_LEN = 4096
"""Cap on the default max_model_len, so a 128k-context model does not size everything for 128k."""


def resolve_model_path(model: str) -> str:
    if model == "default":
        from nanovllm.models.default_model import resolve_default_model
        return resolve_default_model()
    if not os.path.exists(model):
        raise FileNotFoundError(
            f"model {model!r} not found: pass 'default', a local HF model folder or a .gguf file "
            "(no model hub is used)"
        )
    return os.path.abspath(model)


def is_gguf(path: str) -> bool:
    return os.path.isfile(path) and path.endswith(".gguf")


def read_hf_config(path: str) -> dict:
    """The model's config as an HF-style dict, from config.json or GGUF metadata."""
    if is_gguf(path):
        from nanovllm.models.gguf_header import read_gguf_config
        return read_gguf_config(path)
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise FileNotFoundError(f"{path!r} has no config.json; expected an HF model folder or a .gguf file")
    with open(config_file, encoding="utf-8") as f:
        return json.load(f)


def context_length(hf_config: dict) -> int:
    """The model's context length as its config states it (4096 where it states none)."""
    return hf_config.get("max_position_embeddings", 4096)


def cap_model_len(requested: int | None, limit: int) -> int:
    """The engine's max_model_len: as requested, else the context length `limit` capped at 4096."""
    # [ZH-START]
    # 1. 没有指定：取 limit 与 MAX_DEFAULT_MODEL_LEN（4096）中较小者。
    # 2. 指定值超过 limit → ValueError，说出两个数；否则原样返回。
    # [ZH-END]
    if requested is None:
        return min(limit, MAX_DEFAULT_MODEL_LEN)
    if requested > limit:
        raise ValueError(f"max_model_len={requested} exceeds the model's context length {limit}")
    return requested


def max_model_len(model: str, requested: int | None = None) -> int:
    """The engine's max_model_len for a model named as the engine takes it ("default", a folder, a
    .gguf) and its `--max-model-len` (None: the default), read from the config alone (no weights),
    so a stage before the engine refuses what the engine would."""
    # [ZH-START]
    # 模型名 → 路径（resolve_model_path）→ HF 风格配置（config.json 或 GGUF 头）→ context_length
    # → cap_model_len；和引擎用同一个 cap_model_len，所以分词阶段拒绝的正是引擎会拒绝的。
    # [ZH-END]
    return cap_model_len(requested, context_length(read_hf_config(resolve_model_path(model))))
