"""`dtype="auto"` on CPU follows the CPU's bf16 support, unless NANOVLLM_AUTO_DTYPE says otherwise."""
from __future__ import annotations

import pytest
import torch

from nanovllm.config import Config
from nanovllm.engine.model_runner import resolve_dtype
from nanovllm.layers.cpu_kernels import cpu_flags

CPU = torch.device("cpu")


def resolved(model: str, dtype: str = "auto") -> torch.dtype:
    return resolve_dtype(Config(model=model, dtype=dtype), None, CPU)


def test_auto_follows_the_cpu_when_nothing_forces_it(tiny_model_dir, monkeypatch):
    monkeypatch.delenv("NANOVLLM_AUTO_DTYPE", raising=False)
    native = bool({"amx_bf16", "avx512_bf16"} & cpu_flags()) and torch.backends.mkldnn.is_available()
    assert resolved(tiny_model_dir) == (torch.bfloat16 if native else torch.float32)


@pytest.mark.parametrize("forced", ["float32", "bfloat16"])
def test_the_variable_makes_auto_resolve_as_on_the_other_kind_of_cpu(tiny_model_dir, monkeypatch, caplog, forced):
    monkeypatch.setenv("NANOVLLM_AUTO_DTYPE", forced)
    with caplog.at_level("INFO", logger="nanovllm.layers.cpu_kernels"):
        assert resolved(tiny_model_dir) == getattr(torch, forced)
    # An explicit dtype is what it says, whatever the variable.
    other = "bfloat16" if forced == "float32" else "float32"
    assert resolved(tiny_model_dir, other) == getattr(torch, other)


def test_the_variable_is_read_at_each_resolution(tiny_model_dir, monkeypatch):
    # The suite forces it per test, after other engines of the same process resolved auto.
    for forced in ("bfloat16", "float32", "bfloat16"):
        monkeypatch.setenv("NANOVLLM_AUTO_DTYPE", forced)
        assert resolved(tiny_model_dir) == getattr(torch, forced)


@pytest.mark.parametrize("bad", ["bf16", "fp32", "float16", "auto", " float32"])
def test_a_bad_value_is_refused_naming_the_variable_and_the_choices(tiny_model_dir, monkeypatch, bad):
    monkeypatch.setenv("NANOVLLM_AUTO_DTYPE", bad)
    with pytest.raises(ValueError, match=r"NANOVLLM_AUTO_DTYPE must be one of float32, bfloat16 \(or unset\); got"):
        resolved(tiny_model_dir)


def test_the_auto_dtype_fixture_forces_the_engine(tiny_model_dir, auto_dtype):
    from nanovllm.engine.llm_engine import LLMEngine

    engine = LLMEngine(Config(model=tiny_model_dir, num_kvcache_blocks=16, num_threads=1))
    assert engine.runner.dtype == getattr(torch, auto_dtype)
    assert engine.runner.kv_cache.dtype == getattr(torch, auto_dtype)
