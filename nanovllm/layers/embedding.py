"""Token embedding and LM head with the vocabulary split over tensor-parallel ranks.

Rank r holds rows [r * shard, (r + 1) * shard) of the vocabulary, `shard = ceil(V / N)`; the
last rank's tail past V is zero padding, so any vocabulary size splits. The embedding looks up
the ids in its range (others give zeros) and all-reduces; the LM head computes its shard's
logits and gathers them on rank 0, which samples. With tied embeddings both share one weight.
On one rank the weight may come packed (`QuantizedWeight`, a GGUF matrix on CPU): lookups then
dequantize just the rows asked for, and the LM head runs the packed matmul (layers/quant.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.distributed import TensorParallel
from nanovllm.layers.cpu_gemm import linear
from nanovllm.layers.quant import QuantizedWeight, quant_embedding, quant_linear


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
        self.quant: QuantizedWeight | None = None
        """The weight kept quantized (one rank, GGUF on CPU); `weight` is then empty."""
        self.cpu_ops = None  # the compiled CpuOps (layers/cpu_kernels.py) the packed path runs on

    def weight_loader(self, param: nn.Parameter, tensor: torch.Tensor | QuantizedWeight) -> None:
        expected = (self.vocab_size, param.shape[1])
        if isinstance(tensor, QuantizedWeight):
            if self.tp.size == 1 and tensor.shape == expected:
                self.keep_packed(tensor)
                return
            tensor = tensor.dequantize(param.dtype)
        if tuple(tensor.shape) != expected:
            raise ValueError(f"has shape {tuple(tensor.shape)}, expected {expected}")
        rows = self.vocab_end - self.vocab_start
        param.data[:rows].copy_(tensor.narrow(0, self.vocab_start, rows))

    def keep_packed(self, quant: QuantizedWeight) -> None:
        """Hold `quant` instead of the float weight, which is freed (a tied LM head shares both)."""
        self.quant = quant
        self.weight = nn.Parameter(torch.empty(0, self.weight.shape[1], dtype=self.weight.dtype), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            return quant_embedding(input_ids, self.quant, self.weight.dtype, self.cpu_ops)  # (T, C)
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
        if self.quant is not None:
            return quant_linear(hidden, self.quant, None, self.cpu_ops)  # (B, V), one rank
        logits = linear(hidden, self.weight, None, self.packed_weight)  # (B, shard)
        if self.tp.size == 1:
            return logits
        logits = self.tp.gather_last_dim(logits)  # (B, N * shard) on rank 0
        return None if logits is None else logits[:, : self.vocab_size]
