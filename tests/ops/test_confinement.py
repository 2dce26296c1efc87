"""The stages under the seccomp rules their units declare (SystemCallFilter=, SystemCallErrorNumber=,
SystemCallArchitectures=, MemoryDenyWriteExecute=, RestrictAddressFamilies=, RestrictRealtime=),
reproduced by tests/ops/seccomp_exec.py since systemd cannot start units here: each stage runs
with its unit's ExecStart= line and environment, says READY=1 on $NOTIFY_SOCKET, the three serve a
request (the HTTP front one over HTTP) and stop cleanly. The rules are shown to be in force, and the engine is shown to need
writable+executable memory (the reason its unit leaves MemoryDenyWriteExecute= out).
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nanovllm import install_systemd as installer
from tests.ops.seccomp_exec import spec_from_unit, supported, wrap
from tests.ops.stages import FRONT_MODULE, FRONT_UNIT, STAGE_OF_UNIT
from tests.ops.unit_files import exec_start, parse_unit
from tests.service.harness import short_tmpdir

REPO = Path(__file__).resolve().parents[2]
pytestmark = [
    pytest.mark.skipif(supported() is not None, reason=str(supported())),
    pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                       reason="systemd-analyze is not installed (Debian package: systemd); it names the system "
                              "calls of each @group"),
]
START_ORDER = ("nanovllm-detok@.service", "nanovllm-engine@.service", "nanovllm-tokenizer@.service", FRONT_UNIT)
_CHECKS = r"""
import ctypes, errno, os, socket
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype, libc.mmap.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                                          ctypes.c_int, ctypes.c_int, ctypes.c_long]
def refused(call, *args):
    try:
        call(*args)
    except OSError as e:
        return errno.errorcode[e.errno]
    return "allowed"
def mmap_rwx():
    if libc.mmap(None, 4096, 7, 0x22, -1, 0) in (None, 2**64 - 1):
        raise OSError(ctypes.get_errno(), "mmap")
def setuid():
    if libc.setuid(os.getuid()):
        raise OSError(ctypes.get_errno(), "setuid")
print(refused(mmap_rwx), refused(socket.socket, socket.AF_NETLINK, socket.SOCK_RAW),
      refused(socket.socket, socket.AF_INET, socket.SOCK_STREAM), refused(setuid),
      refused(os.sched_setscheduler, 0, os.SCHED_FIFO, os.sched_param(1)),
      refused(os.sched_setscheduler, 0, os.SCHED_OTHER, os.sched_param(0)))
"""


@pytest.fixture()
def units(tmp_path) -> Path:
    installer.install(tmp_path / "prefix", "t", sys.executable)
    return tmp_path / "prefix/etc/systemd/system"


def test_the_units_rules_are_in_force(units, tmp_path):
    """A process under the tokenizer unit's rules cannot map writable+executable memory, open a
    netlink socket, change its uid (@privileged) or go realtime; ordinary calls still work."""
    spec = spec_from_unit(parse_unit(units / "nanovllm-tokenizer@.service"))
    run = subprocess.run(wrap(spec, str(tmp_path / "spec.json"), [sys.executable, "-c", _CHECKS]),
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["EPERM", "EAFNOSUPPORT", "allowed", "EPERM", "EPERM", "allowed"]
    engine = spec_from_unit(parse_unit(units / "nanovllm-engine@.service"))
    run = subprocess.run(wrap(engine, str(tmp_path / "engine.json"), [sys.executable, "-c", _CHECKS]),
                         capture_output=True, text=True, timeout=60)
    assert run.stdout.split() == ["allowed", "allowed", "allowed", "EPERM", "EPERM", "allowed"], run.stderr


class ConfinedStage:
    """One stage started as its unit would start it, under its unit's seccomp rules."""

    def __init__(self, unit: Path, env_file: Path, runtime_dir: str, dirs: dict[str, str], log_dir: Path,
                 spec_overrides: dict | None = None, manager_env: dict[str, str] | None = None):
        self.name = unit.name
        argv, unit_env = exec_start(unit, env_file, "t", runtime_dir=runtime_dir, dirs=dirs)
        module = STAGE_OF_UNIT.get(unit.name, FRONT_MODULE)
        for variable in ("RUNTIME_DIRECTORY", "STATE_DIRECTORY", "CACHE_DIRECTORY"):
            if variable in unit_env:  # the front has no cache directory
                os.makedirs(unit_env[variable], mode=0o700, exist_ok=True)  # systemd creates them
        self.notify_path = os.path.join(runtime_dir, f"notify-{module}")
        self.notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.notify.bind(self.notify_path)
        # What systemd itself adds (NOTIFY_SOCKET; WATCHDOG_USEC from WatchdogSec= when given).
        env = dict(unit_env, PATH=os.environ.get("PATH", "/usr/bin:/bin"), NOTIFY_SOCKET=self.notify_path,
                   PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "client")]))
        env.update(manager_env or {})
        spec = spec_from_unit(parse_unit(unit))
        for key, value in (spec_overrides or {}).items():
            setattr(spec, key, value)
        self.log_path = log_dir / f"{module}.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(wrap(spec, str(log_dir / f"{module}.json"), argv), env=env, cwd="/",
                                         stdout=log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.name} exited with {self.proc.returncode} before READY=1:\n{self.log()}")
            self.notify.settimeout(0.2)
            try:
                if "READY=1" in self.notify.recv(4096).decode().splitlines():
                    return
            except socket.timeout:
                continue
        raise AssertionError(f"{self.name} sent no READY=1 within {timeout}s:\n{self.log()}")

    def stop(self, timeout: float = 30.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)
            code = None
        self.notify.close()
        return code

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]


class ConfinedService:
    """Stages of one instance started like systemd would (the test picks which and when), with the
    tiny model; `stop()` stops them in systemd's stop order (the reverse of the start order)."""

    def __init__(self, units: Path, model: str, tmp_path: Path):
        self.units, self.tmp_path = units, tmp_path
        self.env_file = tmp_path / "t.env"
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.http_port = s.getsockname()[1]
        self.env_file.write_text(f"NANOVLLM_MODEL={model}\nNANOVLLM_LOG_LEVEL=INFO\nNANOVLLM_TOKENIZER_METRICS_PORT=0\n"
                                 "NANOVLLM_ENGINE_METRICS_PORT=0\nNANOVLLM_DETOK_METRICS_PORT=0\n"
                                 f"NANOVLLM_HTTP_PORT={self.http_port}\n")
        self.runtime_dir = short_tmpdir()  # ipc paths must stay short
        self.cache_dir = tmp_path / "cache"
        self.started: list[ConfinedStage] = []

    def start(self, name: str, manager_env: dict[str, str] | None = None, **spec_overrides) -> ConfinedStage:
        dirs = {"S": str(self.tmp_path / "state"), "C": str(self.cache_dir)}
        self.started.append(ConfinedStage(self.units / name, self.env_file, self.runtime_dir, dirs, self.tmp_path,
                                          spec_overrides, manager_env))
        return self.started[-1]

    @property
    def url(self) -> str:
        return f"ipc://{self.runtime_dir}/nanovllm/t"

    def stop(self) -> dict[str, int | None]:
        codes = {stage.name: stage.stop() for stage in reversed(self.started)}
        shutil.rmtree(self.runtime_dir, ignore_errors=True)
        return codes


@pytest.fixture()
def service(units, tiny_model_dir, tmp_path):
    service = ConfinedService(units, tiny_model_dir, tmp_path)
    yield service
    service.stop()


def test_the_stages_start_serve_and_stop_under_their_units_rules(service, tiny_model_dir):
    import http.client
    import json

    from nanovllm_client import Client

    for name in START_ORDER:  # systemd's start order: each waits for the one before to be ready
        service.start(name).wait_ready(timeout=180)
    with Client(f"ipc://{service.runtime_dir}/nanovllm/t", connect_timeout=60) as client:
        client.wait_engine(timeout=60)
        result = client.generate("Hello there", max_tokens=8, temperature=0, ignore_eos=True)
    assert result.finish_reason == "length" and len(result.token_ids) == 8
    conn = http.client.HTTPConnection("127.0.0.1", service.http_port, timeout=60)
    conn.request("POST", "/v1/completions", body=json.dumps({  # the model name is NANOVLLM_MODEL
        "model": tiny_model_dir, "prompt": "Hello there", "max_tokens": 8, "temperature": 0, "ignore_eos": True}))
    response = conn.getresponse()
    assert response.status == 200 and json.loads(response.read())["choices"][0]["text"] == result.text
    if shutil.which("cc") or shutil.which("gcc"):  # the engine built its kernels with gcc, under the filter
        assert list((service.cache_dir / "nanovllm").glob("cpu_kernels-*.so"))
    assert service.stop() == {name: 0 for name in START_ORDER}, "\n".join(s.log() for s in service.started)


def test_the_engine_does_not_start_without_writable_executable_memory(service):
    """oneDNN compiles the CPU GEMM kernels at run time: MemoryDenyWriteExecute= would stop the engine."""
    engine = service.start("nanovllm-engine@.service", deny_write_execute=True)
    with pytest.raises(AssertionError, match="before READY=1"):
        engine.wait_ready(timeout=180)
    assert engine.proc.returncode == 1 and "could not create a primitive" in engine.log()
