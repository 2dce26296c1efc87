"""Load a GGUF checkpoint as if it were a Hugging Face one: config dict and weights (its tokenizer:
`nanovllm.models.tokenizer`).

The model code only knows HF names and layouts, so this module is the one place that speaks GGUF:
it turns llama.cpp metadata into an HF-style `config.json` dict, renames tensors to HF names,
dequantizes them to float32 in HF's [out_features, in_features] shape, and undoes llama.cpp's
rotary permutation of the Llama Q/K projections. With `packed=True` (the CPU engine with its
compiled kernels) matrices of the types models/gguf_quant.py maps stay quantized instead, as
`QuantizedWeight`s in the same HF shape and row order. Weights are yielded one tensor at a time from
the memory-mapped file, so loading never holds a second full copy of the model. The header and
config come from `nanovllm.models.gguf_header`, which imports no torch.
"""
from __future__ import annotations

import logging
import mmap
import re
from collections.abc import Iterator

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from nanovllm.layers.quant import QuantizedWeight
from nanovllm.models.gguf_header import _GGUFHeader, _read_header, _TensorInfo, read_gguf_config

_GLOBAL_TENSOR_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_TENSOR_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_FLOAT_TYPES = frozenset({GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16})
logger = logging.getLogger(__name__)


def _hf_tensor_name(gguf_name: str) -> str:
    """HF name of a GGUF tensor: `blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`."""
    base, _, suffix = gguf_name.rpartition(".")
    if base in _GLOBAL_TENSOR_NAMES and suffix == "weight":
        return f"{_GLOBAL_TENSOR_NAMES[base]}.weight"
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match and match.group(2) in _LAYER_TENSOR_NAMES:
        layer, part, kind = match.groups()
        return f"model.layers.{layer}.{_LAYER_TENSOR_NAMES[part]}.{kind}"
    # e.g. `rope_freqs.weight` (Llama 3.1 rope scaling): silently dropping it would change the model.
    raise ValueError(f"GGUF tensor {gguf_name!r} has no counterpart in the supported HF models")


def _unpermute_rotary(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's converter permutation of a Llama Q or K projection (rows or bias).

    HF rotates each head's halves (x[:d/2], x[d/2:]); llama.cpp rotates interleaved pairs, so its
    converter reorders each head's rows from [first half, second half] to pairs
    (`reshape(heads, 2, d/2).swapaxes(1, 2)`). The inverse splits rows as (heads, d/2, 2).
    """
    head_half = weight.shape[0] // num_heads // 2
    per_head = weight.reshape(num_heads, head_half, 2, *weight.shape[1:])  # (H, d/2, 2, in)
    return per_head.swapaxes(1, 2).reshape(weight.shape)  # (H*d, in)


def _to_float32_tensor(data: np.ndarray) -> torch.Tensor:
    array = np.asarray(data, dtype=np.float32)
    # F32 tensors come back as read-only views of the memory map; torch needs its own memory.
    if not array.flags.writeable or not array.flags.c_contiguous:
        array = np.array(array, dtype=np.float32, order="C")
    return torch.from_numpy(array)


def iter_gguf_weights(path: str, packed: bool = False) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """(HF name, float32 tensor in HF shape) for every tensor, dequantized one at a time; with
    `packed`, matrices of a packed type come as `QuantizedWeight`s instead.

    The file and its architecture are checked on the call, not on the first `next()`.
    """
    config = read_gguf_config(path)
    # Only Llama files were permuted by llama.cpp's converter; llama.cpp runs Qwen2/Qwen3 with
    # NEOX-style rotary, which is already HF's layout.
    rotary_heads = (
        {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
        if config["model_type"] == "llama"
        else {}
    )
    header = _read_header(path)
    # Map every name up front so an unknown tensor fails before anything is copied into a model.
    hf_names = {gguf_name: _hf_tensor_name(gguf_name) for gguf_name in header.tensors}
    if packed:
        _log_unpacked_types(header)
    return _dequantized_tensors(path, header, hf_names, rotary_heads, packed)


def _keeps_packed(info: _TensorInfo) -> bool:
    from nanovllm.models.gguf_quant import PACKED_TYPES

    return info.tensor_type in PACKED_TYPES and len(info.shape) == 2 and info.shape[0] % 32 == 0


def _log_unpacked_types(header: _GGUFHeader) -> None:
    """One line per quantized type that loads as float for want of a packed kernel."""
    unpacked: dict[str, int] = {}
    for info in header.tensors.values():
        if info.tensor_type not in _FLOAT_TYPES and not _keeps_packed(info):
            name = GGMLQuantizationType(info.tensor_type).name
            unpacked[name] = unpacked.get(name, 0) + 1
    for name, count in sorted(unpacked.items()):
        logger.info("GGUF type %s (%d tensors) has no packed kernel: dequantized to float at load", name, count)


def _dequantized_tensors(
    path: str, header: _GGUFHeader, hf_names: dict[str, str], rotary_heads: dict[str, int], packed: bool
) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    # Tensor bytes are read straight from a memory map at the offsets the header gives; this
    # skips GGUFReader's ~6 s of per-field numpy views on every engine start.
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as buffer:
        for gguf_name, info in header.tensors.items():
            part = gguf_name.split(".")[2] if gguf_name.startswith("blk.") else ""
            start, heads = header.data_start + info.offset, rotary_heads.get(part)
            if packed and _keeps_packed(info):
                yield hf_names[gguf_name], _load_packed(buffer, start, info, heads)
            else:
                yield hf_names[gguf_name], _load_tensor(buffer, start, info, heads)


def _load_packed(buffer: mmap.mmap, start: int, info: _TensorInfo, rotary_heads: int | None) -> QuantizedWeight:
    """A packed matrix in HF layout: the rotary permutation moves whole rows, so it applies as is."""
    from nanovllm.models.gguf_quant import to_quantized

    weight = to_quantized(_raw_rows(buffer, start, info), info.tensor_type)
    if rotary_heads is not None:
        weight = weight.rows(torch.from_numpy(_unpermute_rotary(np.arange(weight.shape[0]), rotary_heads).copy()))
    return weight


def _load_tensor(buffer: mmap.mmap, start: int, info: _TensorInfo, rotary_heads: int | None) -> torch.Tensor:
    """An owning float32 tensor (no view may outlive the memory map), HF layout."""
    weight = _dequantize(buffer, start, info)  # (out_features, in_features)
    if rotary_heads is not None:
        weight = _unpermute_rotary(weight, rotary_heads)
    tensor = _to_float32_tensor(weight)
    if not tensor.is_contiguous() or np.shares_memory(weight, np.frombuffer(buffer, dtype=np.uint8)):
        tensor = tensor.clone()
    return tensor


def _dequantize(buffer: mmap.mmap, start: int, info: _TensorInfo) -> np.ndarray:
    """One tensor as a float array in numpy order (GGUF's shape reversed)."""
    weight = dequantize(_raw_rows(buffer, start, info), GGMLQuantizationType(info.tensor_type))
    return weight.reshape(tuple(reversed(info.shape)))


def _raw_rows(buffer: mmap.mmap, start: int, info: _TensorInfo) -> np.ndarray:
    """The tensor's bytes as (rows, row_bytes) uint8, a view of the memory map."""
    block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(info.tensor_type)]
    row_elements = info.shape[0]
    if row_elements % block_size:
        raise ValueError(f"GGUF tensor row of {row_elements} elements is not a whole number of blocks")
    num_rows = int(np.prod(info.shape[1:], dtype=np.int64))
    row_bytes = row_elements // block_size * type_size
    return np.frombuffer(buffer, dtype=np.uint8, count=num_rows * row_bytes, offset=start).reshape(num_rows, row_bytes)
