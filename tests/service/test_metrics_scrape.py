"""Prometheus metrics of a real service under a real load, scraped over real HTTP: the counters
agree exactly with what the clients received."""
from __future__ import annotations

import threading
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from nanovllm_client import Client
from tests.service.conftest import START_TIMEOUT, TINY_ENGINE_ARGS, start_service
from tests.service.harness import free_tcp_base_port, short_tmpdir, wait_for

PROMPTS = ["def main():", "import os\nimport sys", "class Foo(object):\n    ", "Hello, world", "for i in range(3):"]


@pytest.fixture(scope="module")
def metered(tiny_model_dir):
    base = free_tcp_base_port()
    ports = {"tokenizer_proc": base, "engine_proc": base + 1, "detok_proc": base + 2}
    procs = start_service(tiny_model_dir, f"ipc://{short_tmpdir()}/svc", engine_args=TINY_ENGINE_ARGS,
                          env={name: {"NANOVLLM_METRICS_PORT": str(port)} for name, port in ports.items()})
    yield procs, ports
    procs.stop()


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} from one endpoint."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict, name: str, **labels) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def test_metrics_agree_exactly_with_what_the_clients_received(metered):
    procs, ports = metered
    results = []
    lock = threading.Lock()

    def worker(k: int) -> None:
        with Client(procs.url, timeout=120) as client:
            for i in range(8):
                r = client.generate(PROMPTS[(k + i) % len(PROMPTS)] + f" #{k}.{i}", max_tokens=5 + (k * 7 + i) % 30,
                                    ignore_eos=True, temperature=0 if i % 2 else 0.8)
                with lock:
                    results.append(r)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=START_TIMEOUT)
    assert len(results) == 48
    prompt_tokens = sum(r.usage["prompt_tokens"] for r in results)
    completion_tokens = sum(r.usage["completion_tokens"] for r in results)

    # The engine's counters come from its post-step hook; wait for the last step to be counted.
    engine = wait_for(lambda: (m := scrape(ports["engine_proc"]))
                      and value(m, "nanovllm:generation_tokens_total") == completion_tokens and m,
                      timeout=60, what="the engine's last step to be counted")
    assert value(engine, "nanovllm:prompt_tokens_total") + value(engine, "nanovllm:prefix_cache_hits_total") \
        == prompt_tokens  # every prompt token was either computed or served from the prefix cache
    assert value(engine, "nanovllm:num_preemptions_total") == 0
    assert value(engine, "nanovllm:request_queue_time_seconds_count") == 48
    assert value(engine, "nanovllm:engine_state", state="ready") == 1
    assert value(engine, "nanovllm:num_requests_running") == 0

    detok = scrape(ports["detok_proc"])
    assert value(detok, "nanovllm:request_success_total", finished_reason="length") == 48
    assert value(detok, "nanovllm:request_success_total", finished_reason="error") == 0
    assert value(detok, "nanovllm:request_prompt_tokens_sum") == prompt_tokens
    assert value(detok, "nanovllm:request_generation_tokens_sum") == completion_tokens
    assert value(detok, "nanovllm:time_to_first_token_seconds_count") == 48
    assert value(detok, "nanovllm:e2e_request_latency_seconds_count") == 48
    assert value(detok, "nanovllm:frames_received_total") > 0
    # One observation per engine step that had outputs, not one per request and step.
    assert 0 < value(detok, "nanovllm:detokenize_latency_seconds_count") \
        <= value(engine, "nanovllm:step_time_seconds_count") < completion_tokens

    tokenizer = scrape(ports["tokenizer_proc"])
    assert value(tokenizer, "nanovllm:requests_forwarded_total") == 48
    assert value(tokenizer, "nanovllm:tokenize_latency_seconds_count") == 48


def test_metrics_bind_loopback_only_unless_told(metered):
    import socket

    _, ports = metered
    for port in ports.values():
        with socket.socket() as s:  # listening on 127.0.0.1, not on every address
            assert s.connect_ex(("127.0.0.1", port)) == 0
        addresses = {line.split()[1] for line in open("/proc/net/tcp").read().splitlines()[1:]
                     if line.split()[3] == "0A"}  # listening sockets: local address hex ip:port
        assert f"0100007F:{port:04X}" in addresses and f"00000000:{port:04X}" not in addresses


def test_idle_connections_cannot_use_up_a_stages_threads_and_descriptors(metered):
    """Every connection to `/metrics` held a thread and a file descriptor for as long as the peer
    kept it open, idle or not: 1,015 idle connections left the engine at its 1,024-descriptor
    limit (systemd's default), and when the detokenizer restarted, zmq found no descriptor for
    the new connection and aborted the engine. Now 16 are served at once and an idle one is
    closed after 5 s."""
    import os
    import socket

    from nanovllm.metrics import METRICS_IDLE_S, METRICS_MAX_CONNECTIONS

    procs, ports = metered
    pid, port = procs.pid("engine_proc"), ports["engine_proc"]

    def threads() -> int:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))

    def descriptors() -> int:
        return len(os.listdir(f"/proc/{pid}/fd"))

    before = threads(), descriptors()
    idle = []
    try:
        for _ in range(200):
            try:
                idle.append(socket.create_connection(("127.0.0.1", port), timeout=2))
            except OSError:  # refused or timed out: the server is full, as it should be
                pass
        time.sleep(0.5)
        assert threads() <= before[0] + METRICS_MAX_CONNECTIONS + 1
        assert descriptors() <= before[1] + METRICS_MAX_CONNECTIONS + 8
        with Client(procs.url, timeout=60) as client:
            assert client.generate("def f():", max_tokens=3, ignore_eos=True).finish_reason == "length"
        # The idle ones are closed after METRICS_IDLE_S: a scraper gets through again, while they stay open.
        def scraped() -> bool:
            try:
                return bool(scrape(port))
            except OSError:  # closed at once: every slot is taken
                return False
        wait_for(scraped, timeout=METRICS_IDLE_S + 10, what="a scrape served again")
    finally:
        for sock in idle:
            sock.close()
    procs.assert_running()
