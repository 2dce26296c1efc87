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
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class PrefillSpan:
    """The new tokens of one sequence: rows [start, start + q_len) of the batch."""
    start: int
    q_len: int
    num_cached: int
    """Tokens already in the cache before this chunk (prefix hits or earlier chunks)."""
    context_slots: torch.Tensor | None = None
    """(num_cached + q_len,) cache slots to attend over, for the torch path after cached tokens."""
    mask: torch.Tensor | None = None
    """(q_len, num_cached + q_len) bool, True where a query may attend; with `context_slots`."""
    block_table: torch.Tensor | None = None
    """(1, num_blocks), for the compiled kernel."""
    row_ctx: torch.Tensor | None = None
    """(q_len,) context length of each query (num_cached + i + 1), for the compiled kernel."""


@dataclass
class AttentionMetadata:
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
        """`kv_stored`: the new K/V rows are already in the cache (the fused CPU op wrote them)."""
        if self.triton_ops is not None:
            return self._forward_triton(q, k, v, meta)
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
                # Rows of one sequence, each with one more token of context than the last; on
                # fresh prompts too, where it beats causal SDPA by ~25% at these lengths.
                zeros = torch.zeros(span.q_len, dtype=torch.long)
                out[rows] = kernel(q[rows], self.k_cache, self.v_cache, span.block_table, zeros, span.row_ctx, self.scale)
            elif span.num_cached == 0:
                out[rows] = self._attend(q[rows], k[rows], v[rows], mask=None)
            else:
                out[rows] = self._attend(q[rows], k_flat[span.context_slots], v_flat[span.context_slots], span.mask)
        return out

    def _forward_triton(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        ops, num_decode = self.triton_ops, meta.num_decode
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
