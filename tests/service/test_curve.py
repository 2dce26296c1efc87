"""CURVE over tcp: a client with an allowed key streams; a client with a wrong key or none gets
nothing through (no request reaches the engine); a raw socket without keys cannot inject frames
into the engine or the detokenizer; without keys a non-loopback bind is refused."""
from __future__ import annotations

import os
import stat
import subprocess
import sys
import time

import pytest
import zmq

from nanovllm_client import Client, ServiceUnavailableError
from nanovllm_client import protocol as p
from nanovllm_client.endpoints import service_endpoints
from nanovllm_client.security import generate_keypair, load_keypair, load_public_key
from tests.service.conftest import start_service
from tests.service.harness import REPO, free_tcp_base_port, fresh_engine_stats


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    root = tmp_path_factory.mktemp("keys")
    service_public, service_secret = generate_keypair(str(root / "service"), "service")
    allowed_public, allowed_secret = generate_keypair(str(root / "clients-secret"), "alice")
    os.makedirs(root / "allowed")
    os.replace(allowed_public, root / "allowed" / "alice.key")
    _, stranger_secret = generate_keypair(str(root / "stranger"), "mallory")
    server_key = load_public_key(service_public)
    return {"service_secret": service_secret, "allowed_dir": str(root / "allowed"), "server_key": server_key,
            "alice": (load_keypair(allowed_secret), server_key), "mallory": (load_keypair(stranger_secret), server_key),
            "service": (load_keypair(service_secret), server_key)}


@pytest.fixture(scope="module")
def curve_service(tiny_model_dir, keys):
    env = {"NANOVLLM_CURVE_SECRET_KEY": keys["service_secret"], "NANOVLLM_CURVE_CLIENTS": keys["allowed_dir"],
           "NANOVLLM_CACHE_SALT_PER_CLIENT": "1"}
    procs = start_service(tiny_model_dir, f"tcp://127.0.0.1:{free_tcp_base_port()}",
                          env={name: env for name in ("tokenizer_proc", "engine_proc", "detok_proc")},
                          curve=keys["alice"])
    yield procs
    procs.stop()


def engine_stats(procs, keys) -> dict:
    """The engine's counters, from a heartbeat sent after this call began."""
    with Client(procs.url, curve=keys["alice"], connect_timeout=60) as client:
        client.wait_engine(timeout=60)
        return fresh_engine_stats(client)


def test_salted_per_client_the_cache_is_shared_by_one_key_not_by_one_connection(curve_service, keys):
    # Under CURVE a client is its key: two connections of one key share their cached prompts
    # (whatever routing ids they pick), another allowed key sees none of them.
    prompt = list(range(300, 340))  # two full blocks of 16, and a last one

    def cached(who: str) -> int:
        with Client(curve_service.url, curve=keys[who], connect_timeout=60, timeout=60) as client:
            return client.generate(prompt_token_ids=prompt, max_tokens=2, ignore_eos=True).usage["cached_tokens"]

    assert cached("alice") == 0
    assert cached("alice") == 32
    assert cached("service") == 0


def test_an_allowed_client_streams(curve_service, keys):
    with Client(curve_service.url, curve=keys["alice"], connect_timeout=30, timeout=60) as client:
        result = client.generate("def f():", max_tokens=8, ignore_eos=True)
    assert result.usage["completion_tokens"] == 8


@pytest.mark.parametrize("who", ["mallory", None])
def test_a_wrong_key_or_no_key_gets_nothing_through(curve_service, keys, who):
    before = engine_stats(curve_service, keys)
    with Client(curve_service.url, curve=keys[who] if who else None, connect_timeout=2) as client:
        with pytest.raises(ServiceUnavailableError):
            client.generate("def f():", max_tokens=4)
    # A raw DEALER that skips the readiness handshake and sends a request straight to the tokenizer.
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if who:
            from nanovllm_client.security import client_socket_security
            client_socket_security(sock, *keys[who])
        sock.connect(service_endpoints(curve_service.url).tokenizer)
        sock.send(p.GenerateReq("sneaky", prompt="def f():", sampling={"max_tokens": 4}).encode())
        assert not sock.poll(2000), "the tokenizer answered a client it should not know"
    finally:
        ctx.destroy(linger=0)
    after = engine_stats(curve_service, keys)
    assert after["prefix_cache_queries"] == before["prefix_cache_queries"], (before, after)  # none admitted
    assert after["num_steps"] == before["num_steps"]


def test_stage_sockets_refuse_frames_without_the_service_key(curve_service, keys):
    eps = service_endpoints(curve_service.url)
    before = engine_stats(curve_service, keys)
    ctx = zmq.Context()
    try:
        for endpoint, frame in ((eps.engine, p.TokenizedReq("x:y", p.pack_token_ids([1, 2]), {"max_tokens": 3},
                                                             {"client": b"x", "rid": "y"}).encode()),
                                (eps.detok, p.EngineStatus(False, "forged", "forged death").encode()),
                                (eps.control, p.Ping().encode())):  # a wrong type: counted, had it arrived
            push = ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 0)
            push.connect(endpoint)
            for _ in range(5):
                try:
                    push.send(frame, zmq.NOBLOCK)
                except zmq.Again:
                    pass  # never connected: nothing to queue for
        # Even an allowed client's key is refused on a stage-to-stage socket.
        alice = ctx.socket(zmq.PUSH)
        alice.setsockopt(zmq.LINGER, 0)
        from nanovllm_client.security import client_socket_security
        client_socket_security(alice, *keys["alice"])
        alice.connect(eps.engine)
        time.sleep(2)
    finally:
        ctx.destroy(linger=0)
    after = engine_stats(curve_service, keys)
    assert after["prefix_cache_queries"] == before["prefix_cache_queries"]
    assert after["rejected_frames"] == before["rejected_frames"]  # nothing arrived, not even to be rejected
    with Client(curve_service.url, curve=keys["alice"], connect_timeout=60) as client:
        assert client.server_stats()["engine_alive"] is True  # the forged death notice never arrived
        assert client.generate("x", max_tokens=2, ignore_eos=True).finish_reason == "length"


def test_without_keys_a_non_loopback_bind_is_refused_with_a_clear_error():
    port = free_tcp_base_port()
    out = subprocess.run([sys.executable, "-m", "detok_proc", "--url", f"tcp://0.0.0.0:{port}"], cwd=REPO,
                         capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONPATH=REPO))
    assert out.returncode == 1
    assert "refusing to bind tcp://0.0.0.0" in out.stderr and "--insecure-tcp" in out.stderr


def test_ipc_runtime_directories_are_private(service):
    directory = service.url[len("ipc://"):]
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
