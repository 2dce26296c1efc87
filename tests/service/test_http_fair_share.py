"""Fair share through the HTTP front: it tells the service which API key each request came with,
so one key's flood does not delay another key's request, as one ZeroMQ client's does not delay
another's (tests/service/test_fair_share.py). One `nanovllm serve --http-port` for the module."""
from __future__ import annotations

import http.client
import json
import threading

import pytest

pytest.importorskip("uvicorn")

from tests.service.conftest import TINY_ENGINE_ARGS  # noqa: E402
from tests.service.harness import fresh_engine_stats, num_steps, wait_for  # noqa: E402
from tests.service.test_fair_share import BOUND_STEPS, HEARTBEAT, MINE_TOKENS, SLOW  # noqa: E402
from tests.service.test_http_serve import serve_with_front  # noqa: E402

FLOODER, OTHER = "sk-flood-0123456789", "sk-other-9876543210"
FLOOD = 100
"""Concurrent streams of the flooding key: more than its live share (half of 64 rows), fewer than
the front's --max-streams (256), so the front passes them all on and the service must share."""


@pytest.fixture(scope="module")
def front(tiny_model_dir):
    with serve_with_front(tiny_model_dir, [*TINY_ENGINE_ARGS, *SLOW, *HEARTBEAT], f"{FLOODER}\n{OTHER}\n") as served:
        _, _, port, client = served
        yield port, client


def _open_stream(port: int, model: str, key: str, prompt: str, max_tokens: int) -> http.client.HTTPConnection:
    """A streamed completion, its headers read (the service took it); the caller closes it."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    conn.request("POST", "/v1/completions", body=json.dumps(body),
                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    response = conn.getresponse()
    assert response.status == 200, response.read()
    return conn


def test_one_api_keys_flood_does_not_delay_another_keys_request(front, tiny_model_dir):
    port, client = front
    model = tiny_model_dir  # what `nanovllm serve` names it
    flood: list[http.client.HTTPConnection] = []
    threads = [threading.Thread(target=lambda i=i: flood.append(_open_stream(port, model, FLOODER, f"def f{i}():", 900)))
               for i in range(FLOOD)]
    try:
        for t in threads:
            t.start()
        wait_for(lambda: (e := fresh_engine_stats(client)).get("num_live") == 32 and e.get("num_queued") == FLOOD - 32,
                 timeout=120, what="the flooding key holding its live share and the rest waiting")
        since = num_steps(client)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
        conn.request("POST", "/v1/completions", headers={"Content-Type": "application/json",
                                                         "Authorization": f"Bearer {OTHER}"},
                     body=json.dumps({"model": model, "prompt": "def mine():", "max_tokens": MINE_TOKENS,
                                      "ignore_eos": True}))
        response = conn.getresponse()
        out = json.loads(response.read())
        took = num_steps(client) - since
        print(f"the other key's request: {took} steps from its send to its end (its own: {MINE_TOKENS})")
        assert response.status == 200 and out["usage"]["completion_tokens"] == MINE_TOKENS, out
        assert took <= BOUND_STEPS, f"the other key's request took {took} steps, its own are {MINE_TOKENS}"
    finally:
        for t in threads:
            t.join(timeout=300)
        for conn in flood:
            conn.close()  # the front aborts what nobody reads
    wait_for(lambda: fresh_engine_stats(client).get("num_live") == 0, timeout=120, what="the flood aborted")
