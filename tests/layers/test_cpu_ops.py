"""The fused CPU ops (layers/cpu_ops.c) against the torch code they replace."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nanovllm.layers.cpu_kernels import CpuOps
from nanovllm.layers.rotary import RotaryEmbedding
from nanovllm.models.decoder import RMSNorm


@pytest.fixture(scope="module")
def ops(kernel_threads):
    loaded = CpuOps.load()
    if loaded is None:
        pytest.skip("no C compiler on this machine")
    return loaded


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
