"""A stage that dies: requests in flight go on once it is back (the engine's are continued by the
new engine), new ones are refused while the engine is down, and a restarted stage rejoins
without restarting the others."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from nanovllm_client import Client, EngineDeadError
from nanovllm_client.client_state import merge
from tests.service.conftest import EXACT_ARGS, TINY_ENGINE_ARGS, start_service
from tests.service.harness import short_tmpdir, wait_for


@pytest.fixture(scope="module")
def own_service(tiny_model_dir):
    """A private service: these tests kill its stages."""
    procs = start_service(tiny_model_dir, f"ipc://{short_tmpdir()}/svc", engine_args=TINY_ENGINE_ARGS + EXACT_ARGS)
    yield procs
    procs.stop()


def answer(first, rest: list, reference):
    """The stream's whole answer (its first delta, then the rest), checked to be the reference's
    to the character and the token, ended by its length."""
    result = merge([first] + rest, reference.request_id)
    assert (result.text, result.token_ids, result.finish_reason) == (reference.text, reference.token_ids, "length")
    return result


def test_engine_sigkill_loses_no_stream_and_new_requests_wait_for_the_next_engine(own_service):
    """Streams in flight wait for the restarted engine, which continues each from what its client
    received (they used to fail); a request sent while it is down waits for it too (it was
    refused at once with "engine is not available", while the ones in flight lived on)."""
    others = {name: own_service.pid(name) for name in ("tokenizer_proc", "detok_proc")}
    with Client(own_service.url, timeout=120) as client:
        prompts = [f"def f{i}():" for i in range(4)]
        want = [client.generate(prompt, max_tokens=400, ignore_eos=True, temperature=0) for prompt in prompts]
        streams = [client.stream(prompt, max_tokens=400, ignore_eos=True, temperature=0) for prompt in prompts]
        firsts = [next(s) for s in streams]
        assert all(f.finish_reason is None for f in firsts)
        results: dict = {}
        threads = [threading.Thread(target=lambda i=i, s=s: results.update({i: list(s)})) for i, s in enumerate(streams)]
        for t in threads:
            t.start()
        hello = client.generate("hello", max_tokens=4, ignore_eos=True, temperature=0)
        own_service.kill("engine_proc")
        wait_for(lambda: client.engine_alive is False, timeout=60, what="engine reported dead")
        late = client.stream("hello", max_tokens=4, ignore_eos=True, temperature=0)  # sent with no engine up
        assert not results, "a stream ended while the engine was down"

        own_service.restart("engine_proc")
        for t in threads:
            t.join(timeout=120)
        for i, reference in enumerate(want):
            assert answer(firsts[i], results[i], reference).usage["completion_tokens"] == 400
        assert merge(list(late), "hello").token_ids == hello.token_ids
    assert {name: own_service.pid(name) for name in others} == others  # nobody else restarted
    own_service.assert_running()


def test_a_new_clients_request_waits_for_the_engine_unless_told_not_to(own_service):
    own_service.kill("engine_proc")
    try:
        with Client(own_service.url, timeout=30, engine_restart_wait_s=0) as impatient, \
                Client(own_service.url, timeout=120) as patient:
            wait_for(lambda: impatient.engine_alive is False and patient.engine_alive is False, timeout=60,
                     what="engine reported dead")
            refused_at = time.monotonic()
            with pytest.raises(EngineDeadError, match="engine is not available"):
                impatient.generate("hello", max_tokens=4)  # waiting is off: at once
            assert time.monotonic() - refused_at < 10, "refused only after a wait"
            waiting = patient.stream("hi", max_tokens=3, ignore_eos=True)
            own_service.restart("engine_proc")
            assert merge(list(waiting), "hi").usage["completion_tokens"] == 3
    finally:
        if own_service.procs["engine_proc"].poll() is not None:
            own_service.restart("engine_proc")
    with Client(own_service.url, timeout=60) as client:
        client.wait_engine(timeout=120)
        assert client.generate("hi", max_tokens=3, ignore_eos=True).usage["completion_tokens"] == 3


def test_a_detokenizer_restart_loses_no_stream(own_service):
    """Streams in flight continue after the detokenizer is killed and restarted: the new one gets
    every request from the engine (resync) and each client says how much it already has (resume)."""
    prompts = [f"def f{i}():" for i in range(3)]
    with Client(own_service.url, timeout=120) as client:
        client.wait_engine(timeout=120)
        lengths = [40, 300, 900]  # some end while the detokenizer is down, some after it is back
        reference = [client.generate(p, max_tokens=n, ignore_eos=True, temperature=0) for p, n in zip(prompts, lengths)]
        streams = [client.stream(p, max_tokens=n, ignore_eos=True, temperature=0) for p, n in zip(prompts, lengths)]
        firsts = [next(s) for s in streams]
        tokenizer, engine = own_service.pid("tokenizer_proc"), own_service.pid("engine_proc")
        own_service.kill("detok_proc")
        own_service.start("detok_proc")
        results: dict = {}
        threads = [threading.Thread(target=lambda i=i, s=s: results.update({i: list(s)})) for i, s in enumerate(streams)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        for i, want in enumerate(reference):
            assert answer(firsts[i], results[i], want).usage == want.usage
        assert (own_service.pid("tokenizer_proc"), own_service.pid("engine_proc")) == (tokenizer, engine)
        wait_for(lambda: (st := client.server_stats())["engine"]["num_live"] == 0 and st["detok"]["num_requests"] == 0,
                 timeout=60, what="nothing left behind")


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


def test_a_request_the_tokenizer_could_pass_to_no_engine_waits_for_one(own_service):
    """The client learns of a (new) engine from the detokenizer, and the tokenizer may not have
    reached it yet: it refuses what it holds after a second. That request reached no engine; it
    was kept under the instance the client knew to be up, so nothing sent it again and it failed
    after the whole wait. Now the client sends it again while it is refused, and it goes through
    once the tokenizer reaches the engine. Here a tokenizer pointed at the wrong address stands
    for the one that has not connected yet, then is restarted with the right one."""
    prompt, kw = "def nowhere():", dict(max_tokens=16, temperature=0, ignore_eos=True)
    with Client(own_service.url, timeout=120, engine_restart_wait_s=40) as client:
        client.wait_engine(timeout=120)
        want = client.generate(prompt, **kw)
        tokenizer = client._state.tokenizer_instance
        own_service.kill("tokenizer_proc")
        own_service.args["tokenizer_proc"] = ["--engine-endpoint", f"ipc://{short_tmpdir()}/nowhere"]
        log = f"{own_service.log_dir}/tokenizer_proc.log"
        refusals = lambda: open(log, errors="replace").read().count("refused after")  # noqa: E731
        try:
            own_service.start("tokenizer_proc")
            wait_for(lambda: client._state.tokenizer_instance not in (None, tokenizer), timeout=60,
                     what="the misdirected tokenizer to answer")
            stream = client.stream(prompt, **kw)
            got: list = []
            reader = threading.Thread(target=lambda: got.extend(stream), daemon=True)
            reader.start()
            wait_for(lambda: refusals() >= 3, timeout=30, what="three refusals")  # a second each, sent again
            assert not got, "the request ended while no engine was reachable"
        finally:
            own_service.args["tokenizer_proc"] = []
            own_service.restart("tokenizer_proc")
        reader.join(timeout=60)
        assert not reader.is_alive(), "the request did not go through once the tokenizer reached the engine"
        answer(got[0], got[1:], want)
    own_service.assert_running()


def test_a_stage_raises_its_open_files_limit_to_the_hard_limit(tiny_model_dir):
    """zmq aborts a process that finds no free descriptor for a new connection. The stages ran
    with the soft limit they were given (1,024 under systemd's default, and from most shells)
    while the hard limit allowed far more; each stage now raises it at start-up."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= 256:
        pytest.skip("the hard limit leaves nothing to raise")
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))  # the stages inherit it
    try:
        procs = start_service(tiny_model_dir, f"ipc://{short_tmpdir()}/svc")
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    try:
        for stage in ("tokenizer_proc", "engine_proc", "detok_proc"):
            with open(f"/proc/{procs.pid(stage)}/limits") as f:
                fields = next(line for line in f if line.startswith("Max open files")).split()
            assert fields[3] == fields[4], f"{stage}: soft {fields[3]}, hard {fields[4]}"
    finally:
        procs.stop()


def test_a_continued_stream_survives_its_tokenizer_dying_before_passing_it_on(tiny_model_dir):
    """After an engine restart the client sends each stream it kept to the new engine, continued
    from the output it received. It marked them answered and kept the first frame: a tokenizer
    that died before passing the continuation on left nothing to send again, and the stream
    waited to its timeout. Now the successor gets the continuation."""
    hook = ["--post-step-hook", "tests.helpers.hooks:slow_step"]  # 300 tokens: over 3 s
    procs = start_service(tiny_model_dir, f"ipc://{short_tmpdir()}/svc", engine_args=TINY_ENGINE_ARGS + EXACT_ARGS + hook)
    try:
        with Client(procs.url, timeout=60) as client:
            client.wait_engine(timeout=120)
            kw = dict(max_tokens=300, ignore_eos=True, temperature=0)
            want = client.generate("def f():", **kw)
            wait_for(lambda: client._state.tokenizer_instance is not None, timeout=60, what="the tokenizer's first pong")
            stream = client.stream("def f():", **kw)
            received = [next(stream) for _ in range(3)]
            os.kill(procs.pid("tokenizer_proc"), signal.SIGSTOP)  # it takes no frame from here on
            first_engine = client._state.engine_instance
            procs.kill("engine_proc")
            procs.start("engine_proc")
            state = client._state
            wait_for(lambda: state.engine_alive is True and state.engine_instance != first_engine
                     and not state.parked and len(state.inflight) == 1, timeout=120,
                     what="the stream sent again, to the stopped tokenizer, for the new engine")
            procs.kill("tokenizer_proc")  # with the continuation unread
            procs.start("tokenizer_proc")
            answer(received[0], received[1:] + list(stream), want)
        procs.assert_running()
    finally:
        procs.stop()
