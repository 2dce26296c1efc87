"""bench/kernel_count.py: what counts as a launch, and the decode step's kernels per layer.

The goal the fused CUDA path is held to: at most 10 kernels per decoder layer inside the decode
graph, at Qwen3-0.6B's width (the vocabulary, which only the embedding sees, is cut to keep the
build quick). The torch-ops path (NANOVLLM_TRITON_FUSED=0) launches several times as many, so the
count can tell the two apart.
"""
from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("CUDA present: bench/decode_timeline.py measures the real kernels", allow_module_level=True)
os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel modules are imported
pytest.importorskip("triton")

from bench.kernel_count import QWEN3_0_6B, count_decode_step, count_launches, format_counts  # noqa: E402
from nanovllm.kernels import triton_fused  # noqa: E402

SHAPE = replace(QWEN3_0_6B, vocab_size=4096)


def test_views_and_allocations_are_not_launches_but_casts_and_triton_kernels_are():
    x, weight = torch.randn(4, 64, dtype=torch.bfloat16), torch.ones(64, dtype=torch.bfloat16)
    with torch.inference_mode(), count_launches() as counter:  # as the runner runs the model
        x.view(2, 128).t()[:, 1:].expand(2, 128, 3)
        x.split([32, 32], dim=-1)
        torch.empty(8)
        x.to(torch.bfloat16)  # no cast: the tensor itself
        x.float()
        x + 1
        triton_fused.rms_norm(x, weight, 1e-6)  # its output allocation and the interpreter's copies are not
    assert counter.count.by_scope == {"outside": {"aten::to": 1, "aten::add": 1, "triton:_rms_norm_kernel": 1}}


def test_the_fused_decode_step_launches_at_most_10_kernels_per_layer():
    # 3 rows replay the 4-row graph (a padded row); below 16 rows the decode splits its context
    # and merges the splits in a second kernel.
    got = count_decode_step(3, fused=True, model_config=SHAPE)
    assert got["graph_rows"] == 4
    assert got["kernels_per_layer"] <= 10, format_counts(got)
    assert got["per_layer"] == {"aten::linear": 4, "triton:_rms_norm_kernel": 2, "triton:_qk_norm_rope_store_kernel": 1,
                                "triton:_decode_kernel": 1, "triton:_decode_reduce_kernel": 1,
                                "triton:_silu_mul_kernel": 1}
    assert got["outside"] == {"aten::embedding": 1, "triton:_rms_norm_kernel": 1, "aten::copy_": 1}


def test_the_torch_ops_path_launches_many_more():
    fused = count_decode_step(1, fused=True, model_config=SHAPE)
    torch_ops = count_decode_step(1, fused=False, model_config=SHAPE)
    assert torch_ops["kernels_per_layer"] >= 4 * fused["kernels_per_layer"], format_counts(torch_ops)
    assert torch_ops["per_layer"]["triton:_store_kvcache_kernel"] == 1  # the cache store is a kernel of its own
    assert "triton:_rms_norm_kernel" not in torch_ops["per_layer"]
