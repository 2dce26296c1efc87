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
