"""The design's extension points in the service: a scheduling policy and a post-step hook from an
operator's own module (outside the project), loaded by `nanovllm serve` flags, and request
priorities sent by the client."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

from nanovllm_client import Client
from tests.service.conftest import START_TIMEOUT
from tests.service.harness import CHECKOUT_PATH, REPO, short_tmpdir

OPERATOR_MODULE = textwrap.dedent('''
    """An operator's own scheduling policy and monitoring hook."""
    import json, os, time
    from nanovllm.engine.policy import SchedulerPolicy

    class ShortestPromptFirst(SchedulerPolicy):
        name = "shortest-prompt-first"
        def key(self, seq):
            return (seq.num_prompt_tokens, seq.arrival)

    def record(metrics):
        time.sleep(0.01)  # a slow step, so requests queue up behind the running one
        with open(os.environ["STEP_LOG"], "a") as f:
            f.write(json.dumps(metrics.to_dict()) + "\\n")
''')


def serve(model: str, env: dict, *args: str) -> tuple[subprocess.Popen, str]:
    runtime_dir = short_tmpdir()
    proc = subprocess.Popen([sys.executable, "-m", "nanovllm.supervisor", "--model", model, "--runtime-dir",
                             runtime_dir, "--num-kvcache-blocks", "512", "--num-threads", "1", "--max-num-seqs", "1",
                             *args], cwd=REPO, env=env)
    return proc, f"ipc://{runtime_dir}"


def finish_order(client: Client, requests: dict[str, dict]) -> list[str]:
    """Start a long request, then `requests` (name -> stream kwargs) while it runs; names in the
    order they finished."""
    first = client.stream("def long():", max_tokens=60, ignore_eos=True)
    next(first)
    done: list[str] = []
    lock = threading.Lock()

    def run(name: str, kwargs: dict) -> None:
        list(client.stream(max_tokens=3, ignore_eos=True, **kwargs))
        with lock:
            done.append(name)

    threads = []
    for name, kwargs in requests.items():
        threads.append(threading.Thread(target=run, args=(name, kwargs)))
        threads[-1].start()
        time.sleep(0.2)  # in this order into the engine's waiting queue
    list(first)
    for t in threads:
        t.join(timeout=60)
    return done


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0


def test_a_policy_and_a_hook_from_the_operators_module(tiny_model_dir, tmp_path):
    (tmp_path / "operator_plugins.py").write_text(OPERATOR_MODULE)
    log = tmp_path / "steps.jsonl"
    env = dict(os.environ, STEP_LOG=str(log),
               PYTHONPATH=os.pathsep.join([str(tmp_path), REPO, os.path.join(REPO, "client")]))
    # One client: with the default live share (half of this one-sequence batch: 1) its second and
    # third requests would wait in the stage's per-client line, in arrival order, never both in the
    # scheduler's queue where the operator's policy orders them.
    proc, url = serve(tiny_model_dir, env, "--scheduler-policy", "operator_plugins:ShortestPromptFirst",
                      "--post-step-hook", "operator_plugins:record", "--max-live-per-client", "0")
    try:
        with Client(url, connect_timeout=START_TIMEOUT, timeout=120) as client:
            client.wait_engine(timeout=START_TIMEOUT)
            order = finish_order(client, {"long prompt": {"prompt": "x = 1\n" * 60}, "short prompt": {"prompt": "y"}})
            assert order == ["short prompt", "long prompt"]  # FCFS would have run the long prompt first
            steps = [json.loads(line) for line in log.read_text().splitlines()]
            assert [s["step"] for s in steps] == list(range(1, len(steps) + 1))  # every step, in order
            assert sum(s["num_generated_tokens"] for s in steps) == 60 + 3 + 3
        stop(proc)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_client_priorities_order_admission_under_the_priority_policy(tiny_model_dir):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.path.join(REPO, "client")]))
    proc, url = serve(tiny_model_dir, env, "--scheduler-policy", "priority",
                      "--post-step-hook", "tests.service.plugins:slow_step")
    try:
        with Client(url, connect_timeout=START_TIMEOUT, timeout=120) as client:
            client.wait_engine(timeout=START_TIMEOUT)
            order = finish_order(client, {"low": {"prompt": "a", "priority": -5}, "normal": {"prompt": "b"},
                                          "high": {"prompt": "c", "priority": 10}})
            assert order == ["high", "normal", "low"]
        stop(proc)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_hook_that_does_not_resolve_stops_serve_with_a_clear_error(tiny_model_dir):
    out = subprocess.run([sys.executable, "-m", "nanovllm.supervisor", "--model", tiny_model_dir, "--runtime-dir",
                          short_tmpdir(), "--post-step-hook", "no_such_module:hook"], cwd=REPO, capture_output=True,
                         text=True, timeout=120, env=dict(os.environ, PYTHONPATH=CHECKOUT_PATH))
    assert out.returncode == 1
    assert "post-step hook 'no_such_module:hook': cannot import 'no_such_module'" in out.stderr
