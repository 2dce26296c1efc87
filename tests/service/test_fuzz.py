"""Thousands of hostile frames on every socket of a running service: no stage exits, restarts,
hangs or grows without bound, and a normal request still streams the right answer.

The frames come from `fuzz_frames.py` (seeded): random bytes, random msgpack, truncated and
type-confused real messages, nesting far past any real message, 1-2 MB frames, multipart sends,
and generate requests with valid but extreme sampling values. They go to the tokenizer's and the
detokenizer's client sockets and, as a host that reached the stage-to-stage ports would send
them, to the engine's input and the detokenizer's engine input. `-m soak` runs 12,000 per socket.
"""
from __future__ import annotations

import random
import time
import uuid

import pytest
import zmq

from nanovllm_client import Client
from nanovllm_client import protocol as p
from nanovllm_client.endpoints import service_endpoints
from tests.service.conftest import start_service
from tests.service.fuzz_frames import hostile_frames
from tests.service.harness import STAGES, short_tmpdir, wait_for

RSS_GROWTH_LIMIT_MB = 150
PROMPT = "def main():"


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


@pytest.fixture(scope="module")
def fuzzed_service(tiny_model_dir):
    procs = start_service(tiny_model_dir, f"ipc://{short_tmpdir()}/svc")
    yield procs
    procs.stop()


def forged_engine_message(frame: bytes | list[bytes]) -> bool:
    """A well-formed engine message from a made-up engine. Without keys the stage-to-stage
    sockets cannot tell one from the real engine's (that is what CURVE is for: an impostor there
    can end streams by announcing an engine death or restart); the fuzzer sends malformed ones."""
    try:
        return isinstance(p.decode(frame[0] if isinstance(frame, list) else frame),
                          (p.EngineStatus, p.StepOutput, p.Resync))
    except p.ProtocolError:
        return False


def blast(url: str, frames_per_socket: int, seed: int) -> None:
    """Send the frames to all five sockets, round robin, reading (and discarding) every reply."""
    eps = service_endpoints(url)
    ctx = zmq.Context()
    try:
        targets = []
        for endpoint, kind in ((eps.tokenizer, zmq.DEALER), (eps.stream, zmq.DEALER),
                               (eps.engine, zmq.PUSH), (eps.detok, zmq.PUSH), (eps.control, zmq.PUSH)):
            sock = ctx.socket(kind)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDTIMEO, 10_000)  # a stage that stops reading fails the test, not hangs it
            if kind == zmq.DEALER:
                sock.setsockopt(zmq.ROUTING_ID, uuid.uuid4().bytes)
            sock.connect(endpoint)
            frames = hostile_frames(random.Random(f"{seed}-{endpoint}"), 2 * frames_per_socket)
            if endpoint == eps.detok:
                frames = (f for f in frames if not forged_engine_message(f))
            targets.append((endpoint, sock, frames))
        for i in range(frames_per_socket):
            for endpoint, sock, frames in targets:
                frame = next(frames)
                try:
                    sock.send_multipart(frame if isinstance(frame, list) else [frame])
                except zmq.Again:
                    raise AssertionError(f"{endpoint} stopped reading (frame {i})") from None
                if sock.type == zmq.DEALER:
                    while sock.poll(0):
                        sock.recv_multipart()
    finally:
        # Linger, so every frame still queued here reaches its stage (linger 0 would drop them).
        ctx.destroy(linger=10_000)


def run_fuzz(service, frames_per_socket: int, seed: int) -> None:
    with Client(service.url, timeout=120, connect_timeout=60) as client:
        reference = client.generate(PROMPT, max_tokens=24, temperature=0, ignore_eos=True)
        pids = {name: service.pid(name) for name in STAGES}
        rss_before = {name: rss_mb(pid) for name, pid in pids.items()}
        started = time.monotonic()
        blast(service.url, frames_per_socket, seed)
        # The same request again, behind every fuzz frame on the client sockets: the stages got through them.
        client.wait_engine(timeout=30)  # a forged engine notice may have flipped its state for a moment
        again = client.generate(PROMPT, max_tokens=24, temperature=0, ignore_eos=True)
        assert (again.text, again.token_ids) == (reference.text, reference.token_ids)

        def settled():
            stats = client.server_stats()
            engine = stats["engine"]
            return (engine["num_running"] == engine["num_waiting"] == engine["num_live"] == 0
                    and engine["num_free_blocks"] == engine["num_total_blocks"]
                    and stats["detok"]["num_requests"] == 0 and stats)

        stats = wait_for(settled, timeout=60, interval=0.2, what="the fuzzed requests to drain")
        # Most frames on the two stage-to-stage sockets are malformed: the engine and the detokenizer saw them.
        stats = wait_for(lambda: (stats := client.server_stats())["engine"]["rejected_frames"] > frames_per_socket // 3
                         and sum(stats["detok"]["rejected_frames"].values()) > frames_per_socket // 3 and stats,
                         timeout=30, interval=0.2, what="the stages to count the malformed frames")
        rss_after = {name: rss_mb(pid) for name, pid in pids.items()}
        print(f"{5 * frames_per_socket} frames handled in {time.monotonic() - started:.1f}s; rejected: engine "
              f"{stats['engine']['rejected_frames']}, detokenizer {stats['detok']['rejected_frames']}; "
              f"RSS MB before {rss_before}, after {rss_after}")
        service.assert_running()
        assert {name: service.pid(name) for name in STAGES} == pids
        for name in pids:
            growth = rss_after[name] - rss_before[name]
            assert growth < RSS_GROWTH_LIMIT_MB, f"{name} grew by {growth:.0f} MB"


def test_thousands_of_hostile_frames_on_every_socket_take_no_stage_down(fuzzed_service):
    run_fuzz(fuzzed_service, frames_per_socket=1500, seed=1)


@pytest.mark.soak
def test_soak_twelve_thousand_hostile_frames_per_socket(fuzzed_service):
    run_fuzz(fuzzed_service, frames_per_socket=12_000, seed=2)
