"""Scale-out behind an existing router: two `nanovllm serve --http-port` instances behind SGLang's
router (`smg` on PyPI, the successor of `sglang-router`), cache-aware policy, one API key on the
router and the fronts. The router is not a dependency of the project: the test runs where its binary is found
($NANOVLLM_TEST_SMG, else `smg` on PATH) and is skipped elsewhere (docs/operations.md has the
recipe)."""
from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys

import pytest

pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from tests.service.conftest import START_TIMEOUT, TINY_ENGINE_ARGS  # noqa: E402
from tests.service.harness import REPO, short_tmpdir, wait_for  # noqa: E402
from tests.service.test_supervisor import read_pids  # noqa: E402

SMG = os.environ.get("NANOVLLM_TEST_SMG") or shutil.which("smg")
pytestmark = pytest.mark.skipif(not SMG, reason="SGLang's router (smg) is not installed: set NANOVLLM_TEST_SMG "
                                                "or put smg on PATH (docs/operations.md)")
KEY = "sk-router-test-0123456789"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(port: int, path: str, headers: dict | None = None) -> tuple[int, bytes]:
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("GET", path, headers=headers or {})
        r = conn.getresponse()
        return r.status, r.read()
    except OSError:
        return 0, b""


def _stop(proc: subprocess.Popen, runtime_dir: str | None = None) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    for pid in (read_pids(runtime_dir) or {}).values() if runtime_dir else ():
        if isinstance(pid, int):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _healthy_workers(port: int) -> int:
    status, body = _get(port, "/workers", {"Authorization": f"Bearer {KEY}"})
    return sum(w.get("is_healthy", False) for w in json.loads(body)["workers"]) if status == 200 else 0


def _requests_served(port: int) -> int:
    """Chat and completion requests the front at `port` answered 200 (its /metrics)."""
    _, body = _get(port, "/metrics", {"Authorization": f"Bearer {KEY}"})
    return sum(int(line.rsplit(" ", 1)[1]) for line in body.decode().splitlines()
               if line.startswith("nanovllm_http_requests_total") and 'status="200"' in line)


@pytest.fixture(scope="module")
def routed(tiny_model_dir):
    """Two services, each with its HTTP front and a key file, and smg in front of both."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.path.join(REPO, "client")]))
    services, ports = [], []
    router = None
    try:
        for _ in range(2):
            runtime_dir, port = short_tmpdir(), _free_port()
            keys = os.path.join(runtime_dir, "http-keys")
            with open(os.open(keys, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
                f.write(KEY + "\n")
            proc = subprocess.Popen([sys.executable, "-m", "nanovllm.supervisor", "--model", tiny_model_dir,
                                     "--runtime-dir", runtime_dir, "--log-level", "WARNING", "--http-port", str(port),
                                     "--http-api-key-file", keys, *TINY_ENGINE_ARGS],
                                    cwd=REPO, env=env, start_new_session=True)
            services.append((proc, runtime_dir))
            ports.append(port)
        for port in ports:
            wait_for(lambda: _get(port, "/health")[0] == 200, timeout=START_TIMEOUT, what=f"the front on {port}")
        router_port = _free_port()
        # --api-key: the key the router asks of its own clients (its /workers too) and sends the
        # fronts for its calls (/v1/models discovery): the fronts' key, so one key holds end to end.
        router = subprocess.Popen([SMG, "launch", "--host", "127.0.0.1", "--port", str(router_port),
                                   "--prometheus-host", "127.0.0.1", "--prometheus-port", str(_free_port()),
                                   "--worker-urls", *[f"http://127.0.0.1:{p}" for p in ports],
                                   "--policy", "cache_aware", "--api-key", KEY, "--log-level", "warn"],
                                  cwd=short_tmpdir(), stdout=subprocess.DEVNULL, start_new_session=True)
        wait_for(lambda: _healthy_workers(router_port) == 2, timeout=START_TIMEOUT, what="smg's two healthy workers")
        yield router_port, ports, tiny_model_dir
    finally:
        if router is not None:
            _stop(router)
        for proc, runtime_dir in services:
            _stop(proc, runtime_dir)


def _sdk(port: int, key: str = KEY):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=120)


def test_chat_and_completions_through_the_router(routed):
    router_port, ports, model = routed
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    direct = _sdk(ports[0]).chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0)
    before = sum(_requests_served(p) for p in ports)
    routed_sdk = _sdk(router_port)
    answer = routed_sdk.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0)
    # Greedy on the same weights: whichever instance served it, the answer is the one a front gives directly.
    assert answer.choices[0].message.content == direct.choices[0].message.content
    assert answer.choices[0].finish_reason == direct.choices[0].finish_reason
    assert answer.usage.completion_tokens == direct.usage.completion_tokens
    stream = routed_sdk.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0,
                                                stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == direct.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == direct.usage.completion_tokens
    completion = routed_sdk.completions.create(model=model, prompt="def add(a, b):", max_tokens=6, temperature=0)
    assert completion.choices[0].text == _sdk(ports[1]).completions.create(
        model=model, prompt="def add(a, b):", max_tokens=6, temperature=0).choices[0].text
    # Every routed request was answered by one of the two fronts.
    assert sum(_requests_served(p) for p in ports) - before == 4  # 3 routed + 1 direct to ports[1]


def test_keys_hold_through_the_router(routed):
    router_port, _, model = routed
    with pytest.raises(openai.AuthenticationError):
        _sdk(router_port, "sk-wrong").chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
