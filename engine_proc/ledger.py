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

from nanovllm.engine.llm_engine import RequestOutput
from nanovllm_client.protocol import OutputRow, RequestMeta, ResyncEntry

from .output import output_row


@dataclass(slots=True)
class LiveRequest:
    meta: RequestMeta
    nbytes: int = 0
    """What the request is charged against the stage's byte budget (`request_bytes`)."""
    client: str = ""
    """The client it counts as (`admission._client`): its share is given back when it ends."""
    tokens: array = field(default_factory=lambda: array("I"))
    """Output token ids so far (for a resync)."""
    last: RequestOutput | None = None
    """Its latest output (counts, and how it ended once it has)."""

    def output_row(self, request_id: str) -> OutputRow:
        """Everything it output so far as one row, with its latest counts."""
        last = self.last or RequestOutput(request_id=request_id, new_token_ids=[], finished=False, finish_reason=None)
        return output_row(last, self.tokens)


PROMPT_TOKEN_BYTES = 40
"""What one prompt token costs the engine once admitted: a Python int and its slot in the
`Sequence`'s list (the frame carried it packed, in 4 bytes)."""


def request_bytes(frame_bytes: int, num_prompt_tokens: int) -> int:
    """A request's charge against the stage's byte budgets: its frame (sampling parameters and
    meta are held about as compactly as they travel) plus its prompt as the engine will hold it."""
    return frame_bytes + PROMPT_TOKEN_BYTES * num_prompt_tokens


def entry_bytes(entry: ResyncEntry) -> int:
    """What a finished entry holds: its packed output ids and its meta's stop strings (up to
    4 bytes a character), plus a fixed allowance for the rest."""
    meta = entry.meta
    return 512 + len(entry.output.token_ids) + 4 * sum(len(s) for s in meta.sampling.stop) + len(meta.prompt_tail)


class FinishedRing:
    """Requests that ended recently, with everything a restarted detokenizer needs to deliver
    their last delta: bounded in count, bytes and age, oldest dropped first."""

    def __init__(self, max_entries: int = 4096, max_age_s: float = 60.0, max_bytes: int = 256 << 20):
        self.max_entries, self.max_age_s, self.max_bytes = max_entries, max_age_s, max_bytes
        self.entries: collections.OrderedDict[str, tuple[float, ResyncEntry, int]] = collections.OrderedDict()
        self.nbytes = 0

    def add(self, entry: ResyncEntry) -> None:
        request_id = entry.request_id
        old = self.entries.pop(request_id, None)
        if old is not None:
            self.nbytes -= old[2]
        self.entries[request_id] = (time.monotonic(), entry, entry_bytes(entry))
        self.nbytes += self.entries[request_id][2]
        self._expire()

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.entries

    def values(self) -> list[ResyncEntry]:
        self._expire()
        return [entry for _, entry, _ in self.entries.values()]

    def _expire(self) -> None:
        oldest = time.monotonic() - self.max_age_s
        while self.entries and (len(self.entries) > self.max_entries or self.nbytes > self.max_bytes
                                or next(iter(self.entries.values()))[0] < oldest):
            self.nbytes -= self.entries.popitem(last=False)[1][2]
