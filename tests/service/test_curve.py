"""CURVE over tcp: a client with an allowed key streams; a client with a wrong key or none gets
nothing through (no request reaches the engine); a raw socket without keys cannot inject frames
into the engine or the detokenizer; without keys a non-loopback bind is refused. Per key: another
key cannot take over a client's routing id, an allow-list file's priority ceiling holds, and the
request rate is counted per key, not per connection."""
from __future__ import annotations

import os
import stat
import subprocess
import sys
import time

import pytest
import zmq

from nanovllm_client import Client, RequestError, ServiceUnavailableError
from nanovllm_client import protocol as p
from nanovllm_client.endpoints import service_endpoints
from nanovllm_client.security import (client_socket_security, generate_keypair, load_keypair, load_public_key,
                                      new_routing_id)
from tests.service.conftest import TINY_ENGINE_ARGS, start_service
from tests.service.harness import REPO, free_tcp_base_port, fresh_engine_stats


RATE = 3
"""Requests a second per client key (the tokenizer's --max-request-rate-per-client)."""


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    root = tmp_path_factory.mktemp("keys")
    service_public, service_secret = generate_keypair(str(root / "service"), "service")
    allowed_public, allowed_secret = generate_keypair(str(root / "clients-secret"), "alice")
    os.makedirs(root / "allowed")
    os.replace(allowed_public, root / "allowed" / "alice.key")
    _, stranger_secret = generate_keypair(str(root / "stranger"), "mallory")
    server_key = load_public_key(service_public)
    found = {"service_secret": service_secret, "allowed_dir": str(root / "allowed"), "server_key": server_key,
             "alice": (load_keypair(allowed_secret), server_key), "mallory": (load_keypair(stranger_secret), server_key),
             "service": (load_keypair(service_secret), server_key)}
    for name, ceiling in (("bob", 1), ("carol", None)):  # bob's file caps his priority at 1
        public, secret = generate_keypair(str(root / f"{name}-secret"), name, max_priority=ceiling)
        os.replace(public, root / "allowed" / f"{name}.key")
        found[name] = (load_keypair(secret), server_key)
    return found


@pytest.fixture(scope="module")
def curve_service(tiny_model_dir, keys):
    env = {"NANOVLLM_CURVE_SECRET_KEY": keys["service_secret"], "NANOVLLM_CURVE_CLIENTS": keys["allowed_dir"],
           "NANOVLLM_CACHE_SALT_PER_CLIENT": "1", "NANOVLLM_MAX_REQUEST_RATE_PER_CLIENT": str(RATE)}
    procs = start_service(tiny_model_dir, f"tcp://127.0.0.1:{free_tcp_base_port()}",
                          engine_args=TINY_ENGINE_ARGS + ["--post-step-hook", "tests.helpers.hooks:slow_step"],
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
                                                             p.RequestMeta(client=b"x", client_request_id="y")).encode()),
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


def _dealer(ctx: zmq.Context, endpoint: str, curve, identity: bytes) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, identity)
    client_socket_security(sock, *curve)
    sock.connect(endpoint)
    return sock


def _until_answered(connect, frame: bytes, what: str, limit_s: float = 60.0) -> tuple[zmq.Socket, p.Message]:
    """Connect (`connect()`: a new socket) and send `frame` until an answer comes, a second apart:
    zmq holds a connection under an id still in use unread for good, so each try is a new one."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        sock = connect()
        sock.send(frame)
        if sock.poll(1000):
            return sock, p.decode(sock.recv())
        sock.close()
    raise AssertionError(f"no answer to {what} within {limit_s}s")


def _more_deltas(out: zmq.Socket, what: str, limit_s: float = 60.0) -> list[dict]:
    """The next deltas on a raw client's stream socket, pinging a second apart as a client does
    (a client silent for the detokenizer's client timeout is given up)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        out.send(p.Ping().encode())
        if out.poll(1000):
            msg = p.decode(out.recv())
            if isinstance(msg, p.StreamOutput) and msg.deltas:
                return msg.deltas
    raise AssertionError(f"{what}: nothing within {limit_s}s")


def test_another_key_cannot_take_over_a_clients_routing_id(curve_service, keys):
    # Bob has learnt Alice's routing id. Once her connection to a stage ends he connects under it:
    # he may neither abort her request through the tokenizer nor receive her stream from the
    # detokenizer.
    eps = service_endpoints(curve_service.url)
    alice_id = new_routing_id(keys["alice"])
    ctx = zmq.Context()
    try:
        out, pong = _until_answered(lambda: _dealer(ctx, eps.stream, keys["alice"], alice_id), p.Ping().encode(),
                                    "alice's ping")
        assert isinstance(pong, p.Pong)
        tok = _dealer(ctx, eps.tokenizer, keys["alice"], alice_id)
        tok.send(p.GenerateReq("r1", prompt="def f():", sampling={"max_tokens": 900, "ignore_eos": True}).encode())
        deltas = _more_deltas(out, "alice's stream")  # begun, with >= 9 s to go (steps of >= 10 ms)
        tok.close()
        bob_tok, refused = _until_answered(lambda: _dealer(ctx, eps.tokenizer, keys["bob"], alice_id),
                                           p.AbortReq("r1").encode(), "bob's abort")
        assert isinstance(refused, p.ErrorOutput) and "belongs to another CURVE key" in refused.message
        bob_tok.close()
        received = len(deltas)
        while len(deltas) < received + 3:  # her stream goes on, not aborted
            deltas += _more_deltas(out, "alice's stream")
        assert deltas[-1].finish_reason is None, deltas[-1]
        out.close()  # she is gone from the detokenizer too, her stream still running
        bob_out, refused = _until_answered(lambda: _dealer(ctx, eps.stream, keys["bob"], alice_id),
                                           p.Ping().encode(), "bob's ping")
        assert isinstance(refused, p.ErrorOutput) and "belongs to another CURVE key" in refused.message, refused
        while bob_out.poll(2000):  # nothing of hers follows: her client was given up
            msg = p.decode(bob_out.recv())
            assert not isinstance(msg, p.StreamOutput), f"bob received alice's stream: {msg}"
    finally:
        ctx.destroy(linger=0)


def test_an_allow_list_files_priority_ceiling_holds_for_its_key(curve_service, keys):
    with Client(curve_service.url, curve=keys["bob"], connect_timeout=60, timeout=60) as bob:
        with pytest.raises(RequestError, match=r"priority 2 is above this client key's ceiling of 1"):
            bob.generate("x", max_tokens=2, priority=2)
        assert bob.generate("x", max_tokens=2, ignore_eos=True, priority=1).finish_reason == "length"
    with Client(curve_service.url, curve=keys["carol"], connect_timeout=60, timeout=60) as carol:
        assert carol.generate("x", max_tokens=2, ignore_eos=True, priority=2).finish_reason == "length"


def test_the_request_rate_is_counted_per_key_not_per_connection(curve_service, keys):
    burst = 4 * RATE
    with Client(curve_service.url, curve=keys["carol"], connect_timeout=60, timeout=120) as one, \
            Client(curve_service.url, curve=keys["carol"], connect_timeout=60, timeout=120) as two, \
            Client(curve_service.url, curve=keys["alice"], connect_timeout=60, timeout=120) as alice:
        for c in (one, two, alice):
            c.wait_engine(timeout=60)
        streams = [c.stream("x", max_tokens=1, ignore_eos=True) for _ in range(burst // 2) for c in (one, two)]
        mine = alice.stream("y", max_tokens=1, ignore_eos=True)  # another key: a bucket of its own
        refused = 0
        for s in streams:
            try:
                list(s)
            except RequestError as e:
                assert f"faster than its limit of {RATE} a second (--max-request-rate-per-client)" in str(e)
                refused += 1
        # Both connections draw on one bucket of RATE (plus what refills while the burst is sent).
        assert refused >= burst - 2 * RATE, f"{refused} of {burst} refused"
        assert list(mine)[-1].finish_reason == "length"


def test_only_the_services_own_key_may_say_whom_a_request_is_for(curve_service, keys):
    """The HTTP front, with the service's own key, names each request's API key (`tenant`); an
    allowed client with a key of its own is refused if it tries, so it cannot take another's
    share or cache salt."""
    with Client(curve_service.url, curve=keys["alice"], connect_timeout=60, timeout=60) as alice:
        with pytest.raises(RequestError, match="only the service's HTTP front, connected with the service's own key"):
            alice.generate("x", max_tokens=2, tenant="key:someone-else")
    with Client(curve_service.url, curve=keys["service"], connect_timeout=60, timeout=60) as front:
        assert front.generate("x", max_tokens=2, ignore_eos=True, tenant="key:a").finish_reason == "length"
