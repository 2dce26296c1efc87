"""One regression test per way a single frame, value or failure used to take a stage down or lose
a request (each failed on the code before the fix). Real stage processes on real sockets, except
where a stage is run in-process to fill its queues on purpose."""
from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
import uuid

import msgpack
import pytest
import zmq

from nanovllm_client import Client, RequestError
from nanovllm_client import protocol as p
from nanovllm_client.endpoints import service_endpoints
from nanovllm_client.sampling import SamplingParams
from tests.service.conftest import START_TIMEOUT, TINY_ENGINE_ARGS, start_service
from tests.service.harness import STAGES, short_tmpdir, wait_for

NESTED = b"\x91" * 1000 + b"\x01"


def raw_socket(ctx: zmq.Context, kind: int, endpoint: str, identity: bytes | None = None) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if identity is not None:
        sock.setsockopt(zmq.ROUTING_ID, identity)
    sock.connect(endpoint)
    return sock


def reply(sock: zmq.Socket, timeout_ms: int = 60_000) -> p.Message:
    assert sock.poll(timeout_ms), f"no reply in {timeout_ms // 1000} s (hung)"
    return p.decode(sock.recv())


@contextlib.contextmanager
def running(stage):
    """A stage's loop on a thread of this process, stopped and joined on the way out."""
    stop = threading.Event()
    runner = threading.Thread(target=stage.run, args=(stop,), daemon=True)
    runner.start()
    try:
        yield stage
    finally:
        stop.set()
        runner.join(timeout=10)


def in_process_detok(tokenizer_dir: str, ctx: zmq.Context, client_timeout_s: float):
    """A detokenizer stage in this process on fresh ipc endpoints, fed by a scripted engine (it
    never gives the engine up): (stage, endpoints). Run it with `running`."""
    from transformers import AutoTokenizer

    from detok_proc.server import DetokStage

    eps = service_endpoints(f"ipc://{short_tmpdir()}")
    stage = DetokStage(AutoTokenizer.from_pretrained(tokenizer_dir), eps.stream, eps.detok, eps.control,
                       client_timeout_s=client_timeout_s, engine_timeout_s=60, ctx=ctx)
    return stage, eps


def in_process_engine(model_dir: str, ctx: zmq.Context, *, detok: bool = True, num_kvcache_blocks: int = 64,
                      **stage_kwargs):
    """An engine stage in this process on fresh ipc endpoints, on one thread: (stage, endpoints,
    a PULL bound where a detokenizer would read its outputs, or None with `detok=False`). Run it
    with `running`."""
    from engine_proc.server import EngineStage
    from nanovllm.config import Config
    from nanovllm.engine.llm_engine import LLMEngine

    eps = service_endpoints(f"ipc://{short_tmpdir()}")
    detok_in = None
    if detok:
        detok_in = ctx.socket(zmq.PULL)
        detok_in.bind(eps.detok)
    engine = LLMEngine(Config(model=model_dir, num_kvcache_blocks=num_kvcache_blocks, num_threads=1))
    return EngineStage(engine, eps.engine, eps.detok, eps.control, ctx=ctx, **stage_kwargs), eps, detok_in


def test_deeply_nested_frames_get_an_error_and_no_stage_dies(service, client, ctx):
    """1,000 levels of nesting as the type or version once killed the tokenizer, the detokenizer
    and the engine's input thread with RecursionError while the error message was built."""
    eps = service_endpoints(service.url)
    pids = {name: service.pid(name) for name in STAGES}
    frames = [b"\x93" + NESTED + msgpack.packb("generate") + msgpack.packb({}),
              b"\x93" + msgpack.packb(p.PROTOCOL_VERSION) + NESTED + msgpack.packb({})]
    for endpoint in (eps.tokenizer, eps.stream):
        sock = raw_socket(ctx, zmq.DEALER, endpoint, uuid.uuid4().bytes)
        for frame in frames:
            sock.send(frame)
            msg = reply(sock)
            assert isinstance(msg, p.ErrorOutput) and len(msg.message) < 300
            assert "unknown message type [[[...]]]" in msg.message or "protocol version [[[...]]]" in msg.message
    for endpoint in (eps.engine, eps.detok, eps.control):
        push = raw_socket(ctx, zmq.PUSH, endpoint)
        for frame in frames:
            push.send(frame)
    result = client.generate("def f():", max_tokens=5, ignore_eos=True)
    assert result.usage["completion_tokens"] == 5  # the engine's input thread still reads
    service.assert_running()
    assert {name: service.pid(name) for name in STAGES} == pids


def test_sampling_values_at_the_extremes_end_their_request_not_the_engine(client):
    """top_p=1e-50 once crashed the sampler's gather; temperature=1e-40 produced a token id equal
    to the vocabulary size, which crashed the next step; a nested temperature crashed validation."""
    for sampling in ({"top_p": 1e-50, "temperature": 1.0}, {"temperature": 1e-40}, {"temperature": 5e-324, "top_k": 3}):
        result = client.generate("def f():", max_tokens=4, ignore_eos=True, **sampling)
        assert result.finish_reason == "length" and all(0 <= t < 2048 for t in result.token_ids)
    greedy = client.generate("def f():", max_tokens=4, ignore_eos=True, temperature=0)
    assert client.generate("def f():", max_tokens=4, ignore_eos=True, temperature=1e-40).token_ids == greedy.token_ids
    with pytest.raises(ValueError, match="repetition_penalty"):  # refused by the client's own copy of the checks
        client.generate("x", repetition_penalty=1e-300)
    with pytest.raises(ValueError, match="temperature must be a number"):
        client.generate("x", temperature=[[[0.5]]])


def test_hostile_sampling_values_sent_raw_get_the_validators_words_and_no_stage_dies(service, client, ctx):
    """The same values on raw sockets, past any client's checks: the tokenizer's decode refuses
    them with the struct's validator, for that request."""
    deep: list = [0.5]
    for _ in range(1000):
        deep = [deep]
    assert "deeper than" in run_raw(service, ctx, {"temperature": deep}).error
    assert "temperature must be a number >= 0" in run_raw(service, ctx, {"temperature": [[[0.5]]]}).error
    assert "repetition_penalty must be in [0.01, 100]" in run_raw(service, ctx, {"repetition_penalty": 1e-300}).error
    assert client.generate("x", max_tokens=2, ignore_eos=True).finish_reason == "length"
    service.assert_running()


def raw_client(url: str, ctx: zmq.Context) -> tuple[zmq.Socket, zmq.Socket]:
    """A client on raw sockets, (to the detokenizer, to the tokenizer), one routing id for both;
    the detokenizer has answered its ping, so it can route the client's outputs."""
    eps = service_endpoints(url)
    identity = uuid.uuid4().bytes
    out = raw_socket(ctx, zmq.DEALER, eps.stream, identity)
    out.send(p.Ping().encode())
    assert isinstance(reply(out), p.Pong)
    return out, raw_socket(ctx, zmq.DEALER, eps.tokenizer, identity)


def run_raw(service, ctx, sampling: dict) -> dict:
    """One generate request with `sampling` exactly as given, over raw sockets: its terminal delta
    plus all its text."""
    out, tok = raw_client(service.url, ctx)
    tok.send(msgpack.packb([p.PROTOCOL_VERSION, "generate", {"request_id": "r", "prompt": "def f():",
                                                             "sampling": sampling}]))
    poller = zmq.Poller()
    poller.register(tok, zmq.POLLIN)
    poller.register(out, zmq.POLLIN)
    text = ""
    while True:
        ready = dict(poller.poll(10_000))
        assert ready, "no answer"
        for sock in ready:
            msg = p.decode(sock.recv())
            if isinstance(msg, p.ErrorOutput) and msg.request_id == "r":  # refused as the frame was read
                return p.error_delta("r", msg.message)
            for d in getattr(msg, "deltas", []):
                text += d.text
                if d.finish_reason is not None:
                    return d._replace(text=text)


def test_counts_beyond_what_the_wire_carries_are_refused_at_the_door_naming_the_field(service, ctx):
    """min_tokens above 2**31 once passed the tokenizer's checks (max_tokens had no upper bound) but
    not the engine's check of the meta it travels in: the engine dropped the frame, which has no
    way back to the client, and the request was never answered. One validator now bounds both."""
    done = run_raw(service, ctx, {"max_tokens": 2**33, "min_tokens": 2**31 + 5})
    assert done.finish_reason == "error" and "max_tokens must be an integer in [1, 2147483647]" in done.error, done
    service.assert_running()


def test_stop_strings_inside_sampling_are_checked_like_the_others(service, client, ctx):
    """sampling.stop = 5 once killed the tokenizer; a string there was split into one-character
    stop strings, and stop strings there skipped the limits `stop` has."""
    assert "stop must be a string or a list of non-empty strings, got 5" in run_raw(service, ctx, {"stop": 5}).error
    assert "stop may have at most 64 strings" in run_raw(service, ctx, {"stop": [f"s{i}" for i in range(65)]}).error
    assert "at most 1024 characters" in run_raw(service, ctx, {"stop": ["x" * 1025]}).error
    # One string is one stop string: first character + NUL never matches, so the text runs on.
    plain = run_raw(service, ctx, {"max_tokens": 40, "ignore_eos": True, "temperature": 0})
    stopped = run_raw(service, ctx, {"max_tokens": 40, "ignore_eos": True, "temperature": 0,
                                     "stop": plain.text[0] + "\x00"})
    assert stopped.text == plain.text and stopped.finish_reason == "length"
    assert client.generate("x", max_tokens=2, ignore_eos=True).finish_reason == "length"
    service.assert_running()


def test_malformed_stage_frames_are_dropped_and_counted(service, client, ctx):
    """A tokenized frame whose meta was {}, not a map, had a str client, an int stop or a 3-byte
    tail once killed the engine or the detokenizer; step rows were not checked at all."""
    eps = service_endpoints(service.url)
    ids = p.pack_token_ids([1, 2, 3])
    good_meta = [b"x", "r", {}, b"", 0.0, 0, 0, False]  # as a stage sends it: a positional row
    bad_metas = [{}, [1], {"client": b"x", "client_request_id": "r"}, ["x", *good_meta[1:]],
                 [*good_meta[:2], {"stop": 5}, *good_meta[3:]], [*good_meta[:3], b"abc", *good_meta[4:]],
                 [*good_meta[:2], {"min_tokens": 2**40}, *good_meta[3:]]]
    before = client.server_stats()
    engine = raw_socket(ctx, zmq.PUSH, eps.engine)
    v = p.STAGE_PROTOCOL_VERSION
    for meta in bad_metas:
        engine.send(msgpack.packb([v, "tokenized", {"request_id": "c:r", "prompt_token_ids": ids, "sampling": {},
                                                    "meta": meta}]))
    engine.send(msgpack.packb([v, "tokenized", {"request_id": "c:r", "prompt_token_ids": ids,
                                                "sampling": {"top_p": 0}, "meta": good_meta}]))
    detok = raw_socket(ctx, zmq.PUSH, eps.detok)
    for meta in bad_metas:
        detok.send(msgpack.packb([v, "step", {"instance_id": "x", "started": [["c:r", meta]]}]))
    detok.send(p.StepOutput(instance_id="x", outputs=[["c:r", b"abc", True, "stop", 1, 1, 0, None, None, None]]).encode())

    def counted():
        stats = client.server_stats()
        return (stats["engine"]["rejected_frames"] - before["engine"]["rejected_frames"] >= len(bad_metas) + 1
                and sum(stats["detok"]["rejected_frames"].values())
                - sum(before["detok"]["rejected_frames"].values()) >= len(bad_metas) + 1)

    wait_for(counted, timeout=60, what="the bad frames to be counted")
    assert client.generate("def f():", max_tokens=3, ignore_eos=True).usage["completion_tokens"] == 3
    service.assert_running()


def test_a_request_id_can_be_reused_right_after_its_stream_was_cancelled(client):
    """The old request's final (abort) output once ended the new request that reused its id."""
    for _ in range(5):
        old = client.stream("def f():", request_id="same", max_tokens=500, ignore_eos=True)
        next(old)
        old.cancel()
        new = client.generate("def f():", request_id="same", max_tokens=20, ignore_eos=True)
        assert new.finish_reason == "length" and len(new.token_ids) == 20


def test_a_client_the_detokenizer_gave_up_on_is_told_when_it_returns(tokenizer_dir, ctx):
    """A client whose requests were aborted after a silence (a network blip, a paused process)
    once waited for them forever. In-process detokenizer, fed by a scripted engine, so the
    request is surely still running when the client goes quiet. A 3 s client timeout: a loaded
    machine may stall this test between two sends for a second, not for that long."""
    stage, eps = in_process_detok(tokenizer_dir, ctx, client_timeout_s=3.0)
    engine_in = ctx.socket(zmq.PULL)
    engine_in.bind(eps.control)
    with running(stage):
        engine_out = raw_socket(ctx, zmq.PUSH, eps.detok)
        identity = uuid.uuid4().bytes
        out = raw_socket(ctx, zmq.DEALER, eps.stream, identity)
        out.send(p.Ping().encode())
        assert isinstance(reply(out), p.Pong)
        meta = p.RequestMeta(client=identity, client_request_id="lost")
        row = ["c:lost", p.pack_token_ids([65, 66]), False, None, 3, 2, 0, None, None, None]
        engine_out.send(p.StepOutput(instance_id="engine-1", started=[["c:lost", meta]], outputs=[row]).encode())
        assert isinstance(reply(out), p.EngineStatus)  # the stage now follows engine-1
        assert isinstance(reply(out), p.StreamOutput)
        while True:  # silence: the stage gives up on us and aborts the request in the engine
            msg = p.decode(engine_in.recv()) if engine_in.poll(60_000) else None
            assert msg is not None, "the silent client's request was never aborted"
            if isinstance(msg, p.AbortReq):
                assert msg.request_id == "c:lost"
                break
        out.send(p.Ping().encode())
        told = reply(out)
        assert isinstance(told, p.StreamOutput)
        (delta,) = told.deltas
        assert (delta.request_id, delta.finish_reason) == ("lost", "error")
        assert "gave up on this client" in delta.error and "no heartbeat" in delta.error
        assert isinstance(reply(out), p.Pong)  # and it is served as a new client


def test_resumes_held_before_the_engines_resync_are_bounded_and_dropped_with_their_client(tokenizer_dir, ctx):
    """Until its first resync a detokenizer holds each client's Resume, to apply it then. They
    were kept without limit, and kept after their clients were gone: 20 clients resuming 65,536
    streams each held 240 MB. In-process detokenizer with no engine: it never resyncs. A 5 s
    client timeout: the resumes must be seen held before their silent clients are given up on,
    which a loaded machine once delayed past a 1 s timeout."""
    from detok_proc.recovery import MAX_EARLY_RESUME_ROWS

    stage, eps = in_process_detok(tokenizer_dir, ctx, client_timeout_s=5.0)
    rows = MAX_EARLY_RESUME_ROWS // 2 - 1
    resume = p.Resume([[f"r{i}", 1, 1] for i in range(rows)]).encode()

    def floods() -> int:
        probe = raw_socket(ctx, zmq.DEALER, eps.stream)
        probe.send(p.StatsReq().encode())
        stats = reply(probe).stats
        probe.close()
        return stats["detok"]["rejected_frames"].get("resume_flood", 0)

    with running(stage):
        first, second, third = (raw_socket(ctx, zmq.DEALER, eps.stream, uuid.uuid4().bytes) for _ in range(3))
        for sock in (first, second):
            sock.send(resume)
        wait_for(lambda: len(stage.recovery.early) == 2, timeout=60, what="two resumes held")
        third.send(resume)  # over the limit with the other two, and no smaller than either
        wait_for(lambda: floods() == 1, timeout=60, what="the third resume refused")
        assert "resume refused" in reply(third).message
        time.sleep(1.1)  # one resume a second per client
        first.send(resume)  # the same client again replaces its own: no flood
        time.sleep(0.5)
        assert floods() == 1
        wait_for(lambda: not stage.recovery.early, timeout=60, what="silent clients' resumes dropped")
        third.send(resume)  # their clients are gone, so is what they held
        wait_for(lambda: len(stage.recovery.early) == 1, timeout=60, what="the third client's resume held")
        assert floods() == 1


@pytest.fixture(scope="module")
def one_live_service(tiny_model_dir):
    """An engine that holds one request at a time, so the next ones queue behind it; each step
    10 ms slower, so a long request runs for seconds, whatever the machine's speed."""
    procs = start_service(tiny_model_dir, f"ipc://{short_tmpdir()}/svc",
                          engine_args=TINY_ENGINE_ARGS + ["--max-live", "1", "--post-step-hook", "tests.helpers.hooks:slow_step"])
    yield procs
    procs.stop()


def test_an_abort_does_not_wait_behind_the_admission_gate(one_live_service):
    """Aborts once sat in the engine's inbox, unread, until the live count dropped: the queued
    request's abort then came only after the long one ended (1,000 steps of >= 10 ms)."""
    with Client(one_live_service.url, timeout=120) as client:
        client.wait_engine(timeout=START_TIMEOUT)
        long = client.stream("def f():", max_tokens=1000, ignore_eos=True)
        next(long)
        queued = client.stream("x", max_tokens=5, ignore_eos=True)
        wait_for(lambda: client.server_stats()["engine"].get("num_queued") == 1, timeout=60,
                 what="the second request waiting for admission")
        queued.cancel()
        wait_for(lambda: client.server_stats()["engine"].get("num_queued") == 0, timeout=60,
                 what="the queued request's abort")
        # Had the abort waited for the live count to drop, the long request would be gone by now.
        assert client.server_stats()["engine"]["num_live"] == 1, "the abort waited for the long request to end"
        long.cancel()


def test_requests_a_dying_tokenizer_held_are_sent_again_and_finish(tiny_model_dir):
    """Requests the tokenizer had received but not passed on when it died once ended only at the
    client's 600 s timeout."""
    procs = start_service(tiny_model_dir, f"ipc://{short_tmpdir()}/svc")
    try:
        with Client(procs.url, timeout=60) as client:
            client.wait_engine(timeout=START_TIMEOUT)
            want = client.generate("def f():", max_tokens=8, ignore_eos=True, temperature=0)
            # The client must know the tokenizer's instance (from a pong) to tell a new one from it.
            wait_for(lambda: client._state.tokenizer_instance is not None, timeout=60, what="the tokenizer's first pong")
            os.kill(procs.pid("tokenizer_proc"), signal.SIGSTOP)  # requests pile up unread...
            results: dict = {}
            threads = [threading.Thread(target=lambda k=k: results.update(
                {k: client.generate("def f():", max_tokens=8, ignore_eos=True, temperature=0)})) for k in range(5)]
            for t in threads:
                t.start()
            time.sleep(0.5)
            procs.kill("tokenizer_proc")  # ...and die with it
            procs.start("tokenizer_proc")
            for t in threads:
                t.join(timeout=60)
            assert [results[k].token_ids for k in range(5)] == [want.token_ids] * 5
        procs.assert_running()
    finally:
        procs.stop()


def test_serve_with_a_missing_model_exits_at_once_with_the_stages_error():
    import subprocess
    import sys

    from tests.service.harness import CHECKOUT_PATH, REPO

    runtime_dir = short_tmpdir()
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "nanovllm.supervisor", "--model", "/no/such/model",
                          "--runtime-dir", runtime_dir], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=CHECKOUT_PATH))
    assert out.returncode == 1, out.stderr[-2000:]
    assert "'/no/such/model' not found" in out.stderr and "before it was ready" in out.stderr
    assert time.monotonic() - started < 60


def test_the_engine_stops_promptly_when_its_detokenizer_is_gone(tiny_model_dir, ctx):
    """With nobody reading its outputs, the engine's queues fill; a stop request once blocked
    forever on the full output queue (the process never exited)."""
    from engine_proc.server import SHUTDOWN_SEND_S

    # No detokenizer binds; a 1 s drain, after which nobody reading is no reason to wait.
    stage, eps, _ = in_process_engine(tiny_model_dir, ctx, detok=False, num_kvcache_blocks=128, out_hwm=2,
                                      drain_timeout_s=1.0)
    stop = threading.Event()
    code: list = []
    runner = threading.Thread(target=lambda: code.append(stage.run(stop)), daemon=True)
    runner.start()
    tok = raw_socket(ctx, zmq.PUSH, eps.engine)
    for i in range(4):
        tok.send(p.TokenizedReq(request_id=f"c:{i}", prompt_token_ids=p.pack_token_ids([1, 2, 3]),
                                sampling={"max_tokens": 900, "ignore_eos": True},
                                meta=p.RequestMeta(client=b"c", client_request_id=str(i))).encode())
    wait_for(stage.outbox.full, timeout=60, what="the output queue to fill")
    stopped_at = time.monotonic()
    stop.set()
    limit = stage.drain_timeout_s + 3 * SHUTDOWN_SEND_S + 1
    runner.join(timeout=limit + 5)
    assert not runner.is_alive(), "the engine did not stop"
    assert code == [0] and time.monotonic() - stopped_at < limit


def test_a_flood_of_detokenizer_hellos_gets_at_most_one_resync_a_second(tiny_model_dir, ctx):
    """A hello is a few bytes and a resync can be thousands of entries: answering each one let a
    flood of hellos keep the detokenizer busy validating resyncs meant for nobody."""
    from engine_proc.server import RESYNC_INTERVAL_S

    stage, eps, detok_in = in_process_engine(tiny_model_dir, ctx)
    with running(stage):
        push = raw_socket(ctx, zmq.PUSH, eps.control)
        started = time.monotonic()
        for i in range(200):
            push.send(p.DetokHello(f"d{i}").encode())
        answered = []
        while "d199" not in answered:  # the latest hello is the one answered, in the end
            assert time.monotonic() - started < 60, f"hung: the last hello never answered ({answered})"
            if detok_in.poll(100):
                msg = p.decode(detok_in.recv())
                if isinstance(msg, p.Resync):
                    answered.append(msg.detok_instance)
        elapsed = time.monotonic() - started
        assert len(answered) <= elapsed / RESYNC_INTERVAL_S + 1, (answered, elapsed)


def test_requests_with_the_most_stop_text_allowed_survive_a_detokenizer_restart(tiny_model_dir):
    """Every request's meta, its stop strings included, travels in the engine's step and resync
    frames. Seventy requests with the most stop text a request may carry (64 strings of 1,024
    four-byte characters, ~256 KB) made one resync frame over the 16 MiB frame limit: the
    restarted detokenizer's socket dropped it with the connection, and the detokenizer took the
    engine for dead, once a second, failing every request."""
    stop = ["\U0001F600" * 1023 + chr(0x10000 + i) for i in range(64)]
    procs = start_service(tiny_model_dir, f"ipc://{short_tmpdir()}/svc")
    try:
        with Client(procs.url, timeout=60) as client:
            streams = [client.stream("def f():", stop=stop, max_tokens=4, ignore_eos=True, temperature=0)
                       for _ in range(70)]
            assert {[d for d in s][-1].finish_reason for s in streams} == {"length"}
            detok_log = os.path.join(procs.log_dir, "detok_proc.log")
            logged = os.path.getsize(detok_log)
            procs.restart("detok_proc")  # the engine remembers the 70 for a minute: all go in its resync
            for _ in range(6):  # over three seconds: a detokenizer failing this way fails some of them
                assert client.generate("def f():", max_tokens=4, ignore_eos=True).finish_reason == "length"
                time.sleep(0.5)
            assert client.server_stats()["engine_alive"] is True
        procs.assert_running()
        with open(detok_log, "rb") as f:
            f.seek(logged)
            restarted = f.read().decode(errors="replace")
        assert "resynced with engine" in restarted and "dead" not in restarted, restarted[-3000:]
    finally:
        procs.stop()


def test_an_id_reused_right_after_a_stop_string_ended_its_stream_gets_its_own_answer(tiny_model_dir, ctx):
    """A raw client may reuse an id once its terminal delta arrived. On a stop string the
    detokenizer sent that delta at once and an abort to the engine, which still held the id until
    it applied the abort a step later: a reuse arriving in between was dropped as a duplicate and
    never answered, and the old request's late outputs made the detokenizer abort the id again,
    killing the new request. Other requests keep the engine stepping, as on any busy service."""
    procs = start_service(tiny_model_dir, f"ipc://{short_tmpdir()}/svc")
    try:
        out, tok = raw_client(procs.url, ctx)
        greedy = {"max_tokens": 40, "ignore_eos": True, "temperature": 0}

        def finish(rid: str) -> tuple[str, str | None]:
            text, deadline = "", time.monotonic() + 20
            while time.monotonic() < deadline:
                if not out.poll(200):
                    out.send(p.Ping().encode())  # stay a live client
                    continue
                for d in getattr(p.decode(out.recv()), "deltas", []):
                    if d.request_id == rid:
                        text += d.text
                        if d.finish_reason is not None:
                            return text, d.finish_reason
            return text, None

        for j in range(8):
            tok.send(p.GenerateReq(f"busy{j}", prompt="x " * 200, sampling={"max_tokens": 2000, "ignore_eos": True}).encode())
        tok.send(p.GenerateReq("probe", prompt="Once upon a time", sampling=greedy).encode())
        text, _ = finish("probe")
        stop = text[15:18]
        outcomes = []
        for trial in range(5):
            rid = f"again{trial}"
            tok.send(p.GenerateReq(rid, prompt="Once upon a time", stop=[stop], sampling=greedy).encode())
            first = finish(rid)
            assert first[1] == "stop" and text.startswith(first[0]) and len(first[0]) <= 15, first
            tok.send(p.GenerateReq(rid, prompt="Hello", sampling={"max_tokens": 3, "ignore_eos": True}).encode())
            outcomes.append(finish(rid)[1])
        assert outcomes == ["length"] * 5, outcomes
        for j in range(8):
            tok.send(p.AbortReq(f"busy{j}").encode())
        procs.assert_running()
    finally:
        procs.stop()


def peak_rss_mib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) // 1024 for line in f if line.startswith("VmHWM:"))


def test_a_flood_of_the_largest_requests_stays_within_the_engines_byte_budgets(tiny_model_dir):
    """The engine bounded the requests it holds by count only (4,096 queued + 4,096 live), and
    held a request's 262,144 allowed token ids as a list of Python ints (about 10 MB): 300 such
    requests took the engine from 242 to 3,653 MiB, so a client at the protocol's limits could
    take it past the machine's memory. Now each request is charged its frame plus its prompt,
    the held requests stay within `--max-live-mib` / `--max-queued-mib`, and every one is served."""
    import json

    from nanovllm.sampling_params import MAX_ALLOWED_TOKEN_IDS
    budget_mib, n = 8, 120
    procs = start_service(tiny_model_dir, f"ipc://{short_tmpdir()}/svc",
                          engine_args=TINY_ENGINE_ARGS + ["--max-live-mib", str(budget_mib), "--max-queued-mib", str(budget_mib)])
    try:
        with Client(procs.url, timeout=300) as client:
            client.wait_engine(timeout=START_TIMEOUT)
            with open(os.path.join(tiny_model_dir, "config.json")) as f:
                vocab = json.load(f)["vocab_size"]
            allowed = [i % vocab for i in range(MAX_ALLOWED_TOKEN_IDS)]
            assert client.generate("def f():", max_tokens=2, allowed_token_ids=allowed).usage["completion_tokens"] == 2
            before = {stage: peak_rss_mib(procs.pid(stage)) for stage in ("tokenizer_proc", "engine_proc")}
            streams = [client.stream("def f():", max_tokens=200, ignore_eos=True, allowed_token_ids=allowed)
                       for _ in range(n)]
            held: list[tuple[int, int]] = []
            done = threading.Event()

            def sample() -> None:  # what the engine says it holds, while the flood is on
                while not done.is_set():
                    engine = client.server_stats()["engine"]
                    held.append((engine["live_bytes"], engine["queued_bytes"]))
                    time.sleep(0.05)
            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            finishes = [[d.finish_reason for d in s][-1] for s in streams]
            done.set()
            sampler.join(timeout=15)
            after = {stage: peak_rss_mib(procs.pid(stage)) for stage in before}
            wait_for(lambda: client.server_stats()["engine"]["live_bytes"] == 0, timeout=60, what="the charges returned")
            assert client.server_stats()["engine"]["queued_bytes"] == 0
        procs.assert_running()
    finally:
        procs.stop()
    assert finishes == ["length"] * n
    assert max(live for live, _ in held) > (budget_mib << 19), held  # the budget was reached
    # At most one request over the budget: the one admitted last may cross it.
    frame = 5 * MAX_ALLOWED_TOKEN_IDS
    assert all(live <= (budget_mib << 20) + frame and queued <= (budget_mib << 20) + frame for live, queued in held), held
    growth = {stage: after[stage] - before[stage] for stage in before}
    assert all(g < 400 for g in growth.values()), growth  # the old code: ~1,300 MiB for the engine alone


def test_recently_finished_requests_are_bounded_by_bytes_as_well_as_count():
    """A finished entry keeps its meta (up to 64 stop strings of 1,024 characters) and its output
    ids for a resync: 4,096 of them could hold over a GiB. The oldest go once the bytes run out."""
    from engine_proc.ledger import FinishedRing, entry_bytes

    def entry(rid: str) -> p.ResyncEntry:
        meta = p.RequestMeta(client=b"c", client_request_id=rid, sampling=SamplingParams(stop=["s" * 1024] * 64))
        return p.ResyncEntry(meta=meta, output=p.OutputRow(
            request_id=rid, token_ids=p.pack_token_ids(range(1000)), finished=True, finish_reason=p.FinishReason.LENGTH,
            num_prompt_tokens=3, num_output_tokens=1000, num_cached_tokens=0, error=None))
    one = entry_bytes(entry("x"))
    assert one > 64 * 1024 * 4 + 4000
    ring = FinishedRing(max_entries=4096, max_bytes=10 * one)
    for i in range(25):
        ring.add(entry(str(i)))
    assert [e.request_id for e in ring.values()] == [str(i) for i in range(15, 25)]
    assert ring.nbytes == 10 * one and "14" not in ring and "15" in ring
    ring.add(entry("24"))  # the same id again replaces its entry, charged once
    assert ring.nbytes == 10 * one and len(ring.values()) == 10


def test_every_way_a_request_leaves_the_engine_returns_its_byte_charge(tiny_model_dir, ctx):
    """The byte budgets only bound memory if every charge comes back: a request that finishes, is
    aborted while queued or while live, is refused at admission, or is a duplicate."""
    stage, eps, detok_in = in_process_engine(tiny_model_dir, ctx, max_live=1)
    ends: dict[str, str] = {}

    def read(until) -> None:
        deadline = time.monotonic() + 30
        while not until() and time.monotonic() < deadline:
            if detok_in.poll(50):
                msg = p.decode(detok_in.recv())
                if isinstance(msg, p.StepOutput):
                    ends.update({row[0]: "rejected" for row in msg.rejected})
                    ends.update({row[0]: row[3] for row in msg.outputs if row[2]})
    with running(stage):
        push = raw_socket(ctx, zmq.PUSH, eps.engine)

        def send(rid: str, sampling: dict, prompt=(1, 2, 3)) -> None:
            push.send(p.TokenizedReq(request_id=rid, prompt_token_ids=p.pack_token_ids(list(prompt)), sampling=sampling,
                                     meta=p.RequestMeta(client=b"c", client_request_id=rid)).encode())
        send("long", {"max_tokens": 500, "ignore_eos": True})
        read(lambda: stage.admission.live_bytes > 0)
        send("queued", {"max_tokens": 5, "allowed_token_ids": list(range(100))})
        send("queued", {"max_tokens": 5})  # a duplicate of a queued id: ignored
        send("bad", {"max_tokens": 5, "response_format": '{"type":"regex","regex":"(unclosed"}'})  # does not compile
        send("too-long", {"max_tokens": 5}, prompt=range(1, 5000))  # refused at admission: longer than the model
        send("short", {"max_tokens": 3, "ignore_eos": True})
        read(lambda: stage.input.queued_bytes and len(stage.admission.backlog) == 4)
        assert stage.input.queued_bytes == sum(q.nbytes for q in stage.admission.backlog.values())
        control = raw_socket(ctx, zmq.PUSH, eps.control)
        control.send(p.AbortReq("queued").encode())
        read(lambda: "queued" in ends)
        control.send(p.AbortReq("long").encode())
        read(lambda: len(ends) == 5)
        assert ends == {"long": "abort", "queued": "abort", "bad": "rejected", "too-long": "rejected", "short": "length"}
        read(lambda: not stage.admission.live and not stage.admission.backlog)
        assert (stage.admission.live_bytes, stage.input.queued_bytes, stage.input.num_queued) == (0, 0, 0)


def test_a_request_over_the_frame_limit_once_tokenized_is_refused_by_the_tokenizer(tmp_path, tokenizer_dir, ctx):
    """With a model whose context holds over ~4.2M tokens, a 4 MB text prompt the tokenizer
    accepts became a 16.8 MB TokenizedReq; the engine's socket dropped it (and the connection it
    came on) without a word to anyone, and the client never got an answer."""
    from tests.helpers.tiny_models import make_tiny_model

    model = make_tiny_model(str(tmp_path / "long-context"), "qwen3", tokenizer_dir=tokenizer_dir,
                            max_position_embeddings=8_000_000)
    # The tokenizer's limit is the engine's max_model_len (4096 by default): raised to the model's.
    procs = start_service(model, f"ipc://{short_tmpdir()}/svc",
                          env={"tokenizer_proc": {"NANOVLLM_MAX_MODEL_LEN": "8000000"}})
    try:
        out, tok = raw_client(procs.url, ctx)
        sampling = {"max_tokens": 3, "allowed_token_ids": list(range(2048)) * 128}
        tok.send(p.GenerateReq("big", prompt="a" * 4_194_000, sampling=sampling).encode())
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            msg = reply(tok, timeout_ms=60_000)
            deltas = msg.deltas if isinstance(msg, p.StreamOutput) else []
            if any(d.request_id == "big" for d in deltas):
                break
        (delta,) = deltas
        assert delta.finish_reason == "error" and "frame limit" in delta.error, delta
        with Client(procs.url, timeout=60) as client:
            assert client.generate("def f():", max_tokens=3, ignore_eos=True).finish_reason == "length"
        procs.assert_running()
    finally:
        procs.stop()


def test_a_busy_engine_is_not_reported_dead(tmp_path, tokenizer_dir, ctx):
    """A request the tokenizer could not pass on for 10 s, with the engine connected but its queue
    full, was failed as "engine is not available (dead ...)" with engine_dead set, so the client
    took a running engine for dead. It is now told the engine is overloaded."""
    from tests.helpers.tiny_models import make_tiny_model

    # Long enough a context and slow enough a step that one request holds the engine for ~20 s.
    model = make_tiny_model(str(tmp_path / "longer"), "qwen3", tokenizer_dir=tokenizer_dir, max_position_embeddings=8192,
                            hidden_size=512, intermediate_size=1408, num_hidden_layers=4)
    procs = start_service(model, f"ipc://{short_tmpdir()}/svc",
                          engine_args=TINY_ENGINE_ARGS + ["--max-live", "1", "--max-queued", "1"])
    try:
        with Client(procs.url, timeout=120) as client:
            long = client.stream("def f():", max_tokens=8000, ignore_eos=True)  # holds the one live slot
            next(long)
            out, tok = raw_client(procs.url, ctx)
            # The engine's queue, then the pipes to it fill up (large frames: the kernel's socket
            # buffers would hold thousands of small ones).
            sampling = {"max_tokens": 1, "allowed_token_ids": list(range(2048)) * 32}
            for i in range(300):
                tok.send(p.GenerateReq(f"r{i}", prompt="x", sampling=sampling).encode())
            failed = None
            deadline = time.monotonic() + 60
            while failed is None and time.monotonic() < deadline:
                out.send(p.Ping().encode())  # stay alive for the detokenizer
                if tok.poll(1000):
                    msg = p.decode(tok.recv())
                    failed = next((d for d in getattr(msg, "deltas", []) if d.finish_reason == "error"), None)
            assert failed is not None, "no request was refused"
            assert "overloaded" in failed.error and not failed.engine_dead, failed
            assert client.server_stats()["engine_alive"] is True
            long.cancel()
        procs.assert_running()
    except BaseException:
        print(procs.logs())  # which stage saw what, when
        raise
    finally:
        procs.stop()
