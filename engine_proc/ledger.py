"""What the engine stage remembers of each request beyond the engine itself, so a restarted
detokenizer can be told everything (`Resync`): the request's meta and output so far while it
lives, and the whole request for a minute after it ended (its last delta may have died with the
old detokenizer).
"""
from __future__ import annotations

import collections
import time
from array import array
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class LiveRequest:
    meta: dict[str, Any]
    tokens: array = field(default_factory=lambda: array("I"))
    """Output token ids so far (for a resync)."""
    counts: tuple[int, int, int] = (0, 0, 0)
    """(num_prompt, num_output, num_cached) from its latest output."""


class FinishedRing:
    """Requests that ended recently, with everything a restarted detokenizer needs to deliver
    their last delta: bounded in count and age, oldest dropped first."""

    def __init__(self, max_entries: int = 4096, max_age_s: float = 60.0):
        self.max_entries, self.max_age_s = max_entries, max_age_s
        self.entries: collections.OrderedDict[str, tuple[float, list[Any]]] = collections.OrderedDict()

    def add(self, request_id: str, entry: list[Any]) -> None:
        self.entries[request_id] = (time.monotonic(), entry)
        self.entries.move_to_end(request_id)
        self._expire()

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.entries

    def values(self) -> list[list[Any]]:
        self._expire()
        return [entry for _, entry in self.entries.values()]

    def _expire(self) -> None:
        oldest = time.monotonic() - self.max_age_s
        while self.entries and (len(self.entries) > self.max_entries or next(iter(self.entries.values()))[0] < oldest):
            self.entries.popitem(last=False)
