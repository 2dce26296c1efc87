"""The compiled CPU attention kernel and the torch path agree with the plain references."""
from __future__ import annotations

import pytest
import torch

from nanovllm.kernels import reference
from nanovllm.layers.cpu_kernels import CpuAttentionKernel


def paged_cache(num_blocks=40, block_size=4, kv_heads=2, head_dim=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    v = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    return k, v


def test_decode_rows_match_reference(kernel):
    kc, vc = paged_cache()
    torch.manual_seed(1)
    tables = torch.stack([torch.randperm(40)[:12] for _ in range(6)])  # shuffled blocks
    ctx = torch.tensor([1, 4, 5, 47, 19, 0])  # partial blocks, one empty padded row
    q = torch.randn(6, 6, 16)  # 6 query heads over 2 KV heads (GQA 3)
    out = kernel(q, kc, vc, tables, torch.arange(6), ctx, 0.3)
    expected = reference.paged_decode_attention(q, kc, vc, tables.int(), ctx.int(), 0.3)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert torch.all(out[5] == 0)


def test_continuation_rows_match_prefill_reference(kernel):
    # A 9-token chunk after 10 cached tokens: row i sees 10 + i + 1 tokens.
    kc, vc = paged_cache(seed=2)
    table = torch.tensor([[7, 3, 30, 12, 5]])
    q = torch.randn(9, 4, 16)
    rows = torch.zeros(9, dtype=torch.long)
    ctx = torch.arange(11, 20)
    out = kernel(q, kc, vc, table, rows, ctx, 0.25)
    expected = reference.paged_prefill_attention(q, kc, vc, torch.tensor([0, 9], dtype=torch.int32),
                                                 torch.tensor([19], dtype=torch.int32), table.int(), 0.25)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_strided_query_rows_are_read_correctly(kernel):
    # q arrives as a view into the fused qkv projection: rows are further apart than H * D.
    kc, vc = paged_cache(seed=3)
    tables = torch.tensor([[1, 2, 3], [4, 5, 6]])
    ctx = torch.tensor([9, 12])
    qkv = torch.randn(2, 4 * 16 + 2 * 2 * 16)
    q = qkv[:, : 4 * 16].view(2, 4, 16)
    out = kernel(q, kc, vc, tables, torch.arange(2), ctx, 0.25)
    expected = reference.paged_decode_attention(q.contiguous(), kc, vc, tables.int(), ctx.int(), 0.25)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_engine_greedy_output_is_the_same_with_and_without_the_kernel(tiny_model_dir, monkeypatch):
    from nanovllm import LLM, SamplingParams
    from tests.engine.conftest import random_prompts

    prompts = random_prompts([30, 3, 70], vocab=2048, seed=9)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    # A small step budget forces chunk continuations, which use the kernel too.
    config = dict(dtype="float32", block_size=4, num_kvcache_blocks=128, max_num_batched_tokens=24)  # bf16 rounds differently
    with_kernel = LLM(tiny_model_dir, **config)
    assert with_kernel.engine.runner.cpu_kernel is not None or CpuAttentionKernel.load() is None
    monkeypatch.setenv("NANOVLLM_CPU_KERNELS", "0")
    torch_path = LLM(tiny_model_dir, **config)
    assert torch_path.engine.runner.cpu_kernel is None
    a = with_kernel.generate(prompts, params, use_tqdm=False)
    b = torch_path.generate(prompts, params, use_tqdm=False)
    assert [o["token_ids"] for o in a] == [o["token_ids"] for o in b]


@pytest.mark.parametrize("head_dim", [64, 128, 40])
def test_specialised_head_sizes_match_reference(kernel, head_dim):
    # 64 and 128 take compile-time-specialised loops, 40 the generic one.
    kc, vc = paged_cache(num_blocks=30, block_size=16, kv_heads=2, head_dim=head_dim, seed=head_dim)
    torch.manual_seed(head_dim)
    tables = torch.stack([torch.randperm(30)[:6] for _ in range(4)])
    ctx = torch.tensor([1, 17, 96, 50])
    q = torch.randn(4, 8, head_dim)  # GQA 4
    out = kernel(q, kc, vc, tables, torch.arange(4), ctx, head_dim ** -0.5)
    expected = reference.paged_decode_attention(q, kc, vc, tables.int(), ctx.int(), head_dim ** -0.5)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_rising_scores_rescale_earlier_blocks(kernel):
    # The kernel keeps a running softmax, one cache block at a time: keys that grow along the
    # context raise the maximum block after block, so every earlier block's share is rescaled;
    # scores span ~100, so the smallest weights underflow to zero as they should.
    kc, vc = paged_cache(num_blocks=12, block_size=16, kv_heads=1, head_dim=64, seed=5)
    growth = torch.linspace(0.1, 4.0, 12 * 16).view(12, 16, 1, 1)
    kc = kc * growth
    q = torch.randn(3, 2, 64)
    tables = torch.arange(12).view(1, 12).expand(3, 12).contiguous()
    ctx = torch.tensor([192, 131, 9])
    out = kernel(q, kc, vc, tables, torch.arange(3), ctx, 0.5)
    expected = reference.paged_decode_attention(q, kc, vc, tables.int(), ctx.int(), 0.5)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_a_model_the_kernel_cannot_serve_gets_the_torch_path_with_its_masks(tiny_model_dir, monkeypatch):
    # float16 is outside the kernel: the runner must not hand it out, or the step metadata would
    # leave out the masks the torch path needs and decode rows would attend to padding.
    from nanovllm import LLM, SamplingParams
    from tests.engine.conftest import random_prompts

    prompts = random_prompts([30, 3, 70], vocab=2048, seed=9)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    config = dict(dtype="float16", block_size=4, num_kvcache_blocks=128, max_num_batched_tokens=24)
    default = LLM(tiny_model_dir, **config)
    assert default.engine.runner.cpu_kernel is None
    monkeypatch.setenv("NANOVLLM_CPU_KERNELS", "0")
    torch_path = LLM(tiny_model_dir, **config)
    a = default.generate(prompts, params, use_tqdm=False)
    b = torch_path.generate(prompts, params, use_tqdm=False)
    assert [o["token_ids"] for o in a] == [o["token_ids"] for o in b]


@pytest.mark.parametrize("head_dim", [64, 128, 40])
def test_bf16_cache_rows_match_the_fp32_reference_within_bf16_rounding(kernel, head_dim):
    # bf16 q and K/V are widened as read, accumulated in fp32, and the output rounded once.
    kc, vc = paged_cache(num_blocks=30, block_size=16, kv_heads=2, head_dim=head_dim, seed=head_dim)
    kc, vc = kc.bfloat16(), vc.bfloat16()
    torch.manual_seed(head_dim)
    tables = torch.stack([torch.randperm(30)[:6] for _ in range(5)])
    ctx = torch.tensor([1, 17, 96, 50, 0])
    qkv = torch.randn(5, 8 * head_dim + 4 * head_dim).bfloat16()
    q = qkv[:, : 8 * head_dim].view(5, 8, head_dim)  # strided rows, as from the fused projection
    out = kernel(q, kc, vc, tables, torch.arange(5), ctx, head_dim ** -0.5)
    assert out.dtype == torch.bfloat16
    expected = reference.paged_decode_attention(q.float().contiguous(), kc.float(), vc.float(), tables.int(),
                                                ctx.int(), head_dim ** -0.5)
    torch.testing.assert_close(out.float(), expected, rtol=8e-3, atol=4e-3)  # one bf16 rounding: 2^-8 relative
    assert torch.all(out[4] == 0)


def test_the_kernel_refuses_mixed_dtypes(kernel):
    kc, vc = paged_cache()
    with pytest.raises(TypeError, match="mix"):
        kernel(torch.randn(1, 2, 16).bfloat16(), kc, vc, torch.tensor([[0]]), torch.arange(1), torch.tensor([1]), 0.25)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128, 40])
@pytest.mark.parametrize("group", [2, 3])
@pytest.mark.parametrize("rows", [5, 1])  # one row: its heads are split over the threads, a group at a time
def test_grouped_gqa_heads_give_the_bits_of_heads_one_at_a_time(kernel, head_dim, dtype, group, rows):
    # The query heads of one KV head (pairs for an even group size, threes for a multiple of
    # three: the default model's 9 over 3) are computed together, each K and V row read once for
    # them all; with the KV heads duplicated per query head (group size 1) every head goes alone.
    # Same operations in the same order per head: the outputs must be identical.
    kc, vc = paged_cache(num_blocks=30, block_size=16, kv_heads=2, head_dim=head_dim, seed=7)
    kc, vc = kc.to(dtype), vc.to(dtype)
    torch.manual_seed(head_dim + 1)
    tables = torch.stack([torch.randperm(30)[:6] for _ in range(rows)])
    ctx = torch.tensor([1, 7, 96, 53, 23])[:rows] if rows > 1 else torch.tensor([90])  # remainders of 1..7 keys
    q = torch.randn(rows, 2 * group, head_dim).to(dtype)  # 2 * group query heads over 2 KV heads
    grouped = kernel(q, kc, vc, tables, torch.arange(rows), ctx, head_dim ** -0.5)
    single = kernel(q, kc.repeat_interleave(group, dim=2), vc.repeat_interleave(group, dim=2), tables,
                    torch.arange(rows), ctx, head_dim ** -0.5)
    assert torch.equal(grouped, single)


CHUNK_CASES = [  # (query heads, KV heads, head_dim, block_size, cached tokens, new rows)
    (4, 2, 16, 4, 0, 150),     # a fresh prompt of three row tiles (64 rows each), two query heads per KV head
    (6, 2, 64, 16, 37, 70),    # three query heads per KV head, after a prefix that ends mid-block
    (4, 4, 128, 16, 300, 9),   # one query head per KV head, a short chunk after a long prefix
    (7, 1, 40, 128, 5, 67),    # seven per KV head (lane groups mix rows), blocks longer than a key tile
    (8, 4, 65, 1, 64, 64),     # an odd head size, one-token blocks
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CHUNK_CASES, ids=lambda c: "h{}-kv{}-d{}-bs{}-cached{}-rows{}".format(*c))
def test_prompt_chunks_match_the_reference(kernel, case, dtype):
    # The chunk kernel works on tiles of rows and lanes of query vectors, with the causal mask per
    # lane; each row must still see exactly the positions before it, its cached prefix included.
    heads, kvh, d, bs, cached, rows = case
    blocks = -(-(cached + rows) // bs)
    g = torch.Generator().manual_seed(rows)
    kc, vc = (torch.randn(blocks + 3, bs, kvh, d, generator=g).to(dtype) for _ in range(2))
    table = torch.randperm(blocks + 3, generator=g)[:blocks]  # scattered blocks
    qkv = (2 * torch.randn(rows, (heads + 2 * kvh) * d, generator=g)).to(dtype)
    q = qkv[:, : heads * d].view(rows, heads, d)  # strided rows, as from the fused projection
    out = kernel.chunk(q, kc, vc, table, cached, d ** -0.5)
    assert out.dtype == dtype
    expected = reference.paged_prefill_attention(
        q.float().contiguous(), kc.float(), vc.float(), torch.tensor([0, rows], dtype=torch.int32),
        torch.tensor([cached + rows], dtype=torch.int32), table.view(1, -1).int(), d ** -0.5)
    tol = dict(rtol=2e-5, atol=2e-5) if dtype == torch.float32 else dict(rtol=8e-3, atol=4e-3)  # bf16: one rounding
    torch.testing.assert_close(out.float(), expected, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_step_of_decode_rows_and_prompt_chunks_matches_the_torch_path(kernel, dtype):
    # PagedAttention.forward hands decode rows to the row kernel and each prompt chunk, with its
    # own block table and cached length, to the chunk kernel; the torch path (gathers, masks and
    # SDPA) on the same step must give the same attention.
    from nanovllm.engine.step_input import StepInput, build_cpu_batch
    from nanovllm.layers.attention import PagedAttention

    bs, kvh, heads, d = 4, 2, 4, 16
    decode_ctx = [9, 30]
    chunks = [(0, 150), (100, 40), (7, 1)]  # (cached tokens, new tokens)
    tables, next_block = [], 0
    for length in decode_ctx + [start + n for start, n in chunks]:
        blocks = -(-length // bs)
        tables.append(list(range(next_block, next_block + blocks))[::-1])  # blocks out of order
        next_block += blocks
    step = StepInput([1] * len(decode_ctx), [c - 1 for c in decode_ctx], tables[:len(decode_ctx)],
                     [[1] * n for _, n in chunks], [start for start, _ in chunks], tables[len(decode_ctx):], [])
    g = torch.Generator().manual_seed(4)
    kc, vc = (torch.randn(next_block, bs, kvh, d, generator=g).to(dtype) for _ in range(2))
    q = torch.randn(len(decode_ctx) + sum(n for _, n in chunks), heads, d, generator=g).to(dtype)
    outs, calls = [], []
    for use_kernel in (True, False):
        _, _, meta = build_cpu_batch(step, bs, torch_attention=not use_kernel)
        k_new, v_new = (c.view(-1, kvh, d)[meta.slot_mapping].clone() for c in (kc, vc))  # this step's rows, as stored
        layer = PagedAttention(heads, kvh, d)
        layer.k_cache, layer.v_cache = kc, vc
        if use_kernel:
            class Counting:  # the kernel, noting which call took which rows
                def __call__(self, q_rows, *args):
                    calls.append(("rows", q_rows.shape[0]))
                    return kernel(q_rows, *args)

                def chunk(self, q_rows, *args):
                    calls.append(("chunk", q_rows.shape[0]))
                    return kernel.chunk(q_rows, *args)
            layer.cpu_kernel = Counting()
        outs.append(layer.forward(q, k_new, v_new, meta, kv_stored=True))
    assert calls == [("rows", 2), ("chunk", 150), ("chunk", 40), ("chunk", 1)]
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)  # bf16: SDPA rounds too
    torch.testing.assert_close(outs[0].float(), outs[1].float(), **tol)


def test_the_avx2_build_computes_the_same_attention(tmp_path):
    # The kernels take their vector width from the CPU they are built on: 16 lanes with AVX-512,
    # 8 with AVX2. Built here for an AVX2-only x86-64 (x86-64-v3), both kernels must still match
    # the reference, whatever this machine's own build uses.
    import ctypes
    import shutil
    import subprocess

    from nanovllm.layers.cpu_kernels import _SOURCES, cpu_flags

    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None or not {"avx2", "fma"} <= cpu_flags():
        pytest.skip("needs a C compiler and an x86-64 CPU with AVX2 and FMA")
    lib = tmp_path / "cpu_kernels_avx2.so"
    subprocess.run([compiler, "-O3", "-march=x86-64-v3", "-fopenmp", "-fPIC", "-shared", "-o", str(lib), *_SOURCES,
                    "-lm"], check=True, capture_output=True)
    avx2 = CpuAttentionKernel(ctypes.CDLL(str(lib)))
    heads, kvh, d, bs, cached, rows = 6, 2, 64, 16, 37, 70
    g = torch.Generator().manual_seed(11)
    kc, vc = (torch.randn(12, bs, kvh, d, generator=g) for _ in range(2))
    table = torch.randperm(12, generator=g)[:7]
    q = torch.randn(rows, heads, d, generator=g)
    out = avx2.chunk(q, kc, vc, table, cached, 0.125)
    expected = reference.paged_prefill_attention(q, kc, vc, torch.tensor([0, rows], dtype=torch.int32),
                                                 torch.tensor([cached + rows], dtype=torch.int32),
                                                 table.view(1, -1).int(), 0.125)
    torch.testing.assert_close(out, expected, rtol=2e-5, atol=2e-5)
    tables, ctx = table.view(1, -1).expand(3, -1).contiguous(), torch.tensor([1, 50, 107])
    out = avx2(q[:3], kc, vc, tables, torch.arange(3), ctx, 0.125)
    expected = reference.paged_decode_attention(q[:3], kc, vc, tables.int(), ctx.int(), 0.125)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
