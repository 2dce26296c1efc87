"""The service-manager protocol, with each stage started by the exact ExecStart= line of its unit
and the unit's environment (plus the test's env file), under the unit's seccomp rules, and with a
NOTIFY_SOCKET (and WATCHDOG_USEC, as systemd derives it from WatchdogSec=) the test owns:
READY=1 comes only once the stage serves, WATCHDOG=1 keeps coming from the engine's step loop
during a long generation, and stops when that loop hangs although the process lives on."""
from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from nanovllm_client import Client
from nanovllm_client.health import check_health
from tests.ops.test_confinement import REPO
from tests.service.harness import wait_for
from tests.ops.test_confinement import pytestmark as confinement_marks
from tests.ops.test_confinement import service, units  # noqa: F401  (fixtures)

pytestmark = confinement_marks
WATCHDOG_S = 1.5
"""A short WatchdogSec= for the test: the stages ping every third of it."""
MANAGER = {"WATCHDOG_USEC": str(int(WATCHDOG_S * 1e6))}


class Notifications:
    """Every datagram a stage sends, with its arrival time, read on a thread."""

    def __init__(self, stage):
        self.stage, self.lines = stage, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        self.stage.notify.settimeout(0.1)
        while not self._stop.is_set():
            try:
                data = self.stage.notify.recv(4096)
            except socket.timeout:
                continue
            except OSError:
                return
            now = time.monotonic()
            self.lines.extend((now, line) for line in data.decode().splitlines())

    def times(self, line: str) -> list[float]:
        return [t for t, seen in self.lines if seen == line]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)


def start_all(service, engine_env: str = "", python_path: str = "", watchdog_s: float = WATCHDOG_S) -> dict:
    """detok, engine, tokenizer in systemd's order; `engine_env` lines go into the env file;
    `python_path` is put in front of the stages' import path (a module of the operator's)."""
    if engine_env:
        service.env_file.write_text(service.env_file.read_text() + engine_env)
    stages = {}
    for name in ("nanovllm-detok@.service", "nanovllm-engine@.service", "nanovllm-tokenizer@.service"):
        manager = dict(MANAGER, WATCHDOG_USEC=str(int(watchdog_s * 1e6)))
        if python_path:
            manager["PYTHONPATH"] = os.pathsep.join([python_path, str(REPO), str(REPO / "client")])
        stage = service.start(name, manager_env=manager)
        stages[name.split("@")[0].rsplit("-", 1)[1]] = Notifications(stage)
        if name != "nanovllm-engine@.service":
            wait_for_line(stages, name.split("@")[0].rsplit("-", 1)[1], "READY=1", 180)
    return stages


def wait_for_line(stages: dict, role: str, line: str, timeout: float) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if stages[role].times(line):
            return stages[role].times(line)[0]
        if stages[role].stage.proc.poll() is not None:
            raise AssertionError(f"{role} exited:\n{stages[role].stage.log()}")
        time.sleep(0.05)
    raise AssertionError(f"no {line} from {role} within {timeout}s:\n{stages[role].stage.log()}")


SLOW_IMPORT = ("import os, time\n"
               "while not os.path.exists(os.path.join(os.path.dirname(__file__), 'go')):\n"
               "    time.sleep(0.05)\n\n"
               "def hook(metrics):\n    pass\n")
"""A hook module whose import waits for the test's word (a file `go` beside it): the engine stays
"loading" until the test has seen it so, however slow the machine."""


def test_ready_comes_only_once_each_stage_serves(service, tmp_path):
    (tmp_path / "slow_import.py").write_text(SLOW_IMPORT)
    stages = start_all(service, "NANOVLLM_POST_STEP_HOOK=slow_import:hook\n", python_path=str(tmp_path))
    try:
        def engine_loading() -> bool:
            health = check_health(service.url, timeout=30)  # the limit only catches a hang
            assert health.stages["tokenizer"].state == health.stages["detokenizer"].state == "ready", health.lines()
            assert stages["engine"].stage.proc.poll() is None, stages["engine"].stage.log()
            assert not stages["engine"].times("READY=1"), "the engine said READY=1 while loading"
            return health.stages["engine"].state == "loading"

        wait_for(engine_loading, timeout=180, interval=0.1, what="health to show the engine loading")
        (tmp_path / "go").touch()
        wait_for_line(stages, "engine", "READY=1", 180)
        # Ready means serving at once; the detokenizer, which health asks, hears of it with the next heartbeat.
        with Client(service.url, connect_timeout=60, timeout=60) as client:
            assert client.generate("Hello", max_tokens=4, ignore_eos=True).usage["completion_tokens"] == 4
        wait_for(lambda: check_health(service.url, timeout=30).healthy, timeout=60, interval=0.05,
                 what="health to report the engine ready")
    finally:
        for n in stages.values():
            n.close()


def test_the_watchdog_keeps_coming_from_the_step_loop_during_a_long_generation(service):
    # A 3 s watchdog (pings every second): a loaded machine may stall a process for a second or
    # so without the stage being silent a whole period, which is what this holds it to.
    watchdog_s = 3.0
    stages = start_all(service, "NANOVLLM_POST_STEP_HOOK=tests.service.plugins:slow_step\n",  # 20 ms+ a step
                       watchdog_s=watchdog_s)
    try:
        wait_for_line(stages, "engine", "READY=1", 180)
        with Client(service.url, connect_timeout=30, timeout=300) as client:
            started = time.monotonic()
            result = client.generate("def f():", max_tokens=600, ignore_eos=True)
            ended = time.monotonic()
        assert result.usage["completion_tokens"] == 600 and ended - started > 3 * watchdog_s
        pings = [t for t in stages["engine"].times("WATCHDOG=1") if started <= t <= ended]
        gaps = [b - a for a, b in zip([started, *pings], [*pings, ended])]
        assert max(gaps) < watchdog_s, gaps  # never once silent for a whole watchdog period
        for role in ("tokenizer", "detok"):  # the other two ping from their loops too
            assert [t for t in stages[role].times("WATCHDOG=1") if started <= t <= ended]
    finally:
        for n in stages.values():
            n.close()


def test_a_hung_step_loop_stops_the_watchdog(service):
    stages = start_all(service, "NANOVLLM_POST_STEP_HOOK=tests.service.plugins:hang_after_steps\n"
                                "NANOVLLM_TEST_HANG_AFTER=5\n")
    try:
        wait_for_line(stages, "engine", "READY=1", 180)
        with Client(service.url, connect_timeout=30, timeout=5) as client:
            stream = client.stream("def f():", max_tokens=50, ignore_eos=True)
            next(stream)  # the loop hangs in the 5th step's hook
            hung_at = time.monotonic()
            time.sleep(3 * WATCHDOG_S)
            assert client.server_stats()["engine_alive"] is True  # its I/O threads still heartbeat...
            stream.cancel()
        late = [t for t in stages["engine"].times("WATCHDOG=1") if t > hung_at + WATCHDOG_S]
        assert not late, "the engine kept pinging the watchdog from a hung step loop"  # ...but systemd would kill it
        assert stages["engine"].stage.proc.poll() is None
        assert stages["tokenizer"].times("WATCHDOG=1")[-1] > hung_at + WATCHDOG_S  # the others still ping
    finally:
        engine = stages["engine"].stage.proc if "engine" in stages else None
        if engine is not None and engine.poll() is None:
            engine.kill()  # what systemd's watchdog does to it; a SIGTERM would wait out the 30 s drain
        for n in stages.values():
            n.close()
