"""Read a GGUF file's header: its metadata and tensor table, and the HF-style config built from them.

Torch-free on purpose: the tokenizer and detokenizer stages read a GGUF file's context length and
tokenizer metadata through this module without importing torch (`nanovllm.models.gguf_loader` turns
the tensors into weights). A small struct parser instead of `GGUFReader`, which is ~50x slower on
metadata.
"""
# [ZH-START]
# 【模块定位】GGUF 文件头：元数据和张量表，以及由它们拼出的 HF 风格配置；不导入 torch。
# 分词阶段读上下文长度、首次转换分词器时读聊天模板都经过这里；gguf_loader.py 用它读张量位置。
# [ZH-END]
from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

from gguf import GGUF_MAGIC, GGUFValueType

# GGUF `general.architecture` -> HF `architectures[0]`; the model_type is the GGUF name itself.
_HF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H", GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i", GGUFValueType.UINT64: "Q", GGUFValueType.INT64: "q",
    GGUFValueType.FLOAT32: "f", GGUFValueType.FLOAT64: "d", GGUFValueType.BOOL: "?",
}
_MIN_HEADER_BYTES = 24  # magic, version, tensor count, metadata count
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
