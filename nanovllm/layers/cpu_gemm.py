"""Linear layers on CPU with weights prepacked once for oneDNN.

`F.linear` on CPU hands each call to a GEMM that re-lays out (packs) the weight matrix every
time; at decode batch sizes (tens of rows) that repacking is a large share of the work. oneDNN
can pack a weight once into its blocked format and reuse it: measured on this 2-core machine at
64 rows, 56-66 GFLOP/s instead of 35-61, and ~70 instead of 55-65 at 2048 rows. Results differ
from `F.linear` only by float rounding (relative ~1e-6).

oneDNN JIT-compiles a kernel for every new row count (measured: calls with new row counts took
~1.5 ms longer than repeats), and a serving engine sees hundreds of row counts (decode batch
sizes, prefill chunk lengths) while oneDNN caches a bounded number of kernels. Rows are
therefore padded up to a bucket (powers of two to 32, then multiples of 32 to 512, then of 128),
which bounds the kernels to a few dozen per weight shape for a few percent of padded rows.

The packed copy is made after the weights are loaded (`pack_linear_weights`); a layer without
one, or on another device or dtype, keeps using `F.linear`. oneDNN packs bf16 weights only on
CPUs with AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT: on an AVX2-only CPU an explicit
`dtype="bfloat16"` runs through `F.linear` (correct, slow; `auto` picks float32 there).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

_PACKING_BATCH_HINT = 64  # oneDNN picks its blocking for this many rows; any row count works


def packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs and multiplies `dtype` weights on this CPU: float32 everywhere, bf16
    only with AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT (torch raises in the reorder elsewhere).

    Asked of torch, not tried: a failing reorder must stay an error where it fails for another
    reason (oneDNN compiles its kernels at run time, which a W^X sandbox forbids)."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return dtype == torch.float32


def can_pack(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and packs(weight.dtype)


def row_bucket(rows: int) -> int:
    """The padded row count oneDNN sees for `rows` rows."""
    if rows <= 32:
        return 1 << max(0, rows - 1).bit_length()
    step = 32 if rows <= 512 else 128
    return -(-rows // step) * step


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor | None) -> torch.Tensor:
    """`F.linear`, through the prepacked oneDNN weight when there is one."""
    if packed is None or x.dim() != 2:
        return F.linear(x, weight, bias)
    rows = x.shape[0]
    padded = row_bucket(rows)
    if padded != rows:
        x = F.pad(x, (0, 0, 0, padded - rows))  # (padded, in)
    y = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return y if padded == rows else y[:rows]  # a leading slice of a row-major tensor stays contiguous


def pack_linear_weights(model: nn.Module) -> int:
    """Give every module with a `packed_weight` slot a packed copy of its weight; returns how many."""
    count = 0
    for module in model.modules():
        if hasattr(module, "packed_weight") and getattr(module, "quant", None) is None and can_pack(module.weight):
            module.packed_weight = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), _PACKING_BATCH_HINT)
            count += 1
    return count
