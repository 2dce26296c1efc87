"""Graceful stop: SIGTERM to `nanovllm serve` (and so to its stages, in order) during a load.
Requests in flight finish, or end with an abort that says the engine was draining; none is lost;
a request sent during the drain is refused at once with a draining error; everything exits 0."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from nanovllm_client import Client, ServiceDrainingError
from nanovllm_client.health import check_health
from tests.service.conftest import START_TIMEOUT, TINY_ENGINE_ARGS
from tests.service.harness import REPO, short_tmpdir, wait_for


def serve(model: str, *args: str) -> tuple[subprocess.Popen, str]:
    runtime_dir = short_tmpdir()
    proc = subprocess.Popen([sys.executable, "-m", "nanovllm.supervisor", "--model", model, "--runtime-dir",
                             runtime_dir, *args, *TINY_ENGINE_ARGS], cwd=REPO,
                            env=dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.path.join(REPO, "client")])))
    return proc, f"ipc://{runtime_dir}"


def stream_all(client: Client, n: int, max_tokens: int, outcomes: list) -> list[threading.Thread]:
    streams = [client.stream(f"def f{i}():", max_tokens=max_tokens, ignore_eos=True) for i in range(n)]
    firsts = [next(s) for s in streams]  # each one is running in the engine

    def consume(s, first) -> None:
        deltas = [first, *s]
        outcomes.append((deltas[-1].finish_reason, deltas[-1].error, sum(len(d.token_ids) for d in deltas)))

    threads = [threading.Thread(target=consume, args=(s, first)) for s, first in zip(streams, firsts)]
    for t in threads:
        t.start()
    return threads


@pytest.mark.parametrize("drain_timeout, expect, max_tokens", [(30, "length", 200), (10, "abort", 1000)])
def test_sigterm_drains_then_exits_zero(tiny_model_dir, drain_timeout, expect, max_tokens):
    # Every step made 20 ms slower (a hook from tests/service/plugins.py): 200 tokens take over 4 s,
    # so the stop lands mid-generation and a 30 s drain lets them finish; 1000 take over 20 s, and
    # a 10 s drain (long enough for the checks below to land inside it on a loaded machine) runs out.
    proc, url = serve(tiny_model_dir, "--drain-timeout", str(drain_timeout),
                      "--post-step-hook", "tests.service.plugins:slow_step")
    try:
        with Client(url, connect_timeout=START_TIMEOUT, timeout=120) as client:
            client.wait_engine(timeout=START_TIMEOUT)
            outcomes: list = []
            threads = stream_all(client, 6, max_tokens, outcomes)
            proc.send_signal(signal.SIGTERM)
            wait_for(lambda: client._state.engine_state == "draining", timeout=60, what="the client to see the drain")
            refused_at = time.monotonic()
            with pytest.raises(ServiceDrainingError, match="draining"):
                client.stream("x", max_tokens=3)
            assert time.monotonic() - refused_at < 10  # at once, not the request's 120 s timeout
            assert check_health(url, timeout=10).stages["engine"].state == "draining"
            for t in threads:
                t.join(timeout=60)
        assert len(outcomes) == 6, "a request was lost"
        for reason, error, tokens in outcomes:
            assert reason == expect, (reason, error)
            if expect == "length":
                assert tokens == max_tokens and error is None
            else:  # aborted when the drain ran out: saying so
                assert "draining" in error and 0 < tokens < max_tokens
        assert proc.wait(timeout=drain_timeout + 30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
