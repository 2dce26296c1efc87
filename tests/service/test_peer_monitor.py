"""A stage counts its engine from the zmq handshake events of the socket to it; those are only
reported to a monitor that exists when the handshake completes."""
from __future__ import annotations

import pytest

@pytest.mark.parametrize("stage", ["tokenizer", "detokenizer"])
def test_a_stage_counts_an_engine_whose_handshake_completed_at_once(stage, tokenizer_dir, monkeypatch):
    """A monitor attached after its socket connected (or bound) misses a handshake that completed
    first, and the engine is never counted: a tokenizer then took its live engine for absent and
    refused held requests as "engine is not available". The engine is there before the stage
    starts, and the stage's thread stalls 0.3 s right after making the socket (a busy core)."""
    import time

    import zmq

    import detok_proc.server as detok_server
    import tokenizer_proc.server as tokenizer_server
    from nanovllm_client.endpoints import service_endpoints
    from tests.service.harness import short_tmpdir

    eps = service_endpoints(f"ipc://{short_tmpdir()}")
    module, factory = (tokenizer_server, "pipeline_push") if stage == "tokenizer" else (detok_server, "pipeline_pull")
    real = getattr(module, factory)

    def stalling(*args, **kwargs):
        sock = real(*args, **kwargs)
        time.sleep(0.3)  # longer than an engine's reconnect interval (0.1 s)
        return sock

    monkeypatch.setattr(module, factory, stalling)
    ctx = zmq.Context()
    try:
        if stage == "tokenizer":
            engine = ctx.socket(zmq.PULL)
            engine.bind(eps.engine)
            made = tokenizer_server.TokenizerStage(None, eps.tokenizer, eps.engine, eps.control, ctx=ctx)
        else:
            from transformers import AutoTokenizer

            engine = ctx.socket(zmq.PUSH)
            engine.connect(eps.detok)  # the engine keeps trying until the detokenizer binds
            made = detok_server.DetokStage(AutoTokenizer.from_pretrained(tokenizer_dir), eps.stream, eps.detok,
                                           eps.control, ctx=ctx)
        deadline = time.monotonic() + 5
        while not made.engine_peers.connected and time.monotonic() < deadline:
            time.sleep(0.05)
        assert made.engine_peers.connected
    finally:
        ctx.destroy(linger=0)
