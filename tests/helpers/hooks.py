"""Engine post-step hooks that service tests load by name (`--post-step-hook tests.helpers.hooks:slow_step`)."""
from __future__ import annotations

import os
import signal
import time

STEP_DELAY_S = 0.01


def slow_step(_metrics) -> None:
    """Each step lasts 10 ms longer: a tiny model's requests then run long enough, in steps that
    can be counted, for a test to act while one is still running."""
    time.sleep(STEP_DELAY_S)


DIE_AT_STEP_ENV = "NANOVLLM_TEST_DIE_AT_STEP"
_steps = 0


def die_at_step(_metrics) -> None:
    """The engine process kills itself (SIGKILL, as a crash would end it) at its Nth step, N from
    $NANOVLLM_TEST_DIE_AT_STEP: every engine started with it dies once it has done N steps of
    work, like one that a request makes crash."""
    global _steps
    _steps += 1
    if _steps == int(os.environ[DIE_AT_STEP_ENV]):
        os.kill(os.getpid(), signal.SIGKILL)
