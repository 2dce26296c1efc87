"""The overlapped step (Config.overlap_scheduling) against the synchronous one.

The overlapped step launches step t+1 before reading step t's tokens back: decode inputs are
stand-ins resolved on the device, stops and aborts land one step late, and a request that needs
the host's sampler, or a step that would preempt, runs synchronously. On CPU nothing runs in
parallel, but the code path is the one CUDA runs (the same scheduler calls, stand-ins, device-side
sampling and late settling), so its results must equal the synchronous engine's: token for token
for greedy and seeded requests, with the same finish reasons, every KV block free at the end. The
GPU check runs this file on CUDA too, where the host really is a step ahead of the device.
"""
from __future__ import annotations

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from nanovllm import LLM, SamplingParams
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.layers.pending import is_pending
from nanovllm_client.protocol import FinishReason
from tests.engine.conftest import finish_all, random_prompts

CONFIG = dict(block_size=4, num_kvcache_blocks=200, max_num_batched_tokens=16, max_num_seqs=4, max_model_len=96,
              dtype="float32")
"""float32: a stop lands a step later overlapped, so batches differ in size for a step; on a GPU a
bf16 GEMM's rounding may change with the batch size, and these tests compare tokens exactly."""


def generate(model_dir: str, prompts, params, overlap: bool, **config):
    llm = LLM(model_dir, overlap_scheduling=overlap, **{**CONFIG, **config})
    assert llm.engine.overlap is overlap
    outputs = llm.generate(prompts, params, use_tqdm=False)
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_total_blocks and not llm.engine.requests
    return [(o["token_ids"], o["finish_reason"]) for o in outputs], llm.engine


def prompts_with_a_shared_prefix() -> list[list[int]]:
    shared = random_prompts([13], vocab=2048, seed=1)[0]
    return [shared + p for p in random_prompts([3, 9], 2048, 2)] + random_prompts([30, 2, 17, 6, 41], 2048, 3)


def test_overlapped_greedy_equals_synchronous_with_stops_lengths_chunks_and_a_queue(tiny_model_dir):
    prompts = prompts_with_a_shared_prefix()
    lengths = [8, 20, 3, 15, 1, 12, 25]
    plain = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    reference, _ = generate(tiny_model_dir, prompts, plain, overlap=False)
    # A stop token each request meets mid-way (its 3rd token, or the last one it has): the stop
    # is read one step after the token was sampled, and the token computed meanwhile is dropped.
    stops = [SamplingParams(temperature=0, max_tokens=n, stop_token_ids=[tokens[min(2, len(tokens) - 1)]])
             for n, (tokens, _) in zip(lengths, reference)]
    expected, _ = generate(tiny_model_dir, prompts, stops, overlap=False)
    got, engine = generate(tiny_model_dir, prompts, stops, overlap=True)
    assert got == expected
    assert sum(reason == "stop" for _, reason in got) >= 4  # the stops did land
    assert engine.block_manager.prefix_cache_hits > 0
    got_plain, _ = generate(tiny_model_dir, prompts, plain, overlap=True)
    assert got_plain == reference


def test_overlapped_seeded_and_filtered_sampling_equals_synchronous(tiny_model_dir):
    prompts = random_prompts([7, 19, 4, 25, 11], 2048, 5)
    params = [SamplingParams(temperature=0.9, seed=11, max_tokens=14, ignore_eos=True),
              SamplingParams(temperature=0.7, top_k=20, seed=12, max_tokens=9, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=1.2, top_p=0.8, min_p=0.02, seed=13, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=0.5, top_k=5, top_p=0.9, seed=14, max_tokens=10, ignore_eos=True)]
    expected, _ = generate(tiny_model_dir, prompts, params, overlap=False)
    got, _ = generate(tiny_model_dir, prompts, params, overlap=True)
    assert got == expected


def test_penalties_and_logit_bias_are_sampled_on_the_device_as_on_the_host(tiny_model_dir, monkeypatch):
    # The penalties' token lists end with the stand-in for the token still on the device, which
    # is resolved there: the same tokens as the synchronous sampler's, and no step synchronous.
    prompts = random_prompts([9, 14, 6, 11], 2048, 7)
    params = [SamplingParams(temperature=0, max_tokens=18, repetition_penalty=1.3, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=16, presence_penalty=1.5, frequency_penalty=0.7, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=5, max_tokens=14, frequency_penalty=2.0, top_k=30, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=15, logit_bias={7: 5.0, 900: -100.0}, ignore_eos=True)]
    expected, _ = generate(tiny_model_dir, prompts, params, overlap=False)
    sampled_on_host = []
    original = LLMEngine._launch

    def launch(self, scheduled):
        sampled_on_host.append(bool(self._host_sampled))
        return original(self, scheduled)

    monkeypatch.setattr(LLMEngine, "_launch", launch)
    got, engine = generate(tiny_model_dir, prompts, params, overlap=True)
    assert got == expected
    assert sampled_on_host and not any(sampled_on_host)
    unpenalized, _ = generate(tiny_model_dir, prompts[:2], [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                                                            for n in (18, 16)], overlap=True)
    assert [tokens for tokens, _ in got[:2]] != [tokens for tokens, _ in unpenalized]  # the penalties did act


def test_a_request_that_needs_the_host_sampler_makes_steps_synchronous_while_it_lives(tiny_model_dir):
    prompts = random_prompts([9, 14, 6], 2048, 7)
    params = [SamplingParams(temperature=0, max_tokens=18, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=6, min_tokens=3, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=18, ignore_eos=True, logprobs=2)]
    expected, _ = generate(tiny_model_dir, prompts, params, overlap=False)
    got, engine = generate(tiny_model_dir, prompts, params, overlap=True)
    assert got == expected
    assert not engine._host_sampled


def test_overlapped_steps_under_preemption_equal_synchronous(tiny_model_dir):
    # 40 blocks of 4 tokens for 6 sequences growing to ~60 tokens each: preemption is due often,
    # and each time the step before is read back first (a preempted sequence is recomputed).
    prompts = random_prompts([20, 25, 18, 30, 22, 27], 2048, 9)
    params = SamplingParams(temperature=0, max_tokens=36, ignore_eos=True)
    config = dict(num_kvcache_blocks=40, max_num_seqs=6, max_num_batched_tokens=64)
    expected, sync_engine = generate(tiny_model_dir, prompts, params, overlap=False, **config)
    got, engine = generate(tiny_model_dir, prompts, params, overlap=True, **config)
    assert got == expected
    assert engine.scheduler.num_preemptions > 0


def test_abort_while_the_step_is_in_flight_ends_it_once_and_drops_its_token(tiny_model_dir):
    engine = LLMEngine(model=tiny_model_dir, overlap_scheduling=True, **CONFIG)
    prompts = random_prompts([5, 8, 11], 2048, 4)
    ids = ["a", "b", "c"]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    terminal = {rid: 0 for rid in ids}
    tokens = {rid: [] for rid in ids}

    def step():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            terminal[out.request_id] += out.finished
            if out.finished and out.request_id == "b":
                assert out.finish_reason is FinishReason.ABORT

    for _ in range(4):
        step()
    b = engine.requests["b"]
    assert engine._pending is not None and is_pending(b.token_ids[-1])  # its newest token is still on the device
    assert engine.abort("b")
    assert not any(is_pending(t) for t in b.token_ids)
    finish_all(engine, step, ids, terminal)
    assert tokens["b"] == b.output_token_ids and all(t >= 0 for t in tokens["b"])
    assert len(tokens["a"]) == len(tokens["c"]) == 10


def test_a_row_the_device_could_not_sample_ends_its_request_with_the_reason(tiny_model_dir, monkeypatch):
    engine = LLMEngine(model=tiny_model_dir, overlap_scheduling=True, **CONFIG)
    prompts = random_prompts([6, 9], 2048, 6)
    engine.add_request("bad", prompts[0], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    engine.add_request("good", prompts[1], SamplingParams(temperature=0.8, seed=3, max_tokens=8, ignore_eos=True))
    run = engine.runner.run
    steps = []

    def nan_for_bad_on_third_step(scheduled, previous=None):
        logits = run(scheduled, previous)
        steps.append(1)
        rows = [item.seq.request_id for item in scheduled if item.samples]
        if len(steps) == 3 and "bad" in rows:
            with torch.inference_mode():
                logits[rows.index("bad")] = float("nan")
        return logits

    monkeypatch.setattr(engine.runner, "run", nan_for_bad_on_third_step)
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    bad, good = outs["bad"][-1], outs["good"][-1]
    assert bad.finish_reason is FinishReason.ERROR and "NaN" in bad.error
    assert bad.num_output_tokens == 2  # the two tokens before the failed one
    assert good.finish_reason is FinishReason.LENGTH and good.num_output_tokens == 8


class NoReadBack(TorchDispatchMode):
    """Fails on the ops that read a tensor's value back to the host (on CUDA each waits for the
    device): .item(), bool(), int(), nonzero(), equal()."""

    READS = {"_local_scalar_dense", "is_nonzero", "nonzero", "equal"}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.split(".")[0] in self.READS:
            raise AssertionError(f"{func} reads a value back inside an overlapped step")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def no_read_back():
    def tolist(self):
        raise AssertionError("tolist() reads values back inside an overlapped step")

    original = torch.Tensor.tolist
    torch.Tensor.tolist = tolist
    try:
        with NoReadBack():
            yield
    finally:
        torch.Tensor.tolist = original


@pytest.mark.parametrize("params", [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                                    SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=2, max_tokens=12,
                                                   ignore_eos=True),
                                    SamplingParams(temperature=0.7, top_p=0.95, repetition_penalty=1.2,
                                                   presence_penalty=0.5, frequency_penalty=0.5,
                                                   logit_bias={5: 3.0}, max_tokens=12, ignore_eos=True)],
                         ids=["greedy", "top-k-top-p", "penalties-bias"])
def test_an_overlapped_decode_step_reads_nothing_back(tiny_model_dir, monkeypatch, params):
    # The launch of a decode step (inputs, forward, sampling, the copy back) must not read a
    # device value on the host: on CUDA any such read waits for the step before to finish.
    engine = LLMEngine(model=tiny_model_dir, overlap_scheduling=True, **CONFIG)
    launch = engine._launch
    guarded = []

    def guarded_launch(scheduled):
        if all(item.num_new_tokens == 1 for item in scheduled):
            guarded.append(len(scheduled))
            with no_read_back():
                return launch(scheduled)
        return launch(scheduled)

    monkeypatch.setattr(engine, "_launch", guarded_launch)
    for i, prompt in enumerate(random_prompts([5, 9, 7], 2048, 8)):
        engine.add_request(str(i), prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
    assert len(guarded) >= 10


def test_overlap_is_on_by_default_with_cuda_only_and_refused_with_tensor_parallelism(tiny_model_dir):
    from nanovllm.config import Config
    engine = LLMEngine(model=tiny_model_dir, **CONFIG)
    assert engine.overlap is (engine.runner.device.type == "cuda")
    with pytest.raises(ValueError, match="overlap_scheduling"):
        Config(overlap_scheduling=True, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="overlap_scheduling"):
        Config(overlap_scheduling="yes")
