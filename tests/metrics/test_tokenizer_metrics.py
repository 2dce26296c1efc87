"""TokenizerMetrics over HTTP: tokenize time, forwarded and refused requests."""
from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from nanovllm.metrics import TokenizerMetrics, serve_metrics
from tests.metrics.conftest import Scrape


def test_tokenizer_metrics():
    metrics = TokenizerMetrics(CollectorRegistry())
    for seconds in (0.0001, 0.0003, 0.2):
        metrics.tokenize_seconds(seconds)
    for _ in range(3):
        metrics.request_forwarded()
    metrics.request_rejected()
    metrics.frame_received()
    metrics.frame_rejected("multipart")
    metrics.set_live_clients(2)
    with serve_metrics(metrics.registry) as server:
        got = Scrape(server.port)
    assert got("nanovllm:tokenize_latency_seconds_count") == 3
    assert got("nanovllm:tokenize_latency_seconds_sum") == pytest.approx(0.2004)
    assert got("nanovllm:tokenize_latency_seconds_bucket", le="0.0001") == 1
    assert got("nanovllm:tokenize_latency_seconds_bucket", le="0.00025") == 1
    assert got("nanovllm:tokenize_latency_seconds_bucket", le="0.0005") == 2
    assert got("nanovllm:requests_forwarded_total") == 3.0 and got("nanovllm:requests_rejected_total") == 1.0
    assert got("nanovllm:frames_received_total") == 1.0
    assert got("nanovllm:frames_rejected_total", reason="multipart") == 1.0
    assert got("nanovllm:live_clients") == 2.0
