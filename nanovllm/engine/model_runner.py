"""Runs one engine step's forward: builds the batch, attends over the paged cache, returns logits.

The runner owns the model weights and the KV cache tensor. Its input is the scheduler's list of
`ScheduledSeq`; its output is the logits of every sequence whose chunk reaches its end, in
scheduled order, which the engine's sampler turns into tokens. The batch is reordered
decode-first (engine/step_input.py).

On CPU attention is torch / compiled C; on CUDA it is the Triton kernels, the KV budget comes
from memory measured after a warm-up forward (engine/kv_budget.py) and decode-only steps replay
CUDA graphs (engine/cuda_graphs.py). With `tensor_parallel_size` N this object is rank 0: it
starts ranks 1..N-1 as worker processes (engine/tp_workers.py), each running its own ModelRunner
shard, and broadcasts every step's inputs to them; only rank 0 gets logits. With `null_model` (a
benchmark tool) the model is `models/null_model.py`: no weights, no cache tensor, fixed logits.
"""
# [ZH-START]
# 【模块定位】引擎里"真正执行一步前向"的那一层：调度器决定这一步算哪些 token，
# ModelRunner 把它们送进模型、读写分页 KV cache，交回要采样的行的 logits；采样是引擎的事。
# 服务整体：客户端 → tokenizer_proc → engine_proc(LLMEngine) → detok_proc → 客户端
# 引擎内部的一步（本文件是中间这段的总控）：
#   Scheduler.schedule() → list[ScheduledSeq]
#     → ModelRunner.run()
#         StepInput.from_scheduled()          纯 list 数据（step_input.py）
#         → build_cpu_batch / build_gpu_batch  张量 + AttentionMetadata
#         → DecoderForCausalLM 前向，每层 PagedAttention 读写 KV（attention.py）
#         → compute_logits (B, V)
#     → LLMEngine 的 Sampler（sampler.py）→ 每条序列一个 token id
#     → Scheduler.advance() / settle() 追加 token、判定结束 → LLMEngine 产出 RequestOutput
# 它独占两样资源：模型权重，和所有层共用的一整块 KV cache 张量。
# KV 块数在这里算出（CPU 按 kv_cache_memory_gib，GPU 靠预热实测，见 kv_budget.py），
# BlockManager 再按这个块数管理块 id。
# 张量并行时本对象就是 rank 0：拉起 rank 1..N-1 的 worker 进程，每步把 StepInput
# 广播过去，各 rank 同步前向，只有 rank 0 拿到 logits。
# [ZH-END]
from __future__ import annotations

import importlib
import logging
import os
import threading
import weakref

import torch

from nanovllm.config import Config
from nanovllm.distributed import (StepChannel, TensorParallel, check_can_init, init_tensor_parallel,
                                  shutdown_tensor_parallel, validate_tensor_parallel)
from nanovllm.engine.cuda_graphs import DecodeGraphs
from nanovllm.engine.heap import release_free_heap
from nanovllm.engine.kv_budget import gpu_kv_cache_bytes, num_blocks_for
from nanovllm.engine.scheduler import ScheduledSeq
from nanovllm.engine.step_input import StepInput, build_cpu_batch, build_gpu_batch
from nanovllm.engine.tp_workers import WorkerProcesses
from nanovllm.layers.attention import PagedAttention
from nanovllm.layers.cpu_gemm import pack_linear_weights, packs
from nanovllm.layers.cpu_kernels import CpuAttentionKernel, CpuOps, auto_cpu_dtype
from nanovllm.layers.host_copy import upload
from nanovllm.layers.logprobs import TokenLogprobs, prompt_logprobs
from nanovllm.layers.pending import resolve_pending
from nanovllm.layers.quant import quantize_model_int8
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
        dtype = DTYPES[config.dtype]
        if device.type == "cpu" and dtype == torch.bfloat16 and not packs(dtype):
            logging.getLogger(__name__).warning(
                "dtype bfloat16 on a CPU without AVX-512 or AVX-NE-CONVERT: its matmuls are emulated, "
                "5-10x slower than float32 (dtype='auto' picks float32 here)")
        return dtype
    if device.type == "cpu":
        return auto_cpu_dtype()  # bf16 where the CPU has AMX-BF16 or AVX512-BF16, fp32 elsewhere
    return model_config.torch_dtype if model_config.torch_dtype != torch.float32 else torch.bfloat16


def _shutdown(workers: WorkerProcesses | None, channel: StepChannel | None, workers_serving: bool) -> None:
    """Stop the worker ranks (rank 0) and leave the process group; safe to call in any state.

    Workers in `serve_steps` are asked to exit; otherwise (a failed start) they are terminated.
    The goodbye runs in a thread with a deadline: a worker stuck in a collective rank 0 never
    joined (rank 0 failed mid-step) cannot receive it, and terminating it unblocks the send.
    """
    # [ZH-START]
    # 1. 有 worker 且它们已进入 serve_steps：开一个守护线程发 ["exit"]，最多等 5 秒
    #    （worker 若卡在 rank 0 没参加的集合通信里，send 会一直阻塞，所以放线程里限时）。
    # 2. workers.close()：正常道别时给 10 秒退出，否则（启动失败）timeout 0 直接 terminate。
    # 3. 再等道别线程 1 秒；有 channel 时 shutdown_tensor_parallel() 退出进程组。
    # [ZH-END]
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
    # [ZH-START]
    # 【职责】持有模型权重和整块 KV cache；选注意力路径（Triton / 编译好的 C 核 / torch 算子）；
    # 算出 KV 块数；把调度结果执行成一步前向，交回要采样的行的 logits。
    # 【边界】不采样（LLMEngine 持有 Sampler）；不决定调度谁、不分配块（Scheduler /
    # BlockManager 的事，它只照块表读写 slot）；不管请求生命周期、不做停止判定、
    # 不做 detokenize；不知道引擎层的 max_model_len，
    # 自己用 resolve_max_model_len 重算同一个默认值（用于块表宽度和 CUDA 图）。
    # 【协作者】LLMEngine 调 run() 并读 num_blocks / device / sample_ops；
    # PagedAttention 各层从这里拿到 k_cache / v_cache 视图和 cpu_kernel / triton_ops；
    # DecodeGraphs 负责解码步的 CUDA 图；WorkerProcesses + StepChannel 负责张量并行。
    # [ZH-END]
    def __init__(self, config: Config, model_config: ModelConfig, model_path: str, rank: int = 0):
        # [ZH-START]
        # 1. validate_tensor_parallel：heads / kv heads / intermediate_size 必须能被 TP size 整除。
        # 2. resolve_device：auto → 有 CUDA 用 cuda，否则 cpu；TP 时 rank r 固定用 cuda:r。
        #    resolve_dtype：auto 时 CPU 看指令集（AMX-BF16 / AVX512-BF16 → bf16，否则 fp32；
        #    设了 NANOVLLM_AUTO_DTYPE 就按它，好在一台机器上复现另一类 CPU 的结果），
        #    GPU 用模型自带 dtype，模型是 fp32 则改用 bf16。
        # 3. max_model_len 按同一规则解析；workers / channel / graphs 先置空，
        #    _prompt_logprobs 为空表，
        #    tp 先是单卡 TensorParallel()。
        # 4. 调 _start() 真正加载；任何异常（BaseException，含 Ctrl-C）
        #    都先 _shutdown(workers_serving=False) 把已拉起的 worker 直接终止，再把异常抛出去。
        # 5. 成功后挂 weakref.finalize(_shutdown, ..., True)：close()、
        #    对象回收或进程退出时都会道别一次。
        # [ZH-END]
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
        self._prompt_logprobs: list[TokenLogprobs] = []
        try:
            self._start(model_path)
        except BaseException:
            _shutdown(self.workers, self.channel, workers_serving=False)
            raise
        self._finalizer = weakref.finalize(self, _shutdown, self.workers, self.channel, True)

    def _start(self, model_path: str) -> None:
        # [ZH-START]
        # 1. CUDA：set_device，并记下 free_at_start = mem_get_info()[0]，
        #    这是 KV 预算里"本进程用了多少"的基线；CPU：torch.set_num_threads(num_threads 或
        #    可用核数 // TP size)，各 rank 平分核。
        # 2. TP size > 1：rank 0 先 check_can_init()，再 WorkerProcesses.start + wait_ready（worker
        #    起不来立刻报错）；然后所有 rank 调 init_tensor_parallel，
        #    得到计算组 tp 和控制组 channel。
        # 3. sample_ops = None（引擎的 Sampler 用的编译算子，CPU 上第 6 步填上；采样不在这里做）。
        # 4. 在目标设备上构建 DecoderForCausalLM → load_weights 逐张量流式加载 → 再转成 dtype
        #    （单 rank CPU 且 gguf_weights="packed" 时 GGUF 矩阵保持量化打包，否则反量化成浮点；
        #    先加载后转换：保持打包的矩阵从不写入其浮点参数，加载峰值不含它们）
        #    → pack_linear_weights（CPU 上给 oneDNN 预打包浮点权重）→ eval()。
        # 5. 收集模型里所有 PagedAttention 层。
        # 6. 选注意力路径：CUDA 上才 import triton_attention 模块并交给各层（CPU 上从不导入
        #    triton），同时给各模块融合 Triton 算子 gpu_ops（kernels/triton_fused.py；
        #    NANOVLLM_TRITON_FUSED=0 时不给，走 torch 算子）；CPU 上 dtype 为 fp32/bf16 且
        #    head_dim <= 256 时加载 CpuAttentionKernel 和融合算子 CpuOps，否则（或无编译器、
        #    NANOVLLM_CPU_KERNELS=0 时 load() 返回 None）走 torch 算子；CpuOps 只加载一次，
        #    无论注意力走哪条路都存为 sample_ops，交给引擎的 Sampler：无过滤的采样行用编译抽样
        #    draw，只有语法约束的行用 mask_bits 直接套打包掩码（都在 cpu_sample.c）。
        # 7. num_blocks = _num_kv_blocks()，再 _allocate_kv_cache() 分配真正的 cache；
        #    CPU 上随后 release_free_heap()（malloc_trim），把加载时的临时内存还给操作系统。
        # 8. CUDA、非 enforce_eager 且不是 null model：DecodeGraphs 捕获 decode CUDA 图
        #    （档位 1、2、4、8，之后每 16 一档，最后一档固定是 max_num_seqs，
        #    见 cuda_graphs.graph_batch_sizes），块表缓冲宽 max_blocks_per_seq。
        # [ZH-END]
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
        self.sample_ops: CpuOps | None = None
        """The compiled CPU ops the engine's sampler draws with (any model, on CPU)."""
        self.model = self._load_model(model_path)
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, PagedAttention)]
        if self.device.type == "cuda":
            # Imported only on CUDA: triton is not needed (and not always installed) on CPU.
            self.set_attention_kernels(None, importlib.import_module("nanovllm.kernels.triton_attention"))
            if os.environ.get("NANOVLLM_TRITON_FUSED", "1") != "0":
                self.set_gpu_ops(importlib.import_module("nanovllm.kernels.triton_fused").TritonFusedOps())
        else:
            # The kernel only where it serves this model: the step metadata follows the same choice.
            supported = CpuAttentionKernel.supports(self.dtype, self.model_config.head_dim)
            self.set_attention_kernels(CpuAttentionKernel.load() if supported else None, None)
            ops = CpuOps.load()
            self.set_cpu_ops(ops if supported else None)
            self.sample_ops = ops  # the draw kernel serves any model on CPU
        self.num_blocks = self._num_kv_blocks()
        self._allocate_kv_cache()
        if self.device.type == "cpu":
            release_free_heap()  # the load's temporaries: resident memory drops to what is kept
        if self.device.type == "cuda" and not config.enforce_eager and not config.null_model:
            self.graphs = DecodeGraphs(self.model, config.max_num_seqs, self.max_blocks_per_seq,
                                       self.model_config.hidden_size, self.dtype, self.device)

    def _load_model(self, model_path: str) -> DecoderForCausalLM | NullModel:
        if self.config.null_model:
            return NullModel(self.model_config.vocab_size)
        with torch.device(self.device):
            model = DecoderForCausalLM(self.model_config, self.tp)
        load_weights(model, iter_weights(model_path, packed=self._keeps_weights_packed()))
        # Cast after loading, not before: a matrix kept packed replaces its float parameter, which
        # on CPU was allocated but never written and so never resident; a cast first would write
        # every one of them (the load's peak). Values are the same either way (one rounding).
        model.to(self.dtype)
        if self.config.quantization == "int8":
            if not self._packed_kernels_run():
                raise ValueError("quantization='int8' runs on the packed CPU kernels: it needs device cpu, "
                                 "tensor_parallel_size 1, dtype float32 or bfloat16 and a C compiler")
            quantize_model_int8(model)
        pack_linear_weights(model)
        return model.eval()

    def _keeps_weights_packed(self) -> bool:
        """GGUF matrices stay quantized where the packed kernels run them and the operator has not
        asked for float weights (`gguf_weights="float"`); elsewhere they load as float."""
        return self.config.gguf_weights == "packed" and self._packed_kernels_run()

    def _packed_kernels_run(self) -> bool:
        """Whether the packed kernels (layers/quant.py) serve this model: one CPU rank whose
        compiled kernels take its dtype and head size."""
        return (self.device.type == "cpu" and self.config.tensor_parallel_size == 1
                and CpuAttentionKernel.supports(self.dtype, self.model_config.head_dim) and CpuOps.load() is not None)

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

    def set_gpu_ops(self, ops: object | None) -> None:
        """The fused Triton ops (kernels/triton_fused.py) for the decoder's modules, or None for torch
        ops; set before the CUDA graphs are captured, which record whichever path runs then."""
        for module in self.model.modules():
            if hasattr(module, "gpu_ops"):
                module.gpu_ops = ops

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
        # [ZH-START]
        # 1. 用户给了 num_kvcache_blocks 就直接用。
        # 2. CUDA：_measure_gpu_kv_blocks() 实测，再 tp.min_int 取所有 rank 的最小值
        #    （各 rank 必须持有同一组块 id，否则同一个 slot 在不同 rank 上含义不同）。
        # 3. CPU：预算 = kv_cache_memory_gib × 2^30 字节，块数 = 预算 // bytes_per_block；
        #    bytes_per_block = 2(K 和 V) × 层数 × block_size × 本 rank 的 kv
        #    heads × head_dim × 元素字节数。
        # 4. 一块都放不下就抛 ValueError，告诉用户调大 kv_cache_memory_gib。
        # [ZH-END]
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
        # [ZH-START]
        # 1. null model（基准测试用，没有注意力层）：块只记账、从不写入，不分配 cache。
        # 2. 否则一次分配整块 cache：形状 (2, num_layers, num_blocks, block_size, local_kv_heads,
        #    head_dim)，第 0 维 0 是 K、1 是 V；用 zeros，保证从未写过的 slot 也是有限值。
        # 3. 第 i 个 PagedAttention 层拿到 kv_cache[0, i] / kv_cache[1, i] 两个视图，
        #    每个形状 (num_blocks, block_size, KVH, D)，与 Triton 核的布局相同，不发生拷贝。
        # [ZH-END]
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
        # [ZH-START]
        # 1. 构造"最大的一步"：seq_len = min(max_model_len, max_num_batched_tokens)，
        #    num_seqs = max(1, min(max_num_batched_tokens // seq_len, max_num_seqs))，
        #    每条序列 blocks_per_seq = ceil(seq_len / block_size) 块。
        # 2. 临时把 num_blocks 设为 num_seqs × blocks_per_seq，分配一个只够这次预热的草稿 cache。
        # 3. StepInput：num_seqs 条全 0 token 的 prefill，各 seq_len 个 token、从位置 0 开始、
        #    块连续编号；sample_rows 取 max_num_seqs 行（i % rows），于是 logits 是
        #    (max_num_seqs, V)，模拟满批采样。
        # 4. reset_peak_memory_stats → _execute(step)；rank 0 再对 logits 做一次整词表
        #    sort（top-p 的显存峰值）。
        # 5. synchronize 后读 peak = max_memory_allocated、allocated = memory_allocated；
        #    草稿 cache 在重置峰值之前就已分配，所以 peak - allocated 正好是激活显存。
        # 6. 释放草稿 cache（kv_cache=None，各层 k/v 换成空张量）+ empty_cache，
        #    再读 free_now, total。
        # 7. gpu_kv_cache_bytes：激活 = peak - allocated；
        #    本进程已用 = (free_at_start - free_now) + 激活；预算 = min(utilization × total -
        #    本进程已用, free_now - 激活)，最少为 0。
        # 8. num_blocks_for：预算 // bytes_per_block；一块都不够就 ValueError，
        #    提示调 gpu_memory_utilization 等参数。
        # [ZH-END]
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
    def run(self, scheduled: list[ScheduledSeq], previous: torch.Tensor | None = None) -> torch.Tensor | None:
        """The step's forward: the logits (B, V) of the scheduled items that sample, in their
        order, or None when none does (prompt chunks short of their end only fill the cache).
        `previous`: the tokens the step before sampled, still on the device (the overlapped
        step), which the stand-ins among the decode tokens (`pending_token`) stand for."""
        # [ZH-START]
        # 1. StepInput.from_scheduled(scheduled)：转成纯 list 数据，
        #    decode 行在前、prefill 分块在后。
        # 2. 张量并行时先经 channel 广播 ["step", step.to_wire()]：worker 在 serve_steps
        #    里收到后同步执行，前向中的 all-reduce 才凑得齐所有 rank。
        # 3. logits = _execute(step, previous)（previous：重叠调度时上一步留在设备上的采样结果，
        #    decode 行里的占位 token 由它在设备上换成真 token）：本步有要采样的行时形状 (B, V)，
        #    B 为要采样的序列数，
        #    顺序与 scheduled 中的采样项一致；都是没到末尾的 prefill 分块时只把 K/V 写进
        #    cache，返回 None。采样由 LLMEngine 的 Sampler 做。
        # [ZH-END]
        step = StepInput.from_scheduled(scheduled)
        if self.channel is not None:
            self.channel.send(["step", step.to_wire()])
        return self._execute(step, previous)  # (B, V) for the sampled rows

    def take_prompt_logprobs(self) -> list[TokenLogprobs]:
        """The prompt logprobs of the last step's `StepInput.prompt_rows`, in their order, once."""
        out, self._prompt_logprobs = self._prompt_logprobs, []
        return out

    def serve_steps(self) -> None:
        """Worker ranks: run each step rank 0 broadcasts, in lockstep, until it sends "exit"."""
        # [ZH-START]
        # 1. worker rank 循环：channel.receive() 阻塞等 rank 0 的下一条消息（控制组超时一年，
        #    空闲等待不算故障）。
        # 2. 收到 ["exit"] 就返回（进程随后退出）。
        # 3. 收到 ["step", wire]：StepInput.from_wire 还原，在 inference_mode 下 _execute；
        #    本 rank 的 compute_logits 返回 None，不采样。
        # [ZH-END]
        while True:
            message = self.channel.receive()
            if message[0] == "exit":
                return
            with torch.inference_mode():
                self._execute(StepInput.from_wire(message[1]))

    def _execute(self, step: StepInput, previous: torch.Tensor | None = None) -> torch.Tensor | None:
        """Forward one step on this rank; logits of `step.sample_rows` on rank 0, None elsewhere."""
        # [ZH-START]
        # 1. Triton 路径（CUDA，或测试里 TRITON_INTERPRET）：build_gpu_batch 生成设备上的
        #    input_ids、positions 和 int32 元数据（pinned 内存异步上传）。
        #    只有 decode 行、有 graphs 且 graphs.can_run(num_decode, 块表宽度)（能落进某个档位、
        #    块表不比捕获时宽）时重放 CUDA 图，否则 eager 调 model。
        # 2. CPU 路径：build_cpu_batch；每个 prefill 分块都交给编译好的分块内核，只有 cpu_kernel 为
        #    None（走 torch 注意力）时才额外生成 mask 和 slot 列表。eager 前向得到 hidden (T, C)。
        #    两条路径都一样：给了 previous（重叠调度时上一步在设备上的采样结果）且 decode 行里有
        #    占位 token 时，resolve_pending 在设备上把它们换成真 token，再做前向。
        # 3. 有 prompt_rows（要 prompt logprobs 的位置）：取出这些行的 hidden，prompt_logprobs
        #    分片算出每个 prompt token 的 logprob（每个 rank 都算：lm_head 跨 rank gather），
        #    rank 0 的结果留在 _prompt_logprobs，引擎用 take_prompt_logprobs 取走。
        #    没有 sample_rows → 返回 None（纯 prefill 分块的步）。
        # 4. hidden[sample_rows] → (B, C) → compute_logits → rank 0 上 (B, V)
        #    float32，其他 rank 为 None。
        #    sample_rows 恰为 0..T-1（纯解码步的常态）时直接用 hidden，不建索引；
        #    否则索引用 upload 从 pinned 内存异步上传——同步的 torch.tensor(..., device=cuda) 会让
        #    host 在这里干等整个前向（图重放）跑完。
        # [ZH-END]
        triton = self.triton_ops is not None
        if triton:
            input_ids, positions, meta = build_gpu_batch(step, self.block_size, self.device)
        else:
            input_ids, positions, meta = build_cpu_batch(step, self.block_size, torch_attention=self.cpu_kernel is None)
        if previous is not None and step.num_decode and min(step.decode_token_ids) < 0:
            input_ids = resolve_pending(input_ids, previous)  # on the device: no wait for the step before
        graphed = (triton and self.graphs is not None and not step.prefill_token_ids
                   and self.graphs.can_run(step.num_decode, meta.decode_block_tables.shape[1]))
        forward = self.graphs.run if graphed else self.model
        hidden = forward(input_ids, positions, meta)  # (T, C)
        if step.prompt_rows:  # every rank: the vocabulary-parallel head gathers across them
            rows = hidden[upload(step.prompt_rows, torch.long, self.device)]
            self._prompt_logprobs = prompt_logprobs(rows, step.prompt_targets, step.prompt_top,
                                                    self.model.compute_logits)
        if not step.sample_rows:
            return None
        if len(step.sample_rows) == hidden.shape[0] and step.sample_rows == list(range(hidden.shape[0])):
            return self.model.compute_logits(hidden)  # every row samples, in order (decode-only steps)
        rows = upload(step.sample_rows, torch.long, self.device)  # no wait here for the forward to finish
        return self.model.compute_logits(hidden[rows])
