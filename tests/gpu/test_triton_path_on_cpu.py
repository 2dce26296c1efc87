"""The engine's CUDA attention path, run on CPU: Triton kernels under TRITON_INTERPRET, the runner's
varlen metadata (build_gpu_batch) and the CUDA-graph input padding, against the CPU path.

A GPU runs the real thing (test_gpu_engine.py); this keeps the metadata and the padding honest
in CI, with the decoder's elementwise work in torch ops or in the fused Triton kernels
(kernels/triton_fused.py) as the CUDA runner runs it. The graph replay is swapped for an eager
call on the graph's own input buffers, so the padded rows (slot -1, context length 0) go through
the kernels exactly as a replay sends them. Overlapped (`overlap_scheduling`), the decode
inputs' stand-ins for tokens still on the device go through the same buffers.
"""
from __future__ import annotations

import os

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("CUDA present: test_gpu_engine.py runs the real kernels", allow_module_level=True)
os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel module is imported
pytest.importorskip("triton")

from nanovllm import LLM, SamplingParams  # noqa: E402
from nanovllm.engine.cuda_graphs import DecodeGraphs  # noqa: E402
from nanovllm.kernels import triton_attention, triton_fused  # noqa: E402
from tests.engine.conftest import random_prompts  # noqa: E402


class EagerReplay(DecodeGraphs):
    """DecodeGraphs whose 'replay' runs the model on the padded input buffers."""

    def _capture(self, model) -> None:
        self.model = model
        self.graphs = dict.fromkeys(self.sizes)

    def _replay(self, batch: int) -> None:
        self.hidden[:batch] = self.model(self.input_ids[:batch], self.positions[:batch], self._metadata(batch))


@pytest.mark.parametrize("fused, overlap", [(False, False), (True, False), (True, True)],
                         ids=["torch-elementwise", "triton-fused", "triton-fused-overlapped"])
def test_triton_path_with_padded_decode_batches_matches_the_cpu_path(tiny_model_dir, fused, overlap):
    # Prefix hits and a 16-token step budget: chunks continue after cached blocks, mixed with
    # decode rows; max_num_seqs 6 gives buckets 1, 2, 4, 6, so 5 running sequences pad to 6.
    shared = random_prompts([13], vocab=2048, seed=1)[0]
    prompts = [shared + p for p in random_prompts([3, 9], 2048, 2)] + random_prompts([20, 2, 6], 2048, 3)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    config = dict(block_size=4, num_kvcache_blocks=100, max_num_batched_tokens=16, max_num_seqs=6, max_model_len=64)
    expected = LLM(tiny_model_dir, **config).generate(prompts, params, use_tqdm=False)

    llm = LLM(tiny_model_dir, overlap_scheduling=overlap, **config)  # overlapped: the stand-ins go through the graphs
    runner = llm.engine.runner
    runner.set_attention_kernels(None, triton_attention)
    if fused:  # norms, q/k norm + rotary + cache store, SiLU-and-multiply as the CUDA runner sets them
        runner.set_gpu_ops(triton_fused.TritonFusedOps())
    runner.graphs = EagerReplay(runner.model, 6, runner.max_blocks_per_seq, runner.model_config.hidden_size,
                                runner.dtype, runner.device)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [o["token_ids"] for o in got] == [o["token_ids"] for o in expected]
    assert runner.graphs.sizes == [1, 2, 4, 6] and runner.graphs.num_replays > 0
    assert llm.engine.block_manager.prefix_cache_hits > 0


def test_verification_rows_on_the_triton_path_and_graphs_give_the_plain_output(tiny_model_dir):
    """Speculative decoding's k+1 decode rows of one sequence through the Triton decode kernel and
    the graph buffers (padded to a bucket), against the CPU path without speculation. float32: in
    bf16 the Triton and CPU paths round differently enough to part on this model at batch 1 with
    speculation off too. The proposer knows the answer and is right for 0..k tokens, so drafts of
    every acceptance length go through the kernels."""
    from tests.engine.test_speculative import forced_proposer
    phrase = random_prompts([4], vocab=2048, seed=4)[0]
    prompts = [phrase * 4, random_prompts([7], 2048, 5)[0]]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    config = dict(block_size=4, num_kvcache_blocks=100, max_num_batched_tokens=32, max_num_seqs=6, max_model_len=64,
                  dtype="float32")
    plain = LLM(tiny_model_dir, **config)
    expected = [plain.generate([p], params, use_tqdm=False)[0]["token_ids"] for p in prompts]

    llm = LLM(tiny_model_dir, speculative="ngram", **config)
    llm.engine.speculator.draft = forced_proposer(prompts, expected)
    runner = llm.engine.runner
    runner.set_attention_kernels(None, triton_attention)
    runner.set_gpu_ops(triton_fused.TritonFusedOps())
    runner.graphs = EagerReplay(runner.model, 6, runner.max_blocks_per_seq, runner.model_config.hidden_size,
                                runner.dtype, runner.device)
    got = [llm.generate([p], params, use_tqdm=False)[0]["token_ids"] for p in prompts]
    assert got == expected
    c = llm.engine.speculator.counters
    assert 0 < c.num_accepted_tokens < c.num_draft_tokens and runner.graphs.num_replays > 0
