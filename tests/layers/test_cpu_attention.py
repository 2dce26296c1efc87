"""The compiled CPU attention kernel and the torch path agree with the plain references."""
from __future__ import annotations

import pytest
import torch

from nanovllm.kernels import reference
from nanovllm.layers.cpu_kernels import CpuAttentionKernel


@pytest.fixture(scope="module")
def kernel(kernel_threads):
    k = CpuAttentionKernel.load()
    if k is None:
        pytest.skip("no C compiler on this machine")
    return k


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
def test_paired_gqa_heads_give_the_bits_of_heads_one_at_a_time(kernel, head_dim, dtype):
    # Two query heads of one KV head (an even group size) are computed together, each K and V
    # row read once for both; with the KV heads duplicated per query head (group size 1) every
    # head goes alone. Same operations in the same order per head: the outputs must be identical.
    kc, vc = paged_cache(num_blocks=30, block_size=16, kv_heads=2, head_dim=head_dim, seed=7)
    kc, vc = kc.to(dtype), vc.to(dtype)
    torch.manual_seed(head_dim + 1)
    tables = torch.stack([torch.randperm(30)[:6] for _ in range(5)])
    ctx = torch.tensor([1, 7, 96, 53, 23])  # block remainders of 1..7 keys and whole blocks
    q = torch.randn(5, 4, head_dim).to(dtype)  # 4 query heads over 2 KV heads: pairs
    paired = kernel(q, kc, vc, tables, torch.arange(5), ctx, head_dim ** -0.5)
    single = kernel(q, kc.repeat_interleave(2, dim=2), vc.repeat_interleave(2, dim=2), tables, torch.arange(5), ctx,
                    head_dim ** -0.5)
    assert torch.equal(paired, single)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_prompt_chunks_go_to_sdpa_and_short_ones_to_the_kernel(kernel, dtype):
    # Three prompt chunks in one step: a fresh long prompt and a chunk after a long cached prefix
    # (SDPA attends both, causal and with the offset mask), and a chunk after a short prefix (the
    # kernel). All three must give the reference attention, whichever path took them.
    from nanovllm.engine.step_input import StepInput, build_cpu_batch
    from nanovllm.layers.attention import SDPA_MIN_CONTEXT, SDPA_MIN_ROWS, PagedAttention, prefill_uses_sdpa

    bs, kvh, heads, d = 4, 2, 4, 16
    rows = SDPA_MIN_ROWS
    chunks = [(0, SDPA_MIN_CONTEXT + 5), (SDPA_MIN_CONTEXT, rows), (100, rows)]  # (cached tokens, new tokens)
    assert [prefill_uses_sdpa(n, start) for start, n in chunks] == [True, True, False]
    tables, next_block = [], 0
    for start, n in chunks:
        blocks = -(-(start + n) // bs)
        tables.append(list(range(next_block, next_block + blocks))[::-1])  # blocks out of order
        next_block += blocks
    step = StepInput([], [], [], [[1] * n for _, n in chunks], [start for start, _ in chunks], tables, [])
    _, _, meta = build_cpu_batch(step, bs, torch_attention=False)
    assert [s.mask is not None for s in meta.prefills] == [False, True, False]  # only SDPA after a prefix needs one

    g = torch.Generator().manual_seed(4)
    kc, vc = (torch.randn(next_block, bs, kvh, d, generator=g).to(dtype) for _ in range(2))
    total = sum(n for _, n in chunks)
    q = torch.randn(total, heads, d, generator=g).to(dtype)
    k_new, v_new = (kc.view(-1, kvh, d)[meta.slot_mapping].clone() for kc in (kc, vc))  # this step's rows, as stored
    layer = PagedAttention(heads, kvh, d)
    layer.k_cache, layer.v_cache = kc, vc
    rows_seen = []

    def counting_kernel(q_rows, *args):
        rows_seen.append(q_rows.shape[0])
        return kernel(q_rows, *args)

    layer.cpu_kernel = counting_kernel
    out = layer.forward(q, k_new, v_new, meta, kv_stored=True)
    assert rows_seen == [rows]  # the short chunk only
    cu = torch.tensor([0] + [sum(n for _, n in chunks[:i + 1]) for i in range(3)], dtype=torch.int32)
    context = torch.tensor([start + n for start, n in chunks], dtype=torch.int32)
    table = torch.tensor([t + [0] * (max(map(len, tables)) - len(t)) for t in tables], dtype=torch.int32)
    expected = reference.paged_prefill_attention(q.float(), kc.float(), vc.float(), cu, context, table, layer.scale)
    tol = 1e-4 if dtype == torch.float32 else 2e-2  # bf16: within bf16 rounding of outputs of order 1
    torch.testing.assert_close(out.float(), expected, rtol=tol, atol=tol)
