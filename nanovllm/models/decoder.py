"""One decoder-only transformer covering Qwen3 (q/k RMSNorm), Llama and Qwen2 (qkv bias).

The three families differ only in switches read from `ModelConfig`. Projections are packed
(q|k|v and gate|up) so each layer runs two large GEMMs instead of five small ones; the loader
maps HF's separate tensors into the packed rows. Attention reads and writes the paged KV
cache through `PagedAttention`, which receives the per-step metadata as an argument.

Under tensor parallelism (`tp`) each rank builds the same module tree with its share of heads,
MLP rows and vocabulary (layers/linear.py, layers/embedding.py); one rank is the plain model.

On CPU (float32 or bfloat16) the model runner gives the modules `cpu_ops` (layers/cpu_kernels.py): RMSNorm
with its residual add, q/k norm + rotary + the KV-cache store, and SiLU-and-multiply then run as
one compiled pass each instead of chains of torch ops; and a small decode step whose linear
weights are all packed runs every layer in one C call (layers/cpu_decode.py), the same kernels
in the same order without Python between them. On CUDA it gives them `gpu_ops`
(kernels/triton_fused.py), the same three ops as Triton kernels with the same signatures. Where
neither is set (or neither takes the tensor) torch does it.
"""
# [ZH-START]
# 【模块定位】模型本身：一个 decoder-only transformer，Qwen3 / Llama / Qwen2 只差
# ModelConfig 里的几个开关。
# 在一步里的位置：ModelRunner.run ─input_ids、positions、AttentionMetadata→ DecoderForCausalLM
#   → 每层 Attention.forward → PagedAttention（分页注意力就在这里被调用）→ hidden → compute_logits
# 投影是打包的（q|k|v、gate|up），每层两个大 GEMM 代替五个小的；加载器把 HF 的分开张量拼进打包的行。
# CPU 上 cpu_ops、CUDA 上 gpu_ops 提供三个融合算子（RMSNorm + 残差、q/k norm + 旋转 + 写 KV、
# SiLU 乘），都没有时退回 torch 算子。
# [ZH-END]
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.distributed import TensorParallel
from nanovllm.layers.attention import AttentionMetadata, PagedAttention
from nanovllm.layers.cpu_decode import CpuDecode
from nanovllm.layers.cpu_kernels import CpuOps
from nanovllm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from nanovllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from nanovllm.layers.rotary import RotaryEmbedding, StepRope
from nanovllm.models.model_config import ModelConfig


def fused_ops(module: nn.Module, x: torch.Tensor):
    """The fused ops `module` should run on `x`: the compiled CPU ops, the Triton ones, or None (torch)."""
    if module.cpu_ops is not None and CpuOps.supports(x):
        return module.cpu_ops
    if module.gpu_ops is not None and module.gpu_ops.supports(x):
        return module.gpu_ops
    return None


class RMSNorm(nn.Module):
    # [ZH-START]
    # RMSNorm；add_and_norm 把上一层的残差加法和归一化合成一步（有融合算子时是一次编译过的遍历）。
    # [ZH-END]
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.cpu_ops: CpuOps | None = None
        self.gpu_ops = None  # kernels/triton_fused.TritonFusedOps on CUDA

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = fused_ops(self, x)
        if ops is not None:
            return ops.rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Fused `residual += x; return norm(residual), residual`."""
        ops = fused_ops(self, x)
        if ops is not None and residual.is_contiguous():
            return ops.rms_norm(x, self.weight, self.eps, residual=residual), residual  # in place
        residual = residual + x
        return self.forward(residual), residual


class Attention(nn.Module):
    # [ZH-START]
    # 【职责】一层的自注意力：qkv 投影 → q/k norm（Qwen3）→ 旋转位置编码 → 写 KV、分页注意力
    # → o_proj。
    # K/V 不在这里保存：PagedAttention 持有这一层的 k_cache / v_cache，
    # 按 meta.slot_mapping 写、按块表读。
    # [ZH-END]
    def __init__(self, cfg: ModelConfig, tp: TensorParallel):
        super().__init__()
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads,
                                          bias=cfg.attention_bias, tp=tp)
        # This rank's heads.
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False, tp=tp)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, cfg.head_dim)
        self.cpu_ops: CpuOps | None = None
        self.gpu_ops = None

    def forward(self, x: torch.Tensor, rope: StepRope, meta: AttentionMetadata) -> torch.Tensor:
        # [ZH-START]
        # 1. qkv_proj 一次算出 (T, q_size + 2 × kv_size)。
        # 2. 本步用融合算子（rope.cos 为 None）时：qk_norm_rope_store 原地做 q/k norm 和旋转，
        #    并把 K/V 写进 cache 的 slot_mapping 槽位（CPU 上就是 cpu_ops.c 里的写入）。
        # 3. 切成 q (T, H, D)、k / v (T, KVH, D)；不用融合算子时在这里用 torch 做 norm 和旋转。
        # 4. self.attn(...)：PagedAttention 写 KV（融合路径已写过则 kv_stored=True
        #    跳过）并读块表做注意力。
        # 5. o_proj 投回 (T, C)。
        # [ZH-END]
        qkv = self.qkv_proj(x)  # (T, q_size + 2 * kv_size)
        fused = rope.cos is None  # the model chose the fused ops for this step
        if fused:  # norm and rotate q/k in place, store K/V into the cache
            fused_ops(self, qkv).qk_norm_rope_store(
                qkv, self.num_heads, self.num_kv_heads, self.head_dim,
                None if self.q_norm is None else self.q_norm.weight, None if self.k_norm is None else self.k_norm.weight,
                self.q_norm.eps if self.q_norm is not None else 0.0, rope.cos_cache, rope.sin_cache, rope.positions,
                self.attn.k_cache, self.attn.v_cache, meta.slot_mapping)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)  # (T, H, D)
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # (T, KVH, D)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if not fused:
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = RotaryEmbedding.apply(q, k, rope.cos, rope.sin)
        out = self.attn(q, k, v, meta, kv_stored=fused)  # (T, H, D)
        return self.o_proj(out.view(-1, self.q_size))


class MLP(nn.Module):
    # [ZH-START]
    # 前馈层：gate|up 打包成一个 GEMM，SiLU(gate) × up 之后 down_proj。
    # [ZH-END]
    def __init__(self, cfg: ModelConfig, tp: TensorParallel):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, bias=False, tp=tp)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, bias=False, tp=tp)
        self.cpu_ops: CpuOps | None = None
        self.gpu_ops = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # (T, 2 I / tp)
        ops = fused_ops(self, gate_up)
        if ops is not None and gate_up.is_contiguous():
            return self.down_proj(ops.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)  # 2 x (T, I / tp)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    # [ZH-START]
    # 一层 = RMSNorm → 注意力 → RMSNorm → MLP；残差单独传递，在下一次 norm 里才加上（省一次读写）。
    # [ZH-END]
    def __init__(self, cfg: ModelConfig, tp: TensorParallel):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, tp)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, rope: StepRope, meta: AttentionMetadata):
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm.add_and_norm(hidden, residual)
        hidden = self.self_attn(hidden, rope, meta)
        hidden, residual = self.post_attention_layernorm.add_and_norm(hidden, residual)
        return self.mlp(hidden), residual


class DecoderModel(nn.Module):
    # [ZH-START]
    # 词嵌入 → 所有层 → 最后的 norm；旋转位置编码每步只按 positions 算一次，各层共用。
    # CPU 上小的纯解码步（T <= 8、线性层权重全是打包的）词嵌入之后交给 CpuDecode 一次 C 调用跑完
    # 所有层和最后的 norm（结果与逐算子路径逐位相同）；指针表第一次用到时建，KV cache 换了就重建。
    # [ZH-END]
    def __init__(self, cfg: ModelConfig, tp: TensorParallel):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, tp) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta)
        self.cpu_ops: CpuOps | None = None
        self.gpu_ops = None
        self._cpu_decode: CpuDecode | None = None
        self._cpu_decode_built = False  # whether the model was asked once (None then means it does not qualify)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)  # (T, C)
        decode = self._one_call_decode(hidden, meta)
        if decode is not None:
            return decode(hidden, positions, meta)  # (T, C), every layer in one call
        rope = self.rotary.for_step(positions, per_token=fused_ops(self, hidden) is None)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, rope, meta)
        hidden, _ = self.norm.add_and_norm(hidden, residual)
        return hidden

    def _one_call_decode(self, hidden: torch.Tensor, meta: AttentionMetadata) -> CpuDecode | None:
        """The one-call path where this step and model take it: the compiled CPU ops and attention
        kernel in use, and `CpuDecode.serves` the step."""
        if (self.cpu_ops is None or not self.layers or self.layers[0].self_attn.attn.cpu_kernel is None
                or not CpuDecode.serves(hidden, meta)):
            return None
        if not self._cpu_decode_built or (self._cpu_decode is not None and not self._cpu_decode.fresh(self)):
            self._cpu_decode, self._cpu_decode_built = CpuDecode.build(self), True
        return self._cpu_decode


class DecoderForCausalLM(nn.Module):
    # [ZH-START]
    # 对外的模型：DecoderModel 加 lm_head；packed_modules 告诉加载器 HF 的哪个张量拼进
    # 哪个打包参数的第几块。
    # compute_logits 只在张量并行的 rank 0 上返回 (B, V) 的 float logits。
    # [ZH-END]
    # HF tensor name fragment -> (packed parameter fragment, row block index)
    packed_modules = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: ModelConfig, tp: TensorParallel = TensorParallel()):
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg, tp)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """(B, V) float logits on rank 0; None on the other tensor-parallel ranks."""
        logits = self.lm_head(hidden)
        return None if logits is None else logits.float()
