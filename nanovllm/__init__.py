"""nanovllm: a small LLM inference engine with a paged KV cache, prefix caching and
continuous batching, usable in-process (`LLM`) or as a three-stage streaming service."""
from nanovllm.config import Config
from nanovllm.llm import LLM
from nanovllm.sampling_params import SamplingParams

__all__ = ["LLM", "Config", "SamplingParams"]
