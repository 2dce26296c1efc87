"""The decoder's Triton kernels at the width of one Qwen3-0.6B layer, against the torch path.

The other kernel tests use small shapes; these use the real row widths and head counts (hidden
1024, intermediate 3072, 16 q / 8 kv heads of 128, rope theta 1e6, rms eps 1e-6, the engine's
default block size) with few rows and contexts of a few hundred tokens, so that masking,
multi-block loops and splits run as on the GPU. Without CUDA they run under TRITON_INTERPRET=1
(whose fp32 -> bf16 conversion truncates instead of rounding: bf16 is held to a few units of the
last place, as in the small-shape tests).
"""
import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from nanovllm.config import Config  # noqa: E402
from nanovllm.kernels import reference, triton_attention, triton_fused  # noqa: E402
from nanovllm.layers.rotary import RotaryEmbedding  # noqa: E402
from tests.kernels.test_triton_attention import assert_close, make_paged_batch, random_queries  # noqa: E402
from tests.kernels.test_triton_fused import (  # noqa: E402
    DEVICE, TOLERANCE, _randn, _torch_norm, check_qk_norm_rope_store,
)

HIDDEN, INTERMEDIATE = 1024, 3072
HEADS, KV_HEADS, HEAD_DIM = 16, 8, 128
EPS, ROPE_THETA, MAX_POSITIONS = 1e-6, 1e6, 4096
BLOCK_SIZE = Config.block_size  # the engine's default
DTYPES = [torch.float32, torch.bfloat16]
EXACT_BF16 = DEVICE == "cuda"  # the interpreter truncates fp32 -> bf16
# q/k norm + rotary rounds three times (norm, weight, rotation); truncating each, as the interpreter
# does, is up to three units off torch's round-to-nearest where the weight and the rotation
# magnify values (about 8 here: 0.19 apart; a truncating torch twin matches it bit for bit).
ROPE_TOLERANCE = {**TOLERANCE, torch.bfloat16: TOLERANCE[torch.bfloat16] if EXACT_BF16 else dict(atol=5e-2, rtol=3e-2)}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 64])
def test_rms_norm_at_hidden_width(dtype, rows):
    x = _randn(rows, HIDDEN, dtype=dtype, seed=20)
    weight = _randn(HIDDEN, dtype=dtype, seed=21)
    torch.testing.assert_close(triton_fused.rms_norm(x, weight, EPS), _torch_norm(HIDDEN, EPS, weight)(x),
                               **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 64])
def test_rms_norm_with_residual_at_hidden_width(dtype, rows):
    x = _randn(rows, HIDDEN, dtype=dtype, seed=22)
    residual = _randn(rows, HIDDEN, dtype=dtype, seed=23)
    weight = _randn(HIDDEN, dtype=dtype, seed=24)
    expected_out, expected_residual = _torch_norm(HIDDEN, EPS, weight).add_and_norm(x, residual.clone())
    got_residual = residual.clone()
    got = triton_fused.rms_norm(x, weight, EPS, residual=got_residual)
    exact = dtype != torch.bfloat16 or EXACT_BF16
    torch.testing.assert_close(got_residual, expected_residual, **(dict(atol=0, rtol=0) if exact else TOLERANCE[dtype]))
    torch.testing.assert_close(got, expected_out, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 64])
def test_silu_mul_at_intermediate_width(dtype, rows):
    gate_up = _randn(rows, 2 * INTERMEDIATE, dtype=dtype, seed=25)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(triton_fused.silu_mul(gate_up), F.silu(gate) * up, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [True, False], ids=["qk-norm", "no-norm"])
def test_qk_norm_rope_store_at_layer_width(dtype, qk_norm):
    num_blocks = 300
    positions = torch.tensor([0, 1, 511, 2047, 3000, 4095, 17, 0], device=DEVICE)
    # Rows 6 and 7 are CUDA-graph padding (slot -1): nothing of theirs may reach the cache.
    slots = torch.tensor([0, 4799, 16, 2047, 3001, 1234, -1, -1], device=DEVICE)
    tokens = positions.shape[0]
    qkv = _randn(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM, dtype=dtype, seed=26)
    # The tables in the activation dtype, as the model casts them.
    rotary = RotaryEmbedding(HEAD_DIM, MAX_POSITIONS, ROPE_THETA).to(device=DEVICE, dtype=dtype)
    k_cache = check_qk_norm_rope_store(qkv, HEADS, KV_HEADS, HEAD_DIM, EPS, rotary, positions, slots,
                                       27 if qk_norm else None, (num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM),
                                       ROPE_TOLERANCE[dtype])
    written = ~k_cache.view(-1, KV_HEADS, HEAD_DIM).isnan().all(dim=(1, 2))
    assert written.nonzero().flatten().tolist() == sorted(s for s in slots.tolist() if s >= 0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("context_lens", [[700], [300, 0, 517, 33]], ids=["one-row", "rows-with-padding"])
def test_decode_attention_at_layer_heads(dtype, context_lens):
    batch = make_paged_batch(context_lens, KV_HEADS, HEAD_DIM, BLOCK_SIZE, dtype, seed=29)
    q = random_queries(len(context_lens), HEADS, HEAD_DIM, dtype, seed=30)
    args = (q, batch.k_cache, batch.v_cache, batch.block_tables, batch.context_lens, HEAD_DIM ** -0.5)
    expected = reference.paged_decode_attention(*args)
    # The default split count (from the shapes: 2 splits at these widths) and one split, as B >= 16 runs.
    for num_splits in (None, 1):
        out = triton_attention.paged_decode_attention(*args, num_splits=num_splits)
        assert_close(out, expected)
        for row, n in enumerate(context_lens):
            if n == 0:
                assert torch.equal(out[row], torch.zeros_like(out[row])), "a padded row must give zeros"
