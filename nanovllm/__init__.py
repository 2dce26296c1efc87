"""nanovllm: a small LLM inference engine with a paged KV cache, prefix caching and
continuous batching, usable in-process (`LLM`) or as a three-stage streaming service.

The names below load on first use, so importing a submodule that needs no torch (the service
runtime, `nanovllm.service`) does not import torch: a stage's `--help` answers at once."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nanovllm.config import Config
    from nanovllm.llm import LLM
    from nanovllm.sampling_params import SamplingParams

__all__ = ["LLM", "Config", "SamplingParams"]
_HOMES = {"LLM": "nanovllm.llm", "Config": "nanovllm.config", "SamplingParams": "nanovllm.sampling_params"}


def __getattr__(name: str):
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'nanovllm' has no attribute {name!r}")
