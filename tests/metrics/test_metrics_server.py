"""serve_metrics: loopback only unless told, one registry per endpoint, a port freed on close."""
from __future__ import annotations

import socket
import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry

from nanovllm.metrics import DetokMetrics, EngineMetrics, TokenizerMetrics, serve_metrics
from tests.metrics.conftest import Scrape


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("host", ["0.0.0.0", "", "192.168.1.7", "::", "metrics.example.com"])
def test_a_non_loopback_host_is_refused(host):
    with pytest.raises(ValueError, match="not a loopback address.*allow_remote=True"):
        serve_metrics(CollectorRegistry(), host, free_port())


@pytest.mark.parametrize("port", [-1, 65536, 1.5, True])
def test_a_bad_port_is_refused(port):
    with pytest.raises(ValueError, match=r"metrics port must be an integer in \[0, 65535\]"):
        serve_metrics(CollectorRegistry(), port=port)


def test_each_stage_serves_its_own_registry_and_close_frees_the_port():
    # Three metric sets with the same shared names, in one process: no collision.
    engine, detok, tokenizer = (EngineMetrics(CollectorRegistry()), DetokMetrics(CollectorRegistry()),
                                TokenizerMetrics(CollectorRegistry()))
    engine.frame_received()
    detok.frame_received()
    detok.frame_received()
    port = free_port()
    servers = [serve_metrics(m.registry, "127.0.0.1", p) for m, p in ((engine, port), (detok, 0), (tokenizer, 0))]
    try:
        assert servers[0].port == port and len({s.port for s in servers}) == 3
        got = [Scrape(s.port) for s in servers]
        assert [g("nanovllm:frames_received_total") for g in got] == [1.0, 2.0, 0.0]
        assert got[0].has("nanovllm:num_requests_running") and not got[1].has("nanovllm:num_requests_running")
        assert got[1].has("nanovllm:time_to_first_token_seconds_count")
        assert not got[0].has("nanovllm:time_to_first_token_seconds_count")
        assert got[2].has("nanovllm:tokenize_latency_seconds_count") and not got[2].has("nanovllm:engine_state",
                                                                                        state="ready")
    finally:
        for s in servers:
            s.close()
    servers[0].close()  # idempotent
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)
    with serve_metrics(engine.registry, port=port) as again:  # the port is free again
        assert Scrape(again.port)("nanovllm:frames_received_total") == 1.0


def test_two_metric_sets_on_one_registry_collide():
    registry = CollectorRegistry()
    EngineMetrics(registry)
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        TokenizerMetrics(registry)
