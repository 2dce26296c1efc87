"""Post-step hooks: user callbacks that see a metrics snapshot after every engine step.

`LLMEngine.add_post_step_hook(fn)` registers `fn(metrics: StepMetrics)`. Hooks run in the
engine's thread right after the step, in registration order, so they should be quick (hand the
snapshot to a queue or a metrics client). A hook that raises is logged and removed: monitoring
must never take the engine down.
"""
from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Callable

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StepMetrics:
    """The engine right after one step. Counters marked cumulative count since the engine started."""
    step: int
    """Steps run so far, this one included."""
    num_running: int
    num_waiting: int
    num_kv_blocks_used: int
    num_kv_blocks_total: int
    prefix_cache_queries: int
    """Cumulative prompt tokens looked up in the prefix cache."""
    prefix_cache_hits: int
    """Cumulative prompt tokens served from it."""
    num_preemptions: int
    """Cumulative."""
    num_prefill_tokens: int
    """Prompt tokens computed in this step."""
    num_decode_tokens: int
    """Decode tokens computed in this step."""
    num_seqs: int
    """Sequences in this step's batch."""
    step_time_s: float
    num_generated_tokens: int = 0
    """Tokens sampled in this step: one per decode, plus one per prompt chunk that completed its
    prompt (`num_decode_tokens` misses those). Summed over a run, every request's output tokens."""
    queue_times_s: tuple[float, ...] = ()
    """For each sequence scheduled for the first time in this step, the seconds it waited since
    `add_request` (monotonic clock). A preempted sequence admitted again is not counted again."""
    spec_decode_num_drafts: int = 0
    """Cumulative verifications of drafted tokens (speculative decoding; 0 when it is off)."""
    spec_decode_num_draft_tokens: int = 0
    """Cumulative drafted tokens verified."""
    spec_decode_num_accepted_tokens: int = 0
    """Cumulative drafted tokens accepted."""
    spec_decode_accepted_per_position: tuple[int, ...] = ()
    """Cumulative accepted drafts per position in the draft (the i-th drafted token)."""

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of KV blocks in use, 0..1 (exposed as `nanovllm:kv_cache_usage_perc`, a fraction like vLLM's)."""
        return self.num_kv_blocks_used / self.num_kv_blocks_total

    def to_dict(self) -> dict:
        return dict(asdict(self), num_tokens=self.num_tokens)


PostStepHook = Callable[[StepMetrics], object]


class PostStepHooks:
    def __init__(self) -> None:
        self._hooks: list[PostStepHook] = []

    def __bool__(self) -> bool:
        return bool(self._hooks)

    def __len__(self) -> int:
        return len(self._hooks)

    def add(self, fn: PostStepHook) -> PostStepHook:
        if not callable(fn):
            raise TypeError(f"a post-step hook must be callable, got {fn!r}")
        self._hooks.append(fn)
        return fn

    def remove(self, fn: PostStepHook) -> bool:
        """Unregister `fn`; False if it was not registered."""
        if fn in self._hooks:
            self._hooks.remove(fn)
            return True
        return False

    def run(self, metrics: StepMetrics) -> None:
        failed = []
        for fn in self._hooks:
            try:
                fn(metrics)
            except Exception:
                log.exception("post-step hook %r raised; removing it", fn)
                failed.append(fn)
        for fn in failed:
            self._hooks.remove(fn)
