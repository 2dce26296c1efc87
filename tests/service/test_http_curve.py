"""`nanovllm serve --curve-secret-key K --http-port P`: the HTTP front beside a tcp service that
requires CURVE connects with the service's own key pair (handed over as key file paths in its
environment, never on its command line), so /health reports every stage ready and the openai
package gets the same greedy answer as a ZeroMQ client holding an allowed key. The same front
started as its systemd unit starts it finds the service's key where the stages' units do."""
from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys

import pytest

pytest.importorskip("uvicorn")

from nanovllm_client import Client  # noqa: E402
from nanovllm_client.security import CLIENT_KEY_ENV, generate_keypair, load_keypair, load_public_key  # noqa: E402
from tests.service.conftest import START_TIMEOUT, TINY_ENGINE_ARGS, start_service  # noqa: E402
from tests.service.harness import CHECKOUT_PATH, REPO, STAGES, free_tcp_base_port, short_tmpdir, wait_for  # noqa: E402
from tests.service.test_http_serve import _free_port  # noqa: E402
from tests.service.test_supervisor import read_pids, stopped  # noqa: E402


def _health(port: int) -> tuple[int, dict]:
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("GET", "/health")
        r = conn.getresponse()
        return r.status, json.loads(r.read() or b"{}")
    except (OSError, ValueError):
        return 0, {}


@contextlib.contextmanager
def serve_with_http(model: str, url: str, runtime_dir: str, *args: str, client_curve=None,
                    engine_args: list[str] = TINY_ENGINE_ARGS):
    """`nanovllm serve --http-port` on `url` with `args`; yields (proc, port, a ZeroMQ client) once
    the front's /health says every stage is ready. Stopped (SIGTERM, then SIGKILL) after."""
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=CHECKOUT_PATH)
    for name in ("NANOVLLM_CURVE_SECRET_KEY", "NANOVLLM_CURVE_CLIENTS", CLIENT_KEY_ENV, "NANOVLLM_CURVE_SERVER_KEY",
                 "NANOVLLM_INSECURE_TCP"):
        env.pop(name, None)
    proc = subprocess.Popen([sys.executable, "-m", "nanovllm.supervisor", "--model", model, "--url", url,
                             "--runtime-dir", runtime_dir, "--http-port", str(port), *args, *engine_args],
                            cwd=REPO, env=env, start_new_session=True)
    try:
        with Client(url, timeout=120, connect_timeout=START_TIMEOUT, curve=client_curve) as client:
            client.wait_engine(timeout=START_TIMEOUT)
            wait_for(lambda: proc.poll() is not None or _health(port)[0] == 200, timeout=START_TIMEOUT,
                     what="the HTTP front's /health")
            yield proc, port, client
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                stopped(proc, runtime_dir, timeout=60)
            except AssertionError:
                os.killpg(proc.pid, signal.SIGKILL)
        for pid in (read_pids(runtime_dir) or {}).values():
            if isinstance(pid, int):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


@pytest.fixture(scope="module")
def curve_front(tiny_model_dir):
    root = short_tmpdir()
    _, service_secret = generate_keypair(os.path.join(root, "service"), "service")
    alice_public, alice_secret = generate_keypair(os.path.join(root, "alice-secret"), "alice")
    allowed = os.path.join(root, "allowed")
    os.makedirs(allowed, mode=0o700)
    os.replace(alice_public, os.path.join(allowed, "alice.key"))
    runtime_dir = os.path.join(root, "run")
    alice = (load_keypair(alice_secret), load_public_key(service_secret))
    with serve_with_http(tiny_model_dir, f"tcp://127.0.0.1:{free_tcp_base_port()}", runtime_dir,
                         "--curve-secret-key", service_secret, "--curve-clients", allowed,
                         client_curve=alice) as (proc, port, client):
        yield proc, runtime_dir, port, client, tiny_model_dir, service_secret


def test_the_front_reaches_a_curve_service_with_its_key_pair(curve_front):
    proc, runtime_dir, port, client, model, service_secret = curve_front
    assert proc.poll() is None, "nanovllm serve exited"
    status, body = _health(port)
    assert status == 200 and body["status"] == "ok", body
    assert set(body["stages"].values()) == {"ready"} and len(body["stages"]) == 3, body
    # The key travels as a file path in the front's environment, never on its command line.
    front = read_pids(runtime_dir)["http"]
    with open(f"/proc/{front}/cmdline", "rb") as f:
        cmdline = f.read()
    assert b"curve" not in cmdline.lower() and service_secret.encode() not in cmdline
    with open(f"/proc/{front}/environ", "rb") as f:
        environ = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
    assert environ[CLIENT_KEY_ENV.encode()] == service_secret.encode()


def test_the_openai_sdk_through_the_curve_service(curve_front):
    openai = pytest.importorskip("openai")
    _, _, port, client, model, _ = curve_front
    sdk = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)
    assert [m.id for m in sdk.models.list()] == [model]
    want = client.generate("def f():", max_tokens=12, temperature=0, ignore_eos=True)
    out = sdk.completions.create(model=model, prompt="def f():", max_tokens=12, temperature=0,
                                 extra_body={"ignore_eos": True})
    assert out.choices[0].text == want.text and out.usage.completion_tokens == 12


def test_the_front_started_as_its_systemd_unit_starts_it_reaches_a_curve_service(tiny_model_dir, tmp_path):
    """nanovllm-http@.service reads the instance's env file as the stages' units do: where it names
    the service's key (NANOVLLM_CURVE_SECRET_KEY) the front connects with that pair, as under
    `nanovllm serve`, and needs no variable of its own. The argv and environment are the unit's
    (`exec_start`: its Environment= lines, then the env file), the stages a real CURVE service
    whose allow-list is empty: only the service's own key gets in."""
    from nanovllm import install_systemd
    from tests.ops.unit_files import exec_start

    root = short_tmpdir()
    _, service_secret = generate_keypair(os.path.join(root, "service"), "service")
    allowed = os.path.join(root, "allowed")
    os.makedirs(allowed, mode=0o700)
    url, port = f"tcp://127.0.0.1:{free_tcp_base_port()}", _free_port()
    service_keys = {"NANOVLLM_CURVE_SECRET_KEY": service_secret, "NANOVLLM_CURVE_CLIENTS": allowed}
    procs = start_service(tiny_model_dir, url, env={stage: service_keys for stage in STAGES},
                          curve=(load_keypair(service_secret), load_public_key(service_secret)))
    front = None
    try:
        install_systemd.install(tmp_path, "prod", sys.executable)
        env_file = tmp_path / "etc/nanovllm/prod.env"
        env_file.write_text(env_file.read_text() + "".join(f"{name}={value}\n" for name, value in {
            "NANOVLLM_MODEL": tiny_model_dir, "NANOVLLM_URL": url, "NANOVLLM_HTTP_PORT": port, **service_keys}.items()))
        argv, env = exec_start(tmp_path / "etc/systemd/system/nanovllm-http@.service", env_file, "prod",
                               runtime_dir=root, dirs={"S": root})
        assert argv == [sys.executable, "-m", "nanovllm_client.http"]
        assert CLIENT_KEY_ENV not in env and "NANOVLLM_CURVE_SERVER_KEY" not in env
        os.makedirs(env["NANOVLLM_RUNTIME_DIR"], mode=0o700)  # RuntimeDirectory=
        notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        notify.bind(os.path.join(root, "notify"))
        notify.settimeout(START_TIMEOUT)
        # The unit's environment, plus what systemd adds (NOTIFY_SOCKET) and what a checkout needs.
        front = subprocess.Popen(argv, cwd=REPO, env=dict(env, NOTIFY_SOCKET=os.path.join(root, "notify"),
                                                           PATH=os.environ.get("PATH", "/usr/bin:/bin"),
                                                           PYTHONPATH=CHECKOUT_PATH))
        assert b"READY=1" in notify.recv(4096)  # Type=notify: it tells systemd once it listens
        wait_for(lambda: front.poll() is not None or _health(port)[0] == 200, timeout=START_TIMEOUT,
                 what="the front's /health")
        status, body = _health(port)
        assert status == 200 and set(body["stages"].values()) == {"ready"} and len(body["stages"]) == 3, body
        openai = pytest.importorskip("openai")
        sdk = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)
        with Client(url, curve=(load_keypair(service_secret), load_public_key(service_secret)), timeout=120) as client:
            want = client.generate("def f():", max_tokens=8, temperature=0, ignore_eos=True)
        out = sdk.completions.create(model=tiny_model_dir, prompt="def f():", max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True})
        assert out.choices[0].text == want.text
    finally:
        if front is not None and front.poll() is None:
            front.terminate()
            front.wait(timeout=60)
        procs.stop()
