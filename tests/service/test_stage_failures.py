"""A stage that dies: requests in flight end with an error within seconds, new ones are refused
while the engine is down, and a restarted stage rejoins without restarting the others."""
from __future__ import annotations

import threading
import time

import pytest

from nanovllm_client import Client, EngineDeadError, RequestError
from tests.service.conftest import start_service
from tests.service.harness import short_tmpdir, wait_for


@pytest.fixture(scope="module")
def own_service(tiny_model_dir):
    """A private service: these tests kill its stages."""
    procs = start_service(tiny_model_dir, f"ipc://{short_tmpdir()}/svc")
    yield procs
    procs.stop()


def consume(stream, outcome: dict) -> None:
    try:
        for _ in stream:
            pass
        outcome[stream.request_id] = ("finished", time.monotonic())
    except Exception as e:
        outcome[stream.request_id] = (e, time.monotonic())


def start_long_streams(client: Client, n: int) -> tuple[list[threading.Thread], dict]:
    streams = [client.stream(f"def f{i}():", max_tokens=800, ignore_eos=True) for i in range(n)]
    for s in streams:
        assert next(s).finish_reason is None
    outcome: dict = {}
    threads = [threading.Thread(target=consume, args=(s, outcome)) for s in streams]
    for t in threads:
        t.start()
    return threads, outcome


def test_engine_sigkill_fails_in_flight_requests_fast_then_engine_rejoins(own_service):
    others = {name: own_service.pid(name) for name in ("tokenizer_proc", "detok_proc")}
    with Client(own_service.url, timeout=120) as client:
        threads, outcome = start_long_streams(client, 4)
        killed_at = time.monotonic()
        own_service.kill("engine_proc")
        for t in threads:
            t.join(timeout=15)
        assert len(outcome) == 4, "a request hung after the engine died"
        for error, ended_at in outcome.values():
            assert isinstance(error, EngineDeadError), error
            assert ended_at - killed_at < 6.0
        # While it is down, new requests are refused at once rather than queued.
        refused_at = time.monotonic()
        with pytest.raises(EngineDeadError):
            client.generate("hello", max_tokens=4)
        assert time.monotonic() - refused_at < 3.0

        own_service.restart("engine_proc")
        client.wait_engine(timeout=120)
        assert client.generate("hello", max_tokens=4, ignore_eos=True).finish_reason == "length"
    assert {name: own_service.pid(name) for name in others} == others  # nobody else restarted
    own_service.assert_running()


def test_new_client_is_refused_while_the_engine_is_down(own_service):
    own_service.kill("engine_proc")
    try:
        with Client(own_service.url, timeout=30) as client:
            wait_for(lambda: client.engine_alive is False, timeout=6, what="engine reported dead")
            with pytest.raises(EngineDeadError):
                client.generate("hello", max_tokens=4)
    finally:
        own_service.restart("engine_proc")
    with Client(own_service.url, timeout=60) as client:
        client.wait_engine(timeout=120)
        assert client.generate("hi", max_tokens=3, ignore_eos=True).usage["completion_tokens"] == 3


def test_detokenizer_restart_fails_in_flight_and_rejoins(own_service):
    with Client(own_service.url, timeout=120) as client:
        threads, outcome = start_long_streams(client, 2)
        own_service.kill("detok_proc")
        own_service.start("detok_proc")
        for t in threads:
            t.join(timeout=30)
        assert len(outcome) == 2
        assert all(isinstance(e, RequestError) and "detokenizer" in str(e) for e, _ in outcome.values())
        client.wait_engine(timeout=120)
        assert client.generate("hi", max_tokens=3, ignore_eos=True).finish_reason == "length"
        # The orphaned requests were aborted in the engine (their outputs had no owner).
        wait_for(lambda: client.server_stats()["engine"]["num_live"] == 0, timeout=10, what="orphans aborted")


def test_tokenizer_restart_rejoins_and_queued_requests_go_through(own_service):
    with Client(own_service.url, timeout=120) as client:
        client.wait_engine(timeout=120)
        own_service.kill("tokenizer_proc")
        result: dict = {}
        sender = threading.Thread(target=lambda: result.update(r=client.generate("hi", max_tokens=3, ignore_eos=True)))
        sender.start()  # sent while the tokenizer is down: waits in the client's socket
        own_service.start("tokenizer_proc")
        sender.join(timeout=120)
        assert result["r"].usage["completion_tokens"] == 3
