"""Triton kernels for the paged KV cache: cache writes, decode attention, prefill attention.

This is the GPU attention path (flash-attn is not available there). Each public function has a
plain-torch twin of the same name and signature in `reference.py`, which the tests hold these to.

Cache layout (per layer): `[num_blocks, block_size, num_kv_heads, head_dim]`, contiguous; token
position p of a sequence lives in slot `block_table[p // block_size] * block_size + p % block_size`.

Attention runs tile by tile with an online softmax (running max and denominator, fp32
accumulator), so no score matrix is ever materialised. Decode is flash-decoding style: the
context may be split across programs whose partial results a second kernel merges. Scores are
kept in log2 units (scale * log2(e)) so the kernels can use exp2.

Under TRITON_INTERPRET=1 (CPU) these run, slowly, for tests; bf16 `tl.dot` is wrong in the
interpreter, so CPU launches upcast bf16 tiles to fp32 before each dot.
"""
# [ZH-START]
# 【模块定位】GPU 上的注意力实现（GPU 机器没有 flash-attn，所以用自己写的 Triton 核）。
# 引擎一步内的位置：
#   scheduler → step_input.build_gpu_batch（int32 元数据）→ model runner → 解码层
#     → PagedAttention._forward_triton
#     →【本模块】store_kvcache / paged_prefill_attention / paged_decode_attention
# 只在 CUDA 上由 ModelRunner 导入；CPU 测试在 TRITON_INTERPRET=1 下运行，并与 reference.py 里
# 同名同签名的纯 torch 实现逐一比对。
# 共同算法：按 tile 遍历上下文，在线 softmax（running max m、分母 l、fp32 累加器 acc），
# 从不生成完整的分数矩阵；分数乘 scale * log2(e)，用 exp2 代替 exp。
# 常量：decode 每 tile 32 个 key；prefill 每 tile 64 个 query × 32 个 key；
# tl.dot 的每个维度至少 16。
# [ZH-END]

import math

import torch
import triton
import triton.language as tl

from nanovllm.kernels.reference import check_decode_inputs, check_prefill_inputs, check_store_inputs

_LOG2E = 1.4426950408889634
# tl.dot needs every tile dimension >= 16 on GPU.
_MIN_DOT_DIM = 16
_DECODE_BLOCK_N = 32
_PREFILL_BLOCK_M = 64
_PREFILL_BLOCK_N = 32
# Decode splits the context only when batch x kv heads cannot fill the GPU on its own.
_DECODE_PROGRAMS_WITHOUT_SPLIT = 128
_DECODE_TOKENS_PER_SPLIT = 512
_DECODE_MAX_SPLITS = 16


@triton.jit
def _store_kvcache_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_key_row, stride_key_head, stride_value_row, stride_value_head,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # [ZH-START]
    # 网格 (N,)，一个 program 负责一个新 token：
    # 1. row = program_id(0)，slot = slot_mapping[row]（转 int64 防溢出）；slot < 0（CUDA 图的
    #    填充行）直接返回。
    # 2. offs_h 覆盖 BLOCK_H = next_pow2(KVH) 个 head，offs_d 覆盖 BLOCK_D = next_pow2(D)，
    #    多出的部分用 mask 挡住。
    # 3. 按 stride 读出这一行的 key / value，形状 [BLOCK_H, BLOCK_D]（最后一维连续）。
    # 4. cache 偏移 = slot * (KVH * D) + h * D + d（cache 连续存放），写进 k_cache 和 v_cache。
    # [ZH-END]
    row = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + row).to(tl.int64)
    if slot < 0:  # padded row of a CUDA graph
        return
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h < NUM_KV_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]
    key = tl.load(key_ptr + row * stride_key_row + offs_h[:, None] * stride_key_head + offs_d[None, :], mask=mask)
    value = tl.load(
        value_ptr + row * stride_value_row + offs_h[:, None] * stride_value_head + offs_d[None, :], mask=mask
    )
    cache_offs = slot * (NUM_KV_HEADS * HEAD_DIM) + offs_h[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(k_cache_ptr + cache_offs, key, mask=mask)
    tl.store(v_cache_ptr + cache_offs, value, mask=mask)


@triton.jit
def _attend_tile(
    q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, block_table_ptr, kv_head, start, kv_end, query_pos,
    scale_log2e,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr, DOT_FP32: tl.constexpr,
):
    """Fold keys/values at positions [start, start + BLOCK_N) ∩ [0, kv_end) into the running softmax."""
    # [ZH-START]
    # 1. pos = start + arange(BLOCK_N)，kv_mask = pos < kv_end。
    # 2. 查块表：block = block_table[pos // BLOCK_SIZE]（mask 外的 lane 不读，可能是 -1 或垃圾），
    #    slot = block * BLOCK_SIZE + pos % BLOCK_SIZE。
    # 3. kv_offs [N, D] = slot * (KVH * D) + kv_head * D + d，读出 K、V tile（mask 外填 0）。
    # 4. DOT_FP32（解释器里的 bf16）时把 q、k、v 升到 fp32。
    # 5. scores [M, N] = q @ k^T * scale_log2e（input_precision="ieee"：fp32 输入不走 tf32）。
    # 6. 超出 kv_end 的 key，以及 CAUSAL 时 pos > query_pos 的 key，分数置 -inf。
    # 7. 在线 softmax：m_new = max(m_i, 行最大分数)；m_safe 在 m_new 为 -inf 时取 0（避免
    #    -inf - -inf = NaN）；alpha = exp2(m_i - m_safe)，p = exp2(scores - m_safe)；
    #    l_i = l_i * alpha + sum(p)；acc = acc * alpha + p @ V。
    # 8. 返回 (acc [M, D], m_new, l_i)。
    # [ZH-END]
    pos = start + tl.arange(0, BLOCK_N)
    kv_mask = pos < kv_end
    # Unused block-table entries may hold -1 or garbage: masked lanes never read them.
    block = tl.load(block_table_ptr + pos // BLOCK_SIZE, mask=kv_mask, other=0).to(tl.int64)
    slot = block * BLOCK_SIZE + pos % BLOCK_SIZE
    offs_d = tl.arange(0, BLOCK_D)
    kv_offs = slot[:, None] * (NUM_KV_HEADS * HEAD_DIM) + kv_head * HEAD_DIM + offs_d[None, :]  # [N, D]
    load_mask = kv_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
    k = tl.load(k_cache_ptr + kv_offs, mask=load_mask, other=0.0)
    v = tl.load(v_cache_ptr + kv_offs, mask=load_mask, other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    # "ieee" only affects fp32 inputs: keeps fp32 exact instead of tf32 on tensor cores.
    scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2e  # [M, N]
    valid = kv_mask[None, :]
    if CAUSAL:
        valid = valid & (pos[None, :] <= query_pos[:, None])
    scores = tl.where(valid, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    # A row that has seen no valid key keeps m = -inf; subtracting 0 then gives exp2(-inf) = 0
    # where -inf - -inf would give NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(scores - m_safe[:, None])  # [M, N]
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")  # [M, D]
    return acc, m_new, l_i


@triton.jit
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
    out_ptr, partial_out_ptr, partial_lse_ptr,
    scale_log2e, split_len, num_splits,
    stride_q_batch, stride_q_head, stride_out_batch, stride_out_head, stride_bt_batch,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr, WRITE_FINAL: tl.constexpr,
):
    """One program: one sequence, one kv head with all its query heads, one split of the context."""
    # [ZH-START]
    # 网格 (B, KVH, num_splits)，一个 program = 一条序列 × 一个 kv head × 上下文的一段：
    # 1. 读 context_len；本段负责位置 [split * split_len, min(context_len,
    #    split_start + split_len))。
    # 2. 共享这个 kv head 的 GROUP 个 query head 组成 dot 的 M 维：
    #    heads = kv_head * GROUP + offs_g，读出 q [BLOCK_G, BLOCK_D]（BLOCK_G >= 16，
    #    多出的行 mask 成 0），这样每个 K/V tile 只读一次。
    # 3. 初始化 m = -inf、l = 0、acc = 0（都是 fp32）。
    # 4. 以 BLOCK_N = 32 为步长遍历本段，调用 _attend_tile（CAUSAL=False：
    #    decode 的查询在最后一个位置，能看到全部上下文）。
    # 5. out = acc / l；l == 0（空段，或 context_len 为 0 的填充行）时除以 1，输出 0 而不是 NaN。
    # 6. WRITE_FINAL（只有 1 段）：直接按 q 的 dtype 写 out [B, H, D]。
    #    否则写部分结果：partial_out [B, H, num_splits, D]（fp32），partial_lse [B, H,
    #    num_splits] = m + log2(l)（以 2 为底的 log-sum-exp；空段为 -inf），
    #    由 _decode_reduce_kernel 合并。
    # [ZH-END]
    batch = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + batch)
    split_start = split * split_len
    split_end = tl.minimum(context_len, split_start + split_len)

    # The query heads sharing this kv head form the M side of the dot, so K/V tiles load once.
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + offs_g
    mask = (offs_g < GROUP)[:, None] & (offs_d < HEAD_DIM)[None, :]
    q = tl.load(
        q_ptr + batch * stride_q_batch + heads[:, None] * stride_q_head + offs_d[None, :], mask=mask, other=0.0
    )  # [G, D]

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    block_table_ptr = block_tables_ptr + batch * stride_bt_batch
    for start in range(split_start, split_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, block_table_ptr, kv_head, start, split_end, offs_g,
            scale_log2e, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, BLOCK_N, BLOCK_D, False, DOT_FP32,
        )

    # An empty split (or a padded row, context_len 0) has l = 0: emit zeros, not 0/0.
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]  # [G, D]
    if WRITE_FINAL:
        out_offs = batch * stride_out_batch + heads[:, None] * stride_out_head + offs_d[None, :]
        tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        # Partials are [B, num_heads, num_splits, HEAD_DIM] and lse [B, num_heads, num_splits].
        partial_row = (batch * NUM_KV_HEADS * GROUP + heads) * num_splits + split  # [G]
        tl.store(partial_out_ptr + partial_row[:, None] * HEAD_DIM + offs_d[None, :], out, mask=mask)
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(partial_lse_ptr + partial_row, lse, mask=offs_g < GROUP)


@triton.jit
def _decode_reduce_kernel(
    partial_out_ptr, partial_lse_ptr, out_ptr, num_splits, stride_out_batch, stride_out_head,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Merge the splits of one (sequence, query head), weighting each by its softmax mass."""
    # [ZH-START]
    # 网格 (B, H)，一个 program 合并一个 (序列, query head) 的所有段：
    # 1. 读出 num_splits 个 lse（补齐到 BLOCK_S 的部分为 -inf）。
    # 2. lse_max = 最大值；权重 w = exp2(lse - lse_max)，即各段 softmax 质量的相对大小；
    #    全为 -inf 时减 0，权重全 0。
    # 3. 读出各段已归一化的部分输出 [S, D]。
    # 4. out = sum(w * partial) / sum(w)（总和为 0 时除以 1，输出 0），按 out 的 dtype 写回 [D]。
    # [ZH-END]
    batch = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    rows = (batch * NUM_HEADS + head) * num_splits + offs_s  # [S]
    lse = tl.load(partial_lse_ptr + rows, mask=offs_s < num_splits, other=float("-inf"))
    lse_max = tl.max(lse, axis=0)
    weights = tl.exp2(lse - tl.where(lse_max == float("-inf"), 0.0, lse_max))  # [S], 0 for empty splits
    mask = (offs_s < num_splits)[:, None] & (offs_d < HEAD_DIM)[None, :]
    partial = tl.load(partial_out_ptr + rows[:, None] * HEAD_DIM + offs_d[None, :], mask=mask, other=0.0)
    total = tl.sum(weights, axis=0)
    out = tl.sum(weights[:, None] * partial, axis=0) / tl.where(total > 0, total, 1.0)  # [D]
    out_offs = batch * stride_out_batch + head * stride_out_head + offs_d
    tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, cu_seqlens_q_ptr, context_lens_ptr, block_tables_ptr, out_ptr,
    scale_log2e, stride_q_token, stride_q_head, stride_out_token, stride_out_head, stride_bt_batch,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_FP32: tl.constexpr,
):
    """One program: BLOCK_M new tokens of one sequence, one query head."""
    # [ZH-START]
    # 网格 (cdiv(max_seqlen_q, 64), P, H)，一个 program = 一条序列的 BLOCK_M = 64 个新
    # token × 一个 query head：
    # 1. q_start = cu_seqlens_q[b]，q_len = cu_seqlens_q[b + 1] - q_start；tile * 64 >= q_len 就返回
    #    （网格按最长序列开，短序列的多余 tile 什么都不做）。
    # 2. context_len = context_lens[b]，prefix_len = context_len - q_len（本步之前
    #    已缓存的 token 数）。
    # 3. 读 q tile [64, D]（行 q_start + offs_m），各行的绝对位置 query_pos = prefix_len + offs_m。
    # 4. 初始化 m = -inf、l = 0、acc = 0。
    # 5. kv_end = min(context_len, prefix_len + (tile + 1) * 64)：比本 tile 最后一个查询更靠后的 key
    #    对整个 tile 都不可见。
    # 6. 从位置 0 起以 BLOCK_N = 32 遍历到 kv_end，调用 _attend_tile（kv_head = head // GROUP，
    #    CAUSAL=True），缓存前缀和本步新 token 都从 cache 读（store_kvcache 已先写入）。
    # 7. out = acc / l（l == 0 时除以 1），按 mask 写回 q_len 范围内的行。
    # [ZH-END]
    tile = tl.program_id(0)
    batch = tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + batch)
    q_len = tl.load(cu_seqlens_q_ptr + batch + 1) - q_start
    if tile * BLOCK_M >= q_len:  # the grid is sized for the longest sequence
        return
    context_len = tl.load(context_lens_ptr + batch)
    prefix_len = context_len - q_len  # tokens cached before this step

    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m < q_len)[:, None] & (offs_d < HEAD_DIM)[None, :]
    q_offs = (q_start + offs_m)[:, None] * stride_q_token + head * stride_q_head + offs_d[None, :]
    q = tl.load(q_ptr + q_offs, mask=mask, other=0.0)  # [M, D]
    query_pos = prefix_len + offs_m

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    block_table_ptr = block_tables_ptr + batch * stride_bt_batch
    # Keys after the tile's last query are causally invisible to all of it.
    kv_end = tl.minimum(context_len, prefix_len + (tile + 1) * BLOCK_M)
    for start in range(0, kv_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, block_table_ptr, head // GROUP, start, kv_end, query_pos,
            scale_log2e, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, BLOCK_N, BLOCK_D, True, DOT_FP32,
        )

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # [M, D]
    out_offs = (q_start + offs_m)[:, None] * stride_out_token + head * stride_out_head + offs_d[None, :]
    tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def _dot_dim(n: int) -> int:
    return max(_MIN_DOT_DIM, triton.next_power_of_2(n))


def _dot_in_fp32(t: torch.Tensor) -> bool:
    # Only the interpreter (CPU tensors) mishandles bf16 dots; GPUs keep bf16 tensor cores.
    return t.dtype == torch.bfloat16 and t.device.type != "cuda"


def store_kvcache(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write key/value rows `[N, num_kv_heads, head_dim]` into their cache slots; slot -1 is skipped."""
    # [ZH-START]
    # 1. check_store_inputs：形状 / dtype / 设备检查（与 reference.py 共用）。
    # 2. N = key.shape[0]，为 0 直接返回（空网格不能启动）。
    # 3. 从 k_cache 形状取 KVH、D，启动 _store_kvcache_kernel，网格 (N,)，
    #    BLOCK_H / BLOCK_D 为 next_pow2(KVH) / next_pow2(D)。
    # [ZH-END]
    check_store_inputs(key, value, k_cache, v_cache, slot_mapping)
    num_rows = key.shape[0]
    if num_rows == 0:
        return
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    _store_kvcache_kernel[(num_rows,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
    )


def _default_num_splits(batch: int, num_kv_heads: int, max_context_len: int) -> int:
    """How many programs share one sequence's context; from shapes only, so CUDA graphs can replay it."""
    # [ZH-START]
    # 1. B × KVH >= 128：program 已足够占满 GPU，不切分，返回 1。
    # 2. 否则每 512 个 token 切一段：min(16, ceil(max_context_len / 512))，至少 1。
    # 3. 只依赖形状、不读 context_lens，所以同一个 CUDA 图每次重放切分数不变。
    # [ZH-END]
    if batch * num_kv_heads >= _DECODE_PROGRAMS_WITHOUT_SPLIT:
        return 1
    return max(1, min(_DECODE_MAX_SPLITS, math.ceil(max_context_len / _DECODE_TOKENS_PER_SPLIT)))


def paged_decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, scale: float, *, num_splits: int | None = None,
) -> torch.Tensor:
    """One new query token per sequence over its whole cached context; `[B, H, D]` in and out.

    A row with context_len 0 (CUDA-graph padding) yields zeros. `num_splits` overrides how many
    programs split each context (default: from the shapes alone, never from context_lens).
    """
    # [ZH-START]
    # 1. check_decode_inputs；显式给的 num_splits < 1 抛 ValueError。
    # 2. 从 q 取 B、H、D，从 cache 取 block_size、KVH；out = empty_like(q)；B == 0 直接返回。
    # 3. max_context_len = 块表宽度 × block_size：所有上下文的上界，不用把 context_lens 读回
    #    host（无同步，可进 CUDA 图）。
    # 4. num_splits 默认由 _default_num_splits 决定；
    #    split_len = ceil(ceil(max_context_len / num_splits) / 32) * 32，是 BLOCK_N 的整数倍。
    # 5. num_splits > 1：分配 fp32 的 partial_out [B, H, S, D] 和 partial_lse [B, H, S]；
    #    否则用 out 占位（WRITE_FINAL 时不读）。
    # 6. 启动 _decode_kernel，网格 (B, KVH, S)：GROUP = H // KVH，BLOCK_G = max(16,
    #    next_pow2(GROUP))，BLOCK_D = max(16, next_pow2(D))，BLOCK_N = 32，缩放 scale * log2(e)。
    # 7. num_splits > 1 时再启动 _decode_reduce_kernel，网格 (B, H)，合并各段。
    # 8. 返回 out [B, H, D]。
    # [ZH-END]
    check_decode_inputs(q, k_cache, v_cache, block_tables, context_lens)
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    out = torch.empty_like(q)
    if batch == 0:
        return out
    # The block table's width bounds every context, without reading context_lens on the host.
    max_context_len = block_tables.shape[1] * block_size
    if num_splits is None:
        num_splits = _default_num_splits(batch, num_kv_heads, max_context_len)
    split_len = triton.cdiv(triton.cdiv(max_context_len, num_splits), _DECODE_BLOCK_N) * _DECODE_BLOCK_N
    if num_splits > 1:
        partial_out = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        partial_lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
    else:
        partial_out = partial_lse = out  # unused when WRITE_FINAL
    group = num_heads // num_kv_heads
    _decode_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, partial_out, partial_lse,
        scale * _LOG2E, split_len, num_splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, GROUP=group,
        BLOCK_G=_dot_dim(group), BLOCK_D=_dot_dim(head_dim), BLOCK_N=_DECODE_BLOCK_N,
        DOT_FP32=_dot_in_fp32(q), WRITE_FINAL=num_splits == 1,
    )
    if num_splits > 1:
        _decode_reduce_kernel[(batch, num_heads)](
            partial_out, partial_lse, out, num_splits, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim,
            BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=triton.next_power_of_2(head_dim),
        )
    return out


def paged_prefill_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor, block_tables: torch.Tensor, scale: float, *,
    max_seqlen_q: int | None = None,
) -> torch.Tensor:
    """Causal attention for the new tokens of B sequences packed in `q` `[T, H, D]`.

    Sequence b's new tokens are `q[cu_seqlens_q[b]:cu_seqlens_q[b+1]]` at positions
    `context_lens[b] - q_len ... context_lens[b] - 1`; its cached prefix is read from the cache.
    Pass `max_seqlen_q` (the longest q_len) to size the grid without a device-to-host sync.
    """
    # [ZH-START]
    # 1. check_prefill_inputs；T、H、D 取自 q，block_size、KVH 取自 cache；
    #    P = len(cu_seqlens_q) - 1。
    # 2. out = zeros_like(q)：cu_seqlens_q[-1] 之后的填充行不会被核写到，必须是 0；
    #    P 或 T 为 0 直接返回。
    # 3. 没给 max_seqlen_q 就从 cu_seqlens_q 算（会有一次设备到 host 同步）；< 1 抛 ValueError。
    # 4. 网格 (cdiv(max_seqlen_q, 64), P, H)，启动 _prefill_kernel：GROUP = H // KVH，
    #    BLOCK_M = 64，BLOCK_N = 32，BLOCK_D = max(16, next_pow2(D))，缩放 scale * log2(e)。
    # 5. 返回 out [T, H, D]。
    # [ZH-END]
    check_prefill_inputs(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables)
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    batch = cu_seqlens_q.shape[0] - 1
    # Zeros, not empty: rows past cu_seqlens_q[-1] (padding) are never written by the kernel.
    out = torch.zeros_like(q)
    if batch == 0 or num_tokens == 0:
        return out
    if max_seqlen_q is None:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    if max_seqlen_q < 1:
        raise ValueError(f"max_seqlen_q must be >= 1 when q holds tokens, got {max_seqlen_q}")
    grid = (triton.cdiv(max_seqlen_q, _PREFILL_BLOCK_M), batch, num_heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, out,
        scale * _LOG2E, q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, GROUP=num_heads // num_kv_heads,
        BLOCK_M=_PREFILL_BLOCK_M, BLOCK_N=_PREFILL_BLOCK_N, BLOCK_D=_dot_dim(head_dim), DOT_FP32=_dot_in_fp32(q),
    )
    return out
