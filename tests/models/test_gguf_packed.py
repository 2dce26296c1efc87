"""GGUF models on CPU with their weights kept packed: greedy tokens equal those of the same
weights dequantized to float at load (the path every weight took before)."""
from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T  # noqa: E402

from nanovllm.config import Config  # noqa: E402
from nanovllm.engine.llm_engine import LLMEngine  # noqa: E402
from nanovllm.layers.cpu_kernels import CpuOps  # noqa: E402
from nanovllm.sampling_params import SamplingParams  # noqa: E402
from tests.helpers.gguf_blocks import gguf_rows  # noqa: E402

HIDDEN, INTER, VOCAB, HEAD_DIM = 256, 512, 300, 64

pytestmark = pytest.mark.skipif(CpuOps.load() is None, reason="no C compiler on this machine")


def _write_quantized_llama(path: str) -> str:
    """Two Llama layers whose matrices cover every packed type, Q4_K and Q6_K in one q|k|v."""
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTER)
    writer.add_block_count(2)
    writer.add_head_count(HIDDEN // HEAD_DIM)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1e4)
    rng = np.random.default_rng(0)
    writer.add_tensor("token_embd.weight", gguf_rows(T.Q8_0, VOCAB, HIDDEN, seed=1), raw_dtype=T.Q8_0)
    writer.add_tensor("output_norm.weight", rng.uniform(0.5, 1.5, HIDDEN).astype(np.float32))
    matrices = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (2 * HEAD_DIM, HIDDEN), "attn_v": (2 * HEAD_DIM, HIDDEN),
                "attn_output": (HIDDEN, HIDDEN), "ffn_gate": (INTER, HIDDEN), "ffn_up": (INTER, HIDDEN),
                "ffn_down": (HIDDEN, INTER)}
    types = [[T.Q4_K, T.Q4_K, T.Q6_K, T.Q4_0, T.Q4_1, T.Q4_1, T.Q5_K],
             [T.Q4_0, T.Q4_1, T.Q8_0, T.Q6_K, T.Q5_K, T.Q4_K, T.Q8_0]]
    for layer in range(2):
        for (name, (rows, cols)), qtype in zip(matrices.items(), types[layer]):
            raw = gguf_rows(qtype, rows, cols, seed=100 * layer + rows + cols)
            writer.add_tensor(f"blk.{layer}.{name}.weight", raw, raw_dtype=qtype)
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{layer}.{norm}.weight", rng.uniform(0.5, 1.5, HIDDEN).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def greedy_tokens(model: str, prompts: list[list[int]], max_tokens: int, **config) -> list[list[int]]:
    engine = LLMEngine(Config(model=model, num_kvcache_blocks=64, **config))
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    packed = engine.runner.model.model.layers[0].self_attn.qkv_proj.quant is not None
    engine.runner.close()
    return [tokens[str(i)] for i in range(len(prompts))], packed


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tiny_quantized_model_packed_equals_dequantized(tmp_path, dtype):
    """`gguf_weights="float"` (the operator's choice for many streams) loads float weights and
    gives the packed path's greedy tokens: decode rows, a panel-sized prefill, and 12 streams at
    once (the dequantized-panel path at decode)."""
    path = _write_quantized_llama(str(tmp_path / "tiny.gguf"))
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, VOCAB, n).tolist() for n in (1, 7, 40, *range(2, 11))]
    packed, was_packed = greedy_tokens(path, prompts, 12, dtype=dtype)
    floats, was_float_packed = greedy_tokens(path, prompts, 12, dtype=dtype, gguf_weights="float")
    assert was_packed and not was_float_packed
    assert packed == floats


def test_gguf_weights_takes_packed_or_float():
    assert Config(gguf_weights="float").gguf_weights == "float"
    for bad in ("dequantized", "", None, "FLOAT"):
        with pytest.raises(ValueError, match="gguf_weights must be 'packed'.*or 'float'"):
            Config(gguf_weights=bad)


@pytest.mark.slow
def test_default_model_packed_greedy_tokens_equal_dequantized():
    """The bundled Q4_1/Q8_0 model: the README question and a few chats, 24 greedy tokens each,
    token for token (fp32: the packed kernels differ from the float GEMM by ~1e-5 relative)."""
    from nanovllm import LLM

    chats = ["What is the capital of France?", "Name a primary color.", "Say hello in Spanish.",
             "Write a haiku about the sea.", "What is 12 times 7?"]

    def answers(**config) -> list[dict]:
        llm = LLM("default", dtype="float32", num_kvcache_blocks=128, **config)
        prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True,
                                                     tokenize=False) for c in chats]
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
        llm.engine.runner.close()
        return outs

    packed = answers()
    assert packed[0]["text"] == "The capital of France is Paris."
    assert [o["token_ids"] for o in answers(gguf_weights="float")] == [o["token_ids"] for o in packed]


def test_engine_proc_has_the_gguf_weights_flag_and_variable(monkeypatch):
    """`python -m engine_proc --gguf-weights float` (or NANOVLLM_GGUF_WEIGHTS=float, which
    `nanovllm serve` passes on to the engine stage) reaches the engine's Config."""
    import argparse

    from engine_proc.__main__ import add_config_flags

    def parsed(*argv: str) -> str:
        parser = argparse.ArgumentParser()
        add_config_flags(parser, Config)
        return parser.parse_args(argv).gguf_weights

    assert parsed() == "packed"
    assert parsed("--gguf-weights", "float") == "float"
    monkeypatch.setenv("NANOVLLM_GGUF_WEIGHTS", "float")
    assert parsed() == "float"
