"""Runs one engine step through the model: builds the batch, attends over the paged cache, samples.

The runner owns the model weights and the KV cache tensor. Its input is the scheduler's list of
`ScheduledSeq`; its output is one sampled token per sequence whose chunk reaches its end, in
scheduled order. The batch is reordered decode-first (engine/step_input.py).

On CPU attention is torch / compiled C; on CUDA it is the Triton kernels, the KV budget comes
from memory measured after a warm-up forward (engine/kv_budget.py) and decode-only steps replay
CUDA graphs (engine/cuda_graphs.py). With `tensor_parallel_size` N this object is rank 0: it
starts ranks 1..N-1 as worker processes (engine/tp_workers.py), each running its own ModelRunner
shard, and broadcasts every step's inputs to them; only rank 0 samples. With `null_model` (a
benchmark tool) the model is `models/null_model.py`: no weights, no cache tensor, fixed logits.
"""
from __future__ import annotations

import importlib
import os
import threading
import weakref

import torch

from nanovllm.config import Config
from nanovllm.distributed import (StepChannel, TensorParallel, check_can_init, init_tensor_parallel,
                                  shutdown_tensor_parallel, validate_tensor_parallel)
from nanovllm.engine.cuda_graphs import DecodeGraphs
from nanovllm.engine.kv_budget import gpu_kv_cache_bytes, num_blocks_for
from nanovllm.engine.scheduler import ScheduledSeq
from nanovllm.engine.step_input import StepInput, build_cpu_batch, build_gpu_batch
from nanovllm.engine.tp_workers import WorkerProcesses
from nanovllm.layers.attention import PagedAttention
from nanovllm.layers.cpu_gemm import pack_linear_weights
from nanovllm.layers.cpu_kernels import CpuAttentionKernel, CpuOps, auto_cpu_dtype
from nanovllm.layers.sampler import Sampler
from nanovllm.models.decoder import DecoderForCausalLM
from nanovllm.models.loader import iter_weights, load_weights
from nanovllm.models.model_config import DTYPES, ModelConfig, resolve_max_model_len
from nanovllm.models.null_model import NullModel


def resolve_device(config: Config, rank: int = 0) -> torch.device:
    if config.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    elif config.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device='cuda' was requested but no CUDA device is available")
    else:
        device = torch.device(config.device)
    if device.type == "cuda":
        if config.tensor_parallel_size > 1 and torch.cuda.device_count() < config.tensor_parallel_size:
            raise ValueError(f"tensor_parallel_size={config.tensor_parallel_size} needs that many GPUs; "
                             f"{torch.cuda.device_count()} visible")
        # An explicit index: torch.cuda.set_device and friends reject a bare "cuda".
        device = torch.device("cuda", rank if config.tensor_parallel_size > 1 else torch.cuda.current_device())
    return device


def resolve_dtype(config: Config, model_config: ModelConfig, device: torch.device) -> torch.dtype:
    if config.dtype != "auto":
        return DTYPES[config.dtype]
    if device.type == "cpu":
        return auto_cpu_dtype()  # bf16 where the CPU has AMX-BF16 or AVX512-BF16, fp32 elsewhere
    return model_config.torch_dtype if model_config.torch_dtype != torch.float32 else torch.bfloat16


def _shutdown(workers: WorkerProcesses | None, channel: StepChannel | None, workers_serving: bool) -> None:
    """Stop the worker ranks (rank 0) and leave the process group; safe to call in any state.

    Workers in `serve_steps` are asked to exit; otherwise (a failed start) they are terminated.
    The goodbye runs in a thread with a deadline: a worker stuck in a collective rank 0 never
    joined (rank 0 failed mid-step) cannot receive it, and terminating it unblocks the send.
    """
    goodbye = None
    if workers is not None and channel is not None and workers_serving:
        goodbye = threading.Thread(target=_say_goodbye, args=(channel,), daemon=True)
        goodbye.start()
        goodbye.join(5.0)
    if workers is not None:
        workers.close(timeout_s=10.0 if goodbye is not None else 0.0)
    if goodbye is not None:
        goodbye.join(1.0)
    if channel is not None:
        shutdown_tensor_parallel()


def _say_goodbye(channel: StepChannel) -> None:
    try:
        channel.send(["exit"])
    except Exception:  # a worker already died: the collective fails; close() terminates the rest
        pass


class ModelRunner:
    def __init__(self, config: Config, model_config: ModelConfig, model_path: str, rank: int = 0):
        mc = model_config
        validate_tensor_parallel(mc.num_heads, mc.num_kv_heads, mc.intermediate_size, config.tensor_parallel_size)
        self.config = config
        self.model_config = model_config
        self.rank = rank
        self.block_size = config.block_size
        self.device = resolve_device(config, rank)
        self.dtype = resolve_dtype(config, model_config, self.device)
        self.max_model_len = resolve_max_model_len(config.max_model_len, mc)
        self.workers: WorkerProcesses | None = None
        self.channel: StepChannel | None = None
        self.tp = TensorParallel()
        self.graphs: DecodeGraphs | None = None
        try:
            self._start(model_path)
        except BaseException:
            _shutdown(self.workers, self.channel, workers_serving=False)
            raise
        self._finalizer = weakref.finalize(self, _shutdown, self.workers, self.channel, True)

    def _start(self, model_path: str) -> None:
        config, size = self.config, self.config.tensor_parallel_size
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            self._free_at_start = torch.cuda.mem_get_info(self.device)[0]
        else:
            # Ranks share the cores: each gets its share for torch's (and the CPU kernel's) OpenMP pool.
            torch.set_num_threads(self.config.num_threads or max(1, len(os.sched_getaffinity(0)) // size))
        if size > 1:
            if self.rank == 0:
                check_can_init()  # before starting workers that could never join
                self.workers = WorkerProcesses.start(config, model_path)
                self.workers.wait_ready()
            self.tp, self.channel = init_tensor_parallel(config.dist_init_method, self.rank, size, self.device)
        self.sampler = Sampler(self.model_config.vocab_size, self.device, config.seed) if self.rank == 0 else None
        self.model = self._load_model(model_path)
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, PagedAttention)]
        if self.device.type == "cuda":
            # Imported only on CUDA: triton is not needed (and not always installed) on CPU.
            self.set_attention_kernels(None, importlib.import_module("nanovllm.kernels.triton_attention"))
        else:
            # The kernel only where it serves this model: the step metadata follows the same choice.
            supported = CpuAttentionKernel.supports(self.dtype, self.model_config.head_dim)
            self.set_attention_kernels(CpuAttentionKernel.load() if supported else None, None)
            self.set_cpu_ops(CpuOps.load() if supported else None)
        self.num_blocks = self._num_kv_blocks()
        self._allocate_kv_cache()
        if self.device.type == "cuda" and not config.enforce_eager and not config.null_model:
            self.graphs = DecodeGraphs(self.model, config.max_num_seqs, self.max_blocks_per_seq,
                                       self.model_config.hidden_size, self.dtype, self.device)

    def _load_model(self, model_path: str) -> DecoderForCausalLM | NullModel:
        if self.config.null_model:
            return NullModel(self.model_config.vocab_size)
        with torch.device(self.device):
            model = DecoderForCausalLM(self.model_config, self.tp).to(self.dtype)
        load_weights(model, iter_weights(model_path))
        pack_linear_weights(model)
        return model.eval()

    def set_attention_kernels(self, cpu_kernel: CpuAttentionKernel | None, triton_ops: object | None) -> None:
        """Choose the attention path: the compiled CPU kernel, the Triton kernel module, or neither
        (torch ops). Tests use it to run the Triton path on CPU under TRITON_INTERPRET."""
        self.cpu_kernel, self.triton_ops = cpu_kernel, triton_ops
        for layer in self.attention_layers:
            layer.cpu_kernel, layer.triton_ops = cpu_kernel, triton_ops
        if triton_ops is not None:
            self.set_cpu_ops(None)

    def set_cpu_ops(self, ops: CpuOps | None) -> None:
        """The fused elementwise CPU ops for every module that takes them, or None for torch ops."""
        self.cpu_ops = ops
        for module in self.model.modules():
            if hasattr(module, "cpu_ops"):
                module.cpu_ops = ops

    def close(self) -> None:
        """Stop tensor-parallel workers and leave the process group; idempotent (also runs at exit)."""
        self._finalizer()

    # -- KV cache ----------------------------------------------------------------------------

    @property
    def num_local_kv_heads(self) -> int:
        return self.model_config.num_kv_heads // self.config.tensor_parallel_size

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)

    @property
    def bytes_per_block(self) -> int:
        cfg = self.model_config
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * cfg.num_layers * self.block_size * self.num_local_kv_heads * cfg.head_dim * elem

    def _num_kv_blocks(self) -> int:
        if self.config.num_kvcache_blocks is not None:
            return self.config.num_kvcache_blocks
        if self.device.type == "cuda":
            # Ranks may measure slightly different memory; all must hold the same block ids.
            return self.tp.min_int(self._measure_gpu_kv_blocks())
        budget = int(self.config.kv_cache_memory_gib * (1 << 30))
        num_blocks = budget // self.bytes_per_block
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory_gib={self.config.kv_cache_memory_gib} holds no KV block "
                f"({self.bytes_per_block} bytes each); raise it"
            )
        return num_blocks

    def _allocate_kv_cache(self) -> None:
        if not self.attention_layers:  # the null model: blocks are accounted for, never written
            self.kv_cache = None
            return
        cfg = self.model_config
        shape = (2, cfg.num_layers, self.num_blocks, self.block_size, self.num_local_kv_heads, cfg.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        for i, layer in enumerate(self.attention_layers):
            layer.k_cache, layer.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]

    def _measure_gpu_kv_blocks(self) -> int:
        """Run the largest step once on a scratch cache, then budget what is left (kv_budget.py)."""
        cfg = self.config
        seq_len = min(self.max_model_len, cfg.max_num_batched_tokens)
        num_seqs = max(1, min(cfg.max_num_batched_tokens // seq_len, cfg.max_num_seqs))
        blocks_per_seq = -(-seq_len // self.block_size)
        self.num_blocks = num_seqs * blocks_per_seq
        self._allocate_kv_cache()
        rows = num_seqs * seq_len
        step = StepInput([], [], [], [[0] * seq_len] * num_seqs, [0] * num_seqs,
                         [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(num_seqs)],
                         [i % rows for i in range(cfg.max_num_seqs)])  # logits for a full batch of samplers
        torch.cuda.reset_peak_memory_stats(self.device)
        with torch.inference_mode():
            logits = self._execute(step)
            if logits is not None:
                logits.sort(dim=-1)  # top-p sampling sorts the whole vocabulary: its peak counts too
        del logits
        torch.cuda.synchronize(self.device)
        peak, allocated = torch.cuda.max_memory_allocated(self.device), torch.cuda.memory_allocated(self.device)
        self.kv_cache = None
        for layer in self.attention_layers:
            layer.k_cache = layer.v_cache = torch.empty(0)
        torch.cuda.empty_cache()
        free_now, total = torch.cuda.mem_get_info(self.device)
        # The scratch cache was allocated before the peak reset, so `allocated` still holds it: the
        # difference is activations only. `free_now` is measured with the scratch cache released.
        budget = gpu_kv_cache_bytes(total=total, free_at_start=self._free_at_start, free_now=free_now,
                                    peak_allocated=peak, allocated_now=allocated,
                                    utilization=cfg.gpu_memory_utilization)
        return num_blocks_for(budget, self.bytes_per_block,
                              f"raise gpu_memory_utilization (now {cfg.gpu_memory_utilization}), lower "
                              f"max_num_batched_tokens / max_num_seqs, or free memory on the GPU")

    # -- one step ----------------------------------------------------------------------------

    @torch.inference_mode()
    def run(self, scheduled: list[ScheduledSeq]) -> list[int]:
        step = StepInput.from_scheduled(scheduled)
        if self.channel is not None:
            self.channel.send(["step", step.to_wire()])
        sampling = [s for s in scheduled if s.samples]
        if not sampling:
            self._execute(step)
            return []
        logits = self._execute(step)  # (B, V) for the sampled rows
        return self.sampler(logits, [s.seq for s in sampling])

    def serve_steps(self) -> None:
        """Worker ranks: run each step rank 0 broadcasts, in lockstep, until it sends "exit"."""
        while True:
            message = self.channel.receive()
            if message[0] == "exit":
                return
            with torch.inference_mode():
                self._execute(StepInput.from_wire(message[1]))

    def _execute(self, step: StepInput) -> torch.Tensor | None:
        """Forward one step on this rank; logits of `step.sample_rows` on rank 0, None elsewhere."""
        if self.triton_ops is not None:
            input_ids, positions, meta = build_gpu_batch(step, self.block_size, self.device)
            graphed = (self.graphs is not None and not step.prefill_token_ids
                       and self.graphs.can_run(step.num_decode, meta.decode_block_tables.shape[1]))
            hidden = self.graphs.run(input_ids, positions, meta) if graphed else self.model(input_ids, positions, meta)
        else:
            input_ids, positions, meta = build_cpu_batch(step, self.block_size, torch_attention=self.cpu_kernel is None)
            hidden = self.model(input_ids, positions, meta)  # (T, C)
        if not step.sample_rows:
            return None
        rows = torch.tensor(step.sample_rows, device=self.device)
        return self.model.compute_logits(hidden[rows])
