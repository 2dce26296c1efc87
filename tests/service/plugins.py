"""Extension points loaded by import path in service tests (`--post-step-hook`, `--scheduler-policy`),
as an operator's own module would be."""
from __future__ import annotations

import json
import os
import time

from nanovllm.engine.policy import SchedulerPolicy


def slow_step(metrics) -> None:
    """Make every engine step take at least 20 ms longer: long enough to stop mid-generation."""
    time.sleep(0.02)


def record_step(metrics) -> None:
    """Append every step's metrics to the file named by $NANOVLLM_TEST_STEP_LOG."""
    with open(os.environ["NANOVLLM_TEST_STEP_LOG"], "a") as f:
        f.write(json.dumps(metrics.to_dict()) + "\n")


def hang_after_steps(metrics) -> None:
    """Hang the step loop for good once $NANOVLLM_TEST_HANG_AFTER steps have run."""
    if metrics.step >= int(os.environ.get("NANOVLLM_TEST_HANG_AFTER", "1000000")):
        while True:
            time.sleep(1)


class ShortestPromptFirst(SchedulerPolicy):
    """Admit the shortest prompt first (and preempt the longest first)."""
    name = "shortest-prompt-first"

    def key(self, seq) -> tuple:
        return (seq.num_prompt_tokens, seq.arrival)
