"""Triton paged-attention kernels against their torch references, and the references against SDPA.

Without CUDA the kernels run in Triton's interpreter (TRITON_INTERPRET=1, which must be set before
the kernel module is imported); it costs ~10 ms per program per loop step, so CPU shapes are tiny.
Unused cache slots are filled with NaN and unused block-table entries point at an all-NaN block
(or hold -1), so a kernel that reads past a context turns its output into NaN.
"""

import math
import os
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from nanovllm.kernels import reference  # noqa: E402
from nanovllm.kernels import triton_attention as kernels  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {
    # Loose enough for a GPU reference run with TF32 matmuls; real kernel bugs are off by ~0.1.
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.float16: dict(atol=3e-3, rtol=1e-2),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}


@dataclass
class PagedBatch:
    """Sequences written into a shuffled paged cache, plus their dense keys/values for checking."""

    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [B, max_blocks] int32
    context_lens: torch.Tensor  # [B] int32
    keys: list[torch.Tensor]  # per sequence [context_len, num_kv_heads, head_dim]
    values: list[torch.Tensor]


def make_paged_batch(
    context_lens: list[int], num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
    seed: int = 0,
) -> PagedBatch:
    """Even sequences mark unused block-table entries -1, odd ones point them at the NaN block."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [math.ceil(n / block_size) for n in context_lens]
    # One spare column so every row has at least one unused entry; the last block stays all-NaN.
    width = max(blocks_per_seq, default=0) + 1
    num_blocks = sum(blocks_per_seq) + 2
    nan_block = num_blocks - 1
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    # Shuffled, so a kernel that ignores the block table reads the wrong sequence.
    free_blocks = torch.randperm(num_blocks - 1, generator=gen).tolist()
    block_tables = torch.empty(len(context_lens), width, dtype=torch.int32)
    keys, values = [], []
    for b, (n, used) in enumerate(zip(context_lens, blocks_per_seq)):
        block_tables[b] = -1 if b % 2 == 0 else nan_block
        block_tables[b, :used] = torch.tensor([free_blocks.pop() for _ in range(used)], dtype=torch.int32)
        k = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        positions = torch.arange(n)
        slots = block_tables[b].long()[positions // block_size] * block_size + positions % block_size
        k_cache.view(-1, num_kv_heads, head_dim)[slots] = k
        v_cache.view(-1, num_kv_heads, head_dim)[slots] = v
        keys.append(k)
        values.append(v)
    return PagedBatch(
        k_cache.to(DEVICE), v_cache.to(DEVICE), block_tables.to(DEVICE),
        torch.tensor(context_lens, dtype=torch.int32, device=DEVICE), keys, values,
    )


def dense_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_positions: torch.Tensor, scale: float
) -> torch.Tensor:
    """SDPA on contiguous `[T, heads, D]` tensors: an independent check of the reference."""
    allowed = torch.arange(k.shape[0])[None, :] <= query_positions[:, None]  # [Tq, Tk]
    out = F.scaled_dot_product_attention(
        q.float().transpose(0, 1), k.float().transpose(0, 1), v.float().transpose(0, 1),
        attn_mask=allowed, scale=scale, enable_gqa=True,
    )  # [H, Tq, D]
    return out.transpose(0, 1)


def random_queries(num_tokens: int, num_heads: int, head_dim: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype).to(DEVICE)


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert not actual.isnan().any(), "kernel output has NaN: it read an unused slot or divided 0/0"
    torch.testing.assert_close(actual.float(), expected.float(), **TOLERANCE[expected.dtype])


# --- the references against dense SDPA ---------------------------------------------------------


def test_reference_decode_matches_dense_sdpa():
    context_lens = [13, 1, 8, 0]
    batch = make_paged_batch(context_lens, num_kv_heads=2, head_dim=16, block_size=4, dtype=torch.float32)
    q = random_queries(len(context_lens), 4, 16, torch.float32, seed=1)
    out = reference.paged_decode_attention(q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, 0.3)
    for b, n in enumerate(context_lens):
        if n == 0:
            assert torch.equal(out[b], torch.zeros_like(out[b]))
            continue
        expected = dense_causal_attention(q[b : b + 1].cpu(), batch.keys[b], batch.values[b], torch.tensor([n - 1]), 0.3)
        torch.testing.assert_close(out[b].cpu(), expected[0])


def test_reference_prefill_matches_dense_sdpa():
    context_lens, q_lens = [11, 6, 9], [11, 2, 1]  # no prefix, a 4-token prefix, an 8-token prefix
    batch = make_paged_batch(context_lens, num_kv_heads=2, head_dim=16, block_size=4, dtype=torch.float32)
    cu_seqlens = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    q = random_queries(sum(q_lens), 4, 16, torch.float32, seed=2)
    out = reference.paged_prefill_attention(
        q, batch.k_cache, batch.v_cache, cu_seqlens, batch.context_lens, batch.block_tables, 0.3
    )
    for b, (n, q_len) in enumerate(zip(context_lens, q_lens)):
        start = int(cu_seqlens[b])
        positions = torch.arange(n - q_len, n)
        expected = dense_causal_attention(q[start : start + q_len].cpu(), batch.keys[b], batch.values[b], positions, 0.3)
        torch.testing.assert_close(out[start : start + q_len].cpu(), expected)


def test_reference_store_skips_padded_rows():
    k_cache = torch.zeros(3, 4, 2, 8)
    v_cache = torch.zeros(3, 4, 2, 8)
    key, value = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    reference.store_kvcache(key, value, k_cache, v_cache, torch.tensor([5, -1, 0]))
    flat_k = k_cache.view(-1, 2, 8)
    assert torch.equal(flat_k[5], key[0]) and torch.equal(flat_k[0], key[2])
    assert torch.equal(v_cache.view(-1, 2, 8)[5], value[0])
    assert torch.count_nonzero(flat_k[-1]) == 0, "slot -1 must not wrap around to the last slot"


# --- the kernels against the references ------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_store_kvcache_matches_reference(dtype):
    num_blocks, block_size, num_kv_heads, head_dim = 4, 4, 2, 16
    gen = torch.Generator().manual_seed(3)
    # key/value as views into a fused qkv projection: rows are strided, heads contiguous.
    qkv = torch.randn(6, 4 + 2 * num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    key, value = qkv[:, 4 : 4 + num_kv_heads], qkv[:, 4 + num_kv_heads :]
    slot_mapping = torch.tensor([9, -1, 0, 15, -1, 4], dtype=torch.int32, device=DEVICE)
    initial = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    caches = {impl: (initial.clone(), initial.clone()) for impl in ("kernel", "reference")}
    kernels.store_kvcache(key, value, *caches["kernel"], slot_mapping)
    reference.store_kvcache(key, value, *caches["reference"], slot_mapping)
    assert torch.equal(caches["kernel"][0], caches["reference"][0])
    assert torch.equal(caches["kernel"][1], caches["reference"][1])
    assert not torch.equal(caches["kernel"][0], initial), "the store wrote nothing"


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_matches_reference(dtype, num_splits):
    # 37 tokens span two 32-token tiles and two splits (the third split is empty); 0 is padding.
    context_lens = [37, 1, 12, 0, 22]
    batch = make_paged_batch(context_lens, num_kv_heads=2, head_dim=16, block_size=4, dtype=dtype)
    q = random_queries(len(context_lens), 4, 16, dtype, seed=4)
    args = (q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, 0.25)
    out = kernels.paged_decode_attention(*args, num_splits=num_splits)
    assert_close(out, reference.paged_decode_attention(*args))
    assert torch.equal(out[3], torch.zeros_like(out[3])), "a padded row (context_len 0) must give zeros"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prefill_matches_reference(dtype):
    # 70 new tokens span two 64-query tiles; the others start after 12, 8 (a whole block) and 0 cached tokens.
    q_lens, prefix_lens = [70, 9, 1, 3], [0, 12, 8, 0]
    context_lens = [p + n for p, n in zip(prefix_lens, q_lens)]
    batch = make_paged_batch(context_lens, num_kv_heads=2, head_dim=16, block_size=4, dtype=dtype)
    cu_seqlens = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    # q as a view into a fused qkv projection, so token and head strides are not the dense ones.
    qkv = random_queries(sum(q_lens), 4 + 2 * 2, 16, dtype, seed=5)
    q = qkv[:, :4]
    args = (q, batch.k_cache, batch.v_cache, cu_seqlens, batch.context_lens, batch.block_tables, 0.25)
    out = kernels.paged_prefill_attention(*args, max_seqlen_q=max(q_lens))
    assert_close(out, reference.paged_prefill_attention(*args))


def test_odd_shapes_match_reference():
    """Group of 3, head_dim 24 and block_size 6 are not powers of two: masked, not rejected."""
    context_lens = [20, 7]
    batch = make_paged_batch(context_lens, num_kv_heads=2, head_dim=24, block_size=6, dtype=torch.float32)
    q = random_queries(2, 6, 24, torch.float32, seed=6)
    args = (q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, 0.2)
    assert_close(kernels.paged_decode_attention(*args, num_splits=2), reference.paged_decode_attention(*args))

    q_lens = [5, 7]
    cu_seqlens = torch.tensor([0, 5, 12], dtype=torch.int32, device=DEVICE)
    q = random_queries(sum(q_lens), 6, 24, torch.float32, seed=7)
    args = (q, batch.k_cache, batch.v_cache, cu_seqlens, batch.context_lens, batch.block_tables, 0.2)
    assert_close(kernels.paged_prefill_attention(*args), reference.paged_prefill_attention(*args))


def test_bf16_matches_reference():
    """bf16 goes through the fp32-upcast dot path on CPU (the interpreter's bf16 dot is wrong)."""
    context_lens = [9, 14]
    batch = make_paged_batch(context_lens, num_kv_heads=2, head_dim=16, block_size=4, dtype=torch.bfloat16)
    q = random_queries(2, 4, 16, torch.bfloat16, seed=8)
    args = (q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, 0.25)
    assert_close(kernels.paged_decode_attention(*args), reference.paged_decode_attention(*args))

    cu_seqlens = torch.tensor([0, 3, 8], dtype=torch.int32, device=DEVICE)
    q = random_queries(8, 4, 16, torch.bfloat16, seed=9)
    args = (q, batch.k_cache, batch.v_cache, cu_seqlens, batch.context_lens, batch.block_tables, 0.25)
    assert_close(kernels.paged_prefill_attention(*args), reference.paged_prefill_attention(*args))


# --- input validation (no launch) --------------------------------------------------------------


@pytest.mark.parametrize("impl", [kernels, reference], ids=["kernel", "reference"])
def test_bad_inputs_raise_value_error(impl):
    k_cache = torch.zeros(2, 4, 2, 16, device=DEVICE)
    block_tables = torch.zeros(1, 2, dtype=torch.int32, device=DEVICE)
    context_lens = torch.ones(1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        impl.paged_decode_attention(torch.zeros(1, 3, 16, device=DEVICE), k_cache, k_cache, block_tables, context_lens, 1.0)
    with pytest.raises(ValueError, match="int32 or int64"):
        impl.paged_decode_attention(
            torch.zeros(1, 4, 16, device=DEVICE), k_cache, k_cache, block_tables.float(), context_lens, 1.0
        )
    with pytest.raises(ValueError, match="contiguous"):
        strided = k_cache.transpose(1, 2)
        impl.paged_decode_attention(torch.zeros(1, 4, 16, device=DEVICE), strided, strided, block_tables, context_lens, 1.0)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        impl.paged_prefill_attention(
            torch.zeros(3, 4, 16, device=DEVICE), k_cache, k_cache, context_lens.float(), context_lens, block_tables, 1.0
        )
    with pytest.raises(ValueError, match="key and value"):
        impl.store_kvcache(
            torch.zeros(3, 2, 8, device=DEVICE), torch.zeros(3, 2, 8, device=DEVICE), k_cache, k_cache,
            torch.zeros(3, dtype=torch.int32, device=DEVICE),
        )


# --- GPU: realistic sizes --------------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA; CPU runs the interpreter on tiny shapes")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block_size", [16, 256])
def test_kernels_at_realistic_sizes_on_gpu(dtype, block_size):
    num_heads, num_kv_heads, head_dim = 32, 8, 128
    context_lens = [1, 17, 255, 256, 1000, 2049, 0, 777]
    batch = make_paged_batch(context_lens, num_kv_heads, head_dim, block_size, dtype, seed=10)
    scale = head_dim**-0.5

    q = random_queries(len(context_lens), num_heads, head_dim, dtype, seed=11)
    args = (q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, scale)
    expected = reference.paged_decode_attention(*args)
    for num_splits in (None, 1, 5):
        assert_close(kernels.paged_decode_attention(*args, num_splits=num_splits), expected)

    # Prefill the tail of each sequence after a cached prefix (the whole sequence when short).
    q_lens = [n if n < 300 else n // 3 for n in context_lens]
    cu_seqlens = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    q = random_queries(sum(q_lens), num_heads, head_dim, dtype, seed=12)
    args = (q, batch.k_cache, batch.v_cache, cu_seqlens, batch.context_lens, batch.block_tables, scale)
    assert_close(kernels.paged_prefill_attention(*args), reference.paged_prefill_attention(*args))

    # The store: every new token of the prefill into a fresh cache, with padded rows interleaved.
    num_rows = 4096
    key = random_queries(num_rows, num_kv_heads, head_dim, dtype, seed=13)
    value = random_queries(num_rows, num_kv_heads, head_dim, dtype, seed=14)
    slots = torch.randperm(batch.k_cache.shape[0] * block_size, device=DEVICE)[:num_rows]
    slots[::7] = -1
    caches = [torch.zeros_like(batch.k_cache) for _ in range(4)]
    kernels.store_kvcache(key, value, caches[0], caches[1], slots)
    reference.store_kvcache(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
