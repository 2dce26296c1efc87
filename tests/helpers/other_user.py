"""A second, unprivileged local user for tests of what another user on the host can do.

Root can run a child as any uid; elsewhere the tests that need one skip, saying why. The child
runs a stdlib-only Python (the test's own interpreter if that uid may run it, else the system's),
so what it does needs nothing installed.
"""
from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys

import pytest

OTHER_UID = OTHER_GID = 4242


@functools.cache
def other_user_python() -> str | None:
    """An interpreter the other uid can run, or None."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return None
    for candidate in (sys.executable, shutil.which("python3"), "/usr/bin/python3"):
        if not candidate:
            continue
        try:
            ran = subprocess.run([candidate, "-I", "-c", "pass"], user=OTHER_UID, group=OTHER_GID, extra_groups=[],
                                 capture_output=True, timeout=60, cwd="/")
        except (OSError, subprocess.SubprocessError):
            continue
        if ran.returncode == 0:
            return candidate
    return None


@pytest.fixture
def other_user() -> int:
    """The other user's uid; skips where this test process cannot act as another user."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        pytest.skip("needs root, to run a child as a second uid")
    if other_user_python() is None:
        pytest.skip(f"no Python interpreter that uid {OTHER_UID} may run")
    return OTHER_UID


def as_other_user(code: str, *args: str, wait: bool = True, timeout: float = 120):
    """Run `python -I -c code args...` as the other user: its result (wait=True) or its Popen."""
    argv = [other_user_python(), "-I", "-c", code, *args]
    kwargs = dict(user=OTHER_UID, group=OTHER_GID, extra_groups=[], cwd="/", stdout=subprocess.PIPE,
                  stderr=subprocess.PIPE, text=True)
    if not wait:
        return subprocess.Popen(argv, stdin=subprocess.PIPE, **kwargs)
    ran = subprocess.run(argv, timeout=timeout, **kwargs)
    assert ran.returncode == 0, f"the other user's step failed: {ran.stderr[-2000:]}"
    return ran
