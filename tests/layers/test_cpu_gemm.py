"""Prepacked oneDNN weights give F.linear's results (to rounding) and are used by the engine."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from nanovllm.distributed import TensorParallel
from nanovllm.layers.cpu_gemm import can_pack, linear, pack_linear_weights, packs
from nanovllm.layers.cpu_kernels import cpu_flags
from nanovllm.layers.linear import ColumnParallelLinear, RowParallelLinear

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_packed_linear_matches_f_linear(rows):
    torch.manual_seed(rows)
    layer = ColumnParallelLinear(96, 160, bias=True, tp=TensorParallel())
    layer.weight.data.normal_()
    layer.bias.data.normal_()
    x = torch.randn(rows, 96)
    expected = F.linear(x, layer.weight, layer.bias)
    assert pack_linear_weights(layer) == 1 and layer.packed_weight is not None
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-4)


def test_row_buckets_cover_every_count_and_stay_few():
    from nanovllm.layers.cpu_gemm import row_bucket
    buckets = {row_bucket(m) for m in range(1, 2049)}
    assert all(row_bucket(m) >= m for m in range(1, 2049))
    assert len(buckets) <= 40
    assert row_bucket(64) == 64 and row_bucket(1) == 1 and row_bucket(33) == 64 and row_bucket(513) == 640


def test_float16_weights_are_not_packed():
    module = torch.nn.ModuleDict({"a": ColumnParallelLinear(8, 8), "b": RowParallelLinear(8, 8)}).to(torch.float16)
    assert not can_pack(module["a"].weight)
    assert pack_linear_weights(module) == 0
    assert module["a"].packed_weight is None
    x = torch.randn(3, 8, dtype=torch.float16)
    assert linear(x, module["a"].weight, None, None).dtype == torch.float16


@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_packed_bf16_linear_matches_f_linear_to_bf16_rounding(rows):
    # bf16 weights pack where oneDNN computes bf16 (AMX tiles, AVX512-BF16, emulated on other
    # AVX-512 CPUs); on an AVX2-only CPU they stay unpacked and go through F.linear.
    torch.manual_seed(rows)
    module = ColumnParallelLinear(256, 192, bias=True)
    module.weight.data.normal_()
    module.bias.data.normal_()
    module = module.to(torch.bfloat16)
    assert pack_linear_weights(torch.nn.ModuleList([module])) == int(packs(torch.bfloat16))
    x = torch.randn(rows, 256).to(torch.bfloat16)
    got = linear(x, module.weight, module.bias, module.packed_weight)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 192)
    expected = F.linear(x.float(), module.weight.float(), module.bias.float())  # fp32 from the same bf16 values
    torch.testing.assert_close(got.float(), expected, rtol=1.6e-2, atol=2e-2)


def test_bf16_packing_is_used_exactly_where_onednn_supports_it():
    # oneDNN's bf16 reorder needs AVX512 BW+VL+DQ or AVX-NE-CONVERT; without them torch raises,
    # and an explicit dtype="bfloat16" must still load and run (unpacked).
    flags = cpu_flags()
    supported = {"avx512bw", "avx512vl", "avx512dq"} <= flags or "avx_ne_convert" in flags
    assert packs(torch.bfloat16) == supported
    assert packs(torch.float32)
    module = ColumnParallelLinear(16, 8).to(torch.bfloat16)
    assert can_pack(module.weight) == supported
    assert pack_linear_weights(module) == int(supported)
    assert (module.packed_weight is not None) == supported
    assert module(torch.randn(3, 16).to(torch.bfloat16)).shape == (3, 8)


def test_engine_packs_every_projection_and_the_lm_head(tiny_model_dir):
    from nanovllm.config import Config
    from nanovllm.engine.llm_engine import LLMEngine

    engine = LLMEngine(Config(model=tiny_model_dir, num_kvcache_blocks=16))
    model = engine.runner.model
    slots = [m for m in model.modules() if hasattr(m, "packed_weight")]
    assert len(slots) == 4 * engine.model_config.num_layers + 1  # qkv, o, gate_up, down per layer + lm_head
    # Where oneDNN cannot compute the dtype auto resolved to (bf16 forced on an AVX2-only CPU),
    # nothing is packed and F.linear serves.
    assert all((m.packed_weight is not None) == packs(engine.runner.dtype) for m in slots)
    if not os.environ.get("NANOVLLM_AUTO_DTYPE"):
        assert packs(engine.runner.dtype), "auto, left to the CPU, picked a dtype oneDNN cannot pack"


def test_an_explicit_bf16_on_a_cpu_that_emulates_it_is_warned_about(tiny_model_dir, caplog):
    from nanovllm.config import Config
    from nanovllm.engine.model_runner import resolve_dtype

    with caplog.at_level("WARNING", logger="nanovllm.engine.model_runner"):
        assert resolve_dtype(Config(model=tiny_model_dir, dtype="bfloat16"), None, torch.device("cpu")) == torch.bfloat16
        assert resolve_dtype(Config(model=tiny_model_dir, dtype="float32"), None, torch.device("cpu")) == torch.float32
    warned = [r.getMessage() for r in caplog.records if "emulated" in r.getMessage()]
    assert len(warned) == (0 if packs(torch.bfloat16) else 1), warned
