"""`nanovllm serve` (nanovllm.supervisor): starts the stages, restarts a dead one, stops cleanly."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from nanovllm_client import Client
from tests.service.conftest import EXACT_ARGS, START_TIMEOUT, TINY_ENGINE_ARGS
from tests.service.harness import CHECKOUT_PATH, REPO, short_tmpdir, wait_for


def read_pids(runtime_dir: str) -> dict | None:
    try:
        with open(os.path.join(runtime_dir, "stages.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is as good as gone
        return f.read().split()[2] != "Z"


@contextlib.contextmanager
def serving(model: str, *flags: str):
    """`nanovllm serve` in its own session (as from a terminal), killed with its stages after. It
    logs at INFO: pytest shows the log of a failed test, which then says what each stage did when."""
    runtime_dir = short_tmpdir()
    proc = subprocess.Popen([sys.executable, "-m", "nanovllm.supervisor", "--model", model, "--runtime-dir",
                             runtime_dir, "--log-level", "INFO", *flags, *TINY_ENGINE_ARGS],
                            cwd=REPO, env=dict(os.environ, PYTHONPATH=CHECKOUT_PATH), start_new_session=True)
    try:
        yield proc, runtime_dir
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        for pid in (read_pids(runtime_dir) or {}).values():
            if isinstance(pid, int) and pid_alive(pid):
                os.kill(pid, signal.SIGKILL)


def stopped(proc: subprocess.Popen, runtime_dir: str, timeout: float) -> int:
    """`nanovllm serve`'s exit code once it stopped. If it does not within `timeout`, it and its
    stages get SIGABRT first (each prints every thread's stack to the log), so the failure shows
    where the stop hung."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        stages = [pid for name, pid in (read_pids(runtime_dir) or {}).items() if name != "url" and pid]
        for pid in [proc.pid, *stages]:
            if pid_alive(pid):
                os.kill(pid, signal.SIGABRT)
        time.sleep(2)
        raise AssertionError(f"nanovllm serve did not stop within {timeout}s; the stacks of it and its stages "
                             "are in the log above") from None


@pytest.fixture
def supervisor(tiny_model_dir):
    with serving(tiny_model_dir) as (proc, runtime_dir):
        yield proc, runtime_dir


def test_serve_restarts_a_dead_stage_and_stops_cleanly(supervisor):
    proc, runtime_dir = supervisor
    url = f"ipc://{runtime_dir}"
    with Client(url, connect_timeout=START_TIMEOUT, timeout=60) as client:
        client.wait_engine(timeout=START_TIMEOUT)
        assert client.generate("hi", max_tokens=3, ignore_eos=True).usage["completion_tokens"] == 3
        before = read_pids(runtime_dir)
        os.kill(before["engine_proc"], signal.SIGKILL)
        after = wait_for(lambda: (p := read_pids(runtime_dir)) and p["engine_proc"] not in (None, before["engine_proc"]) and p,
                         timeout=30, what="the engine to be restarted")
        assert after["tokenizer_proc"] == before["tokenizer_proc"] and after["detok_proc"] == before["detok_proc"]
        client.wait_engine(timeout=START_TIMEOUT)
        assert client.generate("hi", max_tokens=3, ignore_eos=True).usage["completion_tokens"] == 3
    proc.send_signal(signal.SIGTERM)
    assert stopped(proc, runtime_dir, 30) == 0
    children = [pid for name, pid in after.items() if name != "url"]
    assert not any(pid_alive(pid) for pid in children), "a stage outlived the supervisor"


def test_an_engine_crash_loses_no_request(tiny_model_dir):
    """An engine's death failed every request in flight. Now each client sends its requests to
    the restarted engine, those that had streamed with the output they received, and the new
    engine continues from there: every stream ends as it would have without the crash, to the
    token and the character (greedy and seeded alike), over the sync and the async client."""
    import asyncio
    import threading

    from nanovllm_client import AsyncClient
    from nanovllm_client.client_state import merge

    short = dict(max_tokens=8, temperature=0, ignore_eos=True)
    long = {"greedy": ("def f():", dict(max_tokens=300, temperature=0, ignore_eos=True)),
            "seeded": ("def h():", dict(max_tokens=300, temperature=0.8, seed=5, ignore_eos=True))}

    async def async_queued(url: str, sent: threading.Event, results: list) -> None:
        async with AsyncClient(url, timeout=120) as ac:
            streams = [await ac.stream("def g():", **short) for _ in range(2)]
            sent.set()
            for stream in streams:
                results.append(merge([d async for d in stream], "g"))

    flags = ("--max-live", "2", "--post-step-hook", "tests.helpers.hooks:slow_step", *EXACT_ARGS)
    with serving(tiny_model_dir, *flags) as (proc, runtime_dir):
        url = f"ipc://{runtime_dir}"
        with Client(url, connect_timeout=START_TIMEOUT, timeout=120) as client:
            client.wait_engine(timeout=START_TIMEOUT)
            want = {name: client.generate(prompt, **kw) for name, (prompt, kw) in long.items()}
            want_short = client.generate("def g():", **short)
            streams = {name: client.stream(prompt, **kw) for name, (prompt, kw) in long.items()}
            got = {name: [next(stream)] for name, stream in streams.items()}
            queued = [client.stream("def g():", **short) for _ in range(4)]
            sent, async_results = threading.Event(), []
            other = threading.Thread(target=asyncio.run, args=(async_queued(url, sent, async_results),))
            other.start()
            assert sent.wait(timeout=60)
            wait_for(lambda: client.server_stats()["engine"].get("num_queued", 0) >= 6, timeout=30,
                     what="six requests of two clients queued behind the two streaming")
            for name, stream in streams.items():
                got[name].append(next(stream))
            before = read_pids(runtime_dir)["engine_proc"]
            os.kill(before, signal.SIGKILL)
            for name, stream in streams.items():
                result = merge(got[name] + list(stream), name)
                assert (result.text, result.token_ids) == (want[name].text, want[name].token_ids), name
                assert result.finish_reason == "length" and result.usage["completion_tokens"] == 300
            for stream in queued:
                result = merge(list(stream), "g")
                assert (result.text, result.token_ids, result.finish_reason) == (
                    want_short.text, want_short.token_ids, "length")
            other.join(timeout=120)
            assert [(r.text, r.token_ids) for r in async_results] == [(want_short.text, want_short.token_ids)] * 2
            assert read_pids(runtime_dir)["engine_proc"] not in (None, before)


def test_a_request_in_flight_at_two_engine_deaths_fails_and_the_service_recovers(tiny_model_dir, monkeypatch):
    """A request that makes the engine crash would, sent to every new engine, keep the service
    down for everyone. It goes to one new engine; in flight at a second death, it fails, saying
    why, and the next engine serves the rest. Every engine here dies at its 40th step, so the
    long request (300 tokens) is in flight at the first two deaths."""
    from nanovllm_client import EngineDeadError
    from tests.helpers.hooks import DIE_AT_STEP_ENV

    monkeypatch.setenv(DIE_AT_STEP_ENV, "40")
    with serving(tiny_model_dir, "--post-step-hook", "tests.helpers.hooks:die_at_step") as (proc, runtime_dir):
        with Client(f"ipc://{runtime_dir}", connect_timeout=START_TIMEOUT, timeout=120) as client:
            client.wait_engine(timeout=START_TIMEOUT)
            first = read_pids(runtime_dir)["engine_proc"]
            with pytest.raises(EngineDeadError, match="the engine died 2 times while this request was in flight"):
                client.generate("def f():", max_tokens=300, temperature=0, ignore_eos=True)
            client.wait_engine(timeout=START_TIMEOUT)
            assert client.generate("hi", max_tokens=5, ignore_eos=True).finish_reason == "length"
            assert read_pids(runtime_dir)["engine_proc"] != first


def test_serve_rejects_a_bad_url():
    out = subprocess.run([sys.executable, "-m", "nanovllm.supervisor", "--url", "http://nope"], cwd=REPO,
                         capture_output=True, text=True, timeout=60, env=dict(os.environ, PYTHONPATH=CHECKOUT_PATH))
    assert out.returncode == 2 and "must start with ipc:// or tcp://" in out.stderr


@pytest.mark.parametrize("module", ["tokenizer_proc", "engine_proc", "detok_proc", "nanovllm.supervisor"])
def test_every_stage_has_help_naming_its_flags_and_environment(module):
    out = subprocess.run([sys.executable, "-m", module, "--help"], cwd=REPO, capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, PYTHONPATH=CHECKOUT_PATH))
    assert out.returncode == 0, out.stderr
    assert "--model" in out.stdout and "NANOVLLM_" in out.stdout


def test_ctrl_c_on_serve_drains_the_requests_in_flight(tiny_model_dir):
    """A terminal's Ctrl-C sends SIGINT to the whole foreground process group: the stages got it
    together with the supervisor, the detokenizer was gone within a second while the engine still
    drained, and every stream in flight failed 30 s later ("outputs were lost"). The stages now
    run in their own sessions, so only the supervisor hears it, and it stops them in order."""
    import threading

    finishes: list = []
    with serving(tiny_model_dir) as (proc, runtime_dir):
        with Client(f"ipc://{runtime_dir}", connect_timeout=START_TIMEOUT, timeout=90) as client:
            client.wait_engine(timeout=START_TIMEOUT)
            streams = [client.stream("hello", max_tokens=600, ignore_eos=True) for _ in range(8)]
            for stream in streams:
                next(stream)
            os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does to `nanovllm serve`
            threads = [threading.Thread(target=lambda s=s: finishes.append([d.finish_reason for d in s][-1]))
                       for s in streams]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=60)
        assert stopped(proc, runtime_dir, 60) == 0
    assert finishes == ["length"] * 8


@pytest.mark.parametrize("stage", ["detok_proc", "engine_proc"])
def test_serve_restarts_a_stage_that_hangs(tiny_model_dir, stage):
    """The supervisor restarted a stage that exited, but one that hung (a deadlock, a step that
    never returns; here SIGSTOP) stayed there for ever, and with it every request. Now each
    stage's watchdog pings reach the supervisor, which kills and restarts a silent one."""
    # 8 s: long enough that a healthy stage on a loaded machine is never taken for a hung one.
    with serving(tiny_model_dir, "--watchdog-s", "8") as (proc, runtime_dir):
        with Client(f"ipc://{runtime_dir}", connect_timeout=START_TIMEOUT, timeout=60) as client:
            client.wait_engine(timeout=START_TIMEOUT)
            before = read_pids(runtime_dir)
            os.kill(before[stage], signal.SIGSTOP)
            after = wait_for(lambda: (p := read_pids(runtime_dir)) and p[stage] not in (None, before[stage]) and p,
                             timeout=60, what=f"the hung {stage} to be restarted")
            assert not pid_alive(before[stage])
            assert all(after[name] == before[name] for name in ("tokenizer_proc", "engine_proc", "detok_proc")
                       if name != stage)
        with Client(f"ipc://{runtime_dir}", connect_timeout=START_TIMEOUT, timeout=60) as client:
            client.wait_engine(timeout=START_TIMEOUT)
            assert client.generate("hi", max_tokens=3, ignore_eos=True).usage["completion_tokens"] == 3
        proc.send_signal(signal.SIGTERM)
        assert stopped(proc, runtime_dir, 60) == 0


def test_serve_gives_the_engines_max_model_len_to_the_tokenizer_stage(tiny_model_dir):
    # The tokenizer stage refuses a prompt the engine would refuse, with the engine's limit in the
    # engine's words: the limit `nanovllm serve` was given, not the model's context length (1024).
    from nanovllm.supervisor import shared_with_tokenizer
    from nanovllm_client.errors import RequestError
    assert shared_with_tokenizer(["--num-threads", "1", "--max-model-len", "256", "--max-num-seqs", "8"]) == \
        ["--max-model-len", "256"]
    assert shared_with_tokenizer(["--max-model-len=300"]) == ["--max-model-len=300"]
    with serving(tiny_model_dir, "--max-model-len", "256") as (proc, runtime_dir):
        with Client(f"ipc://{runtime_dir}", connect_timeout=START_TIMEOUT, timeout=60) as client:
            client.wait_engine(timeout=START_TIMEOUT)
            with pytest.raises(RequestError, match="prompt has 300 tokens but max_model_len is 256"):
                client.generate(prompt_token_ids=[7] * 300, max_tokens=4)
            assert client.generate(prompt_token_ids=[7] * 200, max_tokens=3, ignore_eos=True).usage[
                "completion_tokens"] == 3
