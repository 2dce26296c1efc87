"""DetokMetrics: request latencies from what the detokenizer streams, with vLLM's semantics."""
from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from nanovllm.metrics import MAX_REASONS, DetokMetrics, serve_metrics
from tests.metrics.conftest import Scrape


def test_request_latencies_and_outcomes():
    metrics = DetokMetrics(CollectorRegistry())
    # r1 streams 1 + 1 + 3 tokens: one first-token time, then one gap per output (not per token).
    metrics.request_started("r1", 100.0)
    metrics.tokens_streamed("r1", 1, 100.5)
    metrics.tokens_streamed("r1", 1, 100.7)
    metrics.tokens_streamed("r1", 3, 101.0)
    metrics.tokens_streamed("r1", 0, 101.1)  # a terminal row without tokens: no gap
    metrics.request_finished("r1", "stop", 7, 5, 101.2)
    # r2 is aborted before its first token; r3's client goes away; r4 is rebuilt after a restart.
    metrics.request_started("r2", 200.0)
    metrics.request_finished("r2", "abort", 11, 0, 200.4)
    metrics.request_started("r3", 300.0)
    metrics.tokens_streamed("r3", 1, 300.1)
    metrics.request_dropped("r3")
    metrics.request_started("r4", 90.0, resumed_at=400.0)
    metrics.tokens_streamed("r4", 1, 400.25)
    metrics.request_finished("r4", "length", 3, 2, 400.25)
    # Finished without being followed here (started before this detokenizer did): counted, not timed.
    metrics.request_finished("r5", "error", 4, 0, 500.0)
    metrics.tokens_streamed("nobody", 1, 1.0)
    assert metrics.num_tracked_requests == 0

    with serve_metrics(metrics.registry) as server:
        got = Scrape(server.port)
    assert got("nanovllm:time_to_first_token_seconds_count") == 2  # r1 and r3; r4 was resumed
    assert got("nanovllm:time_to_first_token_seconds_sum") == pytest.approx(0.5 + 0.1)
    assert got("nanovllm:inter_token_latency_seconds_count") == 3  # r1's two gaps, r4's one
    assert got("nanovllm:inter_token_latency_seconds_sum") == pytest.approx(0.2 + 0.3 + 0.25)
    assert got("nanovllm:request_time_per_output_token_seconds_count") == 1  # r1; r4's first token was not seen
    assert got("nanovllm:request_time_per_output_token_seconds_sum") == pytest.approx(0.5 / 4)
    assert got("nanovllm:e2e_request_latency_seconds_count") == 3
    assert got("nanovllm:e2e_request_latency_seconds_sum") == pytest.approx(1.2 + 0.4 + 310.25)
    assert {r: got("nanovllm:request_success_total", finished_reason=r) for r in ("stop", "length", "abort", "error")} \
        == {"stop": 1.0, "length": 1.0, "abort": 1.0, "error": 1.0}
    assert got("nanovllm:request_prompt_tokens_count") == 4 and got("nanovllm:request_prompt_tokens_sum") == 25
    assert got("nanovllm:request_generation_tokens_sum") == 7
    assert got("nanovllm:request_generation_tokens_bucket", le="1.0") == 2  # r2 and r5: no tokens
    assert got("nanovllm:request_generation_tokens_bucket", le="4.0") == 3
    assert got("nanovllm:request_generation_tokens_bucket", le="65536.0") == 4


def test_every_finish_reason_is_exposed_before_it_happens():
    metrics = DetokMetrics(CollectorRegistry())
    with pytest.raises(ValueError, match="'timeout' is not a valid FinishReason"):
        metrics.request_finished("r", "timeout", 1, 1, 0.0)
    with serve_metrics(metrics.registry) as server:
        got = Scrape(server.port)
    assert sorted(d["finished_reason"] for d in got.labels_of("nanovllm:request_success_total")) == \
        ["abort", "error", "length", "stop"]
    assert all(got("nanovllm:request_success_total", finished_reason=r) == 0.0 for r in ("stop", "error"))


def test_per_request_state_is_bounded_and_freed():
    metrics = DetokMetrics(CollectorRegistry(), max_tracked_requests=4)
    for i in range(10):
        metrics.request_started(f"r{i}", float(i))
    assert metrics.num_tracked_requests == 4
    metrics.tokens_streamed("r0", 1, 20.0)  # forgotten (the oldest went first): nothing observed
    metrics.tokens_streamed("r9", 1, 20.0)
    assert metrics.registry.get_sample_value("nanovllm:time_to_first_token_seconds_sum") == pytest.approx(11.0)
    metrics.request_started("r9", 15.0)  # an id reused: the new request replaces the old one
    assert metrics.num_tracked_requests == 4
    metrics.request_finished("r6", "stop", 1, 1, 30.0)
    metrics.request_dropped("r7")
    metrics.request_dropped("r7")  # idempotent
    metrics.request_finished("r8", "abort", 1, 0, 30.0)
    metrics.request_dropped("r9")
    assert metrics.num_tracked_requests == 0


def test_shared_stage_metrics_and_bounded_reject_reasons():
    metrics = DetokMetrics(CollectorRegistry())
    metrics.frame_received()
    for i in range(MAX_REASONS + 5):
        metrics.frame_rejected(f"reason{i}")
    metrics.frame_rejected("reason0")
    metrics.set_live_clients(3)
    metrics.stage_restart_seen("engine")
    metrics.stage_restart_seen("engine")
    metrics.detokenize_seconds(0.002)
    metrics.detokenize_seconds(0.004)
    with serve_metrics(metrics.registry) as server:
        got = Scrape(server.port)
    assert got("nanovllm:frames_received_total") == 1.0
    assert len(got.labels_of("nanovllm:frames_rejected_total")) == MAX_REASONS + 1
    assert got("nanovllm:frames_rejected_total", reason="reason0") == 2.0
    assert got("nanovllm:frames_rejected_total", reason="other") == 5.0
    assert got("nanovllm:live_clients") == 3.0
    assert got("nanovllm:stage_restarts_total", stage="engine") == 2.0
    assert got("nanovllm:detokenize_latency_seconds_count") == 2
    assert got("nanovllm:detokenize_latency_seconds_sum") == pytest.approx(0.006)
