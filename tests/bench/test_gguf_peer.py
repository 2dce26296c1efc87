"""bench/gguf_peer.py: the bytes a decode step reads as the engine holds its weights, and the
checks on its new options (a real engine on the tiny model; the timed runs are the bench's own)."""
from __future__ import annotations

import pytest

from bench.gguf_peer import loaded_weight_bytes, main
from nanovllm import LLM


def _matrices(model) -> list:
    """The decoder's linear layers and the LM head (the input embedding is read a row a token)."""
    return [m for name, m in model.named_modules() if hasattr(m, "keep_packed") and not name.endswith("embed_tokens")]


def test_loaded_weight_bytes_counts_packed_and_float_matrices(tiny_model_dir):
    llm = LLM(tiny_model_dir, quantization="int8", dtype="float32", num_kvcache_blocks=16)
    model = llm.engine.runner.model
    packed = loaded_weight_bytes(model)
    # int8 codes, one byte a weight, and a float16 scale per 32 weights
    assert packed == sum(m.quant.shape[0] * m.quant.shape[1] * (1 + 2 / 32) for m in _matrices(model))
    llm.engine.runner.close()

    llm = LLM(tiny_model_dir, dtype="float32", num_kvcache_blocks=16)
    model = llm.engine.runner.model
    assert loaded_weight_bytes(model) == sum(m.weight.numel() * 4 for m in _matrices(model))
    assert packed < loaded_weight_bytes(model) / 3
    llm.engine.runner.close()


@pytest.mark.parametrize("argv, message", [(["--isa", "avx9000"], "--isa takes avx2, avx512, avx512_vnni"),
                                           (["--baseline", "/nonexistent"], "no bench/gguf_peer.py there")])
def test_bad_options_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        main(argv)
    assert message in capsys.readouterr().err
