"""Paged attention over the block-structured KV cache: torch ops on CPU, Triton kernels on CUDA.

Each step the model runner builds one `AttentionMetadata` that every layer shares. The batch is
ordered decode tokens first (one token per sequence, attended as one padded batch), then prefill
chunks (attended per sequence on CPU, since their lengths differ a lot; as one varlen launch on
CUDA). New K/V are written into the cache before attention, so a chunk attends to its cached
prefix and to itself alike.

On CUDA the runner sets `triton_ops` (the `nanovllm.kernels.triton_attention` module, imported
only there) and fills the `gpu_*` fields instead of the CPU ones; padded CUDA-graph rows carry
slot -1 (no cache write) and context length 0 (zero output).

Cache layout per layer: (num_blocks, block_size, num_kv_heads, head_dim); a token at position p
lives in slot `block_table[p // block_size] * block_size + p % block_size`.
"""
# [ZH-START]
# 【模块定位】分页注意力：每个解码层的注意力都在这里读写分块存放的 KV cache。
# 引擎一步内的位置：
#   scheduler → step_input（建 AttentionMetadata）→ model runner → 解码层
#     qkv_proj → q/k norm + rotary → 【PagedAttention】→ o_proj → ... → LM head → sampler
# 三条实现路径，由 ModelRunner 在启动时选定并写进每层：
#   CPU + 编译 C 核（cpu_kernel）：decode 行逐行、prefill 分块按行 tile（chunk），都按块表原地读
#   K/V；CPU + torch 算子：decode 先 gather 整块再 SDPA，prefill 逐序列 SDPA；
#   CUDA：triton_ops（kernels/triton_attention.py），store_kvcache + prefill varlen
#   一次 + decode 一次。
# 先把新 K/V 写进 cache 再做注意力，所以分块既能看到缓存的前缀，也能看到自己。
# cache 每层形状 (num_blocks, block_size, num_kv_heads, head_dim)。
# [ZH-END]
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class PrefillSpan:
    """The new tokens of one sequence: rows [start, start + q_len) of the batch."""
    # [ZH-START]
    # 【职责】描述批里一条序列的一个 prefill 分块：批内行 [start, start + q_len)，
    # 前面已缓存 num_cached 个 token，以及各注意力路径各自需要的附加数据（torch 路径的
    # context_slots / mask，编译核的 block_table）。
    # 【边界】只是数据，不做计算；CUDA 路径不用它（用 AttentionMetadata 的 gpu_* 字段）。
    # 【协作者】由 step_input.build_cpu_batch 填写，PagedAttention.forward 逐个读取。
    # [ZH-END]
    start: int
    q_len: int
    num_cached: int
    """Tokens already in the cache before this chunk (prefix hits or earlier chunks)."""
    context_slots: torch.Tensor | None = None
    """(num_cached + q_len,) cache slots to attend over, for the torch path after cached tokens."""
    mask: torch.Tensor | None = None
    """(q_len, num_cached + q_len) bool, True where a query may attend; with `context_slots`."""
    block_table: torch.Tensor | None = None
    """(num_blocks,) int64, for the compiled kernel."""


@dataclass
class AttentionMetadata:
    # [ZH-START]
    # 【职责】一步里所有层共享的注意力元数据：每个新 token 的 slot（slot_mapping），
    # decode 行的块表 / 上下文长度 / mask，prefill 分块列表，以及 CUDA 路径的 int32 字段。
    # 【边界】每步由 step_input 新建一份，层只读不改；它不持有 KV cache 本身。
    # 【协作者】build_cpu_batch / build_gpu_batch 生成；PagedAttention、融合 CPU 算子（写 KV）、
    # DecodeGraphs（把 decode 字段拷进图的静态缓冲）读取。
    # [ZH-END]
    slot_mapping: torch.Tensor
    """(T,) cache slot of every new token."""
    num_decode: int = 0
    decode_block_tables: torch.Tensor | None = None
    """(num_decode, max_blocks) block ids, padded with 0 (masked out)."""
    decode_mask: torch.Tensor | None = None
    """(num_decode, 1, 1, max_blocks * block_size) bool, True for positions < context length."""
    decode_context_lens: torch.Tensor | None = None
    """(num_decode,) tokens in cache per sequence, the new one included."""
    decode_rows: torch.Tensor | None = None
    """(num_decode,) arange: decode row r reads block-table row r (for the compiled kernel)."""
    prefills: list[PrefillSpan] = field(default_factory=list)
    # The CUDA path (int32 indices, as the Triton kernels take them):
    gpu_prefill_cu_seqlens: torch.Tensor | None = None
    """(P + 1,) row offsets of the prefill chunks, relative to the first prefill row."""
    gpu_prefill_context_lens: torch.Tensor | None = None
    """(P,) cached tokens plus the chunk, per prefill sequence."""
    gpu_prefill_block_tables: torch.Tensor | None = None
    """(P, max_blocks) block ids, padded with 0 (never read past a context)."""
    gpu_max_prefill_len: int = 0
    """The longest chunk: sizes the prefill grid without a device-to-host sync."""


class PagedAttention(nn.Module):
    # [ZH-START]
    # 【职责】一层的注意力：把本步新算出的 K/V 写进分页 cache 的 slot，再让每个查询 token 对其
    # 序列的全部上下文（缓存前缀 + 本步新 token，因果）做注意力，支持 GQA（H 个 query head
    # 共享 KVH 个 kv head）。
    # 【边界】不做 qkv 投影、q/k norm、rotary（在 decoder 的 Attention 里）；不分配 cache、
    # 不管块表，k_cache / v_cache 只是 ModelRunner 赋进来的视图；不决定用哪条实现路径。
    # 【协作者】ModelRunner 设置 k_cache / v_cache / cpu_kernel / triton_ops；decoder 的 Attention
    # 每步调用 forward；具体计算交给 torch SDPA、CpuAttentionKernel 或 triton_attention 模块。
    # [ZH-END]
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim ** -0.5
        # Views into the engine's cache tensor, assigned by the model runner.
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        # The compiled CPU kernel (layers.cpu_kernels), when the runner has one.
        self.cpu_kernel = None
        # The Triton kernel module on CUDA.
        self.triton_ops = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                kv_stored: bool = False) -> torch.Tensor:
        """`kv_stored`: the new K/V rows are already in the cache (a fused op wrote them)."""
        # [ZH-START]
        # 1. 有 triton_ops（CUDA）→ 直接走 _forward_triton（kv_stored 一并传入）。
        # 2. 把 cache 摊平成 k_flat / v_flat：(num_blocks * block_size, KVH, D)，一行一个 slot。
        # 3. 若 kv_stored 为 False：index_copy_ 把新 k / v (T, KVH, D) 写到 slot_mapping 指定的行；
        #    融合 CPU 算子已经写过时（kv_stored=True）跳过。
        # 4. out = empty_like(q)，形状 (T, H, D)。
        # 5. decode 行 [0, num_decode)：没有编译核 → _decode（gather + SDPA）；
        #    有 → kernel(q, 两个 cache, decode_block_tables, decode_rows,
        #    decode_context_lens, scale)。
        # 6. 逐个 prefill 分块，行 [start, start + q_len)：
        #    a. 有编译核：kernel.chunk(q 的这些行, 两个 cache, block_table, num_cached, scale)，
        #       第 i 行看前 num_cached + i + 1 个位置，按行 tile 计算（cpu_attention.c 的
        #       paged_attention_chunk）；
        #    b. 没有编译核且 num_cached == 0：直接用本步的 k / v 行做因果
        #       SDPA（_attend，mask=None）；
        #    c. 没有编译核且有缓存前缀：从 cache 按 context_slots 取出 (num_cached + q_len) 行
        #       K/V，用带偏移的 mask。
        # 7. 返回 out (T, H, D)。
        # [ZH-END]
        if self.triton_ops is not None:
            return self._forward_triton(q, k, v, meta, kv_stored)
        k_flat = self.k_cache.view(-1, self.num_kv_heads, self.head_dim)  # (slots, KVH, D)
        v_flat = self.v_cache.view(-1, self.num_kv_heads, self.head_dim)
        if not kv_stored:
            k_flat.index_copy_(0, meta.slot_mapping, k)
            v_flat.index_copy_(0, meta.slot_mapping, v)
        out = torch.empty_like(q)  # (T, H, D)
        kernel = self.cpu_kernel
        if meta.num_decode:
            decode_q = q[: meta.num_decode]
            out[: meta.num_decode] = self._decode(decode_q, meta) if kernel is None else kernel(
                decode_q, self.k_cache, self.v_cache, meta.decode_block_tables, meta.decode_rows,
                meta.decode_context_lens, self.scale)
        for span in meta.prefills:
            rows = slice(span.start, span.start + span.q_len)
            if kernel is not None:
                out[rows] = kernel.chunk(q[rows], self.k_cache, self.v_cache, span.block_table, span.num_cached,
                                         self.scale)
            elif span.num_cached == 0:
                out[rows] = self._attend(q[rows], k[rows], v[rows], mask=None)
            else:
                out[rows] = self._attend(q[rows], k_flat[span.context_slots], v_flat[span.context_slots], span.mask)
        return out

    def _forward_triton(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                        kv_stored: bool) -> torch.Tensor:
        # [ZH-START]
        # 1. store_kvcache：新 K/V 按 slot_mapping 写入 cache；slot = -1 的行（CUDA 图的
        #    填充行）不写。
        #    kv_stored 为 True（融合 Triton 算子 qk_norm_rope_store 已写过）时跳过。
        # 2. num_decode == T（纯解码步，以及所有 CUDA 图重放）：
        #    一次 paged_decode_attention 覆盖全部行，返回。
        # 3. 否则对 q[num_decode:] 做一次 varlen 的 paged_prefill_attention：
        #    cu_seqlens / context_lens / 块表都是 int32，max_seqlen_q 用 host 上已知的
        #    gpu_max_prefill_len，避免设备到主机同步；结果 (T - B, H, D)。
        # 4. 没有 decode 行就直接返回 prefill 结果；有则对 q[:num_decode] 再做
        #    paged_decode_attention 得 (B, H, D)，按批内行序 cat([decode, prefill])。
        # [ZH-END]
        ops, num_decode = self.triton_ops, meta.num_decode
        if not kv_stored:
            ops.store_kvcache(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        if num_decode == q.shape[0]:  # decode-only steps (and every CUDA graph)
            return ops.paged_decode_attention(q, self.k_cache, self.v_cache, meta.decode_block_tables,
                                              meta.decode_context_lens, self.scale)
        prefill = ops.paged_prefill_attention(
            q[num_decode:], self.k_cache, self.v_cache, meta.gpu_prefill_cu_seqlens, meta.gpu_prefill_context_lens,
            meta.gpu_prefill_block_tables, self.scale, max_seqlen_q=meta.gpu_max_prefill_len)  # (T - B, H, D)
        if not num_decode:
            return prefill
        decode = ops.paged_decode_attention(q[:num_decode], self.k_cache, self.v_cache, meta.decode_block_tables,
                                            meta.decode_context_lens, self.scale)  # (B, H, D)
        return torch.cat([decode, prefill])

    def _decode(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        # [ZH-START]
        # 1. 取批大小 B 和 max_blocks（decode_block_tables 的形状），L = max_blocks * block_size。
        # 2. k_cache[decode_block_tables] 按块 gather：(B, max_blocks, block_size, KVH, D) → view 成
        #    (B, L, KVH, D)，V 同理；这是一份拷贝，每层每步都要做，正是编译核要省掉的开销。
        # 3. SDPA：q (B, H, 1, D)，k / v 转成 (B, KVH, L, D)，attn_mask = decode_mask (B, 1, 1, L)
        #    （超出 context_len 的位置和补 0 的块都被屏蔽），enable_gqa 让 H / KVH 个 query
        #    head 共享一个 kv head。
        # 4. 去掉长度 1 的维度，返回 (B, H, D)。
        # [ZH-END]
        batch, max_blocks = meta.decode_block_tables.shape
        block_size = self.k_cache.shape[1]
        length = max_blocks * block_size
        # Gather whole blocks (contiguous rows), then attend as one padded batch.
        k = self.k_cache[meta.decode_block_tables].view(batch, length, self.num_kv_heads, self.head_dim)
        v = self.v_cache[meta.decode_block_tables].view(batch, length, self.num_kv_heads, self.head_dim)
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2),  # (B, H, 1, D)
            k.transpose(1, 2),  # (B, KVH, L, D)
            v.transpose(1, 2),
            attn_mask=meta.decode_mask,  # (B, 1, 1, L)
            scale=self.scale,
            enable_gqa=True,
        )
        return out.squeeze(2)  # (B, H, D)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Attention of one sequence's chunk: q (Q, H, D) over k/v (K, KVH, D)."""
        # [ZH-START]
        # 1. 维度换成 SDPA 要的批大小为 1 的布局：q (Q, H, D) → (1, H, Q, D)；k / v (K, KVH,
        #    D) → (1, KVH, K, D)。
        # 2. mask 为 None（新 prompt，Q == K）时用 is_causal=True；否则用传入的 (Q, K) 布尔
        #    mask（带缓存前缀的因果掩码）。
        # 3. scale = head_dim ** -0.5，enable_gqa=True。
        # 4. 换回 (Q, H, D) 返回。
        # [ZH-END]
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),  # (1, H, Q, D)
            k.transpose(0, 1).unsqueeze(0),  # (1, KVH, K, D)
            v.transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            is_causal=mask is None,
            scale=self.scale,
            enable_gqa=True,
        )
        return out.squeeze(0).transpose(0, 1)  # (Q, H, D)
