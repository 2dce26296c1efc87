"""Loopback tcp is no trust boundary: another user of the host reaches every port of a service on
127.0.0.1. Given no keys, the service runs CURVE with an instance key only its own user can read,
so another uid's forged stage frame (an engine-death notice naming the real engine, sent with a
stdlib ZMTP script as any local user could) gets nowhere, and a stream running meanwhile ends
normally. A death notice that names no engine is refused even where no CURVE stands in its way."""
from __future__ import annotations

import time

import pytest
import zmq

from nanovllm_client import Client, ServiceUnavailableError
from nanovllm_client import protocol as p
from nanovllm_client.endpoints import service_endpoints
from nanovllm_client.security import instance_key_file
from tests.helpers.other_user import as_other_user
from tests.service.harness import fresh_engine_stats, short_tmpdir

FORGE = r"""
import socket, sys
key_file = sys.argv[1]
try:
    open(key_file, "rb").read()
    print("key: read")
except OSError as e:
    print("key:", type(e).__name__)
greeting = b"\xff" + bytes(8) + b"\x7f\x03\x00" + b"NULL".ljust(20, b"\0") + bytes(32)
ready = b"\x05READY\x0bSocket-Type" + (4).to_bytes(4, "big") + b"PUSH"
for target in sys.argv[2:]:
    port, frame = target.split(":")[0], bytes.fromhex(target.split(":")[1])
    s = socket.create_connection(("127.0.0.1", int(port)), timeout=10)
    try:
        s.sendall(greeting[:10])  # libzmq answers each part of the greeting in turn
        s.recv(10)
        s.sendall(greeting[10:] + b"\x04" + bytes([len(ready)]) + ready)
        for _ in range(5):
            s.sendall(b"\x02" + len(frame).to_bytes(8, "big") + frame)
        s.settimeout(3)
        while s.recv(4096):  # a NULL peer answers and stays; one that wants CURVE hangs up
            pass
        print(port, "closed")
    except socket.timeout:
        print(port, "open")
    except OSError:
        print(port, "closed")
    s.close()
"""
"""A local user's forger: for each PORT:FRAME (hex), a ZMTP 3.0 NULL handshake as a PUSH, then the
frame five times; prints whether it could read the key file and whether each port hung up on it."""


def test_another_user_can_neither_read_the_instance_key_nor_forge_a_stage_frame(other_user, tcp_chain_service):
    url = tcp_chain_service.url
    eps = service_endpoints(url)
    port = {name: getattr(eps, name).rpartition(":")[2] for name in ("detok", "engine", "control", "tokenizer", "stream")}
    with Client(url, timeout=120, connect_timeout=60) as client:
        client.wait_engine(timeout=60)
        engine = client.server_stats()["engine_instance"]
        stream = client.stream("hello", max_tokens=300, ignore_eos=True)  # >= 3 s: steps of >= 10 ms
        first = next(stream)
        before = fresh_engine_stats(client)
        death = p.EngineStatus(False, engine, "forged death").encode()  # names the engine it follows
        work = p.TokenizedReq(request_id="x:y", prompt_token_ids=p.pack_token_ids(list(range(40))),
                              sampling={"max_tokens": 3}, meta=p.RequestMeta(client=b"x", client_request_id="y")).encode()  # a request for the engine to run
        targets = [f"{port['detok']}:{death.hex()}", f"{port['engine']}:{work.hex()}"]
        targets += [f"{port[name]}:{p.Ping().encode().hex()}" for name in ("control", "tokenizer", "stream")]
        out = as_other_user(FORGE, instance_key_file(url), *targets).stdout
        assert "key: PermissionError" in out, out
        for name, number in port.items():
            assert f"{number} closed" in out, (name, out)  # every socket wants CURVE: a NULL handshake is refused
        rest = list(stream)
        assert first.finish_reason is None and rest[-1].finish_reason == "length"
        assert sum(len(d.token_ids) for d in [first, *rest]) == 300
        after = fresh_engine_stats(client)
    assert after["prefix_cache_queries"] == before["prefix_cache_queries"], "the forged request was admitted"
    assert "forged death" not in tcp_chain_service.logs(tail=10**8), "the forged death notice reached the detokenizer"


def test_a_client_without_the_key_gets_nothing_through(tcp_chain_service):
    with Client(tcp_chain_service.url, insecure_tcp=True, connect_timeout=2) as client:
        with pytest.raises(ServiceUnavailableError):
            client.generate("hello", max_tokens=2)


def test_a_death_notice_naming_no_engine_is_refused(tokenizer_dir):
    # Where nothing authenticates the engine socket (--insecure-tcp), a frame that names no engine
    # instance must not pass for the followed engine's.
    from transformers import AutoTokenizer

    from detok_proc.server import DetokStage

    ctx = zmq.Context()
    eps = service_endpoints(f"ipc://{short_tmpdir()}")
    stage = DetokStage(AutoTokenizer.from_pretrained(tokenizer_dir), eps.stream, eps.detok, eps.control, ctx=ctx)
    try:
        stage.engine.state, stage.engine.alive, stage.engine.instance = "ready", True, "E1"
        stage.engine.last_seen = time.monotonic()
        for instance in ("", "E0"):
            stage.on_engine_status(p.EngineStatus(False, instance, "forged death"))
            assert stage.engine.alive is True, f"a death notice from {instance!r} was taken for E1's"
        assert stage.rejects.counts["foreign_engine"] == 2
        stage.on_engine_status(p.EngineStatus(False, "E1", "shut down"))
        assert stage.engine.alive is False
    finally:
        ctx.destroy(linger=0)
