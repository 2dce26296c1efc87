"""Token sampling for a whole batch at once: greedy rows and temperature rows side by side."""
from __future__ import annotations

import torch


def sample(logits: torch.Tensor, temperatures: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """logits (B, V) float32, temperatures (B,) with 0 for greedy -> token ids (B,)."""
    greedy = logits.argmax(dim=-1)
    is_greedy = temperatures == 0
    if bool(is_greedy.all()):
        return greedy  # fast path: no softmax, no random numbers
    probs = torch.softmax(logits / temperatures.clamp(min=1e-5).unsqueeze(1), dim=-1)  # (B, V)
    # Gumbel-max in its exponential form: argmax(p / E) with E ~ Exp(1) samples from p.
    noise = torch.empty_like(probs).exponential_(generator=generator)
    sampled = (probs / noise).argmax(dim=-1)
    return torch.where(is_greedy, greedy, sampled)
