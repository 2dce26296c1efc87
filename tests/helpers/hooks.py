"""Engine post-step hooks that service tests load by name (`--post-step-hook tests.helpers.hooks:slow_step`)."""
from __future__ import annotations

import time

STEP_DELAY_S = 0.01


def slow_step(_metrics) -> None:
    """Each step lasts 10 ms longer: a tiny model's requests then run long enough, in steps that
    can be counted, for a test to act while one is still running."""
    time.sleep(STEP_DELAY_S)
