"""Load a GGUF checkpoint as if it were a Hugging Face one: config dict and weights (its tokenizer:
`nanovllm.models.tokenizer`).

The model code only knows HF names and layouts, so this module is the one place that speaks GGUF:
it turns llama.cpp metadata into an HF-style `config.json` dict, renames tensors to HF names,
dequantizes them to float32 in HF's [out_features, in_features] shape, and undoes llama.cpp's
rotary permutation of the Llama Q/K projections. With `packed=True` (the CPU engine with its
compiled kernels) matrices of the types models/gguf_quant.py maps stay quantized instead, as
`QuantizedWeight`s in the same HF shape and row order. Weights are yielded one tensor at a time from
the memory-mapped file, so loading never holds a second full copy of the model. The config is
read by a small header parser instead of `GGUFReader`, which is ~50x slower on metadata.
"""
from __future__ import annotations

import logging
import mmap
import os
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGUF_MAGIC, GGMLQuantizationType, GGUFValueType
from gguf.quants import dequantize

from nanovllm.layers.quant import QuantizedWeight

# GGUF `general.architecture` -> HF `architectures[0]`; the model_type is the GGUF name itself.
_HF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

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
_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H", GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i", GGUFValueType.UINT64: "Q", GGUFValueType.INT64: "q",
    GGUFValueType.FLOAT32: "f", GGUFValueType.FLOAT64: "d", GGUFValueType.BOOL: "?",
}
_MIN_HEADER_BYTES = 24  # magic, version, tensor count, metadata count
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_FLOAT_TYPES = frozenset({GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16})
logger = logging.getLogger(__name__)


def check_gguf_file(path: str) -> None:
    """FileNotFoundError naming `path` unless it is a file."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")


@dataclass(frozen=True)
class _TensorInfo:
    shape: tuple[int, ...]  # GGUF order: fastest-varying dimension first
    tensor_type: int
    offset: int  # from the start of the data section


@dataclass(frozen=True)
class _GGUFHeader:
    metadata: dict[str, Any]
    tensors: dict[str, _TensorInfo]
    data_start: int  # file offset of the (aligned) tensor data section

    @property
    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: info.shape for name, info in self.tensors.items()}


class _Cursor:
    """Sequential little-endian reads over the file's header bytes."""

    def __init__(self, buffer: mmap.mmap) -> None:
        self.buffer, self.offset = buffer, 0

    def read(self, fmt: str) -> Any:
        (value,) = struct.unpack_from("<" + fmt, self.buffer, self.offset)
        self.offset += struct.calcsize(fmt)
        return value

    def read_str(self) -> str:
        length = self.read("Q")
        self.offset += length
        return self.buffer[self.offset - length : self.offset].decode("utf-8", errors="replace")

    def read_value(self, value_type: int) -> Any:
        """A scalar or string value; arrays (the tokenizer's vocabulary) are skipped as None."""
        if value_type == GGUFValueType.STRING:
            return self.read_str()
        if value_type == GGUFValueType.ARRAY:
            self.skip_array()
            return None
        if value_type not in _SCALAR_FORMATS:
            raise ValueError(f"unknown GGUF metadata value type {value_type}")
        return self.read(_SCALAR_FORMATS[value_type])

    def skip_array(self) -> None:
        item_type, count = self.read("I"), self.read("Q")
        if item_type in _SCALAR_FORMATS:
            self.offset += count * struct.calcsize(_SCALAR_FORMATS[item_type])
            return
        for _ in range(count):  # strings or nested arrays: each carries its own length
            if item_type == GGUFValueType.STRING:
                length = self.read("Q")
                self.offset += length
            else:
                self.skip_array()


def _read_header(path: str) -> _GGUFHeader:
    """Metadata and tensor shapes, without the per-value numpy views GGUFReader builds.

    GGUFReader takes ~6 s on the default model because it makes numpy views of each of the ~100k
    tokenizer strings; plain struct reads take ~0.1 s, which matters because the config is read
    at every engine start and in every process that needs it.
    """
    check_gguf_file(path)
    if os.path.getsize(path) < _MIN_HEADER_BYTES:  # mmap refuses empty files with a vague error
        raise ValueError(f"{path} is too small to be a GGUF file")
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as buffer:
        try:
            return _parse_header(_Cursor(buffer), path)
        except struct.error as exc:
            raise ValueError(f"{path} is truncated or not a GGUF file") from exc


def _parse_header(cursor: _Cursor, path: str) -> _GGUFHeader:
    magic, version = cursor.read("I"), cursor.read("I")
    if magic != GGUF_MAGIC or version not in (2, 3):
        raise ValueError(f"{path} is not a little-endian GGUF v2/v3 file (magic {magic:#x}, version {version})")
    num_tensors, num_fields = cursor.read("Q"), cursor.read("Q")
    metadata = {}
    for _ in range(num_fields):
        key = cursor.read_str()
        metadata[key] = cursor.read_value(cursor.read("I"))
    tensors = {}
    for _ in range(num_tensors):
        name = cursor.read_str()
        shape = tuple(cursor.read("Q") for _ in range(cursor.read("I")))
        tensors[name] = _TensorInfo(shape, cursor.read("I"), cursor.read("Q"))
    alignment = metadata.get("general.alignment") or 32
    data_start = -(-cursor.offset // alignment) * alignment
    return _GGUFHeader(metadata, tensors, data_start)


def _hf_architecture(gguf_arch: str) -> str:
    """The HF class name for a GGUF architecture; ValueError for ones the engine has no model for."""
    if gguf_arch not in _HF_ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {gguf_arch!r}; supported: {', '.join(_HF_ARCHITECTURES)}"
        )
    return _HF_ARCHITECTURES[gguf_arch]


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


def _required(metadata: dict[str, Any], key: str) -> Any:
    if key not in metadata:
        raise ValueError(f"GGUF metadata lacks {key!r}, which the model config needs")
    return metadata[key]


def _rope_scaling(metadata: dict[str, Any], arch: str) -> dict | None:
    rope_type = metadata.get(f"{arch}.rope.scaling.type")
    if rope_type in (None, "none"):
        return None
    scaling: dict[str, Any] = {"rope_type": rope_type, "factor": metadata.get(f"{arch}.rope.scaling.factor")}
    original = metadata.get(f"{arch}.rope.scaling.original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = original
    return scaling


def read_gguf_metadata(path: str) -> dict[str, Any]:
    """The file's metadata (key -> value), read by the header parser alone."""
    return _read_header(path).metadata


def read_gguf_config(path: str) -> dict:
    """An HF-style config dict (as in `config.json`) built from the GGUF metadata."""
    header = _read_header(path)
    meta, shapes = header.metadata, header.tensor_shapes
    arch = _required(meta, "general.architecture")
    architecture = _hf_architecture(arch)
    hidden = _required(meta, f"{arch}.embedding_length")
    num_heads = _required(meta, f"{arch}.attention.head_count")
    # Older files omit vocab_size; the embedding's row count is what the weights need anyway
    # (GGUF lists dimensions fastest-first, so the row count is the last entry).
    vocab = meta.get(f"{arch}.vocab_size") or shapes.get("token_embd.weight", (None,))[-1]
    if vocab is None:
        raise ValueError(f"{path} has neither {arch}.vocab_size nor a token_embd.weight tensor")
    return {
        "architectures": [architecture],
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": _required(meta, f"{arch}.feed_forward_length"),
        "num_hidden_layers": _required(meta, f"{arch}.block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": meta.get(f"{arch}.attention.head_count_kv", num_heads),
        # Qwen3 decouples head_dim from hidden/heads and records it as the key length.
        "head_dim": meta.get(f"{arch}.attention.key_length", hidden // num_heads),
        "rms_norm_eps": float(_required(meta, f"{arch}.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(meta, arch),
        "max_position_embeddings": _required(meta, f"{arch}.context_length"),
        "vocab_size": vocab,
        "tie_word_embeddings": "output.weight" not in shapes,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "attention_bias": arch == "qwen2" or "blk.0.attn_q.bias" in shapes,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }


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
