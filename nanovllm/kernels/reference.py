"""Plain-torch paged-KV-cache attention: the ground truth the Triton kernels are tested against.

Same names and signatures as `triton_attention`. Written for obviousness, not speed: each
sequence's keys are gathered from the cache into a dense tensor and attended in fp32. The
`check_*` validators are shared with the Triton wrappers so both reject bad input alike.

Cache layout (per layer): `k_cache`, `v_cache` are `[num_blocks, block_size, num_kv_heads,
head_dim]`; position p of a sequence lives in slot
`block_table[p // block_size] * block_size + p % block_size` of the flat view
`k_cache.view(-1, num_kv_heads, head_dim)`.
"""

import torch

_INDEX_DTYPES = (torch.int32, torch.int64)


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.dim() != 4:
        raise ValueError(
            f"k_cache must be [num_blocks, block_size, num_kv_heads, head_dim], got {tuple(k_cache.shape)}"
        )
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError(
            f"v_cache {tuple(v_cache.shape)} {v_cache.dtype} must match "
            f"k_cache {tuple(k_cache.shape)} {k_cache.dtype}"
        )
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous (slots are addressed by flat offset)")


def _check_index(name: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tensor.dtype not in _INDEX_DTYPES:
        raise ValueError(f"{name} must be int32 or int64, got {tensor.dtype}")
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(tensor.shape)}")


def _check_same_device(*tensors: torch.Tensor) -> None:
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")


def _check_query(q: torch.Tensor, k_cache: torch.Tensor) -> None:
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    if q.dim() != 3 or q.shape[2] != head_dim:
        raise ValueError(f"q must be [tokens, num_heads, {head_dim}], got {tuple(q.shape)}")
    if q.shape[1] % num_kv_heads != 0:
        raise ValueError(f"num_heads ({q.shape[1]}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if q.dtype != k_cache.dtype:
        raise ValueError(f"q dtype {q.dtype} must match the cache dtype {k_cache.dtype}")
    if q.stride(-1) != 1:
        raise ValueError("q's last dimension (head_dim) must be contiguous")


def check_store_inputs(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Raise ValueError unless the arguments of `store_kvcache` fit together."""
    _check_cache(k_cache, v_cache)
    if key.dim() != 3 or key.shape[1:] != k_cache.shape[2:] or value.shape != key.shape:
        raise ValueError(
            f"key and value must both be [N, {k_cache.shape[2]}, {k_cache.shape[3]}], "
            f"got {tuple(key.shape)} and {tuple(value.shape)}"
        )
    if key.dtype != k_cache.dtype or value.dtype != k_cache.dtype:
        raise ValueError(f"key/value dtype ({key.dtype}, {value.dtype}) must match the cache ({k_cache.dtype})")
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError("key and value must be contiguous in head_dim")
    _check_index("slot_mapping", slot_mapping, (key.shape[0],))
    _check_same_device(key, value, k_cache, v_cache, slot_mapping)


def check_decode_inputs(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor,
) -> None:
    """Raise ValueError unless the arguments of `paged_decode_attention` fit together."""
    _check_cache(k_cache, v_cache)
    _check_query(q, k_cache)
    batch = q.shape[0]
    if block_tables.dim() != 2:
        raise ValueError(f"block_tables must be [batch, max_blocks], got {tuple(block_tables.shape)}")
    _check_index("block_tables", block_tables, (batch, block_tables.shape[1]))
    _check_index("context_lens", context_lens, (batch,))
    _check_same_device(q, k_cache, v_cache, block_tables, context_lens)


def check_prefill_inputs(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor, block_tables: torch.Tensor,
) -> None:
    """Raise ValueError unless the arguments of `paged_prefill_attention` fit together."""
    _check_cache(k_cache, v_cache)
    _check_query(q, k_cache)
    if cu_seqlens_q.dim() != 1 or cu_seqlens_q.shape[0] < 1:
        raise ValueError(f"cu_seqlens_q must be [batch + 1], got {tuple(cu_seqlens_q.shape)}")
    batch = cu_seqlens_q.shape[0] - 1
    _check_index("cu_seqlens_q", cu_seqlens_q, (batch + 1,))
    _check_index("context_lens", context_lens, (batch,))
    if block_tables.dim() != 2:
        raise ValueError(f"block_tables must be [batch, max_blocks], got {tuple(block_tables.shape)}")
    _check_index("block_tables", block_tables, (batch, block_tables.shape[1]))
    _check_same_device(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables)


def store_kvcache(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write key/value rows `[N, num_kv_heads, head_dim]` into their cache slots; slot -1 is skipped."""
    check_store_inputs(key, value, k_cache, v_cache, slot_mapping)
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    slots = slot_mapping.long()
    # -1 marks padded rows; as a Python index it would overwrite the last slot.
    keep = slots >= 0
    k_cache.view(-1, num_kv_heads, head_dim)[slots[keep]] = key[keep]
    v_cache.view(-1, num_kv_heads, head_dim)[slots[keep]] = value[keep]


def _gather_sequence(
    cache: torch.Tensor, block_table: torch.Tensor, num_tokens: int
) -> torch.Tensor:
    """Positions 0..num_tokens-1 of one sequence as a dense `[num_tokens, num_kv_heads, head_dim]`."""
    block_size = cache.shape[1]
    positions = torch.arange(num_tokens, device=cache.device)
    slots = block_table.long()[positions // block_size] * block_size + positions % block_size
    return cache.view(-1, cache.shape[2], cache.shape[3])[slots]


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_positions: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal attention of queries at `query_positions` over keys at positions 0..len(k)-1, in fp32."""
    group = q.shape[1] // k.shape[1]
    # Query head h reads kv head h // group: repeat each kv head `group` times in a row.
    k = k.float().repeat_interleave(group, dim=1)  # [Tk, H, D]
    v = v.float().repeat_interleave(group, dim=1)  # [Tk, H, D]
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale  # [H, Tq, Tk]
    key_positions = torch.arange(k.shape[0], device=q.device)
    future = key_positions[None, :] > query_positions[:, None]  # [Tq, Tk]
    scores = scores.masked_fill(future, float("-inf"))
    probs = scores.softmax(dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)  # [Tq, H, D]


def paged_decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, scale: float, *, num_splits: int | None = None,
) -> torch.Tensor:
    """One new query token per sequence over its whole cached context; `[B, H, D]` in and out.

    A row with context_len 0 (CUDA-graph padding) yields zeros. `num_splits` only tunes the
    Triton kernel and is accepted here so the two are interchangeable.
    """
    check_decode_inputs(q, k_cache, v_cache, block_tables, context_lens)
    out = torch.zeros_like(q)
    for b, context_len in enumerate(context_lens.tolist()):
        if context_len == 0:
            continue
        k = _gather_sequence(k_cache, block_tables[b], context_len)
        v = _gather_sequence(v_cache, block_tables[b], context_len)
        last = torch.tensor([context_len - 1], device=q.device)
        out[b] = _attend(q[b : b + 1], k, v, last, scale)[0]
    return out


def paged_prefill_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor, block_tables: torch.Tensor, scale: float, *,
    max_seqlen_q: int | None = None,
) -> torch.Tensor:
    """Causal attention for the new tokens of B sequences packed in `q` `[T, H, D]`.

    Sequence b's new tokens are `q[cu_seqlens_q[b]:cu_seqlens_q[b+1]]` at positions
    `context_lens[b] - q_len ... context_lens[b] - 1`, so a cached prefix before them is read from
    the cache too. `max_seqlen_q` only tunes the Triton launch.
    """
    check_prefill_inputs(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables)
    out = torch.zeros_like(q)
    bounds = cu_seqlens_q.tolist()
    for b, context_len in enumerate(context_lens.tolist()):
        start, end = bounds[b], bounds[b + 1]
        if end == start:
            continue
        k = _gather_sequence(k_cache, block_tables[b], context_len)
        v = _gather_sequence(v_cache, block_tables[b], context_len)
        positions = torch.arange(context_len - (end - start), context_len, device=q.device)
        out[start:end] = _attend(q[start:end], k, v, positions, scale)
    return out
