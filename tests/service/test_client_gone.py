"""A client that vanishes mid-stream has its requests aborted and their KV blocks freed."""
from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.service.harness import REPO, idle_before_the_natural_end, num_steps, wait_for

CLIENT_SCRIPT = textwrap.dedent("""
    import sys
    from nanovllm_client import Client
    c = Client(sys.argv[1])
    streams = [c.stream(f"def f{i}():", max_tokens=1000, ignore_eos=True) for i in range(4)]
    for s in streams:
        next(s)
    print("STREAMING", flush=True)
    for s in streams:
        for _ in s:
            pass
""")


def test_sigkilled_client_has_its_requests_aborted(slow_service, slow_client):
    # Steps of >= 10 ms: 1000 tokens take over 10 s; the detokenizer aborts the requests when the
    # socket is gone (EHOSTUNREACH) or, at the latest, after 3 s without a heartbeat.
    client = slow_client
    proc = subprocess.Popen([sys.executable, "-c", CLIENT_SCRIPT, slow_service.url], cwd=REPO,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "STREAMING"
        wait_for(lambda: client.server_stats()["engine"].get("num_live", 0) >= 4, timeout=60, what="4 live requests")
        since = num_steps(client)
        proc.kill()
        proc.wait(timeout=60)
        idle_before_the_natural_end(client, since, 1000, "the dead client's requests to end")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=60)


def test_closing_a_client_aborts_its_requests(slow_service, slow_client):
    from nanovllm_client import Client

    client = slow_client
    other = Client(slow_service.url)
    streams = [other.stream(f"x = {i}", max_tokens=600, ignore_eos=True) for i in range(3)]
    for s in streams:
        next(s)
    wait_for(lambda: client.server_stats()["engine"].get("num_live", 0) >= 3, timeout=60, what="3 live requests")
    since = num_steps(client)
    other.close()
    idle_before_the_natural_end(client, since, 600, "closed client's requests to end")
