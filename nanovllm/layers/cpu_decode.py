"""The one-call decode path on CPU: every decoder layer of a small decode step in one C call.

At batch 1 the per-op path (models/decoder.py) spends about as long in Python, calling nine
compiled ops per layer, as the ops take. `CpuDecode` builds once a ctypes table of each layer's
pointers (packed weights, norms, biases, KV cache) and hands a step to `decode_layers` of
cpu_decode.c, which drives the same kernels in the same order: the hidden states are bit for bit
those of the per-op path. `DecoderModel.forward` takes it for steps it serves (`serves`): CPU,
float32 or bfloat16, decode rows only, at most `MAX_ROWS` of them, with the compiled attention
kernel; the model qualifies (`build`) when every linear weight is packed (GGUF, or
`quantization="int8"`) on one rank. NANOVLLM_CPU_DECODE=0 turns it off (read at each step, for A/B).
"""
# [ZH-START]
# 【模块定位】CPU 上解码步的"一次调用"路径（Python 侧）：
# 把所有层交给 cpu_decode.c 的 decode_layers。
# build：模型加载、KV cache 分配之后第一次遇到解码步时建一次每层指针表（ctypes 结构体数组），
#   要求每个线性层都是打包权重（QuantizedWeight）、单 rank；不满足返回 None，走逐算子路径。
# serves：本步能否走这条路——CPU、fp32/bf16、全是 decode 行且 T <= MAX_ROWS、有编译的注意力核、
#   NANOVLLM_CPU_DECODE 不是 "0"。
# __call__：每步只传本步数据（词嵌入、positions、slot_mapping、块表、上下文长度），
#   返回 final norm 后的 (T, C)。
# [ZH-END]
from __future__ import annotations

import ctypes
import os

import torch

from nanovllm.layers.cpu_kernels import _load_library

MAX_ROWS = 8
"""Decode rows up to which a step takes this path: the packed matrix-vector kernel's range
(layers/quant.py MATVEC_MAX_ROWS); larger batches are bound by the GEMMs, not by Python."""
ENABLE_ENV = "NANOVLLM_CPU_DECODE"

_P, _I = ctypes.c_void_p, ctypes.c_int64


class _PackedMatrix(ctypes.Structure):
    _fields_ = [("bits", _I), ("group", _I), ("n", _I), ("k", _I), ("codes", _P), ("scales", _P), ("mins", _P)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _P), ("post_norm", _P), ("q_norm", _P), ("k_norm", _P), ("qkv_bias", _P),
                ("k_cache", _P), ("v_cache", _P), ("qkv", _PackedMatrix), ("o", _PackedMatrix),
                ("gate_up", _PackedMatrix), ("down", _PackedMatrix)]


class _Model(ctypes.Structure):
    _fields_ = [("num_layers", _I), ("hidden", _I), ("heads", _I), ("kv_heads", _I), ("head_dim", _I),
                ("inter", _I), ("block_size", _I), ("eps", ctypes.c_double), ("qk_eps", ctypes.c_double),
                ("scale", ctypes.c_double), ("final_norm", _P), ("cos_cache", _P), ("sin_cache", _P),
                ("layers", ctypes.POINTER(_Layer))]


def enabled() -> bool:
    return os.environ.get(ENABLE_ENV, "1") != "0"


def _matrix(linear) -> _PackedMatrix:
    bits, codes, scales, mins, group = linear.quant.kernel_args
    n, k = linear.quant.shape
    return _PackedMatrix(bits, group, n, k, codes, scales, mins)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _packed(model) -> bool:
    """Every linear weight packed, on one rank, with shapes the kernels take."""
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if any(lin.quant is None or lin.tp.size != 1 for lin in linears) or attn.o_proj.bias is not None:
            return False
        if mlp.down_proj.bias is not None or mlp.gate_up_proj.bias is not None:
            return False
    return len(model.layers) > 0


class CpuDecode:
    # [ZH-START]
    # 【职责】持有一个模型的每层指针表和它引用的张量，每个解码步一次 ctypes 调用跑完所有层。
    # 【边界】不管词嵌入和 LM head；不检查权重是否变化（加载后权重不变）；KV cache 换了（runner
    #   重新分配）时由 fresh() 发现，调用方重建。
    # [ZH-END]
    def __init__(self, lib: ctypes.CDLL, model):
        self._fn = lib.decode_layers
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [ctypes.POINTER(_Model), _P, _P, _I, _P, _P, _P, _I, _P, _P, _I]
        first = model.layers[0]
        attn = first.self_attn
        self._k_cache = attn.attn.k_cache  # the cache tensors this table points into
        self._dtype = model.norm.weight.dtype
        rows = []
        for layer in model.layers:
            a, mlp = layer.self_attn, layer.mlp
            rows.append(_Layer(
                _ptr(layer.input_layernorm.weight), _ptr(layer.post_attention_layernorm.weight),
                _ptr(None if a.q_norm is None else a.q_norm.weight), _ptr(None if a.k_norm is None else a.k_norm.weight),
                _ptr(a.qkv_proj.bias), _ptr(a.attn.k_cache), _ptr(a.attn.v_cache), _matrix(a.qkv_proj),
                _matrix(a.o_proj), _matrix(mlp.gate_up_proj), _matrix(mlp.down_proj)))
        self._layers = (_Layer * len(rows))(*rows)
        self._model = _Model(
            len(rows), model.norm.weight.shape[0], attn.num_heads, attn.num_kv_heads, attn.head_dim,
            first.mlp.down_proj.quant.shape[1], attn.attn.k_cache.shape[1], model.norm.eps,
            attn.q_norm.eps if attn.q_norm is not None else 0.0, attn.attn.scale, _ptr(model.norm.weight),
            _ptr(model.rotary.cos_cache), _ptr(model.rotary.sin_cache), self._layers)
        self._model_ref = ctypes.byref(self._model)

    @classmethod
    def build(cls, model) -> CpuDecode | None:
        """The path for `model` (a `DecoderModel` whose caches are allocated), or None where it
        does not qualify: a float or split weight, norms of different eps, no compiled library."""
        if not _packed(model) or any(layer.self_attn.attn.k_cache.dim() != 4 for layer in model.layers):
            return None
        eps = {model.norm.eps} | {n.eps for layer in model.layers
                                  for n in (layer.input_layernorm, layer.post_attention_layernorm)}
        qk = {(a.q_norm is None, a.k_norm is None) for a in (layer.self_attn for layer in model.layers)}
        if len(eps) > 1 or len(qk) > 1:
            return None
        lib = _load_library()
        return None if lib is None else cls(lib, model)

    @staticmethod
    def serves(hidden: torch.Tensor, meta) -> bool:
        """Whether this step can take the path (the model aside): a small decode-only CPU step."""
        rows = hidden.shape[0]
        return (0 < rows <= MAX_ROWS and meta.num_decode == rows and not meta.prefills and meta.decode_rows is not None
                and hidden.device.type == "cpu" and hidden.dtype in (torch.float32, torch.bfloat16) and enabled())

    def fresh(self, model) -> bool:
        """False once the runner has given the layers another KV cache (the table points into the old one)."""
        return model.layers[0].self_attn.attn.k_cache is self._k_cache

    def __call__(self, hidden: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        """hidden (T, C): the step's embeddings, used in place as the residual stream; returns the
        final norm's output (T, C), as `DecoderModel.forward` does."""
        if hidden.dtype != self._dtype or not hidden.is_contiguous():
            raise TypeError(f"the one-call decode path takes contiguous {self._dtype} rows, got {hidden.dtype}")
        indices = (positions, meta.slot_mapping, meta.decode_block_tables, meta.decode_rows, meta.decode_context_lens)
        rows = hidden.shape[0]
        if any(t.dtype != torch.int64 or not t.is_contiguous() for t in indices) or any(
                t.shape[0] != rows for t in indices):
            raise TypeError(f"the one-call decode path takes contiguous int64 positions, slots and tables of "
                            f"{rows} rows, one per decode row")
        out = torch.empty_like(hidden)
        tables = meta.decode_block_tables  # (T, max_blocks) int64, like the other index tensors
        failed = self._fn(self._model_ref, hidden.data_ptr(), out.data_ptr(), rows, positions.data_ptr(),
                          meta.slot_mapping.data_ptr(), tables.data_ptr(), tables.shape[1], meta.decode_rows.data_ptr(),
                          meta.decode_context_lens.data_ptr(), int(hidden.dtype == torch.bfloat16))
        if failed == -2:
            raise ValueError("a packed weight or head size the decode kernels do not take")
        if failed:
            raise MemoryError("the one-call decode path could not allocate its scratch memory")
        return out
