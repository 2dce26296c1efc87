"""Aborts and pings while the engine's queue is full (one regression test per way they used to
wait behind the requests; each failed on the code before the fix). Real processes and sockets;
each step made 10 ms slower, so what runs meanwhile can be counted in steps."""
from __future__ import annotations

import time

import pytest
import zmq

from nanovllm_client import Client
from nanovllm_client.errors import RequestError
from nanovllm_client import protocol as p
from nanovllm_client.health import check_health
from tests.service.conftest import TINY_ENGINE_ARGS, start_service
from tests.service.harness import free_tcp_base_port, short_tmpdir, wait_for
from tests.service.test_metrics_scrape import scrape, value
from tests.service.test_hardening import in_process_engine, raw_socket, running

FULL_AT_ONE = TINY_ENGINE_ARGS + ["--max-live", "1", "--max-queued", "1",
                                  "--post-step-hook", "tests.helpers.hooks:slow_step"]
"""One request live, one queued: every further request waits in the pipes, unread."""


def engine_stats(client: Client, until=lambda stats: True) -> dict:
    """The engine's stats once `until` holds of them (they lag a heartbeat, up to 0.25 s). Until
    the engine's first heartbeat the detokenizer has only its load-time stats, which lack the
    queue counts: `until` must read those with .get()."""
    seen: list[dict] = []
    wait_for(lambda: until(seen.append(client.server_stats()["engine"]) or seen[-1]), timeout=30, what="engine stats")
    return seen[-1]


def test_a_cancel_reaches_an_engine_whose_queue_is_full(tiny_model_dir):
    """The engine stops reading its input while its queue is full, and aborts came on that socket
    behind the requests waiting there: a cancelled request ran on to its max_tokens (900 steps)
    before the abort was read. Now aborts come on the control socket, read whatever the load."""
    procs = start_service(tiny_model_dir, f"ipc://{short_tmpdir()}/svc", engine_args=FULL_AT_ONE)
    try:
        with Client(procs.url, timeout=120) as c:
            long = c.stream("def f():", max_tokens=900, ignore_eos=True)
            next(long)
            shorts = [c.stream(f"def g{i}():", max_tokens=3, ignore_eos=True) for i in range(6)]
            before = engine_stats(c, until=lambda s: s.get("num_queued") == 1)["num_steps"]
            long.cancel()
            assert [list(s)[-1].finish_reason for s in shorts] == ["length"] * 6
            steps = engine_stats(c, until=lambda s: s.get("num_live") == 0)["num_steps"] - before
            # 6 requests of 3 tokens, the heartbeat's lag and the abort's trip: tens of steps, not 900.
            assert steps < 300, f"{steps} steps between the cancel and the last short request's end"
        procs.assert_running()
    finally:
        procs.stop()


def test_the_tokenizer_answers_pings_while_it_holds_requests_back(tiny_model_dir):
    """While the engine pipe was full the tokenizer read no client frame at all, so a health
    check took a busy tokenizer for a dead one, and a client's abort waited there too. Then it
    held up to 1,024 requests and read on, but stopped reading once it held that many, and the
    probe timed out again. Now past the bound it refuses new requests as overloaded and answers
    pings whatever the load; what it holds shows as a metric."""
    from tokenizer_proc.server import PENDING_MAX_FRAMES
    port = free_tcp_base_port()
    procs = start_service(tiny_model_dir, f"ipc://{short_tmpdir()}/svc", engine_args=FULL_AT_ONE,
                          # One client fills the stage's own bound: no per-client share of it.
                          env={"tokenizer_proc": {"NANOVLLM_METRICS_PORT": str(port),
                                                  "NANOVLLM_MAX_PENDING_PER_CLIENT": "0"}})
    try:
        with Client(procs.url, timeout=300) as c:
            # 3.6 KB frames: more than the pipes and the kernel's socket buffers hold, and more
            # requests than the tokenizer holds on top of them.
            streams = [c.stream(list(range(100, 1000)), max_tokens=100, ignore_eos=True)
                       for _ in range(PENDING_MAX_FRAMES + 600)]
            engine_stats(c, until=lambda s: s.get("num_queued") == 1)
            wait_for(lambda: value(scrape(port), "nanovllm:requests_held") == PENDING_MAX_FRAMES, timeout=60,
                     what=f"the tokenizer holding {PENDING_MAX_FRAMES} requests")
            report = check_health(procs.url, timeout=30)  # a busy tokenizer answers late, never not at all
            assert report.stages["tokenizer"].state == "ready", report.lines()
            assert report.stages["engine"].state == "ready", report.lines()
            assert value(scrape(port), "nanovllm:request_bytes_held") > 3600 * PENDING_MAX_FRAMES
            with pytest.raises(RequestError, match=f"holds {PENDING_MAX_FRAMES} requests .* overloaded"):
                list(streams[-1])
            for s in streams:
                s.cancel()
        procs.assert_running()
    finally:
        procs.stop()


def test_an_abort_that_overtakes_its_request_ends_it_when_it_arrives(tiny_model_dir, ctx):
    """Aborts and requests come on two sockets, so an abort can arrive first (its request still
    waits in the tokenizer or the input pipe). The engine keeps it, and the request starts and
    ends with "abort" in one step output: its client hears the end, and it never runs."""
    stage, eps, detok_in = in_process_engine(tiny_model_dir, ctx)
    with running(stage):
        control = raw_socket(ctx, zmq.PUSH, eps.control)
        control.send(p.AbortReq("c:early").encode())
        wait_for(lambda: "c:early" in stage.admission.early_aborts, timeout=60, what="the early abort kept")
        requests = raw_socket(ctx, zmq.PUSH, eps.engine)
        for rid in ("c:early", "c:other"):
            requests.send(p.TokenizedReq(request_id=rid, prompt_token_ids=p.pack_token_ids([1, 2, 3]),
                                         sampling={"max_tokens": 4, "ignore_eos": True},
                                         meta=p.RequestMeta(client=b"c", client_request_id=rid)).encode())
        ends: dict[str, tuple] = {}
        started: list[str] = []
        deadline = time.monotonic() + 30
        while len(ends) < 2 and time.monotonic() < deadline:
            if detok_in.poll(100):
                msg = p.decode(detok_in.recv())
                if isinstance(msg, p.StepOutput):
                    started += [row[0] for row in msg.started]
                    ends.update({row[0]: (row[3], row[5]) for row in msg.outputs if row[2]})
        assert ends == {"c:early": ("abort", 0), "c:other": ("length", 4)}
        assert started.count("c:early") == 1 and not stage.admission.early_aborts
        wait_for(lambda: not stage.admission.live, timeout=60, what="both requests gone")
        # Every charge came back, and every control message was taken.
        assert (stage.admission.live_bytes, stage.input.queued_bytes, stage.input.num_queued, stage.input.num_control) == (0, 0, 0, 0)
