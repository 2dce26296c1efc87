"""EngineMetrics as a real post-step hook on a tiny-model engine, read back over HTTP."""
from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from nanovllm.engine.hooks import StepMetrics
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.metrics import EngineMetrics, serve_metrics
from nanovllm.sampling_params import SamplingParams
from tests.engine.conftest import random_prompts
from tests.metrics.conftest import Scrape


def run_to_end(engine: LLMEngine) -> dict[str, int]:
    """Step until idle; each request's final output token count."""
    produced = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                produced[out.request_id] = out.num_output_tokens
    return produced


def test_engine_metrics_match_the_run(tiny_model_dir):
    engine = LLMEngine(model=tiny_model_dir, num_kvcache_blocks=256, block_size=4, max_num_batched_tokens=32)
    metrics = EngineMetrics(CollectorRegistry())
    snapshots: list[StepMetrics] = []
    engine.add_post_step_hook(metrics)
    engine.add_post_step_hook(snapshots.append)
    shared = random_prompts([16], vocab=2048, seed=21)[0]
    prompts = [shared + tail for tail in random_prompts([7, 30, 3, 12], vocab=2048, seed=22)]
    max_tokens = [5, 9, 1, 14]
    with serve_metrics(metrics.registry) as server:
        before = Scrape(server.port)
        assert before("nanovllm:engine_state", state="loading") == 1.0
        assert before("nanovllm:generation_tokens_total") == 0.0 and before("nanovllm:step_time_seconds_count") == 0.0
        metrics.set_state("ready")

        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in max_tokens]
        engine.add_request("first", prompts[0], params[0])
        produced = run_to_end(engine)  # the shared prefix is now in the cache
        for i, (p, sp) in enumerate(zip(prompts[1:], params[1:])):
            engine.add_request(str(i), p, sp)
        produced |= run_to_end(engine)
        metrics.set_live(3, 3000)
        metrics.set_queued(7, 7000)
        got = Scrape(server.port)

    assert engine.scheduler.num_preemptions == 0
    assert sorted(produced.values()) == sorted(max_tokens)
    assert got("nanovllm:generation_tokens_total") == sum(produced.values()) == sum(max_tokens)
    hits = got("nanovllm:prefix_cache_hits_total")
    assert hits >= 3 * 16  # the shared prefix's four blocks, for each of the three later requests
    assert got("nanovllm:prompt_tokens_total") + hits == sum(map(len, prompts))
    assert got("nanovllm:prefix_cache_queries_total") == sum(map(len, prompts))
    assert (hits, got("nanovllm:prefix_cache_queries_total")) == (engine.block_manager.prefix_cache_hits,
                                                                  engine.block_manager.prefix_cache_queries)
    assert got("nanovllm:num_preemptions_total") == 0.0
    assert got("nanovllm:request_queue_time_seconds_count") == len(prompts)
    assert got("nanovllm:request_queue_time_seconds_sum") == pytest.approx(
        sum(sum(m.queue_times_s) for m in snapshots))
    assert got("nanovllm:step_time_seconds_count") == engine.num_steps == len(snapshots)
    assert got("nanovllm:step_time_seconds_sum") == pytest.approx(sum(m.step_time_s for m in snapshots))
    assert got("nanovllm:num_requests_running") == 0.0 and got("nanovllm:num_requests_waiting") == 0.0
    assert got("nanovllm:kv_cache_usage_perc") == 0.0  # cached blocks are free blocks
    assert max(m.kv_cache_usage for m in snapshots) > 0
    assert [got("nanovllm:engine_state", state=s) for s in ("loading", "ready", "draining")] == [0.0, 1.0, 0.0]
    assert got("nanovllm:num_requests_live") == 3.0 and got("nanovllm:num_requests_queued") == 7.0
    assert got("nanovllm:request_bytes_live") == 3000.0 and got("nanovllm:request_bytes_queued") == 7000.0


def test_preemptions_are_counted_by_their_increase(tiny_model_dir):
    engine = LLMEngine(model=tiny_model_dir, num_kvcache_blocks=8, block_size=4)
    metrics = EngineMetrics(CollectorRegistry())
    engine.add_post_step_hook(metrics)
    for i, p in enumerate(random_prompts([8, 8], vocab=2048, seed=2)):
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    produced = run_to_end(engine)
    with serve_metrics(metrics.registry) as server:
        got = Scrape(server.port)
    assert engine.scheduler.num_preemptions > 0
    assert got("nanovllm:num_preemptions_total") == engine.scheduler.num_preemptions
    assert got("nanovllm:generation_tokens_total") == sum(produced.values()) == 40
    assert got("nanovllm:request_queue_time_seconds_count") == 2  # once per request, not per admission
    assert got("nanovllm:prefix_cache_queries_total") == engine.block_manager.prefix_cache_queries


def test_a_new_engine_on_the_same_metrics_does_not_lower_the_counters():
    metrics = EngineMetrics(CollectorRegistry())

    def step(queries: int, hits: int, preemptions: int) -> None:
        metrics(StepMetrics(step=1, num_running=0, num_waiting=0, num_kv_blocks_used=0, num_kv_blocks_total=4,
                            prefix_cache_queries=queries, prefix_cache_hits=hits, num_preemptions=preemptions,
                            num_prefill_tokens=0, num_decode_tokens=0, num_seqs=0, step_time_s=0.0))

    step(100, 40, 3)
    step(120, 40, 5)
    step(10, 2, 0)  # counting from zero again
    value = metrics.registry.get_sample_value
    assert value("nanovllm:prefix_cache_queries_total") == 130
    assert value("nanovllm:prefix_cache_hits_total") == 42
    assert value("nanovllm:num_preemptions_total") == 5


def test_engine_states_and_shared_stage_metrics():
    metrics = EngineMetrics(CollectorRegistry())
    with pytest.raises(ValueError, match="unknown engine state 'paused'"):
        metrics.set_state("paused")
    metrics.set_state("draining")
    for _ in range(3):
        metrics.frame_received()
    metrics.frame_rejected("bad_frame")
    metrics.frame_rejected("bad_frame")
    metrics.frame_rejected("duplicate")
    metrics.stage_restart_seen("detokenizer")
    with pytest.raises(ValueError, match="unknown stage"):
        metrics.stage_restart_seen("client")
    with serve_metrics(metrics.registry) as server:
        got = Scrape(server.port)
    assert [got("nanovllm:engine_state", state=s) for s in ("loading", "ready", "draining")] == [0.0, 0.0, 1.0]
    assert got("nanovllm:frames_received_total") == 3.0
    assert got("nanovllm:frames_rejected_total", reason="bad_frame") == 2.0
    assert got("nanovllm:frames_rejected_total", reason="duplicate") == 1.0
    assert got.labels_of("nanovllm:stage_restarts_total") == [{"stage": "detokenizer"}]
    assert not got.has("nanovllm:live_clients")  # the engine has no clients


def test_speculative_decoding_metrics_count_what_the_speculator_counted(tiny_model_dir):
    engine = LLMEngine(model=tiny_model_dir, num_kvcache_blocks=256, block_size=4, speculative="ngram",
                       speculative_ngram_min=1, dtype="float32")
    metrics = EngineMetrics(CollectorRegistry())
    engine.add_post_step_hook(metrics)
    phrase = random_prompts([5], vocab=2048, seed=23)[0]
    for i, prompt in enumerate([phrase * 5, phrase[:3] * 6]):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    run_to_end(engine)
    c = engine.speculator.counters
    assert c.num_accepted_tokens > 0
    with serve_metrics(metrics.registry) as server:
        scrape = Scrape(server.port)
        assert scrape("nanovllm:spec_decode_num_drafts_total") == c.num_drafts
        assert scrape("nanovllm:spec_decode_num_draft_tokens_total") == c.num_draft_tokens
        assert scrape("nanovllm:spec_decode_num_accepted_tokens_total") == c.num_accepted_tokens
        assert scrape("nanovllm:spec_decode_num_accepted_tokens_per_pos_total", position="0") == \
            c.accepted_per_position[0]
