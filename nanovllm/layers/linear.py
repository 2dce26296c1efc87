"""Linear layers split over tensor-parallel ranks, each loading its own slice of HF weights.

Megatron's pairing: a column-parallel layer (each rank computes some output features) feeds a
row-parallel one (each rank holds the matching input features and the partial outputs are summed
with one all-reduce). So attention is qkv (column, split by heads) -> o_proj (row), and the MLP is
gate_up (column) -> down (row): one all-reduce each.

Packed layers hold several HF tensors in one weight (q|k|v, gate|up). On a rank the packed
weight is [q heads of this rank | k heads of this rank | v heads of this rank], so the loader
slices each HF tensor by this rank's heads (or rows) before copying it into its block.

Every parameter carries a `weight_loader(param, tensor[, shard_id])` that the model loader
calls; it raises ValueError on a shape mismatch. On one rank these are plain linear layers (prepacked for oneDNN on CPU).

A loader may hand a layer a `QuantizedWeight` (a GGUF matrix kept packed, layers/quant.py) instead
of a float tensor: the layer then keeps its row blocks packed, stacks them once all have come,
and drops its float weight. A block that comes as float while others come packed makes the layer
float (the packed blocks are dequantized into it), so any mix of tensor types loads.
"""
from __future__ import annotations

import torch
from torch import nn

from nanovllm.distributed import TensorParallel, split_evenly
from nanovllm.layers.cpu_gemm import linear
from nanovllm.layers.quant import QuantizedWeight, quant_linear


def _check_shape(tensor: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != tuple(expected):
        raise ValueError(f"has shape {tuple(tensor.shape)}, expected {tuple(expected)}")


def default_weight_loader(param: nn.Parameter, tensor: torch.Tensor) -> None:
    """A replicated parameter: every rank loads the whole tensor."""
    _check_shape(tensor, param.shape)
    param.data.copy_(tensor)


class _ParallelLinear(nn.Module):
    num_shards = 1
    """HF tensors stacked in this layer's weight (shard ids 0 .. num_shards - 1)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)
        self.packed_weight: torch.Tensor | None = None
        """oneDNN-packed copy of `weight` on CPU (layers/cpu_gemm.py), set after loading."""
        self.quant: QuantizedWeight | None = None
        """The weight kept quantized (GGUF on CPU); `weight` is then empty."""
        self.cpu_ops = None  # the compiled CpuOps (layers/cpu_kernels.py) the packed path runs on
        self._quant_parts: dict[int, QuantizedWeight] = {}
        self._float_shards = False

    def weight_loader(self, param: nn.Parameter, tensor: torch.Tensor | QuantizedWeight, *shard: int) -> None:
        """Route a tensor to `_load_float`, or keep it packed (see the module docstring)."""
        shard_id = shard[0] if shard else 0
        if isinstance(tensor, QuantizedWeight):
            if self._float_shards or self.tp.size > 1 or param is not self.weight:
                self._load_float(param, tensor.dequantize(param.dtype), *shard)
                return
            self._quant_parts[shard_id] = tensor
            if len(self._quant_parts) == self.num_shards:
                self._keep_packed()
            return
        if param is self.weight and not self._float_shards:
            self._float_shards = True
            for part_id, part in self._quant_parts.items():  # float from now on: unpack what came packed
                self._load_float(param, part.dequantize(param.dtype), *([part_id] if shard else []))
            self._quant_parts = {}
        self._load_float(param, tensor, *shard)

    def _keep_packed(self) -> None:
        self.keep_packed(QuantizedWeight.cat_rows([self._quant_parts[i] for i in range(self.num_shards)]))
        self._quant_parts = {}

    def keep_packed(self, quant: QuantizedWeight) -> None:
        """Hold `quant` instead of the float weight, which is freed."""
        if quant.shape != tuple(self.weight.shape):
            raise ValueError(f"has shape {quant.shape}, expected {tuple(self.weight.shape)}")
        self.quant = quant
        self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype), requires_grad=False)

    def _load_float(self, param: nn.Parameter, tensor: torch.Tensor, *shard: int) -> None:
        raise NotImplementedError

    def _linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.quant is not None:
            return quant_linear(x, self.quant, bias, self.cpu_ops)
        return linear(x, self.weight, bias, self.packed_weight)


class ColumnParallelLinear(_ParallelLinear):
    """y = x W^T with W's output rows split over ranks; each rank returns its slice of y."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, tp: TensorParallel = TensorParallel()):
        self.full_out = out_features
        super().__init__(in_features, split_evenly(out_features, tp.size, "the output features"), bias, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x, self.bias)

    def _load_float(self, param: nn.Parameter, tensor: torch.Tensor) -> None:
        _check_shape(tensor, (self.full_out, *param.shape[1:]))
        rows = param.shape[0]
        param.data.copy_(tensor.narrow(0, self.tp.rank * rows, rows))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs packed in one weight (gate|up), each split over ranks."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False, tp: TensorParallel = TensorParallel()):
        for size in output_sizes:
            split_evenly(size, tp.size, "intermediate_size")
        self.output_sizes = output_sizes
        self.num_shards = len(output_sizes)
        super().__init__(in_features, sum(output_sizes), bias, tp)

    def _load_float(self, param: nn.Parameter, tensor: torch.Tensor, shard_id: int) -> None:
        full = self.output_sizes[shard_id]
        _check_shape(tensor, (full, *param.shape[1:]))
        local = full // self.tp.size
        offset = sum(self.output_sizes[:shard_id]) // self.tp.size
        param.data.narrow(0, offset, local).copy_(tensor.narrow(0, self.tp.rank * local, local))


class QKVParallelLinear(ColumnParallelLinear):
    """q|k|v packed in one weight, split over ranks by whole heads (GQA: kv heads split too)."""

    num_shards = 3

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False,
                 tp: TensorParallel = TensorParallel()):
        self.head_dim = head_dim
        self.num_heads = split_evenly(num_heads, tp.size, "num_attention_heads")
        self.num_kv_heads = split_evenly(num_kv_heads, tp.size, "num_key_value_heads")
        super().__init__(hidden_size, (num_heads + 2 * num_kv_heads) * head_dim, bias, tp)

    def _load_float(self, param: nn.Parameter, tensor: torch.Tensor, shard_id: int) -> None:
        """shard_id 0, 1, 2: q, k, v."""
        q_rows, kv_rows = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        local = q_rows if shard_id == 0 else kv_rows
        offset = (0, q_rows, q_rows + kv_rows)[shard_id]
        _check_shape(tensor, (local * self.tp.size, *param.shape[1:]))
        param.data.narrow(0, offset, local).copy_(tensor.narrow(0, self.tp.rank * local, local))


class RowParallelLinear(_ParallelLinear):
    """y = x W^T with W's input columns split over ranks; partial results are summed (all-reduce)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, tp: TensorParallel = TensorParallel()):
        self.full_in = in_features
        super().__init__(split_evenly(in_features, tp.size, "the input features"), out_features, bias, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The bias is added once, after the sum, not once per rank.
        y = self._linear(x, self.bias if self.tp.size == 1 else None)
        if self.tp.size > 1:
            self.tp.all_reduce(y)
            if self.bias is not None:
                y = y + self.bias
        return y

    def _load_float(self, param: nn.Parameter, tensor: torch.Tensor) -> None:
        if param.dim() == 1:  # the bias is replicated
            default_weight_loader(param, tensor)
            return
        _check_shape(tensor, (param.shape[0], self.full_in))
        cols = param.shape[1]
        param.data.copy_(tensor.narrow(1, self.tp.rank * cols, cols))
