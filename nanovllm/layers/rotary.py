"""Rotary position embedding (the "rotate half" layout used by Llama, Qwen2 and Qwen3)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class StepRope:
    """One step's rotary inputs, shared by every layer."""
    positions: torch.Tensor
    """(T,) int64."""
    cos_cache: torch.Tensor
    """(max_positions, D/2): the whole table, for the fused CPU op (layers/cpu_ops.c)."""
    sin_cache: torch.Tensor
    cos: torch.Tensor | None = None
    """(T, 1, D/2) per-token rows for the torch path; None when the fused op rotates."""
    sin: torch.Tensor | None = None


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]  # (P, D/2)
        self.register_buffer("cos_cache", freqs.cos(), persistent=False)
        self.register_buffer("sin_cache", freqs.sin(), persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token cos/sin, shaped (T, 1, D/2) to broadcast over heads; computed once per step."""
        return self.cos_cache[positions].unsqueeze(1), self.sin_cache[positions].unsqueeze(1)

    def for_step(self, positions: torch.Tensor, per_token: bool) -> StepRope:
        """The step's inputs; the per-token rows only where the torch path needs them."""
        rope = StepRope(positions, self.cos_cache, self.sin_cache)
        if per_token:
            rope.cos, rope.sin = self.cos_sin(positions)
        return rope

    @staticmethod
    def apply(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    dtype = x.dtype
    x1, x2 = x.float().chunk(2, dim=-1)  # (T, H, D/2) each
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(dtype)
