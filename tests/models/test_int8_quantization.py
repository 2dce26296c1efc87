"""`quantization="int8"`: float checkpoints quantized at load onto the packed CPU kernels."""
from __future__ import annotations

import glob
import os
import shutil

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.config import Config
from nanovllm.layers.cpu_kernels import CpuOps
from nanovllm.layers.quant import QuantizedWeight


def test_from_float_is_within_half_a_step_of_every_weight():
    weight = torch.randn(24, 96) * torch.linspace(0.01, 3, 96)  # groups of very different ranges
    packed = QuantizedWeight.from_float(weight)
    assert (packed.bits, packed.group, tuple(packed.scales.shape)) == (8, 32, (24, 3))
    step = packed.scales.float().repeat_interleave(32, dim=1)
    assert ((packed.dequantize() - weight).abs() <= step * 0.5 + 1e-6 * weight.abs()).all()


def test_unknown_quantization_is_refused():
    with pytest.raises(ValueError, match="quantization"):
        Config(quantization="int4")


def _int8_rounded_copy(source: str, target: str) -> str:
    """The same checkpoint with every matrix the engine quantizes replaced by its int8 rounding."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, target)
    for path in glob.glob(os.path.join(target, "*.safetensors")):
        tensors = load_file(path)
        rounded = {name: QuantizedWeight.from_float(t).dequantize() if t.dim() == 2 and t.shape[1] % 32 == 0 else t
                   for name, t in tensors.items()}
        save_file(rounded, path)
    return target


@pytest.mark.skipif(CpuOps.load() is None, reason="no C compiler on this machine")
def test_int8_engine_equals_float_engine_on_the_int8_rounded_weights(tiny_model_dir, tmp_path):
    prompts = [[5, 9, 13], list(range(20, 60)), [7]]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    llm = LLM(tiny_model_dir, quantization="int8", dtype="float32", num_kvcache_blocks=32)
    runner = llm.engine.runner
    layer = runner.model.model.layers[0]
    assert layer.mlp.gate_up_proj.quant is not None and layer.mlp.gate_up_proj.weight.numel() == 0
    assert runner.model.lm_head.quant is not None
    int8 = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
    runner.close()
    reference = LLM(_int8_rounded_copy(tiny_model_dir, str(tmp_path / "rounded")), dtype="float32",
                    num_kvcache_blocks=32)
    assert [o["token_ids"] for o in reference.generate(prompts, params, use_tqdm=False)] == int8
