"""GGUF quantized blocks -> the packed layouts of layers/quant.py, without a float copy.

Each function takes one tensor's raw rows (rows, row_bytes) as uint8 and returns a
`QuantizedWeight` whose `dequantize()` equals `gguf.quants.dequantize` of the same bytes, up to
the float16 rounding of the K-quants' combined scales (super-block scale x 6- or 8-bit sub-block
scale, relative 2^-12). The element orders follow gguf's own numpy dequantizers.
"""
from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from nanovllm.layers.quant import QuantizedWeight

_QK_K = 256  # inputs per K-quant super-block


def _f16(column: np.ndarray) -> np.ndarray:
    """Two bytes per row as float16 (rows,)."""
    return np.ascontiguousarray(column).view(np.float16).reshape(-1)


def _tensor(array: np.ndarray, rows: int) -> torch.Tensor:
    """An owning tensor: the input may be a view of the file's memory map."""
    return torch.from_numpy(np.array(array, order="C").reshape(rows, -1))


def _pack_nibbles(values: np.ndarray) -> np.ndarray:
    """(..., 32) codes 0..15 of one group -> (..., 16) bytes: input j low, input j + 16 high."""
    return values[..., :16] | (values[..., 16:] << np.uint8(4))


def _q4_0(raw: np.ndarray, rows: int) -> QuantizedWeight:
    blocks = raw.reshape(-1, 18)
    d = _f16(blocks[:, :2])
    return QuantizedWeight(4, 32, _tensor(blocks[:, 2:], rows), _tensor(d, rows), _tensor(d * np.float16(-8), rows))


def _q4_1(raw: np.ndarray, rows: int) -> QuantizedWeight:
    blocks = raw.reshape(-1, 20)
    return QuantizedWeight(4, 32, _tensor(blocks[:, 4:], rows), _tensor(_f16(blocks[:, :2]), rows),
                           _tensor(_f16(blocks[:, 2:4]), rows))


def _q8_0(raw: np.ndarray, rows: int) -> QuantizedWeight:
    blocks = raw.reshape(-1, 34)
    return QuantizedWeight(8, 32, _tensor(blocks[:, 2:].view(np.int8), rows), _tensor(_f16(blocks[:, :2]), rows), None)


def _k_scales(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K / Q5_K super-block header: float16 scale and min per group of 32, and the rest."""
    from gguf.quants import Q4_K

    d = _f16(blocks[:, :2]).astype(np.float32)[:, None]
    dmin = _f16(blocks[:, 2:4]).astype(np.float32)[:, None]
    sc, m = Q4_K.get_scale_min(blocks[:, 4:16])
    return (d * sc).astype(np.float16), (-(dmin * m)).astype(np.float16), blocks[:, 16:]


def _low_high_nibbles(qs: np.ndarray) -> np.ndarray:
    """K-quant 4-bit codes (n, 128) -> (n, 8, 32) in input order: each 32 bytes hold 64 inputs,
    the first 32 in the low nibbles."""
    shifted = qs.reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (shifted & np.uint8(15)).reshape(-1, 8, 32)


def _q4_k(raw: np.ndarray, rows: int) -> QuantizedWeight:
    scales, mins, qs = _k_scales(raw.reshape(-1, 144))
    return QuantizedWeight(4, 32, _tensor(_pack_nibbles(_low_high_nibbles(qs)), rows), _tensor(scales, rows),
                           _tensor(mins, rows))


def _q5_k(raw: np.ndarray, rows: int) -> QuantizedWeight:
    scales, mins, rest = _k_scales(raw.reshape(-1, 176))
    qh, qs = rest[:, :32], rest[:, 32:]
    high = (qh.reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & np.uint8(1)  # (n, 8, 32)
    codes = (_low_high_nibbles(qs) | (high << np.uint8(4))).view(np.int8)
    return QuantizedWeight(8, 32, _tensor(codes, rows), _tensor(scales, rows), _tensor(mins, rows))


def _q6_k(raw: np.ndarray, rows: int) -> QuantizedWeight:
    blocks = raw.reshape(-1, 210)
    ql, qh, sc = blocks[:, :128], blocks[:, 128:192], blocks[:, 192:208].view(np.int8)
    d = _f16(blocks[:, 208:210]).astype(np.float32)[:, None]
    low = (ql.reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & np.uint8(15)
    high = (qh.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & np.uint8(3)
    codes = (low.reshape(-1, 8, 32) | (high.reshape(-1, 8, 32) << np.uint8(4))).astype(np.int8) - np.int8(32)
    return QuantizedWeight(8, 16, _tensor(codes, rows), _tensor((d * sc).astype(np.float16), rows), None)


_CONVERTERS = {T.Q4_0: _q4_0, T.Q4_1: _q4_1, T.Q8_0: _q8_0, T.Q4_K: _q4_k, T.Q5_K: _q5_k, T.Q6_K: _q6_k}
PACKED_TYPES = frozenset(_CONVERTERS)


def to_quantized(raw: np.ndarray, qtype: int) -> QuantizedWeight:
    """One GGUF tensor's rows (rows, row_bytes) of a type in `PACKED_TYPES`, packed."""
    return _CONVERTERS[T(qtype)](raw, raw.shape[0])
