"""Post-step hooks: a metrics snapshot after every step; a failing hook is logged and removed."""
from __future__ import annotations

import logging

from nanovllm.engine.hooks import StepMetrics
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.sampling_params import SamplingParams
from tests.engine.conftest import random_prompts


def test_hooks_see_every_step_and_a_failing_hook_is_removed(tiny_model_dir, caplog):
    engine = LLMEngine(model=tiny_model_dir, num_kvcache_blocks=64, block_size=4, max_num_batched_tokens=32)
    snapshots: list[StepMetrics] = []
    calls = []

    def flaky(m: StepMetrics) -> None:
        calls.append(m.step)
        if m.step == 2:
            raise RuntimeError("dashboard is down")

    engine.add_post_step_hook(snapshots.append)
    engine.add_post_step_hook(flaky)
    prompts = random_prompts([20, 9, 5], vocab=2048, seed=4)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    with caplog.at_level(logging.ERROR, logger="nanovllm.engine.hooks"):
        while engine.has_unfinished_requests():
            engine.step()
    assert calls == [1, 2] and len(engine.post_step_hooks) == 1
    assert "dashboard is down" in caplog.text and "removing it" in caplog.text
    assert [m.step for m in snapshots] == list(range(1, engine.num_steps + 1))

    first = snapshots[0]
    assert first.num_seqs == 3 and first.num_prefill_tokens == 32 and first.num_decode_tokens == 0  # the step budget
    assert first.num_kv_blocks_total == 64 and first.num_kv_blocks_used == 5 + 3 + 1  # 20, 9 and 3 of 5 tokens
    assert first.num_running == 3 and first.num_waiting == 0 and first.step_time_s > 0
    assert sum(m.num_prefill_tokens for m in snapshots) == sum(map(len, prompts))
    assert sum(m.num_decode_tokens for m in snapshots) == 3 * (6 - 1)
    # The first step completes two prompts, each sampling its first token; no decode yet.
    assert first.num_generated_tokens == 2 and len(first.queue_times_s) == 3
    assert sum(m.num_generated_tokens for m in snapshots) == 3 * 6
    last = snapshots[-1]
    assert (last.num_running, last.num_waiting, last.num_kv_blocks_used) == (0, 0, 0)

    # The same prompt again: its full blocks come from the prefix cache.
    engine.add_request("again", prompts[0], params)
    engine.step()
    m = snapshots[-1]
    assert m.prefix_cache_queries == sum(map(len, prompts)) + 20 and m.prefix_cache_hits == 16
    assert m.to_dict()["num_tokens"] == m.num_prefill_tokens + m.num_decode_tokens == 4


def test_preemptions_show_in_the_snapshot_and_hooks_can_be_removed(tiny_model_dir):
    engine = LLMEngine(model=tiny_model_dir, num_kvcache_blocks=8, block_size=4)
    seen: list[StepMetrics] = []
    engine.add_post_step_hook(seen.append)
    for i, p in enumerate(random_prompts([8, 8], vocab=2048, seed=2)):
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    assert seen[-1].num_preemptions == engine.scheduler.num_preemptions > 0
    assert max(m.num_kv_blocks_used for m in seen) == 8 and max(m.kv_cache_usage for m in seen) == 1.0
    assert engine.remove_post_step_hook(seen.append) and not engine.remove_post_step_hook(seen.append)
    n = len(seen)
    engine.add_request("x", [1, 2, 3], SamplingParams(max_tokens=1))
    engine.step()
    assert len(seen) == n


def test_generated_tokens_and_queue_times_add_up_across_preemption(tiny_model_dir):
    # Three requests in a cache too small for them: some are preempted and admitted again, and
    # one waits behind the others before its first admission.
    engine = LLMEngine(model=tiny_model_dir, num_kvcache_blocks=10, block_size=4, max_num_seqs=2)
    seen: list[StepMetrics] = []
    engine.add_post_step_hook(seen.append)
    produced = {}
    max_tokens = [20, 17, 1]
    for i, (p, n) in enumerate(zip(random_prompts([8, 9, 6], vocab=2048, seed=5), max_tokens)):
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    engine.add_request("gone", [1, 2, 3], SamplingParams(max_tokens=4))
    engine.abort("gone")  # never scheduled: no queue time
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                produced[out.request_id] = out.num_output_tokens
    assert engine.scheduler.num_preemptions > 0
    assert sum(m.num_generated_tokens for m in seen) == sum(produced.values()) == sum(max_tokens)
    assert all(m.num_generated_tokens >= m.num_decode_tokens for m in seen)
    queue_times = [t for m in seen for t in m.queue_times_s]
    assert len(queue_times) == 3 and all(t >= 0 for t in queue_times)  # once per request, preempted or not
    first_admitted = [i for i, m in enumerate(seen) if m.queue_times_s]
    assert len(seen[first_admitted[0]].queue_times_s) == 2  # max_num_seqs: the third waits
    assert seen[first_admitted[-1]].queue_times_s[0] > max(seen[first_admitted[0]].queue_times_s)
    assert seen[-1].to_dict()["queue_times_s"] == ()
