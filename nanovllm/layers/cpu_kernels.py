"""The compiled CPU kernels: built with the system C compiler, called through ctypes.

- `cpu_attention.c`: paged attention that reads the cache in place, where the torch path must
  first gather every sequence's blocks into a padded copy.
- `cpu_ops.c`: the decoder's elementwise work fused per row (RMSNorm with the residual add; q/k
  norm, rotary embedding and the KV-cache store; SiLU-and-multiply).

They are plain C with no torch headers, so they compile in about a second into one library,
cached per source and CPU. They parallelise with OpenMP and, loaded after torch, share torch's
OpenMP runtime (same libgomp.so.1 soname), so kernels and GEMMs use one thread pool. Without a
compiler, or with NANOVLLM_CPU_KERNELS=0, `load()` returns None and the torch path is used.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile

import torch

logger = logging.getLogger(__name__)
_HERE = os.path.dirname(os.path.abspath(__file__))
_SOURCES = [os.path.join(_HERE, name) for name in ("cpu_attention.c", "cpu_ops.c")]
_HEADERS = [os.path.join(_HERE, "cpu_simd.h")]
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared"]


def _cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


def _build() -> str:
    digest = hashlib.sha256(" ".join(_CFLAGS).encode() + _cpu_signature().encode())
    for path in _SOURCES + _HEADERS:
        with open(path, "rb") as f:
            digest.update(f.read())
    key = digest.hexdigest()[:16]
    cache_dir = os.environ.get("NANOVLLM_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "nanovllm")
    lib_path = os.path.join(cache_dir, f"cpu_kernels-{key}.so")
    if os.path.isfile(lib_path):
        return lib_path
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler found")
    os.makedirs(cache_dir, exist_ok=True)
    # Build under a private name, then rename: concurrent processes never load a half-written file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache_dir)
    os.close(fd)
    try:
        subprocess.run([compiler, *_CFLAGS, "-o", tmp, *_SOURCES, "-lm"], check=True, capture_output=True, text=True)
        os.replace(tmp, lib_path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib_path


def _load_library() -> ctypes.CDLL | None:
    """The compiled library, or None (with a warning) where it cannot be built here."""
    if os.environ.get("NANOVLLM_CPU_KERNELS", "1") == "0":
        return None
    try:
        return ctypes.CDLL(_build())
    except (OSError, RuntimeError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        logger.warning("CPU kernels unavailable, using the torch path: %s", detail)
        return None


class CpuAttentionKernel:
    def __init__(self, lib: ctypes.CDLL):
        self._fn = lib.paged_attention_rows_f32
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                             ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                             ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_float]

    @classmethod
    def load(cls) -> "CpuAttentionKernel | None":
        lib = _load_library()
        return None if lib is None else cls(lib)

    @staticmethod
    def supports(dtype: torch.dtype, head_dim: int) -> bool:
        """Whether the kernel can serve a model of this dtype and head size (float32, up to 256)."""
        return dtype == torch.float32 and head_dim <= 256

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 row_table: torch.Tensor, row_ctx: torch.Tensor, scale: float) -> torch.Tensor:
        """q (R, H, D) with contiguous heads; block_tables (S, max_blocks), row_table/row_ctx (R,) int64."""
        rows, num_heads, head_dim = q.shape
        if q.stride(2) != 1 or q.stride(1) != head_dim:
            q = q.contiguous()
        out = torch.empty((rows, num_heads, head_dim), dtype=q.dtype)
        _, block_size, num_kv_heads, _ = k_cache.shape
        failed = self._fn(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
                          block_tables.shape[1], row_table.data_ptr(), row_ctx.data_ptr(), out.data_ptr(), rows,
                          num_heads, num_kv_heads, head_dim, block_size, scale)
        if failed == -2:
            raise ValueError(f"the CPU attention kernel supports head_dim up to 256, got {head_dim}")
        if failed:
            raise MemoryError("CPU attention kernel could not allocate its scratch buffer")
        return out


_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class CpuOps:
    """The fused elementwise ops of `cpu_ops.c`, on float32 CPU tensors with contiguous rows."""

    def __init__(self, lib: ctypes.CDLL):
        self._rms_norm = lib.rms_norm_f32
        self._rms_norm.argtypes = [_P, _I, _P, _P, _P, _I, _I, _F]
        self._qk_norm_rope_store = lib.qk_norm_rope_store_f32
        self._qk_norm_rope_store.argtypes = [_P, _I, _I, _I, _I, _I, _P, _P, _F, _P, _P, _P, _P, _P, _P]
        self._silu_mul = lib.silu_mul_f32
        self._silu_mul.argtypes = [_P, _P, _I, _I]
        for fn in (self._rms_norm, self._qk_norm_rope_store, self._silu_mul):
            fn.restype = None

    @classmethod
    def load(cls) -> "CpuOps | None":
        lib = _load_library()
        return None if lib is None else cls(lib)

    @staticmethod
    def supports(x: torch.Tensor) -> bool:
        """2-D float32 rows on the CPU, each row contiguous."""
        return x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and x.stride(1) == 1

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
        """`weight * norm(x)`; with `residual` (contiguous, updated in place), of `residual + x`."""
        rows, dim = x.shape
        out = torch.empty((rows, dim), dtype=x.dtype)
        self._rms_norm(x.data_ptr(), x.stride(0), None if residual is None else residual.data_ptr(),
                       weight.data_ptr(), out.data_ptr(), rows, dim, eps)
        return out

    def qk_norm_rope_store(self, qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                           q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
                           cos_cache: torch.Tensor, sin_cache: torch.Tensor, positions: torch.Tensor,
                           k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> None:
        """In place on the fused (T, (H + 2 KVH) D) projection; K and V rows go to the cache slots."""
        self._qk_norm_rope_store(
            qkv.data_ptr(), qkv.shape[0], qkv.stride(0), num_heads, num_kv_heads, head_dim,
            None if q_weight is None else q_weight.data_ptr(), None if k_weight is None else k_weight.data_ptr(),
            eps, cos_cache.data_ptr(), sin_cache.data_ptr(), positions.data_ptr(), k_cache.data_ptr(),
            v_cache.data_ptr(), slots.data_ptr())

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of contiguous (T, 2 I) rows [gate | up]."""
        rows, width = gate_up.shape
        out = torch.empty((rows, width // 2), dtype=gate_up.dtype)
        self._silu_mul(gate_up.data_ptr(), out.data_ptr(), rows, width // 2)
        return out
