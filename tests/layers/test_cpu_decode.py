"""The one-call decode path (layers/cpu_decode.py, cpu_decode.c) against the per-op path.

Both run the same compiled kernels in the same order, so every decode step's hidden states must
be equal bit for bit (tolerance zero), for 1 to 8 rows, float32 and bfloat16, one thread and two,
on packed models: the tiny random models quantized at load (`quantization="int8"`; qwen2's qkv
bias and qwen3's q/k norms included) and the bundled GGUF model. Each engine step runs the model twice, per-op first,
then one-call: the second rewrites the same K/V into the same slots, so both see one cache state.
"""
from __future__ import annotations

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.layers import cpu_decode
from nanovllm.layers.cpu_decode import ENABLE_ENV, CpuDecode
from nanovllm.layers.cpu_kernels import CpuOps

pytestmark = pytest.mark.skipif(CpuOps.load() is None, reason="no C compiler on this machine")


def _compare_every_step(llm: LLM, monkeypatch) -> list[int]:
    """Make each forward of `llm`'s model run both paths and assert equal hidden states; returns
    the row counts of the steps the one-call path served."""
    model = llm.engine.runner.model.model
    inner, served = model.forward, []
    call = CpuDecode.__call__

    def counted(self, hidden, positions, meta):
        served.append(hidden.shape[0])
        return call(self, hidden, positions, meta)

    def both(input_ids, positions, meta):
        monkeypatch.setenv(ENABLE_ENV, "0")
        per_op = inner(input_ids, positions, meta)
        monkeypatch.setenv(ENABLE_ENV, "1")
        before = len(served)
        one_call = inner(input_ids, positions, meta)
        if len(served) > before:
            assert torch.equal(one_call, per_op), (one_call - per_op).abs().max()
        return one_call

    monkeypatch.setattr(CpuDecode, "__call__", counted)
    monkeypatch.setattr(model, "forward", both)
    return served


def _staggered(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    """Prompt i generates i + 2 tokens: decode steps of 8, 7, ... 1 rows."""
    params = [SamplingParams(temperature=0, max_tokens=i + 2, ignore_eos=True) for i in range(len(prompts))]
    return [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama"])
def test_int8_tiny_models_one_call_equals_per_op(tiny_models, monkeypatch, arch, dtype, threads):
    """One thread and two: the one-call step shares each product and attention out over one team
    (attention by heads below as many rows as threads), the per-op path over a team per op."""
    llm = LLM(tiny_models[arch], quantization="int8", dtype=dtype, num_kvcache_blocks=64, num_threads=threads)
    served = _compare_every_step(llm, monkeypatch)
    _staggered(llm, [list(range(3 + 5 * i, 20 + 9 * i)) for i in range(8)])
    llm.engine.runner.close()
    assert sorted(set(served)) == list(range(1, 9))


@pytest.mark.parametrize("isa", ["avx2", "avx512"])
def test_the_avx2_and_avx512_kernels_one_call_equals_per_op(tiny_models, monkeypatch, isa):
    """The library built for less than this CPU has (NANOVLLM_CPU_ISA): the same equality."""
    from nanovllm.layers import cpu_kernels

    own = cpu_kernels.cpu_isa()
    if own is None or cpu_kernels.ISA_LEVELS.index(isa) > cpu_kernels.ISA_LEVELS.index(own):
        pytest.skip(f"this CPU cannot run the {isa} kernels")
    monkeypatch.setenv(cpu_kernels.ISA_ENV, isa)
    llm = LLM(tiny_models["qwen3"], quantization="int8", dtype="bfloat16", num_kvcache_blocks=64, num_threads=2)
    assert cpu_kernels.kernel_isa(cpu_kernels._load_library()) == isa  # the library the engine loaded
    served = _compare_every_step(llm, monkeypatch)
    _staggered(llm, [list(range(3 + 5 * i, 20 + 9 * i)) for i in range(8)])
    llm.engine.runner.close()
    assert sorted(set(served)) == list(range(1, 9))


def test_float_weights_and_the_switch_keep_the_per_op_path(tiny_model_dir, monkeypatch):
    llm = LLM(tiny_model_dir, dtype="float32", num_kvcache_blocks=32)
    served = _compare_every_step(llm, monkeypatch)
    _staggered(llm, [[5, 9, 13], [7, 8]])
    assert served == [] and CpuDecode.build(llm.engine.runner.model.model) is None
    llm.engine.runner.close()

    llm = LLM(tiny_model_dir, quantization="int8", dtype="float32", num_kvcache_blocks=32)
    monkeypatch.setattr(cpu_decode, "enabled", lambda: False)
    served = _compare_every_step(llm, monkeypatch)
    _staggered(llm, [[5, 9, 13], [7, 8]])
    llm.engine.runner.close()
    assert served == []


def test_a_new_kv_cache_rebuilds_the_table(tiny_model_dir):
    llm = LLM(tiny_model_dir, quantization="int8", dtype="float32", num_kvcache_blocks=32)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    first = llm.generate([[5, 9, 13]], params, use_tqdm=False)[0]["token_ids"]
    runner, model = llm.engine.runner, llm.engine.runner.model.model
    table = model._cpu_decode
    runner._allocate_kv_cache()  # the layers now point at another cache
    assert llm.generate([[5, 9, 13]], params, use_tqdm=False)[0]["token_ids"] == first
    assert model._cpu_decode is not table and model._cpu_decode.fresh(model)
    runner.close()


@pytest.mark.slow
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_default_model_one_call_equals_per_op(monkeypatch, dtype, threads):
    """The bundled Q4_1/Q8_0 model: hidden states of 1..8-row steps equal, the README answer
    unchanged, and greedy chat answers token for token the same with the path off. Without prefix
    caching: a second run would start from cached prompt blocks, and its shorter prefill (the
    matrix-vector kernel instead of the float GEMM) can change a bf16 answer on either path."""
    llm = LLM("default", dtype=dtype, num_kvcache_blocks=128, enable_prefix_caching=False, num_threads=threads)
    chats = ["What is the capital of France?", "Name a primary color.", "Say hello in Spanish.",
             "Write a haiku about the sea.", "What is 12 times 7?"]
    prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True,
                                                 tokenize=False) for c in chats]
    params = SamplingParams(temperature=0, max_tokens=24)
    one_call = llm.generate(prompts, params, use_tqdm=False)
    assert one_call[0]["text"] == "The capital of France is Paris."
    monkeypatch.setenv(ENABLE_ENV, "0")
    assert [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)] == [
        o["token_ids"] for o in one_call]
    served = _compare_every_step(llm, monkeypatch)
    _staggered(llm, [llm.tokenizer.encode(chats[i % len(chats)])[: 4 + i] for i in range(8)])
    llm.engine.runner.close()
    assert sorted(set(served)) == list(range(1, 9))
