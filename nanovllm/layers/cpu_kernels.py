"""The compiled CPU attention kernel: build it with the system C compiler, call it through ctypes.

The kernel (`cpu_attention.c`) reads the paged cache in place, where the torch path must first
gather every sequence's blocks into a padded copy. It is plain C with no torch headers, so it
compiles in well under a second and is cached per source and CPU. It parallelises with OpenMP
and, loaded after torch, shares torch's OpenMP runtime (same libgomp.so.1 soname), so kernel and
GEMMs use one thread pool. Without a compiler, or with NANOVLLM_CPU_KERNELS=0,
`CpuAttentionKernel.load()` returns None and the torch path is used.
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
_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_attention.c")
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared"]


def _cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


def _build() -> str:
    with open(_SOURCE, "rb") as f:
        source = f.read()
    key = hashlib.sha256(source + " ".join(_CFLAGS).encode() + _cpu_signature().encode()).hexdigest()[:16]
    cache_dir = os.environ.get("NANOVLLM_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "nanovllm")
    lib_path = os.path.join(cache_dir, f"cpu_attention-{key}.so")
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
        subprocess.run([compiler, *_CFLAGS, "-o", tmp, _SOURCE, "-lm"], check=True, capture_output=True, text=True)
        os.replace(tmp, lib_path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib_path


class CpuAttentionKernel:
    def __init__(self, lib: ctypes.CDLL):
        self._fn = lib.paged_attention_rows_f32
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                             ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                             ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_float]

    @classmethod
    def load(cls) -> "CpuAttentionKernel | None":
        """The kernel, or None (with a warning) where it cannot be built here."""
        if os.environ.get("NANOVLLM_CPU_KERNELS", "1") == "0":
            return None
        try:
            return cls(ctypes.CDLL(_build()))
        except (OSError, RuntimeError, subprocess.CalledProcessError) as exc:
            detail = getattr(exc, "stderr", "") or exc
            logger.warning("CPU attention kernel unavailable, using the torch path: %s", detail)
            return None

    @staticmethod
    def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
        return (q.dtype == torch.float32 and k_cache.dtype == torch.float32 and q.device.type == "cpu"
                and q.shape[-1] <= 256)

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
