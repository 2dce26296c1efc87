"""A request's live state inside the engine: its tokens, its KV blocks and how far it has run."""
from __future__ import annotations

import time
from enum import Enum, auto

from nanovllm.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, arrival: int,
                 priority: int = 0):
        self.request_id = request_id
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.params = params
        self.arrival = arrival
        """Arrival order (the FCFS key)."""
        self.arrival_time = time.monotonic()
        """When the request was added (monotonic clock), for its queue time."""
        self.first_scheduled_time: float | None = None
        """When it was first admitted (monotonic); re-admissions after a preemption keep it."""
        self.priority = priority
        """Higher runs first under the priority scheduling policy."""
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.block_table: list[int] = []
        self.num_computed_tokens = 0
        """Tokens whose K/V are in the cache."""
        self.num_cached_tokens = 0
        """Prompt tokens served from the prefix cache at the last admission."""
        self.block_hashes: list[int] = []
        """Chained hashes of the leading full blocks, computed once and reused."""
        self.num_registered_blocks = 0
        """Leading blocks already offered to the prefix cache."""
        self.num_sent_tokens = 0
        """Output tokens already reported by `step()`."""

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={self.block_table})")
