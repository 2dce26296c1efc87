"""The CUDA path through the whole engine: Triton attention equals the CPU path, CUDA graphs equal
eager decode, the fused Triton decoder ops equal torch's, the KV budget follows
gpu_memory_utilization, overlapped steps equal synchronous ones and launch without a CUDA sync.
Skipped without CUDA.

fp32 throughout the equality tests (the Triton dots run in IEEE fp32, cuBLAS without TF32 by
default), on tiny models whose peaked logits keep greedy choices far from ties.
"""
from __future__ import annotations

import socket

import pytest
import torch

from nanovllm import LLM, SamplingParams
from tests.engine.conftest import random_prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def token_ids(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o["token_ids"] for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def prefix_sharing_prompts(seed: int) -> list[list[int]]:
    shared = random_prompts([37], vocab=2048, seed=seed)[0]
    return [shared + p for p in random_prompts([3, 20, 1], 2048, seed + 1)] + random_prompts([90, 2, 33, 64], 2048, seed + 2)


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen2"])
def test_triton_path_matches_the_cpu_path(tiny_models, arch):
    # A 24-token step budget makes prompts continue after cached blocks (chunks and prefix hits)
    # and mixes prefill chunks with decode rows in one step.
    config = dict(block_size=8, num_kvcache_blocks=256, max_num_batched_tokens=24, dtype="float32")
    prompts = prefix_sharing_prompts(seed=len(arch))
    cpu = LLM(tiny_models[arch], device="cpu", **config)
    gpu = LLM(tiny_models[arch], device="cuda", enforce_eager=True, **config)
    assert gpu.engine.runner.graphs is None
    assert token_ids(gpu, prompts) == token_ids(cpu, prompts)
    assert gpu.engine.block_manager.prefix_cache_hits > 0


@pytest.mark.parametrize("num_prompts", [1, 3, 5, 12])
def test_cuda_graph_decode_matches_eager(tiny_model_dir, num_prompts):
    # max_num_seqs 12: buckets 1, 2, 4, 8, 12, so 3 and 5 sequences replay padded graphs.
    config = dict(block_size=8, num_kvcache_blocks=256, max_num_seqs=12, dtype="float32")
    prompts = random_prompts([5 + 7 * i for i in range(num_prompts)], vocab=2048, seed=num_prompts)
    eager = LLM(tiny_model_dir, device="cuda", enforce_eager=True, **config)
    graphed = LLM(tiny_model_dir, device="cuda", **config)
    graphs = graphed.engine.runner.graphs
    assert graphs is not None and graphs.sizes == [1, 2, 4, 8, 12]
    assert token_ids(graphed, prompts) == token_ids(eager, prompts)
    assert graphs.num_replays >= GREEDY.max_tokens - 1


def test_bf16_with_graphs_generates(tiny_model_dir):
    llm = LLM(tiny_model_dir, device="cuda", num_kvcache_blocks=128, max_num_seqs=8)  # auto dtype: bf16 on CUDA
    assert llm.engine.runner.dtype == torch.bfloat16
    outs = token_ids(llm, random_prompts([4, 19, 60], vocab=2048, seed=4))
    assert all(len(o) == GREEDY.max_tokens for o in outs)
    assert llm.engine.runner.graphs.num_replays > 0


def test_fused_triton_ops_match_the_torch_ops_with_graphs(tiny_model_dir, monkeypatch):
    # Greedy tokens agree with the unfused CUDA path through prefill (eager) and graphed decode
    # with padded buckets (fp32: the kernels' sums run in another order than torch's).
    config = dict(block_size=8, num_kvcache_blocks=256, max_num_seqs=6, dtype="float32")
    prompts = random_prompts([4, 19, 60, 7, 33], vocab=2048, seed=7)
    fused = LLM(tiny_model_dir, device="cuda", **config)
    model = fused.engine.runner.model.model
    assert model.norm.gpu_ops is not None and model.layers[0].mlp.gpu_ops is not None
    got = token_ids(fused, prompts)
    monkeypatch.setenv("NANOVLLM_TRITON_FUSED", "0")
    plain = LLM(tiny_model_dir, device="cuda", **config)
    assert plain.engine.runner.model.model.norm.gpu_ops is None
    assert got == token_ids(plain, prompts)
    assert fused.engine.runner.graphs.num_replays > 0


def test_overlapped_steps_equal_synchronous_ones_with_graphs(tiny_model_dir):
    # The same greedy tokens with the host one step behind the GPU (stand-ins resolved on the
    # device, tokens read back a step late) as with the host waiting every step. fp32: a stop
    # lands a step later overlapped, so a step's batch can differ in size, and a bf16 GEMM's
    # rounding may change with it (the launch test below runs bf16).
    config = dict(block_size=8, num_kvcache_blocks=256, max_num_seqs=6, dtype="float32", max_num_batched_tokens=32)
    prompts = prefix_sharing_prompts(seed=3)
    sync = LLM(tiny_model_dir, device="cuda", overlap_scheduling=False, **config)
    overlapped = LLM(tiny_model_dir, device="cuda", **config)  # the default on CUDA
    assert overlapped.engine.overlap and not sync.engine.overlap
    assert token_ids(overlapped, prompts) == token_ids(sync, prompts)
    assert overlapped.engine.runner.graphs.num_replays > 0


@pytest.mark.parametrize("params", [
    GREEDY, SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=1, max_tokens=20, ignore_eos=True),
    SamplingParams(temperature=0.7, top_p=0.95, repetition_penalty=1.2, frequency_penalty=0.5, logit_bias={5: 3.0},
                   max_tokens=20, ignore_eos=True)], ids=["greedy", "top-k-top-p", "penalties-bias"])
def test_an_overlapped_decode_step_never_waits_for_the_gpu(tiny_model_dir, monkeypatch, params):
    # Launching a decode step (inputs, stand-ins, graph replay, sampling, the copy back) makes no
    # synchronising CUDA call: torch's sync debug mode turns any into an error.
    llm = LLM(tiny_model_dir, device="cuda", num_kvcache_blocks=128, max_num_seqs=8)
    engine = llm.engine
    launch, checked = engine._launch, []

    def checked_launch(scheduled):
        if not all(item.num_new_tokens == 1 for item in scheduled):
            return launch(scheduled)
        torch.cuda.set_sync_debug_mode("error")
        try:
            return launch(scheduled)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            checked.append(len(scheduled))

    monkeypatch.setattr(engine, "_launch", checked_launch)
    outs = llm.generate(random_prompts([4, 19, 60], vocab=2048, seed=5), params, use_tqdm=False)
    assert all(len(o["token_ids"]) == 20 for o in outs) and len(checked) >= 15


def test_kv_budget_follows_gpu_memory_utilization(tiny_model_dir):
    llm = LLM(tiny_model_dir, device="cuda", gpu_memory_utilization=0.05, enforce_eager=True)
    runner = llm.engine.runner
    total = torch.cuda.mem_get_info()[1]
    assert runner.num_blocks >= 1
    assert runner.num_blocks * runner.bytes_per_block <= 0.05 * total
    del llm, runner
    with pytest.raises(ValueError, match="no KV-cache block fits"):
        LLM(tiny_model_dir, device="cuda", gpu_memory_utilization=1e-6, enforce_eager=True)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tp2_over_nccl_matches_tp1(tiny_model_dir):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = dict(device="cuda", dtype="float32", num_kvcache_blocks=128, max_num_seqs=8)
    prompts = random_prompts([6, 31, 2], vocab=2048, seed=11)
    expected = token_ids(LLM(tiny_model_dir, **config), prompts)
    llm = LLM(tiny_model_dir, tensor_parallel_size=2, dist_init_method=f"tcp://127.0.0.1:{port}", **config)
    try:
        assert token_ids(llm, prompts) == expected
    finally:
        llm.engine.runner.close()
