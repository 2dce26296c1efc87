"""The detokenizer under a client that stops reading: nothing is lost, memory stays bounded.

In-process DetokStage on real ipc sockets, fed by a fake engine, so the client's socket can be
filled deliberately (tiny HWMs, large frames).
"""
from __future__ import annotations

import threading
import time
import uuid

import pytest
import zmq

from detok_proc.server import DetokStage
from nanovllm_client import protocol as p
from nanovllm_client.endpoints import service_endpoints
from nanovllm.service.stage import PeerMonitor
from tests.service.harness import short_tmpdir, wait_for

TOKENS_PER_STEP = 200
NUM_STEPS = 800


@pytest.fixture
def rig(tokenizer_dir, request):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    eps = service_endpoints(f"ipc://{short_tmpdir()}")
    # The stage gets this test's own context, as a stage process has its own: sharing the global
    # instance across the two tests here made the second one's abort socket never report its
    # handshake about one run in four under load.
    ctx = zmq.Context()
    stop = threading.Event()
    runner = None
    # Cleanup must run even if setup fails: a Context left with open sockets blocks forever in
    # term() when it is garbage-collected later, which would hang the rest of the test session.
    try:
        engine_in = ctx.socket(zmq.PULL)
        engine_peers = PeerMonitor(engine_in)  # before binding (see PeerMonitor)
        engine_in.bind(eps.control)
        stage = DetokStage(tok, eps.stream, eps.detok, eps.control, client_timeout_s=60, engine_timeout_s=60,
                           client_hwm=2, ctx=ctx, **request.param)
        runner = threading.Thread(target=stage.run, args=(stop,), daemon=True)
        wait_for(lambda: engine_peers.connected, timeout=60, what="the detokenizer's abort socket to connect")
        engine_out = ctx.socket(zmq.PUSH)
        engine_out.connect(eps.detok)
        identity = uuid.uuid4().bytes
        client = ctx.socket(zmq.DEALER)
        client.setsockopt(zmq.ROUTING_ID, identity)
        client.setsockopt(zmq.RCVHWM, 2)
        client.setsockopt(zmq.RCVBUF, 4096)
        client.connect(eps.stream)
        runner.start()
        yield tok, stage, engine_in, engine_out, client, identity
    finally:
        stop.set()
        if runner is not None and runner.is_alive():
            runner.join(timeout=10)
        ctx.destroy(linger=0)  # closes every socket of this context (the monitor's too), then terms


def frames_received(stage) -> float:
    return stage.metrics.registry.get_sample_value("nanovllm:frames_received_total") or 0.0


def feed_engine_steps(tok, stage, engine_out, identity, small_client: bytes | None = None) -> list[int]:
    """One request whose every step carries TOKENS_PER_STEP tokens (big frames fill buffers fast).
    Each step is sent once the stage has taken the one before: the stage merges the steps it finds
    waiting into one frame per client, and the point here is many frames to a client that reads
    none of them. With `small_client`, its request "s1" rides along with one token a step."""
    ids = tok.encode("def f(x):\n    return x * 2  # 中文🚀\n" * 800, add_special_tokens=False)
    ids = (ids * 20)[:TOKENS_PER_STEP * NUM_STEPS]
    meta = p.RequestMeta(client=identity, client_request_id="r1")
    frames = [p.EngineStatus(alive=True, instance_id="fake-engine").encode()]
    for k in range(NUM_STEPS):
        chunk = ids[k * TOKENS_PER_STEP:(k + 1) * TOKENS_PER_STEP]
        last = k == NUM_STEPS - 1
        rows = [["c:r1", p.pack_token_ids(chunk), last, "length" if last else None, 5, (k + 1) * TOKENS_PER_STEP, 0, None, None, None]]
        started = [["c:r1", meta]] if k == 0 else []
        if small_client is not None:
            rows.append(["c:s1", p.pack_token_ids(ids[k:k + 1]), last, "length" if last else None, 5, k + 1, 0, None, None, None])
            started += [["c:s1", meta._replace(client=small_client, client_request_id="s1")]] if k == 0 else []
        frames.append(p.StepOutput(instance_id="fake-engine", started=started, outputs=rows).encode())
    for frame in frames:
        seen = frames_received(stage)
        engine_out.send(frame)
        wait_for(lambda: frames_received(stage) > seen, timeout=30, interval=0.0005, what="the stage to take a step")
    return ids


def next_abort(engine_in) -> p.AbortReq:
    """The next abort the detokenizer sends the engine (its DetokHello greetings are skipped)."""
    while True:
        assert engine_in.poll(30_000), "no abort reached the engine"
        msg = p.decode(engine_in.recv())
        if isinstance(msg, p.AbortReq):
            return msg
        assert isinstance(msg, p.DetokHello), msg


def handshake(client) -> None:
    client.send(p.Ping().encode())
    assert client.poll(10_000)
    assert isinstance(p.decode(client.recv()), p.Pong)


@pytest.mark.parametrize("rig", [{"max_pending_frames": 100_000}], indirect=True)
def test_a_client_that_stops_reading_still_gets_every_character_in_order(rig):
    tok, stage, _, engine_out, client, identity = rig
    handshake(client)
    ids = feed_engine_steps(tok, stage, engine_out, identity)
    # The client reads nothing: the detokenizer must queue frames (EAGAIN), not drop them.
    wait_for(lambda: stage.stats()["detok"]["num_pending_frames"] > 0, timeout=30, what="frames held back")
    text, terminals = [], 0
    while terminals == 0:
        assert client.poll(30_000), "stream stalled"
        msg = p.decode(client.recv())
        if isinstance(msg, p.EngineStatus):  # the "engine alive" broadcast
            continue
        for delta in msg.deltas:
            text.append(delta.text)
            terminals += delta.finish_reason is not None
    assert "".join(text) == tok.decode(ids)
    assert not client.poll(500), "nothing may follow the terminal delta"
    wait_for(lambda: stage.stats()["detok"]["num_requests"] == 0 and stage.stats()["detok"]["num_pending_frames"] == 0,
             timeout=60, what="detok state cleared")


@pytest.mark.parametrize("rig", [{"max_pending_frames": 3}], indirect=True)
def test_a_stuck_client_has_its_request_aborted_once_its_queue_is_full(rig):
    tok, stage, engine_in, engine_out, client, identity = rig
    handshake(client)
    feed_engine_steps(tok, stage, engine_out, identity)
    abort = next_abort(engine_in)
    assert abort.request_id == "c:r1"
    wait_for(lambda: stage.stats()["detok"]["num_requests"] == 0 and stage.stats()["detok"]["num_pending_frames"] == 0,
             timeout=60, what="stuck client's state dropped")


@pytest.mark.parametrize("rig", [{"max_pending_frames": 100_000, "max_pending_bytes": 64 << 10}], indirect=True)
def test_the_output_held_for_slow_clients_is_bounded_by_bytes(rig):
    """Frames held for a client that does not read were bounded by count only (1,000 here, 10,000
    more in zmq's pipe), whatever their size: a client with many streams that stopped reading
    could make the detokenizer hold gigabytes. Over the byte budget the client holding the most
    is given up (its requests aborted); the memory it held is released."""
    tok, stage, engine_in, engine_out, client, identity = rig
    handshake(client)
    held: list[float] = []
    aborted = threading.Event()

    def watch() -> None:
        while not aborted.is_set():
            held.append(stage.metrics.registry.get_sample_value("nanovllm:client_output_bytes_held"))
            time.sleep(0.001)
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    feed_engine_steps(tok, stage, engine_out, identity)
    assert next_abort(engine_in).request_id == "c:r1"
    aborted.set()
    watcher.join()
    assert max(held) > 0  # the gauge showed the output held before the client was given up
    detok = stage.stats()["detok"]
    assert detok["num_requests"] == 0 and detok["pending_bytes"] == 0 and detok["num_pending_frames"] == 0
    assert stage.metrics.registry.get_sample_value("nanovllm:client_output_bytes_held") == 0
    client.send(p.Ping().encode())  # it is told why, should it come back
    while True:
        assert client.poll(10_000)
        msg = p.decode(client.recv())
        if isinstance(msg, p.StreamOutput) and msg.deltas[0].finish_reason == "error":
            assert "MiB of output unread" in msg.deltas[0].error
            break


@pytest.mark.parametrize("rig", [{"max_pending_frames": 100_000, "max_pending_bytes": 64 << 10}], indirect=True)
def test_over_the_byte_budget_the_client_holding_the_most_goes_first(rig):
    """Two clients stop reading, both with a request running to the end of the feed; one gets
    200 tokens a step, the other one. When the output held passes the budget, the one holding
    the most is given up, and the other keeps its stream whole."""
    tok, stage, engine_in, engine_out, client, identity = rig
    small_id = uuid.uuid4().bytes
    small = stage.ctx.socket(zmq.DEALER)
    small.setsockopt(zmq.ROUTING_ID, small_id)
    small.setsockopt(zmq.RCVHWM, 2)
    small.setsockopt(zmq.RCVBUF, 4096)
    small.connect(stage.clients_sock.getsockopt(zmq.LAST_ENDPOINT).decode())
    handshake(client)
    handshake(small)
    ids = feed_engine_steps(tok, stage, engine_out, identity, small_client=small_id)
    assert next_abort(engine_in).request_id == "c:r1"
    later = time.monotonic() + 1.0
    while engine_in.poll(max(1, int((later - time.monotonic()) * 1000))):  # hellos repeat: no resync here
        assert not isinstance(p.decode(engine_in.recv()), p.AbortReq), "only the client holding the most goes"
    deltas = []
    while not deltas or deltas[-1].finish_reason is None:
        assert small.poll(10_000), "the small stream stalled"
        msg = p.decode(small.recv())
        deltas += [d for d in getattr(msg, "deltas", []) if d.request_id == "s1"]
    assert deltas[-1].finish_reason == "length"
    assert "".join(d.text for d in deltas) == tok.decode(ids[:NUM_STEPS])
