"""Packed GGUF weights (layers/quant.py, layers/cpu_quant.c, models/gguf_quant.py) against
`gguf.quants.dequantize` of the same bytes and a float matmul."""
from __future__ import annotations

import platform

import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf.quants import dequantize  # noqa: E402

from nanovllm.layers.cpu_kernels import ISA_ENV, ISA_LEVELS, CpuOps  # noqa: E402
from nanovllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear  # noqa: E402
from nanovllm.layers.quant import LEFT_PANEL_MAX_ROWS, MATVEC_MAX_ROWS, QuantizedWeight, quant_embedding, quant_linear  # noqa: E402
from nanovllm.models.gguf_quant import PACKED_TYPES, to_quantized  # noqa: E402
from tests.helpers.gguf_blocks import K_QUANTS, gguf_rows  # noqa: E402

ALL_TYPES = (T.Q4_0, T.Q4_1, T.Q8_0, *K_QUANTS)
# The K-quants' scales and mins are products of two numbers, rounded to float16 in the packed
# layout: each term is off by up to 2^-11 of itself (so up to 2^-10 of the largest weight).
CONVERSION_TOL = {t: (2.0 ** -10 if t in K_QUANTS else 0.0) for t in ALL_TYPES}


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_conversion_equals_gguf_dequantize(qtype):
    raw = gguf_rows(qtype, 12, 512, seed=int(qtype))
    packed = to_quantized(raw, qtype)
    reference = torch.from_numpy(dequantize(raw, qtype))
    assert packed.shape == tuple(reference.shape)
    atol = CONVERSION_TOL[qtype] * reference.abs().max().item()
    torch.testing.assert_close(packed.dequantize(), reference, rtol=0, atol=atol)
    assert qtype in PACKED_TYPES


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
# 21: the dequantized panel as the GEMM's left operand; LEFT_PANEL_MAX_ROWS + 3: as its right one
@pytest.mark.parametrize("rows", [1, 3, MATVEC_MAX_ROWS, 21, LEFT_PANEL_MAX_ROWS + 3])
def test_packed_matmul_matches_float_matmul_of_dequantized_weights(ops, qtype, rows):
    raw = gguf_rows(qtype, 40, 256, seed=rows)
    weight = to_quantized(raw, qtype)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
    reference = x @ torch.from_numpy(dequantize(raw, qtype)).T
    # int16 activations and float16 K-quant scales: relative ~1e-5 and 2^-12 of the output scale
    tol = 2e-3 if qtype in K_QUANTS else 2e-4
    torch.testing.assert_close(quant_linear(x, weight, None, ops), reference, rtol=0, atol=tol * reference.abs().max().item())


@pytest.mark.parametrize("rows", [1, 20])
def test_bf16_packed_matmul_matches_fp32_up_to_bf16_rounding(ops, rows):
    weight = to_quantized(gguf_rows(T.Q4_1, 64, 256, seed=5), T.Q4_1)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(3)).bfloat16()
    bias = torch.randn(64).bfloat16()
    got = quant_linear(x, weight, bias, ops)
    assert got.dtype == torch.bfloat16
    reference = x.float() @ weight.dequantize().T + bias.float()
    torch.testing.assert_close(got.float(), reference, rtol=2e-2, atol=2e-2 * reference.abs().max().item())


@pytest.mark.parametrize("rows", [MATVEC_MAX_ROWS + 1, LEFT_PANEL_MAX_ROWS + 1])  # left and right operand
def test_large_output_is_computed_in_panels(ops, monkeypatch, rows):
    import nanovllm.layers.quant as quant

    monkeypatch.setattr(quant, "PANEL_BYTES", 64 * 256 * 4)  # 64 rows a panel: 300 rows take five
    weight = to_quantized(gguf_rows(T.Q8_0, 300, 256, seed=7), T.Q8_0)
    x = torch.randn(rows, 256)
    torch.testing.assert_close(quant_linear(x, weight, None, ops), x @ weight.dequantize().T, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embedding_rows_are_the_dequantized_rows(ops, dtype):
    weight = to_quantized(gguf_rows(T.Q8_0, 50, 128, seed=1), T.Q8_0)
    ids = torch.tensor([7, 0, 49, 7])
    expected = weight.dequantize(dtype)[ids]
    assert torch.equal(quant_embedding(ids, weight, dtype, ops), expected)
    assert torch.equal(quant_embedding(ids, weight, dtype, None), expected)  # the torch fallback
    with pytest.raises(IndexError):
        ops.quant_rows(weight, torch.tensor([50]), dtype)


def test_torch_fallback_without_kernels_matches():
    weight = to_quantized(gguf_rows(T.Q4_K, 8, 256, seed=2), T.Q4_K)
    x = torch.randn(3, 256)
    torch.testing.assert_close(quant_linear(x, weight, None, None), x @ weight.dequantize().T)


def test_row_blocks_of_different_types_stack_losslessly():
    """A Q4_K_M file mixes Q4_K and Q6_K inside one merged q|k|v weight."""
    parts = [to_quantized(gguf_rows(t, 4 * (i + 1), 256, seed=i), t) for i, t in enumerate((T.Q4_K, T.Q6_K, T.Q4_0))]
    stacked = QuantizedWeight.cat_rows(parts)
    assert (stacked.bits, stacked.group) == (8, 16)
    assert torch.equal(stacked.dequantize(), torch.cat([p.dequantize() for p in parts]))


def test_merged_linear_keeps_packed_blocks_and_frees_its_float_weight(ops):
    layer = QKVParallelLinear(256, head_dim=32, num_heads=2, num_kv_heads=1)
    blocks = [to_quantized(gguf_rows(t, rows, 256, seed=rows), t) for t, rows in ((T.Q4_1, 64), (T.Q4_1, 32), (T.Q8_0, 32))]
    for shard_id in (2, 0, 1):  # any order
        layer.weight_loader(layer.weight, blocks[shard_id], shard_id)
    assert layer.quant is not None and layer.weight.numel() == 0
    layer.cpu_ops = ops
    x = torch.randn(2, 256)
    expected = x @ torch.cat([b.dequantize() for b in blocks]).T
    torch.testing.assert_close(layer(x), expected, rtol=0, atol=2e-4 * expected.abs().max().item())


def test_a_float_block_among_packed_ones_makes_the_layer_float():
    layer = MergedColumnParallelLinear(256, [32, 32])
    packed = to_quantized(gguf_rows(T.Q4_0, 32, 256, seed=3), T.Q4_0)
    up = torch.randn(32, 256)
    layer.weight_loader(layer.weight, packed, 0)
    layer.weight_loader(layer.weight, up, 1)
    assert layer.quant is None
    assert torch.equal(layer.weight, torch.cat([packed.dequantize(), up]))


# Each build of the kernels a CPU may get: the plain-C loops of baseline x86-64 (-march=x86-64),
# and this CPU's library taken down by NANOVLLM_CPU_ISA to the AVX2 path of CPUs without AVX-512,
# the AVX-512 path of CPUs without VNNI, and the AVX-512 VNNI one (levels above this CPU's skip).
BUILDS = ["x86-64", *ISA_LEVELS]


@pytest.fixture(scope="module", params=BUILDS)
def built_ops(request, tmp_path_factory) -> CpuOps:
    import ctypes
    import shutil
    import subprocess

    from nanovllm.layers import cpu_kernels

    if request.param in ISA_LEVELS:
        own = cpu_kernels.cpu_isa()
        if own is None or ISA_LEVELS.index(request.param) > ISA_LEVELS.index(own):
            pytest.skip(f"this CPU cannot run the {request.param} kernels")
        with pytest.MonkeyPatch.context() as env:
            env.setenv(ISA_ENV, request.param)
            lib = cpu_kernels._load_library()
        if lib is None:
            pytest.skip("no C compiler")
        assert cpu_kernels.kernel_isa(lib) == request.param  # the path asked for, not the CPU's best
        return CpuOps(lib)
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None or platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("needs a C compiler on x86-64")
    library = str(tmp_path_factory.mktemp(request.param) / "kernels.so")
    flags = [f for f in cpu_kernels._CFLAGS if f != "-march=native"] + [f"-march={request.param}"]
    sources = [path for path in cpu_kernels._SOURCES  # what CpuOps calls
               if not path.endswith(("cpu_attention.c", "cpu_decode.c"))]
    subprocess.run([compiler, *flags, "-o", library, *sources, "-lm"], check=True, capture_output=True)
    return CpuOps(ctypes.CDLL(library))


def test_an_unknown_isa_is_refused_and_one_above_the_cpu_capped(monkeypatch):
    from nanovllm.layers import cpu_kernels

    monkeypatch.setenv(ISA_ENV, "avx9000")
    with pytest.raises(ValueError, match="avx2, avx512, avx512_vnni"):
        cpu_kernels.isa_flags()
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: {"avx2", "fma", "f16c"})
    monkeypatch.setenv(ISA_ENV, "avx512_vnni")
    assert cpu_kernels.isa_flags() == []  # an AVX2-only CPU builds its own (AVX2) kernels
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl",
                                                           "avx512_vnni"})
    monkeypatch.setenv(ISA_ENV, "avx2")
    assert "-mno-avx512f" in cpu_kernels.isa_flags()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_build_matches_the_reference_and_the_native_build(built_ops, dtype):
    """Batch 1 (the paired-row kernels: 4-bit, and 8-bit with AVX-512) and a few rows, 4- and
    8-bit codes, groups of 32 and 16, with and without mins; at batch 1, 4-bit rows long enough
    (SINGLE_ROW_BYTES) to be read one at a time, in pairs and fours of W rows."""
    native = CpuOps.load()
    for qtype, rows, n, k in ((T.Q4_1, 1, 26, 256), (T.Q4_0, 1, 26, 256), (T.Q8_0, 1, 26, 256), (T.Q6_K, 1, 26, 256),
                              (T.Q4_1, 3, 26, 256), (T.Q6_K, 2, 26, 256), (T.Q5_K, 4, 26, 256),
                              (T.Q4_1, 1, 26, 1536), (T.Q4_0, 1, 40, 1024)):
        raw = gguf_rows(qtype, n, k, seed=rows)  # 26: pairs of W rows, 40: fours
        weight = to_quantized(raw, qtype)
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(int(qtype))).to(dtype)
        reference = x.float() @ torch.from_numpy(dequantize(raw, qtype)).T
        got = built_ops.quant_matmul(weight, x).float()
        tol = (2e-3 if qtype in K_QUANTS else 2e-4) if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(got, reference, rtol=0, atol=tol * reference.abs().max().item())
        torch.testing.assert_close(got, native.quant_matmul(weight, x).float(), rtol=1e-5 if dtype == torch.float32
                                   else 1e-2, atol=1e-5)
        assert torch.equal(built_ops.quant_dequant(weight, 0, n, torch.float32).clone(),
                           native.quant_dequant(weight, 0, n, torch.float32))


@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q8_0, T.Q6_K])
def test_with_avx512_each_row_of_a_small_batch_is_computed_as_alone(ops, qtype):
    """2-8 rows of x take the batch-1 kernels once per row (AVX-512 builds): a decode row's
    products do not depend on which other rows share its step."""
    from nanovllm.layers import cpu_kernels

    if not cpu_kernels.kernel_isa(cpu_kernels._load_library()).startswith("avx512"):
        pytest.skip("the AVX2 and plain builds take the general loop for several rows")
    weight = to_quantized(gguf_rows(qtype, 40, 256, seed=7), qtype)
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    for rows in (2, 5, 8):
        together = ops.quant_matmul(weight, x[:rows])
        for r in range(rows):
            assert torch.equal(together[r:r + 1], ops.quant_matmul(weight, x[r:r + 1].contiguous()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_build_dequantizes_exactly_as_torch(built_ops, dtype):
    """The panel of the large-batch path and the embedding rows: bit for bit `dequantize(dtype)`
    in every build (AVX-512 with `vcvtne2ps2bf16` for bf16, AVX-512 without AVX512-BF16, AVX2,
    plain C): 4- and 8-bit codes, groups of 32 and 16, with and without mins, a tile that starts
    mid-matrix and rows picked by index."""
    for qtype in (T.Q4_0, T.Q4_1, T.Q8_0, T.Q6_K, T.Q5_K, T.Q4_K):
        weight = to_quantized(gguf_rows(qtype, 37, 512, seed=int(qtype)), qtype)
        expected = weight.dequantize(dtype)
        assert torch.equal(built_ops.quant_dequant(weight, 0, 37, dtype).clone(), expected), qtype.name
        assert torch.equal(built_ops.quant_dequant(weight, 5, 30, dtype).clone(), expected[5:35]), qtype.name
        ids = torch.tensor([36, 0, 17, 17])
        assert torch.equal(built_ops.quant_rows(weight, ids, dtype), expected[ids]), qtype.name
    int8 = QuantizedWeight.from_float(torch.randn(70, 96) * 3)  # `quantization="int8"`: no mins
    assert torch.equal(built_ops.quant_dequant(int8, 0, 70, dtype).clone(), int8.dequantize(dtype))


@pytest.mark.parametrize("rows", [MATVEC_MAX_ROWS + 1, 64])
def test_panel_path_equals_float_linear_of_the_dequantized_weight(ops, rows):
    """Many rows (a large decode step, a prefill chunk): the product of x and the dequantized
    panel, as `F.linear` of x and `dequantize()` gives it, whatever the tile size."""
    import nanovllm.layers.quant as quant

    weight = to_quantized(gguf_rows(T.Q4_1, 300, 256, seed=9), T.Q4_1)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)).bfloat16()
    expected = torch.nn.functional.linear(x, weight.dequantize(torch.bfloat16))
    torch.testing.assert_close(quant_linear(x, weight, None, ops), expected, rtol=1e-2, atol=1e-2)
    for tile_rows in (64, 300):  # several tiles, one tile
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(quant, "PANEL_BYTES", tile_rows * 256 * 2)
            torch.testing.assert_close(quant_linear(x, weight, None, ops), expected, rtol=1e-2, atol=1e-2)


def _random_packed(bits: int, group: int, with_mins: bool, n: int, k: int, seed: int) -> QuantizedWeight:
    gen = torch.Generator().manual_seed(seed)
    scales = (torch.rand(n, k // group, generator=gen) * 0.1 + 0.01).half()
    mins = (torch.randn(n, k // group, generator=gen) * 0.2).half() if with_mins else None
    if bits == 4:
        codes = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
    else:
        codes = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    return QuantizedWeight(bits, group, codes, scales, mins)


@pytest.mark.parametrize("layout", [(4, 32, True), (4, 32, False), (8, 32, False), (8, 32, True), (8, 16, False),
                                    (8, 16, True)], ids=lambda l: f"{l[0]}bit-g{l[1]}-{'mins' if l[2] else 'nomins'}")
@pytest.mark.parametrize("rows", [MATVEC_MAX_ROWS + 1, 17, 64, 130])
def test_fused_bf16_gemm_is_the_float_product_of_the_bf16_dequantized_weight(ops, layout, rows):
    """quant_gemm_bf16 multiplies by the very bf16 weights `dequantize(bfloat16)` gives, summing in
    float32: within one bf16 rounding of the output. 300 and 17 columns end in part-filled tiles;
    x's rows are strided."""
    if not ops.has_quant_gemm_bf16:
        pytest.skip("this CPU has no AVX512-BF16: the panel path serves bf16")
    for n in (300, 17):
        weight = _random_packed(*layout, n, 192, seed=rows + n)
        wide = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)).bfloat16()
        x = wide[:, 32:224]  # (rows, 192), rows 256 apart
        reference = x.float() @ weight.dequantize(torch.bfloat16).float().T
        got = ops.quant_gemm_bf16(weight, x)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
        torch.testing.assert_close(got.float(), reference, rtol=2 ** -8, atol=1e-5 * reference.abs().max().item())
        if ops.uses_quant_gemm_bf16:  # the path bf16 rows above the matvec take (not with AMX: the panel)
            assert torch.equal(quant_linear(x, weight, None, ops), got)


def test_fused_bf16_gemm_refuses_float32_x(ops):
    if not ops.has_quant_gemm_bf16:
        pytest.skip("this CPU has no AVX512-BF16")
    with pytest.raises(ValueError, match="bfloat16"):
        ops.quant_gemm_bf16(_random_packed(8, 32, False, 16, 64, seed=0), torch.randn(9, 64))


def test_cpus_with_amx_keep_the_panel_path_for_bf16_rows(ops, monkeypatch):
    """With AMX, oneDNN multiplies the dequantized panel on its tiles: the fused kernel is not chosen."""
    from nanovllm.layers import cpu_kernels
    from nanovllm.layers.quant import _panel_matmul

    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: {"avx512f", "avx512_bf16", "amx_tile", "amx_bf16"})
    on_amx = cpu_kernels.CpuOps(cpu_kernels._load_library())
    assert not on_amx.uses_quant_gemm_bf16
    weight = _random_packed(4, 32, True, 48, 96, seed=3)
    x = torch.randn(MATVEC_MAX_ROWS + 4, 96, generator=torch.Generator().manual_seed(3)).bfloat16()
    assert torch.equal(quant_linear(x, weight, None, on_amx), _panel_matmul(x, weight, on_amx))
