"""The compiled CPU kernels: built with the system C compiler, called through ctypes.

- `cpu_attention.c`: paged attention that reads the cache in place, where the torch path must
  first gather every sequence's blocks into a padded copy.
- `cpu_ops.c`: the decoder's elementwise work fused per row (RMSNorm with the residual add; q/k
  norm, rotary embedding and the KV-cache store; SiLU-and-multiply).
- `cpu_quant.c`: matrix products and row lookups on weights kept packed (layers/quant.py).
- `cpu_decode.c`: every decoder layer of a small decode step in one call, driving the three
  files above (layers/cpu_decode.py).
- `cpu_sample.c`: the sampler's inverse-CDF draw over whole rows (layers/sampling_ops.py).

Every kernel serves float32 and bfloat16 tensors from one source: the body is written once
against the helpers of `cpu_simd.h` and compiled for each element type (the `bf16` argument), and
for the CPU it is built on (-march=native: 16-lane AVX-512 vectors where the CPU has AVX-512,
8-lane AVX2 ones elsewhere; NANOVLLM_CPU_ISA builds for less, see `ISA_ENV`). They are plain C with no torch headers, so they compile in about a
second into one library, cached per source and CPU. They parallelise with OpenMP and, loaded after torch, share torch's
OpenMP runtime (same libgomp.so.1 soname), so kernels and GEMMs use one thread pool. Without a
compiler, or with NANOVLLM_CPU_KERNELS=0, `load()` returns None and the torch path is used.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile

import numpy as np
import torch

logger = logging.getLogger(__name__)
_HERE = os.path.dirname(os.path.abspath(__file__))
_SOURCES = [os.path.join(_HERE, name) for name in ("cpu_attention.c", "cpu_ops.c", "cpu_quant.c",
                                                              "cpu_decode.c", "cpu_sample.c")]
_HEADERS = [os.path.join(_HERE, "cpu_simd.h")]
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared"]


def _cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


def cpu_flags() -> set[str]:
    """The running CPU's feature flags as Linux reports them (`avx2`, `avx512_bf16`, `amx_bf16`...)."""
    line = _cpu_signature()
    return set(line.split(":", 1)[1].split()) if ":" in line else set()


_KERNEL_DTYPES = (torch.float32, torch.bfloat16)
_BF16_FLAGS = {"amx_bf16": "AMX-BF16", "avx512_bf16": "AVX512-BF16"}


AUTO_DTYPE_ENV = "NANOVLLM_AUTO_DTYPE"
"""Makes `dtype="auto"` resolve as it would on another CPU: "float32" as on a CPU without native
bf16, "bfloat16" as on one with it. One machine can then run what depends on the resolution both
ways (the suite's comparisons, an operator reproducing a report from another host)."""
_AUTO_DTYPE_CHOICES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def auto_cpu_dtype() -> torch.dtype:
    """`dtype="auto"` on CPU: bfloat16 where the CPU computes it natively (AMX-BF16 tiles, or
    AVX512-BF16 dot products), float32 elsewhere, where bf16 matmuls are emulated and several
    times slower than fp32; `NANOVLLM_AUTO_DTYPE` overrides the probe. Read at each call (a test
    may set the variable after the first engine), logged once per process and outcome."""
    forced = os.environ.get(AUTO_DTYPE_ENV, "")
    if not forced:
        return native_cpu_dtype()
    if forced not in _AUTO_DTYPE_CHOICES:
        raise ValueError(f"{AUTO_DTYPE_ENV} must be one of {', '.join(_AUTO_DTYPE_CHOICES)} (or unset); got {forced!r}")
    _log_forced(forced)
    return _AUTO_DTYPE_CHOICES[forced]


@functools.cache
def _log_forced(forced: str) -> None:
    logger.info("dtype auto -> %s: forced by %s (this CPU alone would give %s)", forced, AUTO_DTYPE_ENV,
                str(native_cpu_dtype()).removeprefix("torch."))


@functools.cache
def native_cpu_dtype() -> torch.dtype:
    found = [name for flag, name in _BF16_FLAGS.items() if flag in cpu_flags()]
    if found and torch.backends.mkldnn.is_available():
        logger.info("dtype auto -> bfloat16: this CPU has %s (set dtype='float32' to override)", " and ".join(found))
        return torch.bfloat16
    logger.info("dtype auto -> float32: this CPU has neither AMX-BF16 nor AVX512-BF16, so bf16 would be emulated")
    return torch.float32


ISA_ENV = "NANOVLLM_CPU_ISA"
"""Builds the kernels for less than this CPU has, to time or test another CPU's path on this one:
"avx2" (no AVX-512, no VNNI: an AVX2-only CPU's kernels), "avx512" (AVX-512 without VNNI or
AVX512-BF16, as Skylake-SP has it) or "avx512_vnni" (all the CPU has beyond: AVX512-BF16 where it
has it); a level above the CPU's own is capped to it. Only these kernels: torch's own
GEMMs keep the CPU's instruction set (oneDNN has ONEDNN_MAX_CPU_ISA for that)."""
ISA_LEVELS = ("avx2", "avx512", "avx512_vnni")
_ISA_NEEDS = {"avx2": {"avx2", "fma", "f16c"}, "avx512": {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl"},
              "avx512_vnni": {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"}}
_ISA_OFF = {"avx2": ["-mno-avx512f", "-mno-avxvnni"],
            "avx512": ["-mno-avx512vnni", "-mno-avxvnni", "-mno-avx512bf16"], "avx512_vnni": []}
_ISA_CODES = {0: "baseline", 2: "avx2", 3: "avx512", 4: "avx512_vnni"}


def cpu_isa() -> str | None:
    """The highest of ISA_LEVELS this CPU has, or None (the plain C loops)."""
    have = cpu_flags()
    return next((level for level in reversed(ISA_LEVELS) if _ISA_NEEDS[level] <= have), None)


def isa_flags() -> list[str]:
    """Compiler flags that take the build down to the level NANOVLLM_CPU_ISA asks for (none unset,
    or where the CPU has no more than that)."""
    asked = os.environ.get(ISA_ENV, "")
    if not asked:
        return []
    if asked not in ISA_LEVELS:
        raise ValueError(f"{ISA_ENV} must be one of {', '.join(ISA_LEVELS)} (or unset); got {asked!r}")
    own = cpu_isa()
    if own is None or ISA_LEVELS.index(asked) >= ISA_LEVELS.index(own):
        _log_isa_capped(asked, own)
        return []
    return _ISA_OFF[asked]


@functools.cache
def _log_isa_capped(asked: str, own: str | None) -> None:
    if asked != own:
        logger.info("%s=%s: this CPU has no more than %s; building for it", ISA_ENV, asked, own or "baseline x86-64")


def kernel_isa(lib: ctypes.CDLL) -> str:
    """The instruction set a loaded library's products use: baseline, avx2, avx512 or avx512_vnni."""
    return _ISA_CODES.get(lib.cpu_kernels_isa(), "unknown")


def _build() -> str:
    cflags = _CFLAGS + isa_flags()
    digest = hashlib.sha256(" ".join(cflags).encode() + _cpu_signature().encode())
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
        subprocess.run([compiler, *cflags, "-o", tmp, *_SOURCES, "-lm"], check=True, capture_output=True, text=True)
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
        self._fn = lib.paged_attention_rows
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                             ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                             ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_float,
                             ctypes.c_int64]
        self._chunk = lib.paged_attention_chunk
        self._chunk.restype = ctypes.c_int
        self._chunk.argtypes = [_P, _I, _P, _P, _P, _I, _I, _P, _I, _I, _I, _I, _F, _I]

    @classmethod
    def load(cls) -> "CpuAttentionKernel | None":
        lib = _load_library()
        return None if lib is None else cls(lib)

    @staticmethod
    def supports(dtype: torch.dtype, head_dim: int) -> bool:
        """Whether the kernel can serve a model of this dtype and head size (float32 or bfloat16, up to 256)."""
        return dtype in _KERNEL_DTYPES and head_dim <= 256

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 row_table: torch.Tensor, row_ctx: torch.Tensor, scale: float) -> torch.Tensor:
        """q (R, H, D) with contiguous heads, in the caches' dtype; block_tables (S, max_blocks),
        row_table/row_ctx (R,) int64. The output has q's dtype (float32 accumulation either way)."""
        q, out = _query_and_output(q)
        rows, num_heads, head_dim = q.shape
        _, block_size, num_kv_heads, _ = k_cache.shape
        failed = self._fn(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
                          block_tables.shape[1], row_table.data_ptr(), row_ctx.data_ptr(), out.data_ptr(), rows,
                          num_heads, num_kv_heads, head_dim, block_size, scale, _is_bf16(q, k_cache, v_cache))
        _check(failed, head_dim)
        return out

    def chunk(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
              num_cached: int, scale: float) -> torch.Tensor:
        """One sequence's prompt chunk: q (Q, H, D) with contiguous heads, row i attending to the
        positions [0, num_cached + i] of the sequence whose blocks are block_table (int64)."""
        q, out = _query_and_output(q)
        rows, num_heads, head_dim = q.shape
        _, block_size, num_kv_heads, _ = k_cache.shape
        failed = self._chunk(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), block_table.data_ptr(),
                             num_cached, rows, out.data_ptr(), num_heads, num_kv_heads, head_dim, block_size, scale,
                             _is_bf16(q, k_cache, v_cache))
        _check(failed, head_dim)
        return out


def _query_and_output(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q as the kernels read it (rows may be strided, each row's heads contiguous), and an empty
    (R, H, D) output of its dtype."""
    if q.stride(2) != 1 or q.stride(1) != q.shape[2]:
        q = q.contiguous()
    return q, torch.empty(q.shape, dtype=q.dtype)


def _check(failed: int, head_dim: int) -> None:
    """Turn a kernel's return code into the error it stands for."""
    if failed == -2:
        raise ValueError(f"the CPU attention kernel supports head_dim up to 256, got {head_dim}")
    if failed:
        raise MemoryError("CPU attention kernel could not allocate its scratch buffer")


_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


def _is_bf16(first: torch.Tensor, *rest: torch.Tensor | None) -> int:
    """1 for bfloat16, 0 for float32: the `bf16` argument of every kernel, whose pointers must all
    be of that one dtype (a mismatch would be read as garbage, so it is refused here)."""
    for t in rest:
        if t is not None and t.dtype != first.dtype:
            raise TypeError(f"CPU kernel arguments mix {first.dtype} and {t.dtype}")
    if first.dtype not in _KERNEL_DTYPES:
        raise TypeError(f"the CPU kernels take float32 or bfloat16, not {first.dtype}")
    return int(first.dtype == torch.bfloat16)


class CpuOps:
    """The fused elementwise ops of `cpu_ops.c`, on float32 or bfloat16 CPU tensors with contiguous rows."""

    def __init__(self, lib: ctypes.CDLL):
        self._rms_norm = lib.rms_norm
        self._rms_norm.argtypes = [_P, _I, _P, _P, _P, _I, _I, _F, _I]
        self._qk_norm_rope_store = lib.qk_norm_rope_store
        self._qk_norm_rope_store.argtypes = [_P, _I, _I, _I, _I, _I, _P, _P, _F, _P, _P, _P, _P, _P, _P, _I]
        self._silu_mul = lib.silu_mul
        self._silu_mul.argtypes = [_P, _P, _I, _I, _I]
        for fn in (self._rms_norm, self._qk_norm_rope_store, self._silu_mul):
            fn.restype = None
        self._quant_matmul = lib.quant_matmul
        self._quant_matmul.argtypes = [_I, _P, _P, _P, _I, _I, _I, _P, _I, _I, _P, _I]
        self._quant_dequant = lib.quant_dequant
        self._quant_dequant.argtypes = [_I, _P, _P, _P, _I, _I, _P, _I, _I, _P, _I]
        self._quant_gemm_bf16 = lib.quant_gemm_bf16
        self._quant_gemm_bf16.argtypes = [_I, _P, _P, _P, _I, _I, _I, _P, _I, _I, _P]
        for fn in (self._quant_matmul, self._quant_dequant, self._quant_gemm_bf16):
            fn.restype = ctypes.c_int
        self.has_quant_gemm_bf16 = bool(lib.quant_gemm_bf16_ok())
        """Whether this build has `quant_gemm_bf16` (AVX512-BF16 builds)."""
        self.uses_quant_gemm_bf16 = self.has_quant_gemm_bf16 and "amx_bf16" not in cpu_flags()
        """Whether `quant_linear` takes it for bf16 rows above the matvec: not on CPUs with AMX,
        where oneDNN multiplies the dequantized panel on its tiles, which `vdpbf16ps` cannot
        approach at prefill sizes (the panel path serves there, and wherever it is not built)."""
        self._draw_rows = lib.draw_rows
        self._draw_rows.argtypes = [_P, _I, _I, _I, _P, _P, _P]
        self._draw_rows.restype = None
        self._mask_rows_bits = lib.mask_rows_bits
        self._mask_rows_bits.argtypes = [_P, _I, _P, _I, _I, _P, _I, _I]
        self._mask_rows_bits.restype = None
        self._panel = torch.empty(0)
        """Scratch for dequantized weight tiles, reused so large-batch steps allocate nothing."""

    @classmethod
    def load(cls) -> "CpuOps | None":
        lib = _load_library()
        return None if lib is None else cls(lib)

    @staticmethod
    def supports(x: torch.Tensor) -> bool:
        """2-D float32 or bfloat16 rows on the CPU, each row contiguous."""
        return x.device.type == "cpu" and x.dtype in _KERNEL_DTYPES and x.dim() == 2 and x.stride(1) == 1

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
        """`weight * norm(x)`; with `residual` (contiguous, updated in place), of `residual + x`."""
        rows, dim = x.shape
        out = torch.empty((rows, dim), dtype=x.dtype)
        self._rms_norm(x.data_ptr(), x.stride(0), None if residual is None else residual.data_ptr(),
                       weight.data_ptr(), out.data_ptr(), rows, dim, eps, _is_bf16(x, residual, weight))
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
            v_cache.data_ptr(), slots.data_ptr(), _is_bf16(qkv, q_weight, k_weight, cos_cache, sin_cache, k_cache, v_cache))

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of contiguous (T, 2 I) rows [gate | up]."""
        rows, width = gate_up.shape
        out = torch.empty((rows, width // 2), dtype=gate_up.dtype)
        self._silu_mul(gate_up.data_ptr(), out.data_ptr(), rows, width // 2, _is_bf16(gate_up))
        return out

    @staticmethod
    def supports_draw(logits: torch.Tensor) -> bool:
        """float32 (R, V) logits on the CPU, each row contiguous."""
        return logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2 \
            and logits.stride(1) == 1

    def draw(self, logits: torch.Tensor, temperature: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
        """One index per row of float32 logits (R, V), with probability softmax(row / temperature),
        by inverse CDF against `uniform` (R,) float64 in [0, 1) -> (R,) int64 (cpu_sample.c). A row
        with no finite maximum gets -1 (outside every vocabulary: the sampler fails that row)."""
        rows, width = logits.shape
        if not self.supports_draw(logits):
            raise ValueError("draw takes float32 CPU logits with contiguous rows")
        temperature = temperature.to(torch.float32).contiguous()
        uniform = uniform.to(torch.float64).contiguous()
        if temperature.shape != (rows,) or uniform.shape != (rows,):
            raise ValueError(f"draw takes one temperature and one uniform number per row ({rows})")
        out = torch.empty(rows, dtype=torch.int64)
        self._draw_rows(logits.data_ptr(), logits.stride(0), rows, width, temperature.data_ptr(), uniform.data_ptr(),
                        out.data_ptr())
        return out

    def mask_bits(self, logits: torch.Tensor, rows: list[int], bits: np.ndarray, n_vocab: int) -> None:
        """-inf in place in rows `rows` of float32 logits (R, V) wherever the packed token mask
        `bits` (len(rows), ceil(n_vocab / 32)) int32, row g for logits row rows[g], has a 0 bit,
        and at every id from `n_vocab` on (cpu_sample.c)."""
        if not self.supports_draw(logits):
            raise ValueError("mask_bits takes float32 CPU logits with contiguous rows")
        words = -(-n_vocab // 32)
        if bits.dtype != np.int32 or bits.ndim != 2 or bits.shape != (len(rows), words) or bits.strides[1] != 4:
            raise ValueError(f"mask_bits takes int32 bits ({len(rows)}, {words}) with contiguous rows, "
                             f"not {bits.dtype} {bits.shape}")
        if rows and (min(rows) < 0 or max(rows) >= logits.shape[0]):
            raise IndexError(f"a row index is outside the {logits.shape[0]} logits rows")
        index = np.asarray(rows, dtype=np.int64)
        self._mask_rows_bits(logits.data_ptr(), logits.stride(0), index.ctypes.data, len(rows), logits.shape[1],
                             bits.ctypes.data, bits.strides[0] // 4, n_vocab)

    def quant_matmul(self, weight, x: torch.Tensor) -> torch.Tensor:
        """x (M, K) @ W^T -> (M, N) for a `QuantizedWeight` (layers/quant.py), x taken to int16
        per 32 inputs (cpu_quant.c)."""
        n, k = weight.shape
        if x.shape[1] != k:
            raise ValueError(f"input has {x.shape[1]} features, the weight takes {k}")
        y = torch.empty((x.shape[0], n), dtype=x.dtype)
        _check_quant(self._quant_matmul(*weight.kernel_args, n, k, x.data_ptr(), x.stride(0), x.shape[0], y.data_ptr(),
                                        _is_bf16(x)), weight)
        return y

    def quant_gemm_bf16(self, weight, x: torch.Tensor) -> torch.Tensor:
        """bfloat16 x (M, K) @ W^T -> (M, N) bfloat16, W dequantized to bfloat16 a few rows at a
        time inside the kernel (cpu_quant.c); only where `has_quant_gemm_bf16`."""
        n, k = weight.shape
        if x.shape[1] != k or x.dtype != torch.bfloat16:
            raise ValueError(f"quant_gemm_bf16 takes bfloat16 rows of {k} features, got {x.dtype} {tuple(x.shape)}")
        y = torch.empty((x.shape[0], n), dtype=torch.bfloat16)
        failed = self._quant_gemm_bf16(*weight.kernel_args, n, k, x.data_ptr(), x.stride(0), x.shape[0], y.data_ptr())
        if failed == -3:
            raise RuntimeError("this build of the CPU kernels has no AVX512-BF16 GEMM")
        _check_quant(failed, weight)
        return y

    def quant_dequant(self, weight, first: int, count: int, dtype: torch.dtype) -> torch.Tensor:
        """Rows [first, first + count) of W as a (count, K) float panel. The panel is scratch
        memory, overwritten by the next call: use it before asking for another."""
        k = weight.shape[1]
        needed = count * k * torch.tensor([], dtype=dtype).element_size()
        if self._panel.numel() < needed:
            self._panel = torch.empty(needed, dtype=torch.uint8)
        panel = self._panel[:needed].view(dtype).view(count, k)
        _check_quant(self._quant_dequant(*weight.kernel_args, k, None, first, count, panel.data_ptr(),
                                         _is_bf16(panel)), weight)
        return panel

    def quant_rows(self, weight, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` of W as a new (T, K) tensor of `dtype`: the packed embedding lookup."""
        ids = ids.to(torch.int64).contiguous()
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= weight.shape[0]):
            raise IndexError(f"token id out of range for an embedding of {weight.shape[0]} rows")
        out = torch.empty((ids.numel(), weight.shape[1]), dtype=dtype)
        _check_quant(self._quant_dequant(*weight.kernel_args, weight.shape[1], ids.data_ptr(), 0, ids.numel(),
                                         out.data_ptr(), _is_bf16(out)), weight)
        return out


def _check_quant(failed: int, weight) -> None:
    if failed == -2:
        raise ValueError(f"packed weight of shape {weight.shape} with {weight.group} inputs per scale: "
                         "the kernels take a multiple of 32 inputs and groups of 16 or 32")
    if failed:
        raise MemoryError("packed matmul could not allocate its scratch buffer")
