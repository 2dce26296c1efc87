"""Run the three service stages as real processes for tests; always clean up.

`ServiceProcs` starts `python -m tokenizer_proc|engine_proc|detok_proc` with their own logs,
can SIGKILL and restart a single stage, and on `stop()` terminates whatever is left (SIGTERM,
then SIGKILL). Every wait has a timeout.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STAGES = ("tokenizer_proc", "engine_proc", "detok_proc")
CHECKOUT_PATH = os.pathsep.join([REPO, os.path.join(REPO, "client")])
"""PYTHONPATH for `nanovllm serve` started by a test: this checkout's packages, its client package
included (the supervisor imports both), whichever copies are installed."""


def short_tmpdir() -> str:
    """A fresh directory under the test session's own (tests/conftest.py removes it at the end).
    ipc:// paths must stay under ~100 bytes, so not pytest's long tmp_path."""
    from tests.conftest import session_tmpdir

    return tempfile.mkdtemp(dir=session_tmpdir())


def free_tcp_base_port() -> int:
    """A base port with the next four ports free too (the service uses five), below the kernel's
    ephemeral range: a port from that range may be handed to a client's outgoing connection
    before the stage binds it (a client once connected to itself on the detokenizer's port)."""
    import random
    import socket

    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for _ in range(200):
        base = random.randrange(max(1024, low - 12000), low - 5)
        socks = []
        try:
            for off in range(5):
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("127.0.0.1", base + off))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError("no five consecutive free tcp ports")


class ServiceProcs:
    def __init__(self, model: str, url: str, engine_args: list[str] | None = None,
                 detok_args: list[str] | None = None, log_dir: str | None = None,
                 stage_env: dict[str, dict[str, str]] | None = None):
        self.model, self.url = model, url
        self.stage_env = stage_env or {}
        """Extra environment per stage name (e.g. its metrics port)."""
        self.args = {"tokenizer_proc": [], "engine_proc": list(engine_args or []), "detok_proc": list(detok_args or [])}
        self.log_dir = log_dir or short_tmpdir()
        self.procs: dict[str, subprocess.Popen] = {}
        self._logs: list = []

    def env(self) -> dict[str, str]:
        env = dict(os.environ, NANOVLLM_URL=self.url, NANOVLLM_MODEL=self.model, PYTHONUNBUFFERED="1",
                   NANOVLLM_LOG_LEVEL="INFO")
        # The client package works from the checkout even when `pip install -e ./client` was not run.
        env["PYTHONPATH"] = os.pathsep.join([REPO, os.path.join(REPO, "client"), env.get("PYTHONPATH", "")])
        return env

    def start(self, stage: str | None = None) -> ServiceProcs:
        for name in ([stage] if stage else STAGES):
            log = open(os.path.join(self.log_dir, f"{name}.log"), "ab")
            self._logs.append(log)
            self.procs[name] = subprocess.Popen([sys.executable, "-m", name, *self.args[name]], cwd=REPO,
                                                env=dict(self.env(), **self.stage_env.get(name, {})),
                                                stdout=log, stderr=subprocess.STDOUT)
        return self

    def pid(self, stage: str) -> int:
        return self.procs[stage].pid

    def kill(self, stage: str, sig: int = signal.SIGKILL, timeout: float = 10.0) -> int:
        proc = self.procs[stage]
        proc.send_signal(sig)
        return proc.wait(timeout=timeout)

    def restart(self, stage: str) -> None:
        if self.procs[stage].poll() is None:
            self.kill(stage)
        self.start(stage)

    def assert_running(self) -> None:
        dead = {n: p.returncode for n, p in self.procs.items() if p.poll() is not None}
        assert not dead, f"stage(s) exited: {dead}\n{self.logs()}"

    def logs(self, tail: int = 3000) -> str:
        out = []
        for name in STAGES:
            path = os.path.join(self.log_dir, f"{name}.log")
            if os.path.exists(path):
                with open(path, errors="replace") as f:
                    out.append(f"--- {name} ---\n{f.read()[-tail:]}")
        return "\n".join(out)

    def stop(self, timeout: float = 10.0) -> dict[str, int | None]:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        codes = {}
        for name, proc in self.procs.items():
            try:
                codes[name] = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
                codes[name] = None
        for log in self._logs:
            log.close()
        if self.url.startswith("ipc://"):
            shutil.rmtree(self.url[len("ipc://"):], ignore_errors=True)
        return codes


def wait_for(predicate, timeout: float, interval: float = 0.05, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def engine_idle(client):
    stats = client.server_stats()
    eng = stats["engine"]
    idle = (eng.get("num_live") == 0 and eng["num_running"] == 0 and eng["num_waiting"] == 0
            and eng["num_free_blocks"] == eng["num_total_blocks"] and stats["detok"]["num_requests"] == 0)
    return stats if idle else None


def fresh_engine_stats(client) -> dict:
    """The engine's stats from a heartbeat it sent after this call began: the uptime it reports
    must move on twice (the first change may come from a heartbeat already on its way). The
    limit only catches a hang; a sleep would be a guess that load can break."""
    seen = [client.server_stats()]
    for _ in range(2):
        before = seen[-1]["engine_uptime_s"]
        wait_for(lambda: seen.append(client.server_stats()) or seen[-1]["engine_uptime_s"] != before,
                 timeout=60, interval=0.02, what="a new engine heartbeat")
    return seen[-1]["engine"]


def num_steps(client) -> int:
    """The engine's step count now (from a heartbeat sent after this call began)."""
    return fresh_engine_stats(client)["num_steps"]


def idle_before_the_natural_end(client, since: int, max_tokens: int, what: str) -> None:
    """Every request gone and every KV block free (the limit only catches a hang), within half the
    steps after `since` that running them to their `max_tokens` would take: some of their tokens
    may have come before `since`, never half (steps of >= 10 ms; an abort's trip takes a few)."""
    stats = wait_for(lambda: engine_idle(client), timeout=60, interval=0.1, what=what)
    steps = stats["engine"]["num_steps"] - since
    assert steps < max_tokens // 2, f"{what}: took {steps} steps, as if the requests ran on to their end"
