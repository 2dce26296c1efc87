"""The shape of a decoder model, read from an HF `config.json` dict or GGUF metadata.

transformers 4.x and 5.x spell some fields differently (`torch_dtype` vs `dtype`, top-level
`rope_theta` vs `rope_parameters.rope_theta`); both are accepted here so the rest of the
engine sees one spelling.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from nanovllm.models.model_files import cap_model_len, context_length

SUPPORTED_ARCHITECTURES = {
    "Qwen3ForCausalLM": "qwen3",
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
"""dtype names as configs and `Config.dtype` spell them."""


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    torch_dtype: torch.dtype
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_hf_dict(cls, cfg: dict) -> "ModelConfig":
        archs = cfg.get("architectures") or []
        arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported model architecture {archs or cfg.get('model_type')!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        rope = cfg.get("rope_parameters") or {}
        scaling = cfg.get("rope_scaling") or {}
        rope_type = scaling.get("rope_type", scaling.get("type")) or rope.get("rope_type", "default")
        if rope_type not in ("default", None):
            raise ValueError(f"unsupported rope scaling {rope_type!r}; only unscaled RoPE is implemented")
        num_heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        dtype_name = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or hidden // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0),
            max_position_embeddings=context_length(cfg),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", arch == "qwen2")),
            qk_norm=arch == "qwen3",
            torch_dtype=DTYPES.get(str(dtype_name).replace("torch.", ""), torch.float32),
            eos_token_ids=eos_ids,
        )


def resolve_max_model_len(requested: int | None, model: ModelConfig) -> int:
    """The engine's max_model_len: as requested, else the model's context length capped at 4096."""
    return cap_model_len(requested, model.max_position_embeddings)
