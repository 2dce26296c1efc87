"""The sync Client's I/O thread against a stage that stops reading."""
from __future__ import annotations

import multiprocessing
import threading
import time

import zmq

from nanovllm_client import Client
from nanovllm_client import protocol as p
from nanovllm_client.endpoints import service_endpoints
from nanovllm_client.errors import ServiceUnavailableError


def detokenizer_gone_deaf(endpoint: str, stop) -> None:
    """Answers the client's first ping, so it is ready, then reads nothing more: the client's pipe
    to it fills, and a blocking send there would never return."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.RCVHWM, 1)
    sock.setsockopt(zmq.RCVBUF, 4096)
    sock.bind(endpoint)
    identity, _ = sock.recv_multipart()
    sock.send_multipart([identity, p.Pong("detokenizer", "d1", True).encode()])
    stop.poll(None)
    sock.close(linger=0)
    ctx.term()


def test_a_detokenizer_that_stops_reading_does_not_stall_the_client(tmp_path):
    # Stats requests go to the detokenizer. When it stops reading they fill the pipe; the client's
    # one I/O thread, which every stream and the heartbeat depend on, must not wait for room: the
    # requests it cannot send are dropped, server_stats() says no reply came, and close() returns.
    url = f"ipc://{tmp_path}"
    stop, stop_end = multiprocessing.Pipe()
    fake = multiprocessing.get_context("spawn").Process(
        target=detokenizer_gone_deaf, args=(service_endpoints(url).stream, stop_end))
    fake.start()
    outcome: dict[str, object] = {}

    def scenario() -> None:
        client = Client(url, hwm=1, connect_timeout=60, heartbeat_interval=60)
        for _ in range(60_000):  # a few hundred kB of requests: more than the pipe's buffers hold
            try:
                client.server_stats(timeout=0)
            except ServiceUnavailableError:
                pass
        try:
            client.server_stats(timeout=0.5)
        except ServiceUnavailableError as e:
            outcome["error"] = str(e)
        start = time.monotonic()
        client.close()
        outcome["closing"] = time.monotonic() - start

    runner = threading.Thread(target=scenario, daemon=True)
    try:
        runner.start()
        runner.join(30)
    finally:
        stop.send("stop")
        fake.join(10)
    assert not runner.is_alive(), "the client hung: its I/O thread waited on the full pipe"
    assert "no stats reply" in str(outcome.get("error")), outcome
    assert outcome["closing"] < 3, f"close() took {outcome['closing']:.1f}s"
