"""GGUF tensors of every packed type, for tests: quantized by `gguf` where it can, hand-made blocks
for the K-quants (gguf has no quantizer for them)."""
from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T
from gguf.quants import quantize

K_QUANTS = (T.Q4_K, T.Q5_K, T.Q6_K)


def gguf_rows(qtype: T, rows: int, cols: int, seed: int) -> np.ndarray:
    """(rows, row_bytes) of a GGUF tensor: quantized by gguf where it can, else random blocks
    with small float16 super-block scales (every bit pattern of the rest is a valid block)."""
    rng = np.random.default_rng(seed)
    if qtype not in K_QUANTS:
        return quantize(rng.standard_normal((rows, cols), dtype=np.float32) * 0.1, qtype)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // block_size * type_size), dtype=np.uint8)
    blocks = raw.reshape(-1, type_size)
    scale_fields = {T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}[qtype]
    for offset in scale_fields:
        blocks[:, offset:offset + 2] = rng.uniform(2e-4, 1e-3, (len(blocks), 1)).astype(np.float16).view(np.uint8)
    return raw
