"""Token embedding and LM head with the vocabulary split over tensor-parallel ranks.

Rank r holds rows [r * shard, (r + 1) * shard) of the vocabulary, `shard = ceil(V / N)`; the
last rank's tail past V is zero padding, so any vocabulary size splits. The embedding looks up
the ids in its range (others give zeros) and all-reduces; the LM head computes its shard's
logits and gathers them on rank 0, which samples. With tied embeddings both share one weight.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.distributed import TensorParallel
from nanovllm.layers.cpu_gemm import linear


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel = TensorParallel()):
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.shard_size = -(-vocab_size // tp.size)
        self.vocab_start = tp.rank * self.shard_size
        self.vocab_end = min(self.vocab_start + self.shard_size, vocab_size)
        self.weight = nn.Parameter(torch.zeros(self.shard_size, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, tensor: torch.Tensor) -> None:
        expected = (self.vocab_size, param.shape[1])
        if tuple(tensor.shape) != expected:
            raise ValueError(f"has shape {tuple(tensor.shape)}, expected {expected}")
        rows = self.vocab_end - self.vocab_start
        param.data[:rows].copy_(tensor.narrow(0, self.vocab_start, rows))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        mine = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = torch.where(mine, input_ids - self.vocab_start, 0)
        hidden = F.embedding(local_ids, self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)  # (T, C)
        return self.tp.all_reduce(hidden)


class ParallelLMHead(VocabParallelEmbedding):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.packed_weight: torch.Tensor | None = None
        """oneDNN-packed copy of `weight` on CPU (layers/cpu_gemm.py), set after loading."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Full-vocabulary logits (B, V) on rank 0; None on the other ranks."""
        logits = linear(hidden, self.weight, None, self.packed_weight)  # (B, shard)
        if self.tp.size == 1:
            return logits
        logits = self.tp.gather_last_dim(logits)  # (B, N * shard) on rank 0
        return None if logits is None else logits[:, : self.vocab_size]
