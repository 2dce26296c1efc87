"""Shared fixtures: tiny random-weight models with a real (offline-trained) tokenizer.

Everything a test run writes to disk goes under one short directory in /tmp (pytest's own
tmp_path too), removed when the session ends; the session fails if the run left anything else
new in /tmp.
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.helpers.other_user import other_user  # noqa: E402,F401 (a fixture)
from tests.helpers.tiny_models import make_tiny_model, make_tokenizer  # noqa: E402


@pytest.fixture(scope="session")
def server_wheel(tmp_path_factory):
    """The server wheel, built once per session (tests/helpers/wheel.py)."""
    from tests.helpers.wheel import build_server_wheel
    return build_server_wheel(tmp_path_factory.mktemp("wheel"))


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tokenizer"))
    make_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tokenizer_dir) -> str:
    """A random-weight tiny Qwen3 folder with a tokenizer (`<|im_end|>` is EOS)."""
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny-qwen3")), "qwen3", tokenizer_dir=tokenizer_dir)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory, tokenizer_dir) -> dict[str, str]:
    """One tiny folder per supported architecture."""
    return {
        arch: make_tiny_model(str(tmp_path_factory.mktemp(f"tiny-{arch}")), arch, tokenizer_dir=tokenizer_dir, seed=i)
        for i, arch in enumerate(("qwen3", "llama", "qwen2"))
    }


AUTO_DTYPES = ("float32", "bfloat16")
"""What `dtype="auto"` resolves to on CPU: float32 without native bf16 (AVX2-only), bfloat16 with
AVX512-BF16 or AMX."""


@pytest.fixture(params=AUTO_DTYPES, ids=lambda dtype: f"auto={dtype}")
def auto_dtype(request, monkeypatch) -> str:
    """Runs the test once per resolution of `dtype="auto"`, forced by NANOVLLM_AUTO_DTYPE (which the
    stage processes a test starts inherit), as it would resolve on each kind of CPU. For tests that
    compare two engines or services: a comparison that holds in one precision only then fails on
    every machine, not just on the CPUs that resolve to the other."""
    monkeypatch.setenv("NANOVLLM_AUTO_DTYPE", request.param)
    return request.param


LEFTOVER_PREFIXES = ("nv-", "nvb-", "nanovllm", "pytest-of-", "tmp", "torchinductor")
"""Names in /tmp that this suite could create (ipc dirs, pytest's base, tempfile defaults)."""
_SESSION_DIR_ENV = "NANOVLLM_TEST_TMPDIR"
_SESSION_MARK = "session.pid"
"""In each session's directory: the pid of the pytest that owns it, so a session running beside
another one (a loaded-machine run) does not take the other's directory for its own leftover."""
_tmp_before: set[str] = set()


def session_tmpdir() -> str:
    """The one directory under /tmp that this test session writes to (short: ipc paths). Kept in
    the environment, so every module (imported under any name) and every child process agrees.
    Mode 0711: another uid (tests/helpers/other_user.py) may reach a folder the test opens to it
    inside, but list nothing."""
    if not os.environ.get(_SESSION_DIR_ENV):
        path = tempfile.mkdtemp(prefix="nv-", dir="/tmp")
        os.chmod(path, 0o711)
        with open(os.path.join(path, _SESSION_MARK), "w") as f:
            f.write(str(os.getpid()))
        os.environ[_SESSION_DIR_ENV] = path
    return os.environ[_SESSION_DIR_ENV]


def _another_sessions(name: str) -> bool:
    try:
        with open(os.path.join("/tmp", name, _SESSION_MARK)) as f:
            return int(f.read()) != os.getpid()
    except (OSError, ValueError):
        return False


def pytest_configure(config):
    _tmp_before.update(os.listdir("/tmp"))
    os.environ.pop(_SESSION_DIR_ENV, None)  # a fresh one per session, even if the variable leaked in
    if not config.option.basetemp:
        config.option.basetemp = os.path.join(session_tmpdir(), "pytest")
    # tempfile's default folder, for this process and every child: what the suite does not name
    # a place for lands in the session's directory too.
    os.environ["TMPDIR"] = session_tmpdir()
    tempfile.tempdir = None


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(session_tmpdir(), ignore_errors=True)
    left = sorted(name for name in set(os.listdir("/tmp")) - _tmp_before
                  if name.startswith(LEFTOVER_PREFIXES) and not _another_sessions(name))
    if left:
        print(f"\nthe test session left files behind in /tmp: {left}", file=sys.stderr)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
