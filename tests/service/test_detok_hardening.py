"""The detokenizer against misbehaving clients and restarts: one regression test per way it used
to lose a stream or fail everyone's (each failed on the code before the fix). Real processes and
sockets; an in-process detokenizer fed by a scripted engine where the timing must be exact."""
from __future__ import annotations

import time
import uuid

import zmq

from detok_proc.recovery import RESUME_INTERVAL_S
from nanovllm_client import Client
from nanovllm_client import protocol as p
from nanovllm_client.endpoints import service_endpoints
from nanovllm_client.client_state import merge
from tests.service.conftest import EXACT_ARGS, START_TIMEOUT, start_service
from tests.service.harness import short_tmpdir, wait_for
from tests.service.test_hardening import in_process_detok, raw_socket, reply, running


def test_one_clients_burst_of_resumes_does_not_make_the_engine_look_dead(tiny_model_dir):
    """The detokenizer handled up to 256 client frames in a pass before it looked at the engine
    socket or the clock; 60 valid Resumes of 65,536 rows (0.64 MB each, ~0.1-0.3 s each to apply)
    kept it from the engine's heartbeats for seconds, it declared the engine dead, and every
    client's streams failed with EngineDeadError. Default detokenizer timeouts."""
    procs = start_service(tiny_model_dir, f"ipc://{short_tmpdir()}/svc", detok_args=[])
    ctx = zmq.Context()
    try:
        frame = p.Resume([[f"r{i}", 0, 0] for i in range(p.MAX_ROWS)]).encode()
        with Client(procs.url, timeout=120) as client:
            victims = [client.stream("def f():", max_tokens=400, ignore_eos=True) for _ in range(3)]
            for victim in victims:
                next(victim)
            hog = raw_socket(ctx, zmq.DEALER, service_endpoints(procs.url).stream, uuid.uuid4().bytes)
            sent = time.monotonic()
            for _ in range(60):
                hog.send(frame)
            hog.send(p.Ping().encode())  # answered once the stage has handled all 60 (in order)
            finishes = [[d.finish_reason for d in victim][-1] for victim in victims]
            assert finishes == ["length"] * 3
            assert client.server_stats(timeout=120)["engine_alive"] is True  # a limit that only catches a hang
            refused, deadline = 0, time.monotonic() + 120
            while True:
                assert hog.poll(max(0.0, deadline - time.monotonic()) * 1000), "the hog's ping got no answer"
                msg = p.decode(hog.recv())
                if isinstance(msg, p.Pong):
                    break
                refused += isinstance(msg, p.ErrorOutput) and "resume refused" in msg.message
            handled_s = time.monotonic() - sent
            # At most one resume a second was applied, however long each took on this machine.
            assert 1 <= 60 - refused <= handled_s / RESUME_INTERVAL_S + 1, (refused, handled_s)
            assert client.server_stats(timeout=120)["detok"]["rejected_frames"].get("resume_flood", 0) == refused
        procs.assert_running()
    finally:
        ctx.destroy(linger=0)
        procs.stop()


def test_a_stream_the_engine_admitted_while_the_detokenizer_was_down_survives_its_restart(tiny_model_dir):
    """A new detokenizer reads the engine's queued steps first; for a request sent while it was
    down, they carry its start and first tokens before the client has reconnected. The send found
    no socket for the client (EHOSTUNREACH), the stage took the client for gone and aborted its
    requests: the stream ended in an error, 4 times in 4 tries. A client the stage has not heard
    from yet may be reconnecting: its frames are held, and the client timeout decides."""
    procs = start_service(tiny_model_dir, f"ipc://{short_tmpdir()}/svc")
    try:
        # stage_timeout only catches a hang: a detokenizer started on a loaded machine took over
        # the default 30 s to answer (its imports and tokenizer), and the client gave the stream up.
        with Client(procs.url, timeout=180, connect_timeout=60, stage_timeout=120) as client:
            for _ in range(2):
                before = client.stream("def f():", max_tokens=2000, ignore_eos=True)
                next(before)
                procs.kill("detok_proc")
                during = client.stream("x = 1", max_tokens=2000, ignore_eos=True)
                time.sleep(1.0)  # it reaches the engine, which admits it and steps
                procs.start("detok_proc")
                assert [[d.finish_reason for d in s][-1] for s in (before, during)] == ["length", "length"]
                client.wait_engine(timeout=START_TIMEOUT)
        procs.assert_running()
    finally:
        procs.stop()


def test_a_client_gone_before_the_resync_does_not_stop_the_others_resumes(tokenizer_dir, ctx):
    """Resumes that arrive before the engine's resync are applied when it comes, in a loop over
    the held ones; a client whose socket had gone meanwhile was dropped from that dict mid-loop,
    the loop raised, and every later client's streams were never resumed nor ended."""
    stage, eps = in_process_detok(tokenizer_dir, ctx, client_timeout_s=5.0)
    engine_in = ctx.socket(zmq.PULL)
    engine_in.bind(eps.control)
    with running(stage):
        engine_out = raw_socket(ctx, zmq.PUSH, eps.detok)
        engine_out.send(p.EngineStatus(True, "E1", state="ready").encode())
        leaving_id, staying_id = uuid.uuid4().bytes, uuid.uuid4().bytes
        leaving = raw_socket(ctx, zmq.DEALER, eps.stream, leaving_id)
        staying = raw_socket(ctx, zmq.DEALER, eps.stream, staying_id)
        leaving.send(p.Resume([["gone-1", 1, 0]]).encode())  # its answer will find no socket
        staying.send(p.Resume([["v1", 2, 2]]).encode())
        wait_for(lambda: len(stage.recovery.early) == 2, timeout=60, what="both resumes held")
        leaving.close()
        time.sleep(0.3)
        meta = p.RequestMeta(client=staying_id, client_request_id="v1")
        entry = [meta, ["c:v1", p.pack_token_ids([65, 66, 67]), True, "length", 3, 3, 0, None, None, None]]
        engine_out.send(p.Resync("E1", stage.instance_id, [entry], True).encode())
        while True:
            msg = reply(staying)
            if isinstance(msg, p.StreamOutput):
                break
        (delta,) = msg.deltas
        assert (delta.request_id, delta.finish_reason) == ("v1", "length")
        assert stage.rejects.counts.get("internal", 0) == 0


def test_a_huge_early_resume_cannot_crowd_out_a_small_one(tokenizer_dir, ctx):
    """The Resumes held before the engine's resync share one budget; it was first come, first
    served, so one client's 65,536-row Resume made every later client's few rows be refused, and
    their streams were dropped. Now the largest held Resume goes first, and its client is told."""
    from detok_proc.recovery import MAX_EARLY_RESUME_ROWS

    stage, eps = in_process_detok(tokenizer_dir, ctx, client_timeout_s=5.0)
    with running(stage):
        hog_id, small_id = uuid.uuid4().bytes, uuid.uuid4().bytes
        hog = raw_socket(ctx, zmq.DEALER, eps.stream, hog_id)
        small = raw_socket(ctx, zmq.DEALER, eps.stream, small_id)
        hog.send(p.Resume([[f"r{i}", 1, 1] for i in range(MAX_EARLY_RESUME_ROWS)]).encode())
        wait_for(lambda: hog_id in stage.recovery.early, timeout=60, what="the huge resume held")
        small.send(p.Resume([["mine", 1, 1]]).encode())
        assert "resume refused" in reply(hog).message
        wait_for(lambda: list(stage.recovery.early) == [small_id], timeout=60, what="the small resume held")
        assert stage.recovery.early[small_id] == [p.ResumeRow("mine", 1, 1)]


def test_outputs_for_a_client_not_connected_yet_wait_for_it_instead_of_ending_its_requests(tokenizer_dir, ctx):
    """The same, step by step: a step starts a request for a client that has not reached this
    detokenizer yet. The send found no socket, and the stage aborted the request in the engine."""
    stage, eps = in_process_detok(tokenizer_dir, ctx, client_timeout_s=5.0)
    engine_in = ctx.socket(zmq.PULL)
    engine_in.bind(eps.control)
    with running(stage):
        engine_out = raw_socket(ctx, zmq.PUSH, eps.detok)
        identity = uuid.uuid4().bytes
        meta = p.RequestMeta(client=identity, client_request_id="r1")
        engine_out.send(p.StepOutput("E1", [["c:r1", meta]], [], [["c:r1", p.pack_token_ids([65]), False, None,
                                                                   3, 1, 0, None, None, None]]).encode())
        wait_for(lambda: stage.engine.instance == "E1", timeout=60, what="the step applied")
        time.sleep(0.3)  # the stage tries to send, and finds no socket for the client
        out = raw_socket(ctx, zmq.DEALER, eps.stream, identity)
        out.send(p.Ping().encode())
        engine_out.send(p.StepOutput("E1", [], [], [["c:r1", p.pack_token_ids([66]), True, "length",
                                                     3, 2, 0, None, None, None]]).encode())
        got, finish = b"", None
        while finish is None:
            msg = reply(out)
            for delta in msg.deltas if isinstance(msg, p.StreamOutput) else []:
                got += delta.token_ids
                finish = delta.finish_reason
        assert (p.unpack_token_ids(got), finish) == ([65, 66], "length")
        aborts = []
        while engine_in.poll(100):
            msg = p.decode(engine_in.recv())
            if isinstance(msg, p.AbortReq):
                aborts.append(msg.request_id)
        assert aborts == []


def test_requests_go_on_when_the_engine_and_detokenizer_die_together(tiny_model_dir):
    """A request still queued in the engine has no output, so a client's resume cannot ask for it
    and the new engine's resync does not hold it; the detokenizer that saw the old engine die died
    with it, so nobody said so. The request waited for its own timeout (600 s by default). Then
    the client saw the engine instance change (the new detokenizer names it) and failed what it
    had in flight. Now it sends both to the new engine: the queued one as it was, the streaming
    one with what it had received, and each ends as it would have."""
    procs = start_service(tiny_model_dir, f"ipc://{short_tmpdir()}/svc",
                          engine_args=["--num-kvcache-blocks", "512", "--num-threads", "1", "--max-live", "1",
                                       "--post-step-hook", "tests.helpers.hooks:slow_step", *EXACT_ARGS])
    try:
        with Client(procs.url, timeout=60, connect_timeout=60) as client:
            long, short = dict(max_tokens=300, ignore_eos=True, temperature=0), dict(max_tokens=5, ignore_eos=True,
                                                                                       temperature=0)
            want = client.generate("def f():", **long), client.generate("x = 1", **short)
            running = client.stream("def f():", **long)
            first = next(running)
            queued = client.stream("x = 1", **short)
            wait_for(lambda: client.server_stats()["engine"]["num_queued"] == 1, timeout=60, what="one queued")
            procs.kill("detok_proc")  # first: nobody sees the engine die
            procs.kill("engine_proc")
            procs.start("engine_proc")
            procs.start("detok_proc")
            got = merge([first] + list(running), "f"), merge(list(queued), "x")
            for result, reference in zip(got, want):
                assert (result.text, result.token_ids, result.finish_reason) == (
                    reference.text, reference.token_ids, "length")
            assert got[0].usage["completion_tokens"] == 300
            assert client.generate("y", max_tokens=3, ignore_eos=True).finish_reason == "length"
        procs.assert_running()
    finally:
        procs.stop()


def test_a_connection_dropped_before_its_handshake_does_not_make_the_engine_look_dead(tokenizer_dir, ctx):
    """The detokenizer counts the engine's connections to know at once when it dies; a
    connection to its engine socket that closed before the zmq handshake (a port scan, a stage
    that gave up at once) was counted off too, and the live engine was declared dead: every
    request failed with "engine died: its connection closed"."""
    import socket

    stage, eps = in_process_detok(tokenizer_dir, ctx, client_timeout_s=5.0)
    with running(stage):
        engine_out = raw_socket(ctx, zmq.PUSH, eps.detok)
        engine_out.send(p.EngineStatus(True, "E1", state="ready").encode())
        wait_for(lambda: stage.engine.alive is True, timeout=60, what="the engine heard")
        for greeting in (b"", b"GET / HTTP/1.0\r\n\r\n"):
            with socket.socket(socket.AF_UNIX) as stray:
                stray.connect(eps.detok[len("ipc://"):])
                stray.sendall(greeting)
        watch_until = time.monotonic() + 1.5  # the stage sees each disconnect within a loop turn (ms)
        while time.monotonic() < watch_until:
            assert stage.engine.alive is True, "a stray connection's end was taken for the engine's"
            time.sleep(0.02)


def test_a_stall_of_the_detokenizer_is_no_silence_of_the_engine(tokenizer_dir):
    # Right after a SIGSTOP ends, the engine's heartbeats may still sit in zmq's I/O thread, not
    # yet in the socket (a poll sees none): the stall must count toward the engine's silence no
    # more than toward a client's. A silence after the stall is still one.
    from transformers import AutoTokenizer

    from detok_proc.server import DetokStage

    ctx = zmq.Context()
    eps = service_endpoints(f"ipc://{short_tmpdir()}")
    stage = DetokStage(AutoTokenizer.from_pretrained(tokenizer_dir), eps.stream, eps.detok, eps.control,
                       client_timeout_s=3.0, engine_timeout_s=1.5, ctx=ctx)
    try:
        now = time.monotonic()
        stage.engine.state, stage.engine.alive, stage.engine.instance = "ready", True, "E1"
        stage.engine.last_seen = stage._last_check = now - 8.0  # heard just before an 8 s stop
        stage.check_timeouts(now)
        assert stage.engine.alive is True, "the detokenizer's own stall was taken for the engine's silence"
        # Only the stall beyond STALL_S is credited: silent for STALL_S before this check, the
        # engine has engine_timeout_s - STALL_S left for its waiting heartbeats to be read.
        stage.check_timeouts(now + 0.3)
        assert stage.engine.alive is True
        stage.check_timeouts(now + 0.3 + 0.9)  # awake and listening, and still nothing
        assert stage.engine.alive is False
    finally:
        ctx.destroy(linger=0)


def test_a_detokenizer_stopped_for_a_while_does_not_give_up_on_its_clients(tiny_model_dir):
    """Stopped (SIGSTOP, a frozen VM, swapped out) for longer than the client timeout, the
    detokenizer came back, found every client silent for that long (their heartbeats still
    waiting unread) and gave up on them: each stream in flight ended in an error (16 of 16 in a
    soak after a 12 s stop). Time it did not listen now counts toward no client's silence."""
    import os
    import signal
    import threading

    from tests.service.conftest import TINY_ENGINE_ARGS

    hook = ["--post-step-hook", "tests.helpers.hooks:slow_step"]  # the streams outlive the stop
    procs = start_service(tiny_model_dir, f"ipc://{short_tmpdir()}/svc", engine_args=TINY_ENGINE_ARGS + EXACT_ARGS + hook)
    try:
        with Client(procs.url, timeout=120) as client:
            prompts = [f"def f{i}():" for i in range(3)]
            kw = dict(max_tokens=1000, temperature=0, ignore_eos=True)
            want = [merge(list(s), f"want{i}") for i, s in enumerate([client.stream(prompt, **kw) for prompt in prompts])]
            streams = [client.stream(prompt, **kw) for prompt in prompts]
            got = [[next(stream)] for stream in streams]
            errors: list = []

            def read(stream, deltas: list) -> None:
                try:
                    deltas.extend(stream)
                except Exception as e:  # the stream ended in an error
                    errors.append(str(e))

            readers = [threading.Thread(target=read, args=(s, g)) for s, g in zip(streams, got)]
            for reader in readers:
                reader.start()
            detok = procs.pid("detok_proc")
            os.kill(detok, signal.SIGSTOP)
            time.sleep(8.0)  # the detokenizer's client timeout is 3 s here
            os.kill(detok, signal.SIGCONT)
            for reader in readers:
                reader.join(timeout=90)
            assert not errors
            for reference, deltas in zip(want, got):
                result = merge(deltas, reference.request_id)
                assert (result.text, result.token_ids, result.finish_reason) == (reference.text, reference.token_ids,
                                                                                 "length")
        procs.assert_running()
        assert "stalled for" in procs.logs(tail=100_000)
    finally:
        procs.stop()
