"""Triton kernels for the decoder's elementwise work on CUDA: one launch where torch needs many.

Under a CUDA graph every torch op of the decoder is still one kernel: an RMSNorm is about seven
(upcast, square, mean, add eps, rsqrt, multiply, downcast, times weight), the rotary embedding
about ten per tensor, SiLU-and-multiply two. On a small model at small batch those few-microsecond
kernels, ~50 per layer, are the decode step, not the GEMMs. These kernels do the same work in one
pass each, with the torch path's roundings (fp32 arithmetic, rounded to the activation dtype
where torch rounds), so the two agree to the last bf16 bit in the common case:

- `rms_norm`: RMSNorm of each row, optionally after `residual += x` (residual updated in place);
- `silu_mul`: `silu(gate) * up` of the packed `[gate | up]` projection;
- `qk_norm_rope_store`: on the packed `[q | k | v]` projection, in place: per-head RMSNorm of q and
  k (Qwen3), the rotary embedding ("rotate half") of q and k, then K and V rows into their cache
  slots (slot -1, a CUDA-graph padding row, is skipped), replacing `store_kvcache`.

`TritonFusedOps` exposes them with the same signatures as the compiled CPU ops
(layers/cpu_kernels.py `CpuOps`), so the decoder calls either through one code path. They also
run on CPU tensors under TRITON_INTERPRET=1, which the tests use.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_SILU_BLOCK = 1024


def _warps(block: int) -> int:
    return 1 if block <= 256 else 4 if block <= 2048 else 8


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, stride_x, stride_residual, stride_out, dim, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    """One program per row: [residual += x, x = residual,] out = weight * norm(x)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < dim
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual_ptrs = residual_ptr + row * stride_residual + offs
        # torch adds in the activation dtype: round the sum before normalising it.
        x = (tl.load(residual_ptrs, mask=mask, other=0.0).to(tl.float32) + x.to(tl.float32)).to(x.dtype)
        tl.store(residual_ptrs, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / dim + eps)
    normed = (xf * inv_rms).to(x.dtype).to(tl.float32)
    weight = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, (normed * weight).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, stride_in, stride_out, width, BLOCK: tl.constexpr):
    """Grid (rows, cdiv(width, BLOCK)): out[r, i] = silu(gate[r, i]) * up[r, i]."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < width
    gate = tl.load(gate_up_ptr + row * stride_in + offs, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + row * stride_in + width + offs, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)  # torch rounds silu's output
    tl.store(out_ptr + row * stride_out + offs, (silu * up.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _qk_norm_rope_store_kernel(
    qkv_ptr, q_weight_ptr, k_weight_ptr, cos_ptr, sin_ptr, positions_ptr, k_cache_ptr, v_cache_ptr, slots_ptr,
    stride_qkv, eps,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
    HAS_NORM: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    """Grid (T, H + KVH): one program per (token, q or k head); a k head's program also moves v."""
    # Heads 0..H-1 are q, H..H+KVH-1 are k; each head is two halves for "rotate half".
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    is_k = head >= NUM_HEADS
    offs = tl.arange(0, BLOCK_HALF)
    mask = offs < HALF
    base = qkv_ptr + token * stride_qkv + head * HEAD_DIM  # k heads follow the q heads directly
    x1 = tl.load(base + offs, mask=mask, other=0.0)
    x2 = tl.load(base + HALF + offs, mask=mask, other=0.0)
    dtype = x1.dtype
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    if HAS_NORM:
        inv_rms = 1.0 / tl.sqrt((tl.sum(x1f * x1f, axis=0) + tl.sum(x2f * x2f, axis=0)) / HEAD_DIM + eps)
        if is_k:
            weight_ptr = k_weight_ptr
        else:
            weight_ptr = q_weight_ptr
        w1 = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        w2 = tl.load(weight_ptr + HALF + offs, mask=mask, other=0.0).to(tl.float32)
        x1f = ((x1f * inv_rms).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
        x2f = ((x2f * inv_rms).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
    position = tl.load(positions_ptr + token).to(tl.int64)
    cos = tl.load(cos_ptr + position * HALF + offs, mask=mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + position * HALF + offs, mask=mask, other=0.0).to(tl.float32)
    y1 = (x1f * cos - x2f * sin).to(dtype)
    y2 = (x2f * cos + x1f * sin).to(dtype)
    tl.store(base + offs, y1, mask=mask)
    tl.store(base + HALF + offs, y2, mask=mask)
    if is_k:
        slot = tl.load(slots_ptr + token).to(tl.int64)
        if slot >= 0:  # -1: a padded row of a CUDA graph
            kv_head = head - NUM_HEADS
            cache = slot * (NUM_KV_HEADS * HEAD_DIM) + kv_head * HEAD_DIM
            tl.store(k_cache_ptr + cache + offs, y1, mask=mask)
            tl.store(k_cache_ptr + cache + HALF + offs, y2, mask=mask)
            v_base = base + NUM_KV_HEADS * HEAD_DIM  # this head's v follows all the k heads
            tl.store(v_cache_ptr + cache + offs, tl.load(v_base + offs, mask=mask), mask=mask)
            tl.store(v_cache_ptr + cache + HALF + offs, tl.load(v_base + HALF + offs, mask=mask), mask=mask)


def _check_rows(name: str, x: torch.Tensor) -> None:
    if x.dim() != 2 or x.stride(1) != 1 or x.dtype not in _DTYPES:
        raise ValueError(f"{name} must be 2-D rows with contiguous columns in {_DTYPES}, "
                         f"got shape {tuple(x.shape)}, strides {x.stride()}, {x.dtype}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """`weight * norm(x)` of (T, C) rows; with `residual` (updated in place to `residual + x`), of the sum."""
    _check_rows("x", x)
    rows, dim = x.shape
    if weight.shape != (dim,) or not weight.is_contiguous():
        raise ValueError(f"weight must be contiguous ({dim},), got {tuple(weight.shape)}")
    if residual is not None:
        _check_rows("residual", residual)
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(f"residual must match x {tuple(x.shape)} {x.dtype}, "
                             f"got {tuple(residual.shape)} {residual.dtype}")
    out = torch.empty((rows, dim), dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    block = triton.next_power_of_2(dim)
    _rms_norm_kernel[(rows,)](
        x, x if residual is None else residual, weight, out, x.stride(0),
        0 if residual is None else residual.stride(0), out.stride(0), dim, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=_warps(block),
    )
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of (T, 2 I) rows [gate | up] -> (T, I)."""
    _check_rows("gate_up", gate_up)
    rows, width2 = gate_up.shape
    if width2 % 2:
        raise ValueError(f"gate_up must have an even width, got {width2}")
    width = width2 // 2
    out = torch.empty((rows, width), dtype=gate_up.dtype, device=gate_up.device)
    if rows == 0:
        return out
    _silu_mul_kernel[(rows, triton.cdiv(width, _SILU_BLOCK))](
        gate_up, out, gate_up.stride(0), out.stride(0), width, BLOCK=_SILU_BLOCK, num_warps=4,
    )
    return out


def qk_norm_rope_store(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                       q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
                       cos_cache: torch.Tensor, sin_cache: torch.Tensor, positions: torch.Tensor,
                       k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """In place on the packed (T, (H + 2 KVH) D) projection: [q/k RMSNorm,] rotary on q and k, then
    K and V rows into their cache slots (layout (blocks, block_size, KVH, D), contiguous)."""
    _check_rows("qkv", qkv)
    tokens = qkv.shape[0]
    if head_dim % 2 or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim:
        raise ValueError(f"qkv width {qkv.shape[1]} does not hold {num_heads} + 2 x {num_kv_heads} heads "
                         f"of even size {head_dim}")
    if (q_weight is None) != (k_weight is None):
        raise ValueError("q_weight and k_weight come together (q/k norm) or not at all")
    if cos_cache.shape[-1] != head_dim // 2 or not (cos_cache.is_contiguous() and sin_cache.is_contiguous()):
        raise ValueError(f"cos/sin tables must be contiguous (positions, {head_dim // 2})")
    if positions.shape != (tokens,) or slots.shape != (tokens,):
        raise ValueError(f"positions and slots must be ({tokens},), got {tuple(positions.shape)}, {tuple(slots.shape)}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()) or k_cache.shape[-2:] != (num_kv_heads, head_dim):
        raise ValueError(f"caches must be contiguous (..., {num_kv_heads}, {head_dim}), got {tuple(k_cache.shape)}")
    if tokens == 0:
        return
    has_norm = q_weight is not None
    _qk_norm_rope_store_kernel[(tokens, num_heads + num_kv_heads)](
        qkv, q_weight if has_norm else qkv, k_weight if has_norm else qkv, cos_cache, sin_cache, positions,
        k_cache, v_cache, slots, qkv.stride(0), eps,
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HALF=head_dim // 2, HAS_NORM=has_norm,
        BLOCK_HALF=triton.next_power_of_2(head_dim // 2), num_warps=1,
    )


class TritonFusedOps:
    """The kernels above behind `CpuOps`' method names, for the decoder's fused code path."""

    @staticmethod
    def supports(x: torch.Tensor) -> bool:
        """2-D rows with contiguous columns in a float dtype (the runner sets these ops on CUDA only)."""
        return x.dim() == 2 and x.stride(1) == 1 and x.dtype in _DTYPES

    rms_norm = staticmethod(rms_norm)
    silu_mul = staticmethod(silu_mul)
    qk_norm_rope_store = staticmethod(qk_norm_rope_store)
