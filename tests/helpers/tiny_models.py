"""Tiny random-weight checkpoints and an offline tokenizer, for tests and benchmarks.

No model hub is reachable, so tests build their own: a byte-level BPE trained on Python's
own source files, wrapped as an HF tokenizer with a ChatML template, and Qwen3 / Llama /
Qwen2 configs saved with random weights as ordinary safetensors folders.
"""
from __future__ import annotations

import glob
import os
import sysconfig

import torch

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _training_text(max_files: int = 120) -> list[str]:
    stdlib = sysconfig.get_paths()["stdlib"]
    files = sorted(glob.glob(os.path.join(stdlib, "*.py")))[:max_files]
    texts = []
    for path in files:
        with open(path, encoding="utf-8", errors="ignore") as f:
            texts.append(f.read())
    # A little non-ASCII text so multi-byte characters get merged tokens too.
    texts.append("你好，世界！今天天气很好。 😀🎉 café naïve Grüße " * 50)
    return texts


def make_tokenizer(path: str, vocab_size: int = 2048):
    """Train a byte-level BPE tokenizer offline and save it as an HF tokenizer folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_training_text(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = CHATML_TEMPLATE
    fast.save_pretrained(path)
    return fast


def make_tiny_model(path: str, arch: str = "qwen3", tokenizer_dir: str | None = None,
                    seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> str:
    """Save a random-weight model of the given architecture (qwen3, llama, qwen2) to `path`.

    With `tokenizer_dir`, that tokenizer is copied in and the vocab matches it; otherwise a
    tokenizer is trained first.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, Qwen2Config, Qwen3Config

    os.makedirs(path, exist_ok=True)
    if tokenizer_dir is None:
        tokenizer = make_tokenizer(path)
    else:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        tokenizer.save_pretrained(path)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    common = dict(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        rms_norm_eps=1e-6, eos_token_id=eos, bos_token_id=eos,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False,
        # A wide init makes logits peaked, so greedy choices are far from ties and
        # token-exact comparisons between implementations are meaningful.
        initializer_range=0.2,
    )
    common.update(overrides)
    if arch == "qwen3":
        config = Qwen3Config(head_dim=common["hidden_size"] // common["num_attention_heads"], **common)
    elif arch == "llama":
        config = LlamaConfig(**common)
    elif arch == "qwen2":
        config = Qwen2Config(**common)
    else:
        raise ValueError(f"unknown tiny architecture {arch!r}; use qwen3, llama or qwen2")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if arch == "qwen2":
        # Random, non-zero biases so a loader that drops them is caught.
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.2)
    model.save_pretrained(path)
    return path
