"""A client that vanishes mid-stream has its requests aborted and their KV blocks freed."""
from __future__ import annotations

import subprocess
import sys
import textwrap
import time

from tests.service.harness import REPO, wait_for
from tests.service.test_streaming import engine_idle

CLIENT_SCRIPT = textwrap.dedent("""
    import sys
    from nanovllm_client import Client
    c = Client(sys.argv[1])
    streams = [c.stream(f"def f{i}():", max_tokens=600, ignore_eos=True) for i in range(4)]
    for s in streams:
        next(s)
    print("STREAMING", flush=True)
    for s in streams:
        for _ in s:
            pass
""")


def test_sigkilled_client_has_its_requests_aborted(service, client):
    proc = subprocess.Popen([sys.executable, "-c", CLIENT_SCRIPT, service.url], cwd=REPO,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "STREAMING"
        wait_for(lambda: client.server_stats()["engine"]["num_live"] >= 4, timeout=3, what="4 live requests")
        proc.kill()
        proc.wait(timeout=10)
        # 600 steps each would take far longer; the detokenizer aborts them when the socket is
        # gone (EHOSTUNREACH) or, at the latest, after 3 s without a heartbeat.
        t0 = time.monotonic()
        wait_for(lambda: engine_idle(client), timeout=8, interval=0.1, what="the dead client's requests to end")
        print(f"aborted {time.monotonic() - t0:.2f}s after the kill")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def test_closing_a_client_aborts_its_requests(service, client):
    from nanovllm_client import Client

    other = Client(service.url)
    streams = [other.stream(f"x = {i}", max_tokens=600, ignore_eos=True) for i in range(3)]
    for s in streams:
        next(s)
    wait_for(lambda: client.server_stats()["engine"]["num_live"] >= 3, timeout=3, what="3 live requests")
    other.close()
    wait_for(lambda: engine_idle(client), timeout=5, interval=0.1, what="closed client's requests to end")
