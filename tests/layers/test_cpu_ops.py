"""The fused CPU ops (layers/cpu_ops.c) against the torch code they replace."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nanovllm.layers.rotary import RotaryEmbedding
from nanovllm.models.decoder import RMSNorm


def torch_norm(dim: int, seed: int) -> RMSNorm:
    norm = RMSNorm(dim, 1e-6)
    norm.weight.data = torch.randn(dim, generator=torch.Generator().manual_seed(seed))
    return norm


@pytest.mark.parametrize("rows", [1, 7, 300])  # 300 x 131 crosses the threshold for threads
def test_rms_norm_matches_the_module(ops, rows):
    norm = torch_norm(131, seed=rows)  # not a multiple of the 8-lane vectors
    wide = torch.randn(rows, 200) * 3
    x = wide[:, 40:171]  # rows further apart than their length, as views of a wider tensor are
    torch.testing.assert_close(ops.rms_norm(x, norm.weight, norm.eps), norm(x), rtol=1e-5, atol=1e-5)


def test_rms_norm_with_residual_updates_it_in_place(ops):
    norm = torch_norm(131, seed=1)
    x, residual = torch.randn(300, 131), torch.randn(300, 131)
    expected_norm, expected_residual = norm.add_and_norm(x, residual.clone())
    out = ops.rms_norm(x, norm.weight, norm.eps, residual=residual)
    torch.testing.assert_close(residual, expected_residual, rtol=0, atol=0)  # one float add: exact
    torch.testing.assert_close(out, expected_norm, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("qk_norm", [True, False], ids=["qwen3", "llama"])
def test_qk_norm_rope_store_matches_torch_and_fills_the_cache(ops, qk_norm):
    heads, kv_heads, dim, rows = 6, 2, 64, 9
    rotary = RotaryEmbedding(dim, 512, 10000.0)
    q_norm, k_norm = torch_norm(dim, seed=2), torch_norm(dim, seed=3)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim)
    positions = torch.tensor([0, 1, 5, 17, 100, 101, 102, 300, 511])
    slots = torch.tensor([3, 4, -1, 10, 11, 12, 13, 30, 31])  # -1: no cache write (a padded row)
    k_cache, v_cache = torch.zeros(4, 8, kv_heads, dim), torch.zeros(4, 8, kv_heads, dim)

    q, k, v = qkv.clone().split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k, v = q.reshape(rows, heads, dim), k.reshape(rows, kv_heads, dim), v.reshape(rows, kv_heads, dim)
    if qk_norm:
        q, k = q_norm(q), k_norm(k)
    q, k = RotaryEmbedding.apply(q, k, *rotary.cos_sin(positions))

    ops.qk_norm_rope_store(qkv, heads, kv_heads, dim, q_norm.weight if qk_norm else None,
                           k_norm.weight if qk_norm else None, q_norm.eps, rotary.cos_cache, rotary.sin_cache,
                           positions, k_cache, v_cache, slots)
    got_q, got_k, got_v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    torch.testing.assert_close(got_q.reshape(rows, heads, dim), q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_k.reshape(rows, kv_heads, dim), k, rtol=1e-5, atol=1e-5)
    flat_k, flat_v = k_cache.view(-1, kv_heads, dim), v_cache.view(-1, kv_heads, dim)
    written = slots >= 0
    torch.testing.assert_close(flat_k[slots[written]], k[written], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(flat_v[slots[written]], v[written], rtol=0, atol=0)
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool)
    untouched[slots[written]] = False
    assert torch.all(flat_k[untouched] == 0) and torch.all(flat_v[untouched] == 0)


def test_silu_mul_matches_torch_including_extremes(ops):
    inter = 203  # not a multiple of 8: the scalar tail runs too
    gate_up = torch.randn(300, 2 * inter) * 4
    gate_up[0, :8] = torch.tensor([-200.0, -90.0, -30.0, -1e-3, 0.0, 1e-3, 30.0, 200.0])
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(ops.silu_mul(gate_up), F.silu(gate) * up, rtol=2e-6, atol=1e-6)


# bf16: the same kernels on bf16 tensors, against fp32 torch computed from the same bf16 values.
# Each op rounds to bf16 where torch in bf16 would (2^-8 relative each), so a few roundings' worth.
BF16_TOL = dict(rtol=2e-2, atol=2e-2)


def test_bf16_rms_norm_with_residual_matches_fp32_and_adds_exactly(ops):
    norm = torch_norm(203, seed=4)
    x, residual = (torch.randn(300, 203) * 3).bfloat16(), torch.randn(300, 203).bfloat16()
    w = norm.weight.detach().bfloat16()
    expected_residual = residual + x  # one bf16 add, rounded once: the kernel must agree exactly
    s = expected_residual.float()
    expected = w.float() * (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + norm.eps))
    out = ops.rms_norm(x, w, norm.eps, residual=residual)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(residual, expected_residual, rtol=0, atol=0)
    torch.testing.assert_close(out.float(), expected, **BF16_TOL)
    # the torch module in bf16 (the CPU path without a compiler) rounds at the same places
    torch.testing.assert_close(out, norm.to(torch.bfloat16)(expected_residual), rtol=8e-3, atol=8e-3)


def test_bf16_qk_norm_rope_store_matches_fp32(ops):
    heads, kv_heads, dim, rows = 6, 2, 64, 9
    rotary = RotaryEmbedding(dim, 512, 10000.0)
    q_norm, k_norm = torch_norm(dim, seed=2), torch_norm(dim, seed=3)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim).bfloat16()
    positions = torch.tensor([0, 1, 5, 17, 100, 101, 102, 300, 511])
    slots = torch.tensor([3, 4, -1, 10, 11, 12, 13, 30, 31])
    k_cache = torch.zeros(4, 8, kv_heads, dim, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    qw, kw = q_norm.weight.detach().bfloat16(), k_norm.weight.detach().bfloat16()
    cos, sin = rotary.cos_cache.bfloat16(), rotary.sin_cache.bfloat16()

    q, k, v = qkv.float().split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k, v = q.reshape(rows, heads, dim), k.reshape(rows, kv_heads, dim), v.reshape(rows, kv_heads, dim)
    q = qw.float() * (q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + q_norm.eps))
    k = kw.float() * (k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + k_norm.eps))
    q, k = RotaryEmbedding.apply(q, k, cos.float()[positions].unsqueeze(1), sin.float()[positions].unsqueeze(1))

    ops.qk_norm_rope_store(qkv, heads, kv_heads, dim, qw, kw, q_norm.eps, cos, sin, positions, k_cache, v_cache, slots)
    got_q, got_k, got_v = qkv.float().split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    torch.testing.assert_close(got_q.reshape(rows, heads, dim), q, **BF16_TOL)
    torch.testing.assert_close(got_k.reshape(rows, kv_heads, dim), k, **BF16_TOL)
    written = slots >= 0
    torch.testing.assert_close(k_cache.view(-1, kv_heads, dim)[slots[written]].float(), k[written], **BF16_TOL)
    torch.testing.assert_close(v_cache.view(-1, kv_heads, dim)[slots[written]].float(), v[written], rtol=0, atol=0)


def test_bf16_silu_mul_matches_fp32(ops):
    inter = 203
    gate_up = (torch.randn(300, 2 * inter) * 4).bfloat16()
    gate, up = gate_up.float().chunk(2, dim=-1)
    out = ops.silu_mul(gate_up)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), F.silu(gate) * up, **BF16_TOL)
    # and exactly what torch computes in bf16 (silu rounded, then the product rounded), but for
    # the last bit where the two exp implementations round differently
    g16, u16 = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(out, F.silu(g16) * u16, rtol=8e-3, atol=1e-5)


def test_mixed_dtypes_are_refused(ops):
    with pytest.raises(TypeError, match="mix"):
        ops.rms_norm(torch.randn(2, 8).bfloat16(), torch.ones(8), 1e-6)
