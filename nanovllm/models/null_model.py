"""A stand-in for the transformer, to benchmark everything around it (`Config.null_model`).

A benchmark tool, not a model: it reads no weights and does no model work. The "hidden state"
of each position is its own input token id, and the logits of a sampled row put all the weight
on the token after it, `(id + 1) % vocab_size`. Outputs are therefore fixed by the prompt's last
token (greedy, and in practice for any sampling settings: the chosen logit is 30 above the rest)
and walk through the vocabulary instead of repeating one token, so the detokenizer gets varied
text to decode. The runner still builds every step's batch, the block manager still allocates
and hashes KV blocks (the cache tensor itself is never written, so it is not allocated), and the
sampler still samples (B, V) logits: what `bench/serve.py --null-model` measures is what the
scheduler, block manager, sampler and the service stages sustain on their own.
"""
from __future__ import annotations

import torch
from torch import nn

from nanovllm.layers.attention import AttentionMetadata

PEAK_LOGIT = 30.0
"""The chosen token's logit; every other token's is 0 (so its probability is ~1 - V * 1e-13)."""


def null_next_token(token_id: int, vocab_size: int) -> int:
    """The token the null model puts after `token_id`."""
    return (token_id + 1) % vocab_size


class NullModel(nn.Module):
    def __init__(self, vocab_size: int):
        super().__init__()
        self.vocab_size = vocab_size

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return input_ids  # (T,): the "hidden state" is the token id itself

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(B,) token ids of the sampled rows -> (B, V) float32 logits peaked at the next token."""
        logits = torch.zeros(hidden.shape[0], self.vocab_size, dtype=torch.float32, device=hidden.device)
        logits.scatter_(1, ((hidden + 1) % self.vocab_size).unsqueeze(1), PEAK_LOGIT)
        return logits
