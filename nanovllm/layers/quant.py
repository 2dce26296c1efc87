"""Weights kept packed (quantized) in memory on CPU, and the linear layer that reads them.

A decode step at batch 1 reads every weight once, so its time is the weight bytes over the
memory bandwidth: a 4-bit weight costs a quarter of a bf16 one. Two layouts cover the GGUF types
the loader keeps packed (models/gguf_quant.py maps them), so two kernel families serve them all:

- 4 bits: codes 0..15, a float16 scale and min per 32 inputs (w = scale * q + min): Q4_0, Q4_1,
  Q4_K (whose 6-bit sub-block scales times the super-block scale become the float16 scale);
- 8 bits: int8 codes, a float16 scale per 16 or 32 inputs and optionally a min: Q8_0, Q6_K (per
  16), Q5_K (codes 0..31 with a min).

`quant_linear` picks the kernel per call: up to `MATVEC_MAX_ROWS` rows of x (decode at small
batch) go to `quant_matmul` of cpu_quant.c, which takes x as int16 per 32 inputs and reads
each weight group once for up to four rows; more rows (prefill chunks, many streams) are the
GEMM's arithmetic, not the weight bytes: bf16 x on a CPU with AVX512-BF16 and no AMX goes to
`quant_gemm_bf16`, which dequantizes 64 weight rows at a time into registers and an L2-sized
tile and multiplies them with `vdpbf16ps`; other x (fp32, or CPUs without it) dequantize the
weight tile by tile into a float panel for the float GEMM. Without the compiled kernels torch
dequantizes (slow, correct: a reference for the tests and a fallback). `quantize_model_int8`
puts a float checkpoint's matrices into the 8-bit layout (`quantization="int8"`).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

MATVEC_MAX_ROWS = 8
"""Rows of x up to which the matrix-vector kernel beats dequantize-then-GEMM (measured: docs/architecture.md)."""
LEFT_PANEL_MAX_ROWS = 16
"""Rows of x up to which the dequantized tile is the GEMM's left operand (`_panel_matmul`); above
it, the right one, as `F.linear` takes a weight (measured: docs/architecture.md)."""
PANEL_BYTES = 8 << 20
"""Largest float panel one dequantized weight tile fills: it stays in the last-level cache. Tiles
that fit L2 (256 KB-2 MB) were slower: per-call GEMM overhead outweighs the hotter panel
(measured: docs/architecture.md)."""


@dataclass(frozen=True)
class QuantizedWeight:
    """An (N, K) weight as codes and float16 scales (and mins) per `group` inputs of each row."""

    bits: int  # 4: uint8 codes (N, K/2), two per byte; 8: int8 codes (N, K)
    group: int  # inputs per scale: 32, or 16 (8 bits only)
    codes: torch.Tensor
    scales: torch.Tensor  # float16 (N, K / group)
    mins: torch.Tensor | None  # float16 (N, K / group), or None: w = scale * q

    @functools.cached_property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape[0], self.codes.shape[1] * (2 if self.bits == 4 else 1)

    @functools.cached_property
    def kernel_args(self) -> tuple:
        """bits, codes, scales, mins (pointers; the tensors never change) and the group, as the
        cpu_quant.c entry points take them: worked out once, not at every call of a decode step."""
        mins = None if self.mins is None else self.mins.data_ptr()
        return self.bits, self.codes.data_ptr(), self.scales.data_ptr(), mins, self.group

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.mins) if t is not None)

    def int_codes(self) -> torch.Tensor:
        """(N, K) codes as int8 in input order."""
        if self.bits == 8:
            return self.codes
        rows, half = self.codes.shape
        blocks = self.codes.view(rows, half // 16, 16)  # byte j: input j (low), input j + 16 (high)
        return torch.cat([blocks & 15, blocks >> 4], dim=-1).view(rows, half * 2).to(torch.int8)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float (N, K) weight: torch ops, the reference the kernels are tested against."""
        scales = self.scales.float().repeat_interleave(self.group, dim=1)
        weight = self.int_codes().float() * scales
        if self.mins is not None:
            weight += self.mins.float().repeat_interleave(self.group, dim=1)
        return weight.to(dtype)

    def rows(self, index: torch.Tensor) -> QuantizedWeight:
        """The rows `index` (a permutation or a slice of them), still packed."""
        pick = lambda t: None if t is None else t.index_select(0, index).contiguous()  # noqa: E731
        return replace(self, codes=pick(self.codes), scales=pick(self.scales), mins=pick(self.mins))

    def as_8bit(self, group: int) -> QuantizedWeight:
        """The same weights in the 8-bit layout with `group` (<= this group) inputs per scale:
        lossless; lets row blocks of different types share one merged weight."""
        repeat = self.group // group
        scales = self.scales.repeat_interleave(repeat, dim=1)
        mins = torch.zeros_like(scales) if self.mins is None else self.mins.repeat_interleave(repeat, dim=1)
        return QuantizedWeight(8, group, self.int_codes().contiguous(), scales, mins)

    @staticmethod
    def from_float(weight: torch.Tensor, group: int = 32) -> QuantizedWeight:
        """Weight-only int8 with a float16 scale per `group` inputs (amax / 127, round to nearest):
        `quantization="int8"` for float checkpoints, on the same kernels as GGUF's Q8_0."""
        rows, cols = weight.shape
        blocks = weight.detach().float().reshape(rows, cols // group, group)
        scales = (blocks.abs().amax(dim=-1) / 127).half()  # (N, K / group)
        inverse = torch.where(scales > 0, 1 / scales.float(), torch.zeros(()))
        codes = torch.round(blocks * inverse.unsqueeze(-1)).clamp(-127, 127).to(torch.int8).reshape(rows, cols)
        return QuantizedWeight(8, group, codes, scales, None)

    @staticmethod
    def cat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """Row blocks stacked into one weight (q|k|v, gate|up); mixed layouts meet in the 8-bit one."""
        if len({(p.bits, p.group, p.mins is None) for p in parts}) > 1:
            group = min(p.group for p in parts)
            parts = [p.as_8bit(group) for p in parts]
        first = parts[0]
        mins = None if first.mins is None else torch.cat([p.mins for p in parts])
        return replace(first, codes=torch.cat([p.codes for p in parts]), scales=torch.cat([p.scales for p in parts]),
                       mins=mins)


def quant_linear(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None, ops) -> torch.Tensor:
    """x (M, K) @ W^T (+ bias) -> (M, N) in x's dtype; `ops` is the compiled `CpuOps` or None."""
    if ops is None or not ops.supports(x):
        return F.linear(x, weight.dequantize(x.dtype), bias)
    if x.shape[0] <= MATVEC_MAX_ROWS:
        y = ops.quant_matmul(weight, x)  # (M, N)
    elif x.dtype == torch.bfloat16 and ops.uses_quant_gemm_bf16:
        # no panel through memory: 0.3-0.9x the panel path's time at 9-512 rows (docs/architecture.md)
        y = ops.quant_gemm_bf16(weight, x)  # (M, N)
    else:
        y = _panel_matmul(x, weight, ops)
    return y if bias is None else y.add_(bias)


def _panel_matmul(x: torch.Tensor, weight: QuantizedWeight, ops) -> torch.Tensor:
    """x (M, K) @ W^T, W dequantized tile by tile. Up to `LEFT_PANEL_MAX_ROWS` rows each tile is
    the GEMM's left operand, (count, K) @ x^T into rows of a (N, M) result: oneDNN reads a left
    operand as it is, where as the right one (`F.linear(x, tile)`) it repacks the tile on every
    call, which costs most when x is short; only x is repacked, and the result is transposed once
    at the end. With more rows the transpose costs more than the repacking saves."""
    rows, (n, k) = x.shape[0], weight.shape
    tile = min(n, max(16, PANEL_BYTES // (k * x.element_size())))
    if rows > LEFT_PANEL_MAX_ROWS:
        if tile == n:
            return F.linear(x, ops.quant_dequant(weight, 0, n, x.dtype))
        y = torch.empty((rows, n), dtype=x.dtype)  # (M, N)
        for first in range(0, n, tile):
            count = min(tile, n - first)
            y[:, first:first + count] = F.linear(x, ops.quant_dequant(weight, first, count, x.dtype))
        return y
    y_t = torch.empty((n, rows), dtype=x.dtype)  # (N, M)
    x_t = x.t()  # (K, M)
    for first in range(0, n, tile):
        count = min(tile, n - first)
        torch.mm(ops.quant_dequant(weight, first, count, x.dtype), x_t, out=y_t[first:first + count])
    return y_t.t().contiguous()  # (M, N)


def quant_embedding(ids: torch.Tensor, weight: QuantizedWeight, dtype: torch.dtype, ops) -> torch.Tensor:
    """Rows `ids` (T,) of W as (T, K) floats: the packed embedding's lookup."""
    if ops is None or dtype not in (torch.float32, torch.bfloat16):
        return weight.rows(ids).dequantize(dtype)
    return ops.quant_rows(weight, ids, dtype)


def quantize_model_int8(model: torch.nn.Module) -> int:
    """Replace every float matrix that a packed kernel can take (linear layers, the embedding and
    LM head; inputs a multiple of 32) by its int8 form; returns how many. Tied weights stay tied."""
    done: dict[int, QuantizedWeight] = {}
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if not hasattr(module, "keep_packed") or module.quant is not None or weight is None or weight.dim() != 2:
            continue
        if weight.shape[1] % 32 or weight.numel() == 0:
            continue
        key = id(weight)
        if key not in done:
            done[key] = QuantizedWeight.from_float(weight)
        module.keep_packed(done[key])
    return len(done)
