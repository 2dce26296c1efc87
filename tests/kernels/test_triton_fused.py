"""The fused Triton decoder ops (kernels/triton_fused.py) against the decoder's torch path.

The torch path is the reference: `RMSNorm` without fused ops, `RotaryEmbedding.apply`, F.silu and
an index_copy_ into the cache. The kernels keep torch's roundings, so in float32 they agree to
float rounding and in bf16/fp16 to within one or two units of the last place (reductions sum in
a different order). Without CUDA they run under TRITON_INTERPRET=1, on small shapes.
"""
import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from nanovllm.kernels import triton_fused  # noqa: E402
from nanovllm.layers.rotary import RotaryEmbedding  # noqa: E402
from nanovllm.models.decoder import RMSNorm  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOLERANCE = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}


def _randn(*shape, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * 2).to(dtype).to(DEVICE)


def _torch_norm(dim: int, eps: float, weight: torch.Tensor) -> RMSNorm:
    norm = RMSNorm(dim, eps).to(device=DEVICE, dtype=weight.dtype)
    norm.weight.data.copy_(weight)
    return norm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [64, 96])  # 96: not a power of two, the block is masked
def test_rms_norm_matches_torch(dtype, dim):
    x = _randn(5, dim, dtype=dtype, seed=1)
    weight = _randn(dim, dtype=dtype, seed=2)
    expected = _torch_norm(dim, 1e-6, weight)(x)
    got = triton_fused.rms_norm(x, weight, 1e-6)
    torch.testing.assert_close(got, expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_with_residual_updates_it_in_place_like_the_torch_add(dtype):
    dim = 80
    x = _randn(4, dim, dtype=dtype, seed=3)
    residual = _randn(4, dim, dtype=dtype, seed=4)
    weight = _randn(dim, dtype=dtype, seed=5)
    expected_out, expected_residual = _torch_norm(dim, 1e-5, weight).add_and_norm(x, residual.clone())
    got_residual = residual.clone()
    got = triton_fused.rms_norm(x, weight, 1e-5, residual=got_residual)
    # The sum is rounded to the activation dtype exactly as torch rounds it (the interpreter
    # truncates fp32 -> bf16 instead of rounding to nearest, so there it may be one unit off).
    exact = DEVICE == "cuda" or dtype != torch.bfloat16
    torch.testing.assert_close(got_residual, expected_residual, **(dict(atol=0, rtol=0) if exact else TOLERANCE[dtype]))
    torch.testing.assert_close(got, expected_out, **TOLERANCE[dtype])


def test_rms_norm_reads_strided_rows():
    base = _randn(3, 2 * 64, dtype=torch.float32, seed=6)
    x = base[:, :64]  # row stride 128
    weight = _randn(64, dtype=torch.float32, seed=7)
    torch.testing.assert_close(triton_fused.rms_norm(x, weight, 1e-6), _torch_norm(64, 1e-6, weight)(x.contiguous()))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_torch(dtype):
    width = 1500  # more than one 1024-wide block, the second one partly masked
    gate_up = _randn(3, 2 * width, dtype=dtype, seed=8)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(triton_fused.silu_mul(gate_up), F.silu(gate) * up, **TOLERANCE[dtype])


def _torch_qk_norm_rope_store(qkv, heads, kv_heads, head_dim, q_norm, k_norm, rotary, positions, k_cache, v_cache,
                              slots):
    """The decoder's unfused path: returns q, k after norm + rotary, and writes the caches."""
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q, k = q.reshape(-1, heads, head_dim), k.reshape(-1, kv_heads, head_dim)
    v = v.reshape(-1, kv_heads, head_dim)
    if q_norm is not None:
        q, k = q_norm(q), k_norm(k)
    cos, sin = rotary.cos_sin(positions)
    q, k = RotaryEmbedding.apply(q, k, cos, sin)
    keep = slots >= 0
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, slots[keep], k[keep])
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, slots[keep], v[keep])
    return q, k


def check_qk_norm_rope_store(qkv: torch.Tensor, heads: int, kv_heads: int, head_dim: int, eps: float, rotary,
                             positions: torch.Tensor, slots: torch.Tensor, norm_seed: int | None, cache_shape: tuple,
                             tol: dict) -> torch.Tensor:
    """The kernel against the torch path on the same (T, (H + 2 KVH) D) input, into NaN-filled
    caches: q and k within `tol`, v untouched, the caches alike (slots not written stay NaN in
    both). `norm_seed`: the q/k norm weights' seed, None for no q/k norm. Returns the kernel's K cache."""
    tokens, dtype = qkv.shape[0], qkv.dtype
    q_norm = k_norm = None
    if norm_seed is not None:
        q_norm = _torch_norm(head_dim, eps, _randn(head_dim, dtype=dtype, seed=norm_seed))
        k_norm = _torch_norm(head_dim, eps, _randn(head_dim, dtype=dtype, seed=norm_seed + 1))
    caches = [torch.full(cache_shape, float("nan"), dtype=dtype, device=DEVICE) for _ in range(4)]
    exp_q, exp_k = _torch_qk_norm_rope_store(qkv.clone(), heads, kv_heads, head_dim, q_norm, k_norm, rotary,
                                             positions, caches[0], caches[1], slots)
    got = qkv.clone()
    triton_fused.qk_norm_rope_store(
        got, heads, kv_heads, head_dim, q_norm and q_norm.weight, k_norm and k_norm.weight, eps,
        rotary.cos_cache, rotary.sin_cache, positions, caches[2], caches[3], slots)
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    torch.testing.assert_close(got[:, :q_size].view(tokens, heads, head_dim), exp_q, **tol)
    torch.testing.assert_close(got[:, q_size:q_size + kv_size].view(tokens, kv_heads, head_dim), exp_k, **tol)
    torch.testing.assert_close(got[:, q_size + kv_size:], qkv[:, q_size + kv_size:], atol=0, rtol=0)  # v untouched
    # Written slots match, unwritten ones (incl. a padded row's) stay NaN in both.
    torch.testing.assert_close(caches[2], caches[0], equal_nan=True, **tol)
    torch.testing.assert_close(caches[3], caches[1], equal_nan=True, atol=0, rtol=0)
    return caches[2]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [True, False])
def test_qk_norm_rope_store_matches_the_torch_path(dtype, qk_norm):
    heads, kv_heads, head_dim, block_size, num_blocks = 4, 2, 32, 4, 6
    tokens = 5
    qkv = _randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=9)
    rotary = RotaryEmbedding(head_dim, 64, 10000.0).to(device=DEVICE, dtype=dtype)  # as the model casts it
    positions = torch.tensor([0, 7, 3, 63, 12], device=DEVICE)
    slots = torch.tensor([5, -1, 0, 23, 9], device=DEVICE)  # -1: a padded CUDA-graph row, not stored
    k_cache = check_qk_norm_rope_store(qkv, heads, kv_heads, head_dim, 1e-6, rotary, positions, slots,
                                       10 if qk_norm else None, (num_blocks, block_size, kv_heads, head_dim),
                                       TOLERANCE[dtype])
    assert k_cache.isnan().any(dim=(2, 3)).sum() == num_blocks * block_size - 4


def test_inputs_that_do_not_fit_are_rejected():
    with pytest.raises(ValueError, match="even width"):
        triton_fused.silu_mul(torch.zeros(2, 7, device=DEVICE))
    with pytest.raises(ValueError, match="weight"):
        triton_fused.rms_norm(torch.zeros(2, 8, device=DEVICE), torch.ones(4, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="qkv width"):
        triton_fused.qk_norm_rope_store(
            torch.zeros(1, 40, device=DEVICE), 2, 1, 8, None, None, 0.0, torch.zeros(4, 4, device=DEVICE),
            torch.zeros(4, 4, device=DEVICE), torch.zeros(1, dtype=torch.long, device=DEVICE),
            torch.zeros(1, 1, 1, 8, device=DEVICE), torch.zeros(1, 1, 1, 8, device=DEVICE),
            torch.zeros(1, dtype=torch.long, device=DEVICE))
